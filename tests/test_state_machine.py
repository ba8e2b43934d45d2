"""The step state machine and its records, without any OpenTelemetry SDK: events in, plain records out."""

from __future__ import annotations

import os

import pytest

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.recording import state
from opentelemetry_instrumentation_deepspeed.recording.builder import StepBuilder
from opentelemetry_instrumentation_deepspeed.recording.profiler import StepProfiler
from opentelemetry_instrumentation_deepspeed.recording.record import Failure, Interrupted
from opentelemetry_instrumentation_deepspeed.recording.recorder import TRACING_FAILED, StepRecorder
from opentelemetry_instrumentation_deepspeed.recording.state import State
from opentelemetry_instrumentation_deepspeed.runtime.safety import Component
from tests.test_steps_unit import Engine


class Profiler(Component):
    """recording.profiler.StepProfiler as the recorder drives it: profiles the steps it is told to."""

    def __init__(self, profile=()):
        super().__init__("kernel profiling")
        self.profile = set(profile)
        self.running = None
        self.abandoned = 0
        self.top = 8

    def step_opened(self, number):
        if number in self.profile:
            self.running = number
            return True
        return False

    def step_closed(self, _seconds):
        running, self.running = self.running, None
        return None if running is None else f"profile of step {running}"

    def abandon(self, _reason=""):
        self.running = None
        self.abandoned += 1


class Input:
    """A batch of token ids: what the recorder reads of it (shape and dtype), nothing else."""

    class Dtype:
        is_floating_point = False
        is_complex = False

    shape = (4, 16)
    dtype = Dtype()

    def is_floating_point(self):
        return False


class Records(list):
    """The emitter as a recorder sees it: a recorder handed over is replayed at once (the emitter's drain does
    it within half a second), the records it builds are kept."""

    def submit(self, item):
        if isinstance(item, StepRecorder):
            item.replay()
        else:
            self.append(item)


def recorder(grad_accum=1, profiler=None):
    records = Records()
    engine = Engine(grad_accum)
    return StepRecorder(engine, "facts", records.submit, profiler), engine, records


def micro_batch(rec, engine, direct=False):
    rec.data_waited(10, 20)
    rec.phase_ended(rec.forward_started(engine, (Input(),), {}))
    if direct:
        rec.backward_started(engine, direct=True)
        rec.direct_backward_ended()
    else:
        rec.phase_ended(rec.backward_started(engine))
    engine.step(rec)


def test_every_state_and_event_has_a_row():
    assert set(state.TRANSITIONS) == {(s, e) for s in state.STATES for e in state.EVENTS}
    assert len(state.STATES) == 6 and len(state.EVENTS) == 15
    actions = {name for _, names in state.TRANSITIONS.values() for name in names}
    rec, _, _ = recorder()
    assert actions <= set(rec.builder.actions), "every action named in the table is implemented"


def test_a_step_spans_its_micro_batches_and_closes_on_the_boundary():
    rec, engine, records = recorder(grad_accum=3)
    for _ in range(2):
        micro_batch(rec, engine)
    assert records == [] and rec.state == State.OPEN and rec.open.micro_batches == 2
    micro_batch(rec, engine)
    (record,) = records
    assert rec.state == State.IDLE and rec.open is None
    assert [p.name for p in record.phases] == ["forward", "backward"] * 3 + ["optimizer.step"]
    assert [p.micro_step for p in record.phases] == [0, 0, 1, 1, 2, 2, None]
    assert [w[2] for w in record.waits] == [0, 1, 2], "each wait is the micro-batch it fetched"
    assert record.start == 10, "the step opens at its first data wait"
    assert record.samples == 12 and record.tokens == 3 * 64
    assert all(p.end is not None and p.failure is None for p in record.phases)
    assert record.end is not None and record.failure is None and not record.skipped
    assert record.number == 1
    micro_batch(rec, engine)  # grad_accum=3: the next step is open, not closed
    assert records[-1] is record and rec.open.number == 2


def test_a_direct_loss_backward_is_the_backward_phase():
    rec, engine, records = recorder()
    micro_batch(rec, engine, direct=True)
    backward = records[0].phases[1]
    assert backward.name == semconv.PHASE_BACKWARD and backward.direct and backward.failure is None


