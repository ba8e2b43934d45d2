"""The training thread's side of one engine's steps: events in, a ``StepRecord`` out.

The wrappers report what happened (a data wait, a phase starting or ending, a collective issued);
``state.TRANSITIONS`` says what each event does in the current state, and the actions below do it
on plain data: no OpenTelemetry object is touched here. A record leaves through ``submit`` when its
step closes or fails; the emitter makes its spans and metric points on its own thread. The open
record stays readable from other threads (``open``).
"""

from __future__ import annotations

import time

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.recording import state
from opentelemetry_instrumentation_deepspeed.recording.batches import batch_shape
from opentelemetry_instrumentation_deepspeed.recording.record import Failure, Interrupted, Phase, StepRecord
from opentelemetry_instrumentation_deepspeed.recording.state import Event, State
from opentelemetry_instrumentation_deepspeed.runtime.safety import Component, fail_open

_PHASE_NAMES = {Event.FORWARD: semconv.PHASE_FORWARD, Event.BACKWARD: semconv.PHASE_BACKWARD,
                Event.DIRECT_BACKWARD: semconv.PHASE_BACKWARD, Event.OPTIMIZER: semconv.PHASE_OPTIMIZER_STEP}
_BACKWARD_NOT_COMPLETED = "backward did not complete"
TRACING_FAILED = "step tracing failed; see the log"


