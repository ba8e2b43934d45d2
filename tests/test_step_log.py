"""The recorder's log: the training thread appends, other threads build the records from it."""

from __future__ import annotations

import sys
import threading
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.export import emitter as emitter_module
from opentelemetry_instrumentation_deepspeed.recording import scalars
from opentelemetry_instrumentation_deepspeed.recording.builder import TRACING_FAILED, StepBuilder
from opentelemetry_instrumentation_deepspeed.recording.record import Interrupted, Phase, StepRecord
from opentelemetry_instrumentation_deepspeed.recording.recorder import IDLE_LOG_LIMIT, LOG_LIMIT, StepRecorder
from opentelemetry_instrumentation_deepspeed.recording.state import State
from tests.test_state_machine import Input, Profiler, Records, micro_batch, recorder
from tests.test_steps_unit import Engine

_PHASE_OF = {State.FORWARD: semconv.PHASE_FORWARD, State.BACKWARD: semconv.PHASE_BACKWARD,
             State.DIRECT_BACKWARD: semconv.PHASE_BACKWARD, State.OPTIMIZER: semconv.PHASE_OPTIMIZER_STEP}


def test_the_training_thread_only_logs_and_the_records_are_built_when_read(monkeypatch):
    built = []

    def counted(init):
        def counting(self, *args, **kwargs):
            built.append(type(self).__name__)
            init(self, *args, **kwargs)
        return counting

    for kind in (Phase, StepRecord):
        monkeypatch.setattr(kind, "__init__", counted(kind.__init__))
    queued = []
    engine = Engine(2)
    rec = StepRecorder(engine, "facts", queued.append)
    for _ in range(4):
        micro_batch(rec, engine)
    assert built == [] and queued == [rec], "the first close hands the recorder over; nothing is built yet"
    records = Records()
    rec.builder._submit = records.submit
    assert rec.open is None, "both steps closed"
    assert [r.number for r in records] == [1, 2]
    assert sorted(built) == ["Phase"] * (4 + 4 + 2) + ["StepRecord"] * 2, "4 forwards, 4 backwards, 2 optimizer steps"


def test_a_reader_on_another_thread_builds_the_same_steps():
    def run(read_meanwhile: bool) -> list:
        rec, engine, records = recorder(grad_accum=3)
        stop, saw_open, seen = threading.Event(), threading.Event(), []

        def watch():  # the hang watchdog's view, as often as it can
            while not stop.is_set():
                record = rec.open
                seen.append(None if record is None else (record.number, record.micro_batches))
                if record is not None:
                    saw_open.set()

        reader = threading.Thread(target=watch)
        switching = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # the two threads take turns as often as the interpreter lets them
        try:
            if read_meanwhile:
                reader.start()
            for index in range(600):
                micro_batch(rec, engine)
                if read_meanwhile and index == 0:
                    # A step is open: the reader sees it at least once, however late a loaded machine starts it.
                    assert saw_open.wait(30), "the reader never saw the open step"
            stop.set()
            if read_meanwhile:
                reader.join()
        finally:
            sys.setswitchinterval(switching)
        if read_meanwhile:
            opened = [view for view in seen if view is not None]
            assert opened and all(1 <= number <= 200 and 1 <= micro <= 3 for number, micro in opened)
        return [(r.number, [(p.name, p.micro_step) for p in r.phases], [w[2] for w in r.waits], r.samples, r.tokens)
                for r in records]

    assert run(read_meanwhile=True) == run(read_meanwhile=False)


def test_a_loop_that_never_steps_keeps_the_log_short():
    rec, engine, records = recorder()
    for index in range(10 * IDLE_LOG_LIMIT):
        rec.data_waited(index, index + 1)
        rec.not_training()  # an evaluation forward
    assert len(rec.builder.log) <= IDLE_LOG_LIMIT and records == []
    micro_batch(rec, engine)
    assert [len(r.waits) for r in records] == [1]


class Collective:
    in_step = False
    parent = None
    is_async = False
    start = 0
    end = None  # completed on the host: its time


def _boundary_step(rec, engine, started):
    engine.micro_steps = engine.grad_accum - 1
    started.append(rec.optimizer_step_started(engine))


def _step_end(rec, engine, started):
    engine.global_steps += 1
    rec.optimizer_step_ended(engine, started.pop() if started else None)


def test_the_log_stays_bounded_when_nothing_takes_it():
    """An emitter that failed (or whose thread cannot run) never replays the recorder it was handed: past
    LOG_LIMIT entries the training thread builds the records itself, which the emitter then drops."""
    taken = []  # what a failed emitter is handed, and drops
    engine = Engine(1)
    rec = StepRecorder(engine, "facts", taken.append)
    steps = 2 * LOG_LIMIT // 7  # seven entries a step: a wait, three phases' starts and ends
    for _ in range(steps):
        micro_batch(rec, engine)
    assert len(rec.builder.log) <= LOG_LIMIT
    assert taken[0] is rec and 0 < sum(type(item) is StepRecord for item in taken) < steps