def test_a_direct_backward_that_never_completed_is_interrupted_by_the_next_phase():
    rec, engine, records = recorder()
    rec.phase_ended(rec.forward_started(engine))
    rec.backward_started(engine, direct=True)  # raised inside autograd, caught by the user: no epilogue
    rec.phase_ended(rec.forward_started(engine))
    engine.step(rec)
    _, backward, forward_again, _ = records[0].phases
    assert backward.failure == Interrupted("backward did not complete") and backward.end <= forward_again.start


def test_a_skipped_step_is_marked():
    rec, engine, records = recorder()
    micro_batch(rec, engine)
    engine.skipped_steps += 1  # DeepSpeed counts an fp16 overflow inside step()
    rec.phase_ended(rec.forward_started(engine))
    rec.phase_ended(rec.backward_started(engine))
    phase = rec.optimizer_step_started(engine)
    engine.skipped_steps += 1
    rec.optimizer_step_ended(engine, phase)
    assert [r.skipped for r in records] == [False, True]


def test_a_step_that_raises_ends_with_its_phase_and_the_retry_keeps_the_number():
    rec, engine, records = recorder()
    phase = rec.forward_started(engine)
    try:
        raise RuntimeError("CUDA out of memory")
    except RuntimeError as error:
        rec.phase_failed(phase, error)
    assert rec.state == State.IDLE
    (failed,) = records
    assert isinstance(failed.failure, Failure) and failed.failure.description == "RuntimeError: CUDA out of memory"
    assert failed.phases[0].failure == failed.failure and "Traceback" in failed.failure.stacktrace
    rec.phase_ended(phase)  # a stale end does nothing
    micro_batch(rec, engine)
    assert [r.number for r in records] == [1, 1] and records[1].failure is None


@pytest.mark.parametrize("fetched_before", [0, 1])
def test_a_fetch_that_raises_ends_the_step_it_was_for_and_the_loop_may_go_on(fetched_before):
    """A dataset's exception (a corrupt sample) left no step: the rank's traces ended at the step before."""
    rec, engine, records = recorder(grad_accum=2)
    if fetched_before:  # the step's first micro-batch ran: the step is open
        rec.data_waited(5, 8)
        rec.phase_ended(rec.forward_started(engine))
        rec.phase_ended(rec.backward_started(engine))
    try:
        raise ValueError("corrupt sample")
    except ValueError as error:
        rec.data_failed(10, 20, error)
    assert rec.state == State.IDLE
    (failed,) = records
    assert failed.number == 1 and failed.failure.description == "ValueError: corrupt sample"
    assert failed.start == (5 if fetched_before else 10) and failed.waits[-1][:2] == (10, 20)
    micro_batch(rec, engine)
    micro_batch(rec, engine)
    assert [r.number for r in records] == [1, 1] and records[1].failure is None, "a loop that skips it goes on"


def test_nested_phases_are_not_phases_of_their_own():
    rec, engine, records = recorder()
    outer = rec.forward_started(engine)
    assert rec.forward_started(engine) is None
    assert rec.optimizer_step_started(engine) is None
    rec.phase_ended(outer)
    rec.phase_ended(rec.backward_started(engine))
    engine.step(rec)
    assert [p.name for p in records[0].phases] == ["forward", "backward", "optimizer.step"]


def test_interrupt_closes_the_open_step_and_its_phase():
    rec, engine, records = recorder()
    rec.backward_started(engine)
    rec.interrupted("terminated by SIGTERM")
    (record,) = records
    assert record.failure == Interrupted("terminated by SIGTERM") == record.phases[0].failure
    rec.interrupted("again")  # nothing open: nothing to do
    assert len(records) == 1


def test_evaluation_forwards_drop_the_waits_kept_for_the_next_step():
    rec, engine, records = recorder()
    rec.data_waited(1, 2)
    rec.not_training()
    micro_batch(rec, engine)
    assert records[0].waits == [(10, 20, 0)]


