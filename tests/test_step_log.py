"""The recorder's log: the training thread appends, other threads build the records from it."""

from __future__ import annotations

import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.recording.record import Phase, StepRecord
from opentelemetry_instrumentation_deepspeed.recording.recorder import IDLE_LOG_LIMIT, LOG_LIMIT, StepRecorder
from opentelemetry_instrumentation_deepspeed.recording.state import State
from tests.test_state_machine import Input, Records, micro_batch, recorder
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
        stop = threading.Event()

        def watch():  # the hang watchdog's view, as often as it can
            while not stop.is_set():
                record = rec.open
                assert record is None or record.number >= 1

        reader = threading.Thread(target=watch)
        if read_meanwhile:
            reader.start()
        for _ in range(600):
            micro_batch(rec, engine)
        stop.set()
        if read_meanwhile:
            reader.join()
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