def test_a_step_that_does_not_close_keeps_the_log_bounded_too():
    """A loop that never calls engine.step() (a gradient analysis), with no drain and no hang watchdog replaying
    the open step (OTEL_PYTHON_DEEPSPEED_HANG_TIMEOUT=0): past LOG_LIMIT entries the training thread builds it."""
    taken = []
    engine = Engine(1)
    rec = StepRecorder(engine, "facts", taken.append)
    for _ in range(LOG_LIMIT):  # four entries each, none a step's close
        rec.phase_ended(rec.forward_started(engine, (Input(),), {}))
        rec.phase_ended(rec.backward_started(engine))
        assert len(rec.builder.log) <= LOG_LIMIT + 1
    assert taken and all(item is rec for item in taken), "handed over, never replayed: then built here"
    record = rec.open
    assert record.micro_batches == LOG_LIMIT and len(record.phases) + record.phases_dropped == 2 * LOG_LIMIT


def test_a_direct_backward_opening_a_step_on_autograd_s_thread_leaves_the_training_thread_as_it_was():
    """A forward nothing saw (a compiled one), then loss.backward(): DeepSpeed's backward prologue opens the step on
    the thread autograd runs it on (a device's, on CUDA), which is no training thread."""
    rec, engine, _records = recorder()
    prologue = threading.Thread(target=lambda: rec.backward_started(engine, direct=True))
    prologue.start()
    prologue.join()
    assert rec.thread == threading.get_ident() and rec.state == State.DIRECT_BACKWARD


# What a training loop may do next: the wrappers' calls, handing back the phase the latest start returned.
_ACTIONS = {
    "wait": lambda rec, engine, started: rec.data_waited(1, 2),
    "forward": lambda rec, engine, started: started.append(rec.forward_started(engine, (Input(),), {})),
    "forward_end": lambda rec, engine, started: rec.forward_ended(started.pop() if started else None, None),
    "backward": lambda rec, engine, started: started.append(rec.backward_started(engine)),
    "backward_end": lambda rec, engine, started: rec.phase_ended(started.pop() if started else None),
    "direct_backward": lambda rec, engine, started: rec.backward_started(engine, direct=True),
    "direct_backward_end": lambda rec, engine, started: rec.direct_backward_ended(),
    "direct_backward_failed": lambda rec, engine, started: rec.direct_backward_failed(RuntimeError("autograd")),
    "step": _boundary_step,
    "step_end": _step_end,
    "failed": lambda rec, engine, started: rec.phase_failed(started.pop() if started else None, ValueError("x")),
    "interrupted": lambda rec, engine, started: rec.interrupted("terminated by SIGTERM"),
    "evaluation": lambda rec, engine, started: rec.not_training(),
    "collective": lambda rec, engine, started: rec.comm_issued(Collective()),
}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(sorted(_ACTIONS)), max_size=60))
def test_the_built_step_agrees_with_the_recorder_s_state_after_any_events(actions):
    """Whatever a loop does (nested, stale or missing ends included), the record built from the log is the one
    the state says is open, with the phase it says is running, and every record handed over is closed."""
    rec, engine, records = recorder(grad_accum=2)
    started: list = []
    for action in actions:
        _ACTIONS[action](rec, engine, started)
        record = rec.open
        assert (record is None) == (rec.state == State.IDLE), action
        if record is not None:
            phase = record.phase
            assert (phase is None) == (rec.state == State.OPEN), action
            if phase is not None:
                assert phase.name == _PHASE_OF[rec.state] and phase.end is None
        assert not rec.broken
    for record in records:
        assert record.end is not None and all(p.end is not None for p in record.phases)
        assert sum(p.name == semconv.PHASE_FORWARD for p in record.phases) == record.micro_batches


# -- what the review of the log found ---------------------------------------------------------------


class DeviceScalars:
    """recording.scalars.DeviceScalars at its boundary: CUDA scalars copied into slots, one event behind them."""

    def __init__(self):
        self.copies = 0

    def copy(self, _tensor):
        self.copies += 1
        return scalars.Pending(self, self.copies)

    def event(self):
        return "the copies' event"


class CudaLoss:
    is_cuda = True
    ndim = 0


def test_a_backward_that_opens_the_step_keeps_its_loss_copy_s_event():
    """A loop whose forward is not seen (trace_training without module=) opens each step at its backward: the
    copy of its CUDA loss must still be waited for before it is read."""
    engine, records = Engine(1), Records()
    rec = StepRecorder(engine, "facts", records.submit, device_scalars=DeviceScalars())
    engine.get_global_grad_norm = lambda: None
    rec.phase_ended(rec.backward_started(engine, loss=CudaLoss()))
    engine.step(rec)
    (record,) = records
    assert len(record.losses) == 1 and record.scalars_copied == "the copies' event"