@pytest.mark.parametrize("profiled", [set(), {2}])
def test_the_profiler_runs_over_the_steps_it_chose_and_stops_whatever_happens(profiled):
    profiler = Profiler(profiled)
    rec, engine, records = recorder(profiler=profiler)
    for _ in range(3):
        micro_batch(rec, engine)
    assert [r.profile for r in records] == [None, "profile of step 2" if profiled else None, None]
    assert [r.profiled for r in records] == [False, bool(profiled), False]
    profiler.profile.add(4)
    phase = rec.forward_started(engine)
    assert profiler.running == 4
    rec.phase_failed(phase, ValueError("x"))
    assert profiler.running is None and profiler.abandoned == 1 and records[-1].profile is None


@pytest.mark.parametrize("where", ["step_opened", "step_closed"])
def test_a_failing_profiler_turns_itself_off_and_the_steps_go_on(where, monkeypatch, caplog):
    profiler = Profiler({1, 2, 3})
    rec, engine, records = recorder(profiler=profiler)

    def broken(*_args):
        raise RuntimeError("kineto")

    monkeypatch.setattr(profiler, where, broken)
    for _ in range(3):
        micro_batch(rec, engine)
    assert profiler.broken and not rec.broken
    assert [r.number for r in records] == [1, 2, 3] and all(r.failure is None for r in records)
    assert [r.profile for r in records] == [None, None, None]
    assert caplog.text.count(f"kernel profiling failed in StepProfiler.{where}") == 1


def test_the_profile_of_a_step_stops_before_the_recorder_s_own_reads():
    """The step span ends where the optimizer step did; the gradient norm is read after that (a tensor's item(), an
    operator), so a profile still running then would hold an operator that lies outside its step."""
    profiler, profiling_at_read = Profiler({1}), []

    class Norm(Engine):
        def get_global_grad_norm(self):
            profiling_at_read.append(profiler.running)
            return 0.5

    records, engine = Records(), Norm(1)
    rec = StepRecorder(engine, "facts", records.submit, profiler)
    micro_batch(rec, engine)
    assert records[0].profile == "profile of step 1" and records[0].grad_norm == 0.5
    assert profiling_at_read == [None]


def test_a_profiler_that_fails_stops_the_profile_it_was_running(caplog):
    class Running:
        stopped = False

        def stop(self):
            self.stopped = True

    profiler = StepProfiler(every=1, trigger=None, top=8, slow_factor=0)
    running = profiler._profile = Running()
    try:
        raise RuntimeError("kineto")
    except RuntimeError:
        profiler.fail("StepProfiler.step_closed")
    assert profiler.broken and running.stopped and profiler._profile is None
    assert "kernel profiling failed in StepProfiler.step_closed" in caplog.text


class _Kineto:
    """torch.profiler.profile at its boundary: started and stopped, nothing recorded."""

    def __init__(self, **_options):
        pass

    def start(self):
        pass

    def stop(self):
        pass


def slow_step_profiler(monkeypatch):
    """A profiler of slow steps, and ``steps(seconds, count)``: that many steps of that length; the ones it profiled."""
    import torch

    monkeypatch.setattr(torch.profiler, "profile", _Kineto)
    profiler = StepProfiler(every=0, trigger=None, top=8, slow_factor=3)
    number = 0

    def steps(seconds: float, count: int = 1) -> list[int]:
        nonlocal number
        profiled = []
        for _ in range(count):
            number += 1
            if profiler.step_opened(number):
                profiled.append(number)
            profiler.step_closed(seconds)
        return profiled

    return profiler, steps


def test_slow_steps_are_profiled_within_a_budget_of_the_run(monkeypatch):
    # A loader that stalls every 6th step: profiling the step after each stall cost 30-60% of a 2-rank job.
    _profiler, steps = slow_step_profiler(monkeypatch)

    assert steps(0.02, 10) == []
    assert steps(0.3) == [] and steps(0.05) == [12], "the step after the first slow one is profiled"
    # That profile cost the training thread 30 ms beyond the 20 ms median, and its stop (microseconds here, however
    # long a loaded host makes them): 0.5% of the unprofiled steps' time covers it some 300 steps of 20 ms later,
    # not 40 steps later. 600: a margin of 30 ms for the stop's own clock reads.
    for _ in range(5):
        assert steps(0.3) == [] and steps(0.02, 5) == []
    assert steps(0.02, 600) == []
    assert steps(0.3) == [] and len(steps(0.02)) == 1, "once paid for, a slow step is profiled again"