class StepRecorder(Component):
    """Records one DeepSpeed engine's steps. Holds no reference to the engine or its tensors."""

    def __init__(self, engine, facts, submit, profiler=None, gpu=None, comm_span_limit: int = 64):  # noqa: PLR0917
        super().__init__("step tracing")
        self.facts = facts  # carried by every record, for the emitter: static attributes, where spans go
        self._submit = submit
        self.profiler = profiler
        self._gpu = gpu  # a GpuTimeline on CUDA: each phase also gets its GPU-side interval
        self._comm_span_limit = comm_span_limit
        # A pipeline stage runs several forwards before the first backward (1F1B): its backwards are
        # numbered in their own order, which the schedule keeps in micro-batch order.
        self.pipelined = False
        self._micro_batch_size = engine.train_micro_batch_size_per_gpu()
        # Waits kept before a step opens: the ones that fetch its micro-batches, no older.
        self._max_waits = max(1, engine.gradient_accumulation_steps())
        self._waits: list[tuple[int, int]] = []
        self._skipped_before = 0
        self.state = State.IDLE
        self.open: StepRecord | None = None
        self._actions = {name: getattr(self, "_" + name) for name in (
            state.KEEP_WAIT, state.ADD_WAIT, state.DROP_WAITS, state.OPEN_STEP, state.START_PHASE, state.END_PHASE,
            state.FAIL_PHASE, state.INTERRUPT_PHASE, state.CLOSE_STEP, state.FAIL_STEP)}
        # The table with each action bound to this recorder: one lookup per event.
        self._transitions = {key: (next_state, tuple(self._actions[name] for name in names))
                             for key, (next_state, names) in state.TRANSITIONS.items()}

    def _fire(self, event: str, data=None) -> None:
        next_state, actions = self._transitions[self.state, event]
        for action in actions:
            action(event, data)
        if next_state is not None:
            self.state = next_state

    # -- what the wrappers call -------------------------------------------------------------

    @fail_open
    def data_waited(self, start: int, end: int) -> None:
        self._fire(Event.DATA_WAIT, (start, end))

    @fail_open
    def not_training(self) -> None:
        """An evaluation forward: waits so far fed it, not the next step."""
        self._fire(Event.EVALUATION)

    @fail_open
    def forward_started(self, engine, args=(), kwargs=None) -> Phase | None:
        return self._start(Event.FORWARD, (engine, args, kwargs or {}))

    @fail_open
    def backward_started(self, engine, direct: bool = False) -> Phase | None:
        return self._start(Event.DIRECT_BACKWARD if direct else Event.BACKWARD, (engine,))

    @fail_open
    def direct_backward_ended(self) -> None:
        # Called at every backward's epilogue; only a direct one has anything to end.
        if self.state == State.DIRECT_BACKWARD:
            self._fire(Event.DIRECT_BACKWARD_END)

    @fail_open
    def direct_backward_failed(self, error: BaseException) -> None:
        if self.state == State.DIRECT_BACKWARD:
            self._fire(Event.DIRECT_BACKWARD_FAILED, Failure.of(error))

    @fail_open
    def optimizer_step_started(self, engine) -> Phase | None:
        """None unless this ``engine.step()`` call is a gradient-accumulation boundary."""
        # Read before step(): micro_steps advances inside it. Unmanaged accumulation makes every step() one.
        managed = getattr(engine, "managed_gradient_accumulation", None)
        if (managed is None or managed()) and not engine.is_gradient_accumulation_boundary():
            return None
        self._skipped_before = engine.skipped_steps
        return self._start(Event.OPTIMIZER, (engine,))

    @fail_open
    def batch_started(self, engine) -> None:
        """A pipeline's ``train_batch()``: the whole step, from its first load to the loss it returns."""
        self._fire(Event.BATCH, (engine,))

    @fail_open
    def batch_ended(self, engine) -> None:
        self._fire(Event.BATCH_END, engine)

    @fail_open
    def pipeline_optimizer_started(self, engine) -> Phase | None:
        """The pipeline schedule's optimizer step (always a boundary); it ends through ``phase_ended``."""
        self._skipped_before = engine.skipped_steps
        return self._start(Event.OPTIMIZER, (engine,))

    @fail_open
    def optimizer_step_ended(self, engine, phase: Phase | None) -> None:
        record = self.open
        if phase is not None and record is not None and phase is record.phase:
            self._fire(Event.OPTIMIZER_END, engine)

    @fail_open
    def phase_ended(self, phase: Phase | None) -> None:
        record = self.open
        if phase is not None and record is not None and phase is record.phase:
            self._fire(Event.PHASE_END)

    @fail_open
    def phase_failed(self, phase: Phase | None, error: BaseException) -> None:
        """The step raised inside a phase: both end with the error; the next event opens a new step
        (a retry of the same number, DeepSpeed not having counted it, joins the same root)."""
        if phase is None or phase is self._current_phase():
            self._fire(Event.PHASE_FAILED, Failure.of(error))

    @fail_open
    def interrupted(self, description: str) -> None:
        """The process is going away with a step open (a signal, an error outside DeepSpeed's calls)."""
        self._fire(Event.INTERRUPT, description)

    def step_number(self) -> int | None:
        record = self.open
        return None if record is None else record.number

    def comm_issued(self, collective, want_span: bool) -> None:
        """A collective issued now joins the open step, under the running phase; within the span
        limit it gets a span. Any thread may call this (backward hooks run on autograd's)."""
        record = self.open
        if record is None or self.broken:
            return
        record.comm_count += 1
        phase = record.phase
        if phase is not None:
            phase.comm_count += 1
        collective.in_step, collective.parent = True, phase
        if want_span:
            if record.comm_spans < self._comm_span_limit:
                record.comm_spans += 1
                collective.spanned = True
            else:
                record.comm_dropped += 1
                if phase is not None:
                    phase.comm_dropped += 1
        record.collectives.append(collective)

    def fail(self, where: str) -> None:
        # Whatever broke, a profiler must not keep running (and costing) for the rest of the job.
        if self.profiler is not None:
            self.profiler.abandon()
        was_broken = self.broken
        super().fail(where)
        record, self.open = self.open, None
        self.state = State.IDLE
        if record is None or was_broken:
            return
        # The open step ends here, so nothing later (a collective) joins a trace whose spans never end.
        try:
            now = time.time_ns()
            if record.phase is not None:
                record.phase.end, record.phase.failure = now, Interrupted(TRACING_FAILED)
            record.failure, record.end = Interrupted(TRACING_FAILED), now
            self._submit(record)
        except Exception:  # noqa: BLE001 - already failing: the emitter gets what it can
            pass

    # -- the actions of state.TRANSITIONS ---------------------------------------------------------

    def _current_phase(self) -> Phase | None:
        record = self.open
        return None if record is None else record.phase

    def _start(self, event: Event, data) -> Phase | None:
        before = self._current_phase()
        self._fire(event, data)
        phase = self._current_phase()
        return phase if phase is not before else None  # a nested start is no phase of its own

    def _keep_wait(self, _event, wait) -> None:
        if len(self._waits) >= self._max_waits:
            del self._waits[0]
        self._waits.append(wait)

    def _add_wait(self, _event, wait) -> None:
        record = self.open
        record.waits.append((wait[0], wait[1], record.micro_batches))

    def _drop_waits(self, _event, _data) -> None:
        self._waits.clear()

    def _open_step(self, _event, data) -> None:
        engine = data[0]
        waits = self._waits
        start = waits[0][0] if waits else time.time_ns()
        record = StepRecord(self.facts, engine.global_steps + 1, start, [(s, e, 0) for s, e in waits], [], [])
        waits.clear()
        if self._gpu is not None:
            self._gpu.anchor_if_idle()
            record.gpu = self._gpu
        if self.profiler is not None and self.profiler.step_opened(record.number):
            record.profiled = True
        self.open = record

    def _start_phase(self, event: Event, data) -> None:
        record = self.open
        now = time.time_ns()
        if event == Event.FORWARD:
            micro_step = record.micro_batches
            record.micro_batches += 1
            samples, tokens = batch_shape(data[1], data[2])
            record.samples += samples or self._micro_batch_size
            if tokens:
                record.tokens += tokens
        elif event == Event.OPTIMIZER:
            micro_step = None
        elif self.pipelined:
            micro_step = record.backwards
            record.backwards += 1
        else:
            micro_step = max(record.micro_batches - 1, 0)
        phase = Phase(_PHASE_NAMES[event], micro_step, now, None if self._gpu is None else self._gpu.event(),
                      event == Event.DIRECT_BACKWARD)
        record.phases.append(phase)
        record.phase = phase

    def _end_phase(self, _event, _data) -> None:
        record = self.open
        phase, record.phase = record.phase, None
        phase.end = time.time_ns()
        if phase.gpu_start is not None:
            phase.gpu_end = self._gpu.event()

    def _fail_phase(self, _event, failure: Failure) -> None:
        if self.open.phase is not None:
            self.open.phase.failure = failure
            self._end_phase(None, None)

    def _interrupt_phase(self, event: Event, description) -> None:
        if self.open.phase is not None:
            reason = description if event == Event.INTERRUPT else _BACKWARD_NOT_COMPLETED
            self.open.phase.failure = Interrupted(reason)
            self._end_phase(None, None)

    def _close_step(self, _event, engine) -> None:
        record, self.open = self.open, None
        record.skipped = engine.skipped_steps > self._skipped_before
        record.end = end = time.time_ns()
        if self.profiler is not None:
            record.profile = self.profiler.step_closed((end - record.start) / 1e9)
        self._submit(record)

    def _fail_step(self, event: Event, failure) -> None:
        record, self.open = self.open, None
        record.failure = Interrupted(failure) if event == Event.INTERRUPT else failure
        record.end = time.time_ns()
        if self.profiler is not None:
            self.profiler.abandon()
        self._submit(record)
