"""The training thread's side of one engine's steps: events in, a ``StepRecord`` out.

The wrappers report what happened (a data wait, a phase starting or ending, a collective issued);
``state.TRANSITIONS`` says what each event does in the current state, and the actions below do it
on plain data: no OpenTelemetry object is touched here. A record leaves through ``submit`` when its
step closes or fails; the emitter makes its spans and metric points on its own thread. The open
record stays readable from other threads (``open``).
"""

from __future__ import annotations

import os
import time
import weakref
from collections import deque

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.recording import inputs as input_batches
from opentelemetry_instrumentation_deepspeed.recording import scalars, state
from opentelemetry_instrumentation_deepspeed.recording.batches import batch_shape
from opentelemetry_instrumentation_deepspeed.recording.record import Failure, Interrupted, Phase, StepRecord
from opentelemetry_instrumentation_deepspeed.recording.state import Event, State
from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env
from opentelemetry_instrumentation_deepspeed.runtime.safety import Component, fail_open

_PHASE_NAMES = {Event.FORWARD: semconv.PHASE_FORWARD, Event.BACKWARD: semconv.PHASE_BACKWARD,
                Event.DIRECT_BACKWARD: semconv.PHASE_BACKWARD, Event.OPTIMIZER: semconv.PHASE_OPTIMIZER_STEP}
_BACKWARD_NOT_COMPLETED = "backward did not complete"
TRACING_FAILED = "step tracing failed; see the log"
# The profiler's per-step calls are guarded here, where the recorder calls them, not by fail_open: a frame fewer at
# each step's opening and close. What the log names on a failure:
_STEP_OPENED = "StepProfiler.step_opened"
_STEP_CLOSED = "StepProfiler.step_closed"