def test_the_budget_counts_what_the_profiles_cost_the_emitter(monkeypatch):
    """Making a profile spans takes the emitter's thread about as long again as the profiled step took the training
    thread's, on the same CPUs: both count."""
    profiler, steps = slow_step_profiler(monkeypatch)

    assert steps(0.02, 10) == [] and steps(0.3) == [] and steps(0.05) == [12]
    profiler.emitted(0.06)
    # 30 ms of the training thread and 60 of the emitter's: 0.5% of 20 ms steps covers them after 900 steps.
    assert steps(0.02, 650) == []
    assert steps(0.3) == [] and steps(0.02) == [], "650 steps paid for the training thread's 30 ms alone"
    assert steps(0.02, 400) == []
    assert steps(0.3) == [] and len(steps(0.02)) == 1


def test_a_profile_waits_for_a_step_that_is_recorded_and_never_ends_the_program_s_own(monkeypatch, tmp_path):
    """Sampled-out steps were profiled (their stop cost 16-28 ms each) and the profile thrown away; our session ended
    the program's own torch.profiler, emptied; a rank with a pending request did not look at the trigger file, and
    profiled a step the others did not."""
    import os

    import torch

    monkeypatch.setattr(torch.profiler, "profile", _Kineto)
    trigger = tmp_path / "trigger"
    profiler = StepProfiler(every=0, trigger=str(trigger), top=8, slow_factor=3)
    recorded = {9, 10, 16}
    profiler.worth = lambda number: number in recorded

    # Steps of 1 s: the stop's own cost (clock reads a loaded host may stretch) stays far within the budget.
    def profiled(number: int, seconds: float = 1.0) -> bool:
        started = profiler.step_opened(number)
        profiler.step_closed(seconds)
        return started

    assert [profiled(number) for number in range(1, 7)] == [False] * 6
    assert not profiled(7, seconds=5.0), "slow: the next step is asked for"
    assert not profiled(8), "not recorded: the request waits"
    assert profiled(9)
    trigger.write_text("")
    assert [profiled(number) for number in range(10, 16)] == [False] * 6, "the trigger is read at every 8th step"
    assert profiled(16), "touched: read there, and recorded"
    recorded.update({24, 32})
    assert not any(profiled(number) for number in range(17, 23))
    assert not profiled(23, seconds=5.0)
    os.utime(trigger, ns=(1, 1))  # touched again, with a slow step's request pending for step 24
    assert profiled(24), "one profile for both"
    assert [profiled(number) for number in range(25, 33)] == [False] * 8, "every rank read the touch at step 24"

    profiler.worth = lambda number: False  # a sampler that drops every trace
    assert not profiled(33, seconds=5.0)
    asked = []
    profiler.worth = lambda number: asked.append(number) or False
    assert not any(profiled(number) for number in range(34, 134))
    assert len(asked) == 64, "a request waits 64 steps, then is dropped: not asked at every step"

    monkeypatch.setattr(torch._C._autograd, "_profiler_enabled", lambda: True)
    profiler = StepProfiler(every=1, trigger=None, top=8, slow_factor=0)
    assert not profiler.step_opened(1), "the program profiles: ours would end its session"


def test_a_profile_that_fails_to_start_half_way_is_stopped(monkeypatch):
    import torch

    class HalfStarted(_Kineto):
        stopped = False

        def start(self):
            raise RuntimeError("Kineto enabled, then a metadata call failed")

        def stop(self):
            HalfStarted.stopped = True

    monkeypatch.setattr(torch.profiler, "profile", HalfStarted)
    profiler = StepProfiler(every=1, trigger=None, top=8, slow_factor=0)
    with pytest.raises(RuntimeError):
        profiler.step_opened(1)
    profiler.fail("StepProfiler.step_opened")  # as the recorder does
    assert HalfStarted.stopped and profiler._profile is None