def test_a_step_with_no_fetch_starts_before_its_profiler_does():
    class Slow(Profiler):
        def step_opened(self, number):
            time.sleep(0.05)
            return super().step_opened(number)

    rec, engine, records = recorder(profiler=Slow({1}))
    rec.phase_ended(rec.forward_started(engine, (Input(),), {}))
    rec.phase_ended(rec.backward_started(engine))
    engine.step(rec)
    (record,) = records
    assert record.profiled and record.phases[0].start - record.start >= 0.05e9


def test_a_builder_that_fails_on_another_thread_stops_the_profile_at_the_next_close(monkeypatch, caplog):
    def broken(*_args):
        raise KeyError("a future DeepSpeed")

    monkeypatch.setattr(StepBuilder, "_start_phase", broken)
    profiler = Profiler({1})
    rec, engine, records = recorder(profiler=profiler)
    forward = rec.forward_started(engine, (Input(),), {})  # step 1 opens: its profile starts
    watchdog = threading.Thread(target=lambda: rec.open)  # whose replay meets the bug
    watchdog.start()
    watchdog.join()
    assert profiler.running == 1, "only the training thread can stop it"
    rec.phase_ended(forward)
    rec.phase_ended(rec.backward_started(engine))
    engine.step(rec)
    assert profiler.running is None and rec.broken and rec.state == State.IDLE
    assert caplog.text.count("step tracing failed in StepBuilder.replay") == 1
    assert [r.failure for r in records] == [Interrupted(TRACING_FAILED)], "the step it had open ends there"


def test_a_replay_beside_a_draining_emitter_never_deadlocks(monkeypatch):
    """The watchdog replays (the builder's lock, then the emitter's queue) while the emitter drains (its lock, then
    a replay): with the queue past its limit, neither may wait for the other."""
    inside, go = threading.Event(), threading.Event()
    close_step = StepBuilder._close_step

    def slow_close(self, entry):  # widens the window in which the watchdog holds the builder's lock
        inside.set()
        go.wait(30)
        close_step(self, entry)

    monkeypatch.setattr(StepBuilder, "_close_step", slow_close)  # before the builder binds its actions
    sink = emitter_module.Emitter()
    monkeypatch.setattr(sink, "_start", lambda: None)  # its thread: the one started below
    sink._thread = threading.current_thread()
    drained = []
    monkeypatch.setattr(sink, "_step", lambda record, _writers: drained.append(record.number))
    engine = Engine(1)
    rec = StepRecorder(engine, "facts", sink.submit)
    micro_batch(rec, engine)  # a step closes: the recorder is queued
    assert list(sink._queue) == [rec]
    monkeypatch.setattr(emitter_module, "LIMIT", 0)  # a backlog: submitters drain
    watchdog = threading.Thread(target=lambda: rec.open, daemon=True)
    watchdog.start()
    assert inside.wait(30)
    drain = threading.Thread(target=sink.drain, daemon=True)
    drain.start()
    time.sleep(0.2)
    go.set()
    watchdog.join(30)
    drain.join(30)
    assert not watchdog.is_alive() and not drain.is_alive()
    micro_batch(rec, engine)  # the training thread's hand-over drains here: it must not wait either
    sink.drain()
    assert drained == [1, 2]


def test_a_builder_failing_beside_a_draining_emitter_never_deadlocks(monkeypatch, caplog):
    """A builder that fails in the watchdog's replay hands over the collectives it drops while it holds its lock;
    the emitter's drain, meanwhile, waits for that lock to replay. Past the queue's limit the watchdog must not wait
    for the drain: it leaves the collective to it."""
    inside, go = threading.Event(), threading.Event()

    def failing_start(_self, _entry):  # holds the builder's lock until told, then fails
        inside.set()
        go.wait(30)
        raise KeyError("a future DeepSpeed")

    monkeypatch.setattr(StepBuilder, "_start_phase", failing_start)  # before the builder binds its actions
    sink = emitter_module.Emitter()
    monkeypatch.setattr(sink, "_start", lambda: None)
    sink._thread = threading.current_thread()
    emitted = []
    monkeypatch.setattr(sink, "_collective", lambda item, *_args: emitted.append(item))
    engine = Engine(1)
    rec = StepRecorder(engine, "facts", sink.submit)
    rec.forward_started(engine, (Input(),), {})
    completed = Collective()
    rec.comm_issued(completed)
    completed.end = 1
    rec.queued = True
    sink._queue.append(rec)  # handed over, as at a step's close
    monkeypatch.setattr(emitter_module, "LIMIT", 0)  # a backlog: submitters drain
    watchdog = threading.Thread(target=lambda: rec.open, daemon=True)
    watchdog.start()
    assert inside.wait(30)
    drain = threading.Thread(target=sink.drain, daemon=True)  # waits for the builder's lock in its replay
    drain.start()
    time.sleep(0.2)
    go.set()
    watchdog.join(10)
    drain.join(10)
    assert not watchdog.is_alive() and not drain.is_alive()
    sink.drain()
    assert emitted == [completed], "the dropped collective is measured, once"
    assert caplog.text.count("step tracing failed in StepBuilder.replay") == 1