class StepRecorder(Component):
    """Records one DeepSpeed engine's steps. Holds no reference to the engine or its tensors."""

    def __init__(self, engine, facts, submit, profiler=None, gpu=None, memory=None,  # noqa: PLR0917
                 device_scalars=None):
        super().__init__("step tracing")
        self.facts = facts  # carried by every record, for the emitter: static attributes, where spans go
        self._submit = submit
        self.profiler = profiler
        self._gpu = gpu  # a GpuTimeline on CUDA: each phase also gets its GPU-side interval
        self._memory = memory  # an AllocatorMemory on CUDA: each phase ends with the allocator's figures
        self._device_scalars = device_scalars  # a DeviceScalars on CUDA: losses are copied, not read
        self._forward_output = None  # a weak reference to the last forward's scalar output (a direct backward's loss)
        # A pipeline stage runs several forwards before the first backward (1F1B): its backwards are
        # numbered in their own order, which the schedule keeps in micro-batch order.
        self.pipelined = False
        self._micro_batch_size = engine.train_micro_batch_size_per_gpu()
        # Waits for the next step's micro-batches, fetched before it opens: (start, end, ahead), the
        # most recent G at most; ahead: fetched while the previous step was open (a loader's look-ahead).
        self._max_waits = max(1, engine.gradient_accumulation_steps())
        # Unmanaged accumulation (the user steps at each boundary) makes every step() one: a setting of the
        # engine's config, read once, not at every step() (one of DeepSpeed's frames fewer per step).
        managed = getattr(engine, "managed_gradient_accumulation", None)
        self._every_step_a_boundary = managed is not None and not managed()
        self._waits: list[tuple[int, int, bool]] = []
        # What each fetched micro-batch holds (recording/inputs.py), until the forward that takes it.
        self.inputs: deque = deque(maxlen=self._max_waits + 1)
        self.pad_token_id = input_batches.pad_token_id(engine, env.pad_token_id())
        self._skipped_before = 0
        # The training thread's schedstat, read as each step closes: its wait for a CPU, step by step; and as each
        # phase starts and ends while the emitter's figures say it waits (host_cpu.phase_reads).
        self._host_cpu = getattr(facts, "host_cpu", None)
        self._thread_stat = getattr(self._host_cpu, "thread_stat", None)
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
        """An evaluation forward: waits (and batches) so far fed it, not the next step."""
        self.inputs.clear()
        self._fire(Event.EVALUATION)

    @fail_open
    def forward_started(self, engine, args=(), kwargs=None) -> Phase | None:
        return self._start(Event.FORWARD, (engine, args, kwargs or {}))

    @fail_open
    def forward_ended(self, phase: Phase | None, output) -> None:
        """The forward returned ``output``: a scalar tensor (or a ``loss`` entry) may be the loss a
        direct ``loss.backward()`` later starts from; only a weak reference to it is kept."""
        record = self.open
        if phase is not None and record is not None and phase is record.phase:
            self._fire(Event.PHASE_END)
            loss = output if getattr(output, "ndim", None) == 0 else _loss_entry(output)
            self._forward_output = weakref.ref(loss) if getattr(loss, "ndim", None) == 0 else None

    @fail_open
    def backward_started(self, engine, direct: bool = False, loss=None) -> Phase | None:
        """``loss``: what ``engine.backward(loss)`` was given; a direct backward's is the forward's output."""
        return self._start(Event.DIRECT_BACKWARD if direct else Event.BACKWARD, (engine, loss))

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
        # Read before step(): micro_steps advances inside it.
        if not self._every_step_a_boundary and not engine.is_gradient_accumulation_boundary():
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

    def comm_issued(self, collective) -> None:
        """A collective issued now joins the open step, under the running phase (the emitter counts them,
        and keeps their spans within the span limit). Any thread may call this (backward hooks run on autograd's)."""
        record = self.open
        if record is None or self.broken:
            return
        collective.in_step, collective.parent = True, record.phase
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
        """``_fire`` for a phase's start event, which the table answers with a new phase (its last action,
        START_PHASE) or with nothing (a start nested in a running phase, no phase of its own): that phase, or None.
        The dispatch is ``_fire``'s, written out: starts are three of a step's seven events, and a frame costs
        about what the dispatch does."""
        next_state, actions = self._transitions[self.state, event]
        if not actions:
            return None
        for action in actions:
            action(event, data)
        self.state = next_state
        return self.open.phase

    # Waits count fetches, not forwards: the i-th fetch of a step is its micro-batch i, whenever the
    # loop made it. A step holds G fetches at most; a further one, made while it is open, fetched
    # ahead for the next step (a loader's look-ahead) and is kept for it.

    def _keep_wait(self, _event, wait, ahead: bool = False) -> None:
        waits = self._waits
        if len(waits) >= self._max_waits:
            # More fetches than a step has micro-batches: the oldest made since the last step goes (a
            # skipped batch, an evaluation's), before a look-ahead, which is the next step's first.
            for index, kept in enumerate(waits):
                if not kept[2]:
                    del waits[index]
                    break
            else:
                del waits[0]
        waits.append((wait[0], wait[1], ahead))

    def _add_wait(self, _event, wait) -> None:
        waits = self.open.waits
        if len(waits) < self._max_waits:
            waits.append((wait[0], wait[1], len(waits)))
        else:
            self._keep_wait(None, wait, True)

    def _drop_waits(self, _event, _data) -> None:
        # An evaluation forward: what was fetched since the last step fed it; a look-ahead is the next step's.
        self._waits = [wait for wait in self._waits if wait[2]]

    def _open_step(self, _event, data) -> None:
        engine = data[0]
        waits = self._waits
        # The step starts where the loop began fetching for it, not at a look-ahead made in the step before.
        start = None
        for wait_start, _end, ahead in waits:
            if not ahead:
                start = wait_start
                break
        if start is None:
            start = time.time_ns()
        # A loop, not a list comprehension, which is a frame of its own before Python 3.12.
        numbered = []
        for index, wait in enumerate(waits):
            numbered.append((wait[0], wait[1], index))
        record = StepRecord(self.facts, engine.global_steps + 1, start, numbered, [], [])
        waits.clear()
        if self._gpu is not None:
            self._gpu.anchor_if_idle()
            record.gpu = self._gpu
        profiler = self.profiler
        if profiler is not None and not profiler.broken:
            try:
                record.profiled = profiler.step_opened(record.number)
            except Exception:  # noqa: BLE001 - the profiler's own failure turns the profiler off, not the step
                profiler.fail(_STEP_OPENED)
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
        # The loss is taken here, not in a helper: once per backward, a frame saved.
        loss = None
        if event == Event.BACKWARD:
            loss = data[1]
        elif event == Event.DIRECT_BACKWARD:
            output, self._forward_output = self._forward_output, None
            loss = None if output is None else output()
        if loss is not None:
            taken = scalars.take(loss, self._device_scalars)
            if taken is not None:
                record.losses.append(taken)
        if self._memory is not None:
            self._memory.phase_started()
        phase = Phase(_PHASE_NAMES[event], micro_step, now, None if self._gpu is None else self._gpu.event(),
                      event == Event.DIRECT_BACKWARD)
        if self._thread_stat is not None and self._host_cpu.phase_reads:
            phase.schedstat_start = self._schedstat()
        if event == Event.FORWARD and self.inputs:
            phase.inputs = self.inputs.popleft()
        record.phases.append(phase)
        record.phase = phase

    def _end_phase(self, _event, _data) -> None:
        record = self.open
        phase, record.phase = record.phase, None
        phase.end = time.time_ns()
        if phase.schedstat_start is not None and self._thread_stat is not None:
            phase.schedstat_end = self._schedstat()
        if phase.gpu_start is not None:
            phase.gpu_end = self._gpu.event()
        if self._memory is not None:
            phase.memory = self._memory.read()  # host counters of the allocator: also right after an OOM

    def _fail_phase(self, _event, failure: Failure) -> None:
        if self.open.phase is not None:
            self.open.phase.failure = failure
            self._end_phase(None, None)

    def _interrupt_phase(self, event: Event, description) -> None:
        if self.open.phase is not None:
            reason = description if event == Event.INTERRUPT else _BACKWARD_NOT_COMPLETED
            self.open.phase.failure = Interrupted(reason)
            self._end_phase(None, None)

    def _close_step(self, event, engine) -> None:
        record, self.open = self.open, None
        record.skipped = engine.skipped_steps > self._skipped_before
        record.grad_norm = scalars.take(engine.get_global_grad_norm(), self._device_scalars)
        if self._device_scalars is not None and (type(record.grad_norm) is scalars.Pending or record.losses):
            record.scalars_copied = self._device_scalars.event()
        record.end = end = time.time_ns()
        if self._thread_stat is not None:  # the bytes only: the emitter parses them against the read before
            # The optimizer step's end was read a moment ago: one read serves both.
            last = record.phases[-1].schedstat_end if event == Event.OPTIMIZER_END and record.phases else None
            record.schedstat = last if last is not None else self._schedstat()
        profiler = self.profiler
        if profiler is not None and not profiler.broken:
            try:
                record.profile = profiler.step_closed((end - record.start) / 1e9)
            except Exception:  # noqa: BLE001 - as at the step's opening
                profiler.fail(_STEP_CLOSED)
        self._submit(record)

    def _schedstat(self) -> bytes | None:
        """The training thread's schedstat, unparsed (its run-queue delay, for the emitter); None, and no more
        reads, once it is unreadable (the emitter falls back to its samples)."""
        try:
            return os.pread(self._thread_stat, 64, 0)
        except OSError:
            self._thread_stat = None
            return None

    def _fail_step(self, event: Event, failure) -> None:
        record, self.open = self.open, None
        record.failure = Interrupted(failure) if event == Event.INTERRUPT else failure
        record.end = time.time_ns()
        if self.profiler is not None:
            self.profiler.abandon()
        self._submit(record)


def _loss_entry(output):
    """The ``loss`` of a model output that holds one (a dict, a Hugging Face ``ModelOutput``)."""
    if isinstance(output, dict):
        return output.get("loss")
    return None