def test_a_waiting_request_outlives_a_slow_step_past_the_budget_and_a_failed_stop_ends_our_session(monkeypatch,
                                                                                                     tmp_path):
    import torch

    monkeypatch.setattr(torch.profiler, "profile", _Kineto)
    trigger = tmp_path / "trigger"
    profiler = StepProfiler(every=0, trigger=str(trigger), top=8, slow_factor=3)
    profiler.worth = lambda number: number != 16  # step 16 is sampled out
    for number in range(1, 16):
        profiler.step_opened(number)
        profiler.step_closed(0.02)
    profiler._spent = 10.0  # profiling has cost far more than the budget allows a slow step
    trigger.write_text("")
    assert not profiler.step_opened(16)
    profiler.step_closed(0.5)  # slow, past the budget: the trigger's request must stay
    assert profiler.step_opened(17), "the trigger's profile, on the next step that is recorded"

    class StopFails(_Kineto):
        def stop(self):
            raise RuntimeError("stop failed half-way")

    disabled = []
    monkeypatch.setattr(torch.profiler, "profile", StopFails)
    monkeypatch.setattr(torch._C._autograd, "_profiler_enabled", lambda: not disabled)
    monkeypatch.setattr(torch._C._autograd, "_disable_profiler", lambda: disabled.append(True))
    profiler = StepProfiler(every=1, trigger=None, top=8, slow_factor=0)
    monkeypatch.setattr(torch._C._autograd, "_profiler_enabled", lambda: False)
    assert profiler.step_opened(1)
    monkeypatch.setattr(torch._C._autograd, "_profiler_enabled", lambda: not disabled)
    with pytest.raises(RuntimeError):
        profiler.step_closed(0.02)
    profiler.fail("StepProfiler.step_closed")  # as the recorder does
    assert disabled == [True] and profiler._profile is None, "the session it left on is ended"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_process_forked_inside_a_profiled_step_records_nothing_and_the_step_keeps_its_profile():
    """A loop that restarts its DataLoader's iterator inside a step forks the new epoch's workers there: a child of
    the profiling thread inherited its Kineto session and recorded every operator it ran for good. The lifecycle's
    END_PROFILE stage calls ``before_fork`` as the process forks (tests/test_lifecycle.py; a real DataLoader's
    workers: tests/test_reliability_workers.py)."""
    import torch

    profiler = StepProfiler(every=1, trigger=None, top=8, slow_factor=0)
    assert profiler.step_opened(1)
    tensor = torch.ones(4)
    for _ in range(5):
        tensor = tensor + 1
    reading, writing = os.pipe()
    profiler.before_fork()
    pid = os.fork()
    if pid == 0:  # the child: is it recording?
        os.write(writing, b"1" if torch._C._autograd._profiler_enabled() else b"0")
        os._exit(0)
    os.close(writing)
    inherited = os.read(reading, 1)
    os.close(reading)
    os.waitpid(pid, 0)
    for _ in range(3):
        tensor = tensor * 2  # after the fork: no longer profiled
    assert inherited == b"0", "the child inherited the running profile"
    profile = profiler.step_closed(0.01)
    names = [event.name for event in profile.events()]
    assert names.count("aten::add") == 5 and "aten::mul" not in names, "the step keeps what was profiled before"
    assert not torch._C._autograd._profiler_enabled()
    assert profiler.step_opened(2) and profiler.step_closed(0.01) is not None, "the next step is profiled again"


def test_a_fork_from_another_thread_leaves_the_profile_running():
    """Only the thread that started the session hands it to a child; another thread's fork need not end it."""
    import threading

    import torch

    profiler = StepProfiler(every=1, trigger=None, top=8, slow_factor=0)
    assert profiler.step_opened(1)
    forking = threading.Thread(target=profiler.before_fork)
    forking.start()
    forking.join()
    torch.ones(2).add(1)
    profile = profiler.step_closed(0.01)
    assert "aten::add" in [event.name for event in profile.events()]