def test_a_collective_another_thread_issues_as_the_step_closes_is_measured_outside_it():
    """A background thread's collective joins the step it saw open, but its entry may land after the step's close:
    it is then measured as issued outside any step, not lost."""
    records, handed = Records(), []
    engine = Engine(1)
    rec = StepRecorder(engine, "facts", handed.append)
    rec.builder._submit = lambda item: (records.submit if isinstance(item, StepRecord) else handed.append)(item)
    checked, closed = threading.Event(), threading.Event()
    append = rec._append

    def late_append(entry):  # the background thread saw the step open; the training thread closes it now
        if threading.current_thread().name == "background":
            checked.set()
            closed.wait(30)
        append(entry)

    rec._append = late_append
    rec.phase_ended(rec.forward_started(engine, (Input(),), {}))
    rec.phase_ended(rec.backward_started(engine))
    call = Collective()
    background = threading.Thread(target=rec.comm_issued, args=(call,), name="background")
    background.start()
    assert checked.wait(30)
    engine.step(rec)
    closed.set()
    background.join(30)
    call.end = 1  # it completed before the replay: the builder hands it over
    rec.replay()
    (record,) = list(records)
    assert record.collectives == [] and not call.in_step
    assert call in handed, "measured as issued outside any step"


def test_the_training_thread_never_waits_for_a_slow_drain_and_a_full_queue_drops_steps(monkeypatch, caplog):
    """A span processor that exports as each span ends, at a slow endpoint, makes every drain slow: the training
    thread must go on (it neither waits for the drain nor drains behind it), and the steps past the queue's bound are
    dropped, said once."""
    from opentelemetry_instrumentation_deepspeed.recording import recorder as recorder_module

    inside, go = threading.Event(), threading.Event()
    sink = emitter_module.Emitter()
    monkeypatch.setattr(sink, "_start", lambda: None)
    sink._thread = threading.current_thread()
    emitted = []

    def slow_step(record, _writers):  # the first step's export does not return until told
        inside.set()
        go.wait(30)
        emitted.append(record.number)

    monkeypatch.setattr(sink, "_step", slow_step)
    engine = Engine(1)
    rec = StepRecorder(engine, "facts", sink.submit)
    micro_batch(rec, engine)  # step 1 closes: the recorder is queued
    drain = threading.Thread(target=sink.drain, daemon=True)
    drain.start()
    assert inside.wait(30)
    monkeypatch.setattr(emitter_module, "LIMIT", 0)  # every hand-over would drain
    monkeypatch.setattr(emitter_module, "MAX_QUEUED", 3)
    monkeypatch.setattr(recorder_module, "LOG_LIMIT", 0)  # every hand-over builds the records on the training thread
    training = threading.Thread(target=lambda: [micro_batch(rec, engine) for _ in range(6)], daemon=True)
    training.start()
    training.join(10)
    assert not training.is_alive(), "six steps closed while the drain was stuck"
    assert sink.dropped_records >= 3, "past three items waiting, the queue was full"
    go.set()
    drain.join(30)
    sink.drain()
    assert emitted == list(range(1, 8 - sink.dropped_records)), "each step emitted in order, or dropped and counted"
    assert caplog.text.count("the telemetry of some steps is dropped") == 1


def test_a_failed_builder_leaves_the_collectives_it_dropped_measured(monkeypatch, caplog):
    """Collectives logged in a step the builder could not build are measured as if issued outside any step: those
    completed are handed over now, the others by their wrappers once they complete; later ones stay outside."""

    def broken(*_args):
        raise KeyError("a future DeepSpeed")

    monkeypatch.setattr(StepBuilder, "_start_phase", broken)
    handed = []  # the emitter, which replays only when asked here
    engine = Engine(1)
    rec = StepRecorder(engine, "facts", handed.append)
    rec.forward_started(engine, (Input(),), {})
    completed, running = Collective(), Collective()
    for call in (completed, running):
        rec.comm_issued(call)
    completed.end = 1
    assert completed.in_step and running.in_step
    assert rec.open is None, "the watchdog's replay meets the bug"
    assert not completed.in_step and not running.in_step
    assert completed in handed and running not in handed
    later = Collective()
    rec.comm_issued(later)
    assert not later.in_step
    assert caplog.text.count("step tracing failed in StepBuilder.replay") == 1