def test_a_step_that_autograd_s_thread_opens_is_not_profiled_there():
    """A direct backward that opens a step runs its prologue on autograd's thread (a device's, on CUDA): a session
    started there is that thread's, and the step's close on the training thread would find none to stop."""
    import threading

    profiler = Profiler({1, 2})
    rec, engine, records = recorder(profiler=profiler)
    opening = threading.Thread(target=rec.backward_started, args=(engine,), kwargs={"direct": True})
    opening.start()
    opening.join()
    rec.direct_backward_ended()
    engine.step(rec)
    micro_batch(rec, engine)
    assert [(r.number, r.profile) for r in records] == [(1, None), (2, "profile of step 2")]


def test_the_exit_on_another_thread_leaves_the_profile_to_its_own(capfd):
    """The hang watchdog's thread runs the exit of a rank stuck in native code: a stop there finds no session."""
    import threading

    import torch

    profiler = StepProfiler(every=1, trigger=None, top=8, slow_factor=0)
    assert profiler.step_opened(1)
    exiting = threading.Thread(target=profiler.abandon, args=("terminated by SIGTERM",))
    exiting.start()
    exiting.join()
    assert torch._C._autograd._profiler_enabled() and not profiler.broken
    profiler.abandon()
    assert not torch._C._autograd._profiler_enabled()
    assert "no active profiling session" not in capfd.readouterr().err


def test_a_start_event_starts_a_phase_or_does_nothing():
    # StepRecorder._start numbers a new phase for any start event whose row has actions: every such row is either
    # empty or ends by starting the phase its next state names.
    phase_of = {state.Event.FORWARD: State.FORWARD, state.Event.BACKWARD: State.BACKWARD,
                state.Event.DIRECT_BACKWARD: State.DIRECT_BACKWARD, state.Event.OPTIMIZER: State.OPTIMIZER}
    for (_state, event), (next_state, actions) in state.TRANSITIONS.items():
        if event in phase_of:
            assert (actions == () and next_state is None) or (
                actions[-1] == state.START_PHASE and next_state == phase_of[event]), (_state, event)


class Call:
    """A collective as the recorder sees it."""

    in_step = False
    parent = "not set"
    is_async = False
    start = 0
    end = None


def test_collectives_join_the_open_step_under_the_running_phase():

    rec, engine, records = recorder()
    outside = Call()
    rec.comm_issued(outside)
    assert not outside.in_step and outside.parent == "not set", "no open step: the collective stays on its own"
    forward = rec.forward_started(engine)
    calls = [Call() for _ in range(3)]
    for call in calls:
        rec.comm_issued(call)
    rec.phase_ended(forward)
    between = Call()
    rec.comm_issued(between)
    rec.phase_ended(rec.backward_started(engine))
    engine.step(rec)
    assert records[0].collectives == [*calls, between] and all(c.in_step for c in records[0].collectives)
    forward_phase = records[0].phases[0]
    assert all(c.parent is forward_phase for c in calls) and between.parent is None


def test_the_time_in_collectives_between_two_steps_is_the_next_step_s_wait_for_the_others():
    """Rank 0 checkpoints after a step, then every rank meets it in a barrier: the other ranks' gap before the next
    step was read as their own work, and the rank that worked was not told apart."""
    import threading

    rec, engine, records = recorder()

    def step(fetched):
        rec.data_waited(fetched, fetched + 10)
        rec.phase_ended(rec.forward_started(engine, (Input(),), {}))
        rec.phase_ended(rec.backward_started(engine))
        engine.step(rec)

    step(10)

    def issued(start, end, is_async=False):
        call = Call()
        call.start, call.is_async = start, is_async
        rec.comm_issued(call)
        call.end = end  # it returns (a synchronous call), or its handle is waited for
        return call

    barrier = issued(100, 250_000_100)
    issued(300, 400, is_async=True)  # a handle the loop waits for later, if at all: not the thread's wait
    elsewhere = threading.Thread(target=issued, args=(500, 90_000_500))  # a monitoring thread's: not the loop's
    elsewhere.start()
    elsewhere.join()
    assert not barrier.in_step, "measured as issued outside any step, as before"
    step(300_000_000)
    step(400_000_000)
    assert [record.between_comm for record in records] == [0, 250_000_000, 0]


def test_a_collective_after_the_step_s_first_fetch_and_before_its_forward_is_the_step_s():
    """The Trainer fetches a step's micro-batches, then gathers their token count, then runs the forwards: the
    gather was in no step and in no wait between steps; a rank's wait there for a peer's loader read as host work."""
    rec, engine, records = recorder(grad_accum=2)
    submitted = []
    rec.builder._submit = lambda item: submitted.append(item) if isinstance(item, Call) else records.submit(item)
    rec.data_waited(100, 110)
    gather = Call()
    gather.start = 120
    rec.comm_issued(gather)
    gather.end = 170
    assert gather.in_step is None, "not measured as outside a step when it completes"
    rec.data_waited(180, 190)
    for _ in range(2):
        rec.phase_ended(rec.forward_started(engine, (Input(),), {}))
        rec.phase_ended(rec.backward_started(engine))
        engine.step(rec)
    (record,) = records
    assert record.start == 100 and record.collectives == [gather] and gather.parent is None and gather.in_step
    assert record.between_comm == 0 and submitted == []
    # Fetches an evaluation took (its forward seen): its collectives are measured as outside any step.
    rec.data_waited(300, 310)
    metric = Call()
    metric.start, metric.end = 320, 330
    rec.comm_issued(metric)
    rec.not_training()
    rec.replay()
    assert submitted == [metric] and metric.in_step is False


@pytest.mark.parametrize(("where", "method"), [(StepBuilder, "_end_phase"), (StepRecorder, "_close")])
def test_a_bug_in_an_action_disables_the_recorder_and_ends_the_open_step(where, method, caplog, monkeypatch):
    """A bug in the builder raises as the log is replayed (here: as the step closes), one on the training thread
    where the event happens; either way the recorder turns off and the step it had open ends."""

    def broken(*_args):
        raise KeyError("a future DeepSpeed")

    monkeypatch.setattr(where, method, broken)
    rec, engine, records = recorder()
    rec.phase_ended(rec.forward_started(engine))
    engine.step(rec)
    assert rec.open is None and rec.broken
    (record,) = records
    assert record.failure == Interrupted(TRACING_FAILED) == record.phases[-1].failure
    assert rec.forward_started(engine) is None and len(records) == 1
    assert caplog.text.count("step tracing failed") == 1


# -- data waits count fetches, not forwards ---------------------------------------------------------


def train_micro_batch(rec, engine):
    rec.phase_ended(rec.forward_started(engine, (Input(),), {}))
    rec.phase_ended(rec.backward_started(engine))
    engine.step(rec)


def test_a_loop_that_fetches_a_step_s_micro_batches_first_numbers_them_in_fetch_order():
    """The Trainer fetches all micro-batches of a step before its first forward."""
    rec, engine, records = recorder(grad_accum=3)
    for step in range(2):
        for micro in range(3):
            rec.data_waited(100 * step + 10 * micro, 100 * step + 10 * micro + 5)
        for _ in range(3):
            train_micro_batch(rec, engine)
    assert [r.waits for r in records] == [[(0, 5, 0), (10, 15, 1), (20, 25, 2)],
                                          [(100, 105, 0), (110, 115, 1), (120, 125, 2)]]
    assert [r.start for r in records] == [0, 100], "a step starts at the fetch of its first micro-batch"


def test_a_loader_that_fetches_ahead_gives_each_step_its_own_micro_batches():
    """Batch k+1 is fetched before batch k is handed over; the last, partial step of the epoch has its wait."""
    rec, engine, records = recorder(grad_accum=2)
    batches = 5
    fetched = 0

    def fetch():
        nonlocal fetched
        if fetched < batches:
            rec.data_waited(1000 + 10 * fetched, 1000 + 10 * fetched + 5)
            fetched += 1

    fetch()  # the loader's first next(): batches 0 and 1
    for _ in range(batches):
        fetch()
        rec.phase_ended(rec.forward_started(engine, (Input(),), {}))
        rec.phase_ended(rec.backward_started(engine))
        if engine.micro_steps == batches - 1:
            engine.micro_steps = engine.grad_accum - 1  # the end of the epoch is a boundary (Accelerate)
        engine.step(rec)
    assert [[w[2] for w in r.waits] for r in records] == [[0, 1], [0, 1], [0]]
    assert [[w[0] for w in r.waits] for r in records] == [[1000, 1010], [1020, 1030], [1040]]
    first, second, last = records
    assert first.start == 1000
    assert second.start == 1030, "the fetch made ahead, inside step 1, does not move step 2's start"
    assert last.start > 1045, "nothing was fetched for it after step 2 closed: it starts at its forward"


def test_a_fetch_beyond_the_micro_batches_of_the_open_step_is_the_next_step_s():
    """A loop that fetches its next batch before computing the current one."""
    rec, engine, records = recorder(grad_accum=1)
    rec.data_waited(0, 1)
    for step in range(3):
        rec.phase_ended(rec.forward_started(engine, (Input(),), {}))
        rec.data_waited(10 * step + 10, 10 * step + 11)
        rec.phase_ended(rec.backward_started(engine))
        engine.step(rec)
    assert [r.waits for r in records] == [[(0, 1, 0)], [(10, 11, 0)], [(20, 21, 0)]]


def test_evaluation_forwards_keep_a_wait_fetched_ahead_for_the_next_step():
    rec, engine, records = recorder(grad_accum=2)
    rec.data_waited(0, 1)
    rec.data_waited(2, 3)  # a loader that fetches ahead: batches 0 and 1
    train_micro_batch(rec, engine)
    rec.data_waited(4, 5)  # batch 2, fetched ahead inside step 1
    train_micro_batch(rec, engine)
    for start in range(10, 50, 10):  # the evaluation loader's batches, then its forwards
        rec.data_waited(start, start + 1)
    rec.not_training()
    rec.data_waited(60, 61)  # batch 3
    train_micro_batch(rec, engine)
    train_micro_batch(rec, engine)
    assert [r.waits for r in records] == [[(0, 1, 0), (2, 3, 1)], [(4, 5, 0), (60, 61, 1)]]


def test_an_evaluation_forward_inside_a_step_drops_its_own_fetch_not_the_step_s():
    """Each micro-step: the main loader's batch, the training forward, an auxiliary batch through the model in eval
    mode under no_grad, then the backward. The auxiliary fetches fed no micro-batch."""
    rec, engine, records = recorder(grad_accum=2)
    for step in range(2):
        for micro in range(2):
            at = 100 * step + 10 * micro
            rec.data_waited(at, at + 1)  # main
            rec.phase_ended(rec.forward_started(engine, (Input(),), {}))
            rec.data_waited(at + 5, at + 6)  # auxiliary
            rec.not_training()
            rec.phase_ended(rec.backward_started(engine))
            engine.step(rec)
    assert [r.waits for r in records] == [[(0, 1, 0), (10, 11, 1)], [(100, 101, 0), (110, 111, 1)]]


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_an_evaluation_forward_inside_a_step_drops_only_the_latest_fetch(grad_accum):
    """A loop that fetches its next micro-batch right after each forward, then an auxiliary batch for an evaluation
    forward (eval mode, no_grad) before the backward: only the auxiliary batch fed the evaluation. With one
    micro-batch per step the next batch is kept ahead, and the auxiliary one, kept ahead after it, must not push it
    out for good."""
    rec, engine, records = recorder(grad_accum=grad_accum)
    fetch = iter(range(0, 10_000, 10))

    def main():
        at = next(fetch)
        rec.data_waited(at, at + 1)
        return at

    expected, first = [], main()
    taken = [first]
    for _step in range(2):
        for _micro in range(grad_accum):
            rec.phase_ended(rec.forward_started(engine, (Input(),), {}))
            taken.append(main())  # the next micro-batch, fetched ahead
            aux = next(fetch)
            rec.data_waited(aux + 5, aux + 6)
            rec.not_training()
            rec.phase_ended(rec.backward_started(engine))
            engine.step(rec)
        expected.append([(at, at + 1, micro) for micro, at in enumerate(taken[:grad_accum])])
        taken = taken[grad_accum:]
    assert [r.waits for r in records] == expected
