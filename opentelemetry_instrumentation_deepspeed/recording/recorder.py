"""The training thread's side of one engine's steps: events in, a log out; the records are built elsewhere.

The wrappers report what happened (a data wait, a phase starting or ending, a collective issued).
On the training thread, ``state.TRANSITIONS`` says whether the event does anything in the current
state and which state follows; what can only be read there and then is read (the clock, a batch's
shape, the loss, DeepSpeed's counters, the thread's schedstat, CUDA events and the allocator, the
profiler's per-step calls), and one entry is appended to the log. ``recording/builder.py`` replays the
log into ``StepRecord``s off the training thread: the recorder hands itself to the emitter when a step
closes or fails (``replay``), and ``open`` replays it for the hang watchdog. No OpenTelemetry object is
touched here.

Why a log (``benchmarks/README.md``, 2026-12-06): the training thread executes 14% fewer instructions
per step than when it built the records itself, and the open step is built where it is read.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque

from opentelemetry_instrumentation_deepspeed.recording import inputs as input_batches
from opentelemetry_instrumentation_deepspeed.recording import scalars, state
from opentelemetry_instrumentation_deepspeed.recording.batches import batch_shape
from opentelemetry_instrumentation_deepspeed.recording.builder import COLLECTIVE, TRACING_FAILED, StepBuilder
from opentelemetry_instrumentation_deepspeed.recording.host_cpu import QUIET_READS_EVERY
from opentelemetry_instrumentation_deepspeed.recording.record import Failure, Interrupted, StepRecord
from opentelemetry_instrumentation_deepspeed.recording.state import Event, State
from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env
from opentelemetry_instrumentation_deepspeed.runtime.safety import Component, fail_open

__all__ = ["TRACING_FAILED", "StepRecorder"]

_get_ident = threading.get_ident
# The profiler's per-step calls are guarded here, where the recorder calls them, not by fail_open: a frame fewer at
# each step's opening and close. What the log names on a failure:
_STEP_OPENED = "StepProfiler.step_opened"
_STEP_CLOSED = "StepProfiler.step_closed"
# The events whose log entries start a phase.
_PHASE_STARTS = (Event.FORWARD, Event.BACKWARD, Event.DIRECT_BACKWARD, Event.OPTIMIZER)
# Entries logged with no step open (data waits, evaluation forwards) past which the recorder hands itself to the
# emitter: a loop that never steps (an evaluation) must not grow the log.
IDLE_LOG_LIMIT = 256
# Entries past which the training thread builds the records itself (about a thousand steps': the emitter's LIMIT).
# A step that does not close (a loop that never calls engine.step()) hands the recorder over past it too: the
# builder keeps its record bounded (builder.MAX_PHASES), and the log must not grow either.
LOG_LIMIT = 8192
MAX_BETWEEN = 64  # synchronous collectives kept between two steps (their time sums; the rest are not counted)
_ENDS = {state.END_PHASE, state.FAIL_PHASE, state.INTERRUPT_PHASE}


class StepRecorder(Component):
    """Records one DeepSpeed engine's steps. Holds no reference to the engine or its tensors."""

    def __init__(self, engine, facts, submit, profiler=None, gpu=None, memory=None,  # noqa: PLR0917
                 device_scalars=None):
        super().__init__("step tracing")
        self.facts = facts  # carried by every record, for the emitter: static attributes, where spans go
        # The training thread: the one that builds the engine, until one opens its steps (a harness may build it on
        # one thread and train on another). The data loader's wrapper times its fetches only; the watchdog reads it.
        self.thread = threading.get_ident()
        self._engine = weakref.ref(engine)  # its step number, for a step that a failed fetch opens and ends
        self._submit = submit
        self.profiler = profiler
        self._gpu = gpu  # a GpuTimeline on CUDA: each phase also gets its GPU-side interval
        self._memory = memory  # an AllocatorMemory on CUDA: each phase ends with the allocator's figures
        self._device_scalars = device_scalars  # a DeviceScalars on CUDA: losses are copied, not read
        self._forward_output = None  # a weak reference to the last forward's scalar output (a direct backward's loss)
        max_waits = max(1, engine.gradient_accumulation_steps())
        self.builder = StepBuilder(facts, submit, max_waits, engine.train_micro_batch_size_per_gpu(), gpu)
        self._log = self.builder.log
        self._append = self._log.append
        self._joining = self.builder.joining
        self._keeping = self.builder.keeping
        self._on_cuda = gpu is not None or memory is not None
        # Handed to the emitter, which has not replayed it yet: a step's close need not hand it over again.
        self.queued = False
        # Unmanaged accumulation (the user steps at each boundary) makes every step() one: a setting of the
        # engine's config, read once, not at every step() (one of DeepSpeed's frames fewer per step).
        managed = getattr(engine, "managed_gradient_accumulation", None)
        self._every_step_a_boundary = managed is not None and not managed()
        # What each fetched micro-batch holds (recording/inputs.py), until the forward that takes it.
        self.inputs: deque = deque(maxlen=max_waits + 1)
        self.pad_token_id = input_batches.pad_token_id(engine, env.pad_token_id())
        self._skipped_before = 0
        # Forwards without gradients in training mode since the last with them (or the last step's close): 0 none, 1
        # one (a pseudo-labelling pass, a probe, or an evaluation's), 2 one and a fetch after it. Another then makes
        # it an evaluation loop, whose fetches fed no step.
        self._no_grad = 0
        # The phases started when a loader's iterator ran out with fetches that no forward took and no step open (an
        # evaluation loop that calls the bare module, unseen: the Trainer's, a DDP loop's model.module): where the
        # next fetch comes before another phase, those fed no step.
        self._ran_out: int | None = None
        self._losses = False  # a loss was taken in the open step (on CUDA its copy needs the step's event)
        # The training thread's schedstat, read as steps close (on a quiet host, a close QUIET_READS_EVERY after the
        # last read): its wait for a CPU; and as each phase starts and ends while the emitter's figures say it
        # waits (host_cpu.phase_reads).
        self._host_cpu = getattr(facts, "host_cpu", None)
        self._thread_stat = getattr(self._host_cpu, "thread_stat", None)
        self._phase_reads = False  # the running phase read the schedstat as it started
        self._read_at = 0  # when a step's close last read it (time.time_ns())
        self.state = State.IDLE
        self._phase: int | None = None  # the running phase's number, which its start returned; None between phases
        self._phases = 0  # phases started: their numbers
        self._ran_out_after = -1  # the number of the latest phase started before a loader last ran out
        self._number: int | None = None  # the open step's
        # The profiler's measure of a step: from the first data wait made with no step open (the record's start,
        # unless the loop fetched more than a step's micro-batches before it), else from its opening.
        self._fetch_start: int | None = None
        self._step_start = 0
        # Synchronous collectives the training thread issued since the last step closed (a barrier after rank 0's
        # checkpoint): their time before the next step is a wait for the other ranks, not the loop's own work.
        self._between: list = []
        # (state, event) -> None where the event does nothing, else (next state or None, the builder's actions,
        # whether they open a step, end a running phase, close the step, fail it): one lookup per event.
        self._rows = {key: _row(next_state, names, self.builder.actions)
                      for key, (next_state, names) in state.TRANSITIONS.items()}

    @property
    def pipelined(self) -> bool:
        """A pipeline stage runs several forwards before the first backward (1F1B): its backwards are numbered in
        their own order, which the schedule keeps in micro-batch order."""
        return self.builder.pipelined

    @pipelined.setter
    def pipelined(self, value: bool) -> None:
        self.builder.pipelined = value

    def replay(self) -> StepRecord | None:
        """Build the records of everything logged so far (the emitter's thread, the watchdog's): the step open
        after it, if any. Closed records go to the emitter. Not skipped once the recorder is off (``broken``): what
        it logged before is built (a failure's abandon() has built it already)."""
        self.queued = False  # first: a step closing meanwhile hands the recorder over again
        return self.builder.replay()

    open = property(replay)

    # -- what the wrappers call -------------------------------------------------------------

    @fail_open
    def data_waited(self, start: int, end: int) -> None:
        if self._ran_out is not None:
            if self._ran_out == self._phases and self.state == State.IDLE:
                self.not_training()  # no forward took what the ended iterator gave: not the next step's
            self._ran_out = None
        if self._no_grad == 1:
            self._no_grad = 2
        if self.state == State.IDLE:
            if self._fetch_start is None:
                self._fetch_start = start
            if len(self._log) >= IDLE_LOG_LIMIT:
                self._hand_over()
        self._append((Event.DATA_WAIT, self._rows[self.state, Event.DATA_WAIT][1], end, (start, end), None, None,
                      None))

    def fetched_since_phase(self) -> bool:
        """Whether a batch was fetched (or a loader ran out) after the latest phase started: the next micro-batch's,
        in a step still open. A loop's own fetch ahead (the next step's batch, before this step's optimizer) reads
        the same: no more than a sign. Read from the log, back to the latest phase's start, by the rare caller (a
        ``step(closure)`` in an open step), not noted at every fetch."""
        if self._ran_out_after == self._phases:
            return True
        for entry in reversed(self._log):
            if entry[0] == Event.DATA_WAIT:
                return True
            if entry[0] in _PHASE_STARTS:
                return False
        return False

    @fail_open
    def data_failed(self, start: int, end: int, error: BaseException) -> None:
        """A fetch raised: its wait is kept, and the step it was for ends with the error, as a phase's would."""
        self.data_waited(start, end)
        engine = self._engine()
        if engine is not None:
            self._fire(Event.DATA_FAILED, Failure.of(error), engine)

    @fail_open
    def ran_out(self) -> None:
        """A loader's iterator ended (``StopIteration``). Fetches pending with no step open then fed no step if the
        next fetch (another iterator's) comes before any forward: an evaluation loop that our wrappers do not see
        ran over them. A forward first takes them (an epoch's last, partial step: the Trainer fetches a step's
        micro-batches before its forwards)."""
        self._ran_out_after = self._phases  # a prefetching loader's refill that ran out: a fetch, for the step's rule
        if self.state == State.IDLE and self._fetch_start is not None:
            self._ran_out = self._phases

    @fail_open
    def not_training(self) -> None:
        """An evaluation forward: waits (and batches) so far fed it, not the next step."""
        self._no_grad = 0
        self.inputs.clear()
        self._fetch_start = None
        self._fire(Event.EVALUATION)
        if self.state == State.IDLE and len(self._log) >= IDLE_LOG_LIMIT:
            self._hand_over()

    def without_gradients(self) -> None:
        """A forward without gradients in training mode: no phase. After another and a fetch (an evaluation loop under
        no_grad alone), an evaluation forward; else nothing yet (a pseudo-labelling pass keeps its batch's wait)."""
        if self._no_grad == 2:
            self.not_training()
        self._no_grad = 1

    @fail_open
    def forward_started(self, engine, args=(), kwargs=None) -> int | None:
        """The forward's phase (a number to hand back at its end); None where it is no phase of its own."""
        self._no_grad = 0
        row = self._rows[self.state, Event.FORWARD]
        if row is None:
            return None
        samples, tokens = batch_shape(args, kwargs or {})
        inputs = self.inputs.popleft() if self.inputs else None
        return self._start(Event.FORWARD, row, engine, (samples, tokens, inputs))

    @fail_open
    def forward_ended(self, phase: int | None, output) -> None:
        """The forward returned ``output``: a scalar tensor (or a ``loss`` entry) may be the loss a
        direct ``loss.backward()`` later starts from; only a weak reference to it is kept."""
        if phase is not None and phase == self._phase:
            self._end(Event.PHASE_END)
            loss = output if getattr(output, "ndim", None) == 0 else _loss_entry(output)
            self._forward_output = weakref.ref(loss) if getattr(loss, "ndim", None) == 0 else None

    @fail_open
    def backward_started(self, engine, direct: bool = False, loss=None, share: bool = False) -> int | None:
        """``loss``: what ``engine.backward(loss)`` was given; a direct backward's is the forward's output. ``share``:
        the loss is the step's share already (``scale_wrt_gas=False``)."""
        event = Event.DIRECT_BACKWARD if direct else Event.BACKWARD
        row = self._rows[self.state, event]
        if row is None:
            return None
        if direct:
            output, self._forward_output = self._forward_output, None
            root = BackwardRoot.by_thread.get(self.thread)
            # What loss.backward() was called on, when it is a scalar: the loss as the loop made it from the forward's
            # output (scaled, or a criterion of logits); else the forward's own scalar output.
            loss = root if getattr(root, "ndim", None) == 0 else None if output is None else output()
        taken = None if loss is None else scalars.take(loss, self._device_scalars)
        if taken is not None:
            self._losses = True
            if share:
                taken = scalars.Share(taken)
        return self._start(event, row, engine, taken)

    @fail_open
    def direct_backward_ended(self) -> None:
        # Called at every backward's epilogue; only a direct one has anything to end.
        if self.state == State.DIRECT_BACKWARD:
            self._end(Event.DIRECT_BACKWARD_END)

    @fail_open
    def direct_backward_failed(self, error: BaseException) -> None:
        if self.state == State.DIRECT_BACKWARD:
            self._fire(Event.DIRECT_BACKWARD_FAILED, Failure.of(error))

    @fail_open
    def optimizer_step_started(self, engine) -> int | None:
        """None unless this ``engine.step()`` call is a gradient-accumulation boundary."""
        # Read before step(): micro_steps advances inside it.
        if not self._every_step_a_boundary and not engine.is_gradient_accumulation_boundary():
            return None
        row = self._rows[self.state, Event.OPTIMIZER]
        if row is None:
            return None
        self._skipped_before = engine.skipped_steps
        return self._start(Event.OPTIMIZER, row, engine, None)

    @fail_open
    def batch_started(self, engine) -> None:
        """A pipeline's ``train_batch()``: the whole step, from its first load to the loss it returns."""
        self._fire(Event.BATCH, None, engine)

    @fail_open
    def batch_ended(self, engine) -> None:
        self._fire(Event.BATCH_END, None, engine)

    @fail_open
    def pipeline_optimizer_started(self, engine) -> int | None:
        """The pipeline schedule's optimizer step (always a boundary); it ends through ``phase_ended``."""
        row = self._rows[self.state, Event.OPTIMIZER]
        if row is None:
            return None
        self._skipped_before = engine.skipped_steps
        return self._start(Event.OPTIMIZER, row, engine, None)

    @fail_open
    def optimizer_step_ended(self, engine, phase: int | None) -> None:
        if phase is not None and phase == self._phase:
            self._end(Event.OPTIMIZER_END, engine)

    @fail_open
    def phase_ended(self, phase: int | None) -> None:
        if phase is not None and phase == self._phase:
            self._end(Event.PHASE_END)

    @fail_open
    def phase_failed(self, phase: int | None, error: BaseException) -> None:
        """The step raised inside a phase: both end with the error; the next event opens a new step
        (a retry of the same number, DeepSpeed not having counted it, joins the same root)."""
        if phase is None or phase == self._phase:
            self._fire(Event.PHASE_FAILED, Failure.of(error))

    @fail_open
    def interrupted(self, description: str, unfinished: bool = False, cause=None) -> None:
        """The process is going away with a step open (a signal, an error outside DeepSpeed's calls: ``cause``, its
        ``Failure``; ``unfinished``: it ends normally)."""
        self._fire(Event.INTERRUPT, Interrupted(description, unfinished, cause))

    def step_number(self) -> int | None:
        return self._number

    def next_number(self) -> int | None:
        """The number the next step takes (its engine's steps so far, plus one); None once the engine is gone. Any
        thread: the watchdog's at exit, before the steps closed are drained."""
        engine = self._engine()
        return None if engine is None else engine.global_steps + 1

    def take(self, tensor):
        """A scalar as a backward's loss is kept (``scalars.take``), taken ahead of it (a plain loop's scaled loss)."""
        return scalars.take(tensor, self._device_scalars)

    def comm_issued(self, collective) -> None:
        """A collective issued now joins the open step, under the running phase (the emitter counts them,
        and keeps their spans within the span limit). Any thread may call this (backward hooks run on autograd's)."""
        if self.state == State.IDLE or self.broken or self.builder.broken:
            if self.state != State.IDLE or self.broken or _get_ident() != self.thread:
                return
            if self._fetch_start is not None:
                # After the next step's first fetch, before its first phase (the Trainer gathers the step's token
                # count there): the step's, from where it starts; kept with its fetches until it opens (None: not
                # yet in a step, nor measured as outside one when it completes; a rank blocked in it is between steps).
                collective.in_step = None
                self._append((COLLECTIVE, self._keeping, 0, collective, None, None, None))
            elif not collective.is_async and len(self._between) < MAX_BETWEEN:
                self._between.append(collective)
            return
        collective.in_step = True
        self._append((COLLECTIVE, self._joining, 0, collective, None, None, None))

    def fail(self, where: str) -> None:
        """Turned off by its own failure (on the training thread, where every call into the recorder is made): the
        open step ends as far as it was logged."""
        was_broken = self.broken
        super().fail(where)
        self._turn_off()
        if not was_broken:
            self.builder.abandon(time.time_ns())

    def _turn_off(self) -> None:
        """Off, on the training thread: the only one that can stop a profile it started."""
        self.broken = True
        if self.profiler is not None:
            self.profiler.abandon()
        self.state, self._phase, self._number = State.IDLE, None, None

    # -- the log's entries --------------------------------------------------------------------

    def _start(self, event: str, row: tuple, engine, payload) -> int:
        """A phase starts (``row`` its event's, not None): its entry, and its number for the wrapper to hand back."""
        step = self._open(engine, event) if row[2] else None
        now = time.time_ns()
        # A direct backward that never reached its epilogue ends, interrupted, where this phase starts.
        ended = self._ended() if row[3] and self._phase is not None else None
        gpu_start = None
        if self._on_cuda:
            if self._memory is not None:
                self._memory.phase_started()
            if self._gpu is not None:
                gpu_start = self._gpu.event()
        schedstat = self._schedstat() if self._thread_stat is not None and self._host_cpu.phase_reads else None
        self._phase_reads = schedstat is not None
        self._append((event, row[1], now, None, ended, (payload, gpu_start, schedstat), step))
        self.state = row[0]
        number = self._phase = self._phases = self._phases + 1
        return number

    def _end(self, event: str, engine=None) -> None:
        """The running phase ends; an optimizer step's end also closes the step."""
        row = self._rows[self.state, event]
        if row is None:
            return
        now = time.time_ns()
        if self._on_cuda:
            ended = self._ended()
        else:  # _ended() written out, as it reads on a CPU: three of a step's events end a phase, a frame each
            self._phase = None
            ended = (self._schedstat() if self._phase_reads and self._thread_stat is not None else None, None, None)
        step = self._close(engine, now, ended[0]) if row[4] else None
        self._append((event, row[1], now, None, ended, None, step))
        self.state = row[0]
        if step is not None or len(self._log) > LOG_LIMIT:
            self._hand_over()

    def _fire(self, event: str, data=None, engine=None) -> None:
        """Any other event: what its row does, read and logged."""
        row = self._rows[self.state, event]
        if row is None:
            return
        next_state, actions, opens, ends, closes, fails = row
        step = self._open(engine, event) if opens else None
        now = time.time_ns()
        ended = self._ended() if ends and self._phase is not None else None
        if closes:
            step = self._close(engine, now, None)
        elif fails:
            self._number, self._losses = None, False
            if self.profiler is not None:
                self.profiler.abandon()
        self._append((event, actions, now, data, ended, None, step))
        if next_state is not None:
            self.state = next_state
        if closes or fails:
            self._hand_over()

    def _hand_over(self) -> None:
        """To the emitter, whose thread builds the records logged so far; here, past LOG_LIMIT entries (its thread
        could not run, or it failed and no longer takes anything)."""
        if not self.queued:
            self.queued = True
            self._submit(self)
        elif len(self._log) > LOG_LIMIT:
            self._replay_here()
        if self.builder.broken:  # it failed on another thread (its log says where): the recorder is off too
            self._turn_off()

    def _replay_here(self) -> None:
        self.replay()
        # The records are queued now; handed over once more, the emitter drains them here if its thread cannot.
        self.queued = True
        self._submit(self)

    def _open(self, engine, event: str) -> tuple[int, bool, int]:
        number = self._number = engine.global_steps + 1
        here = _get_ident()
        if event != Event.DIRECT_BACKWARD:  # its prologue runs on autograd's thread (a device's, on CUDA)
            self.thread = here
        fetched, self._fetch_start = self._fetch_start, None
        # Where the step starts: its first fetch, else here, before the profiler starts (the clock is read only then).
        start = self._step_start = fetched if fetched is not None else time.time_ns()
        if self._gpu is not None:
            self._gpu.anchor_if_idle()
        between = 0
        if self._between:
            between = sum(call.end - call.start for call in self._between if call.end is not None and
                          call.start < start)
            self._between = []
        profiled = False
        profiler = self.profiler
        # Not from autograd's thread: a Kineto session is its thread's, and the step closes on the training thread,
        # whose stop would find none (the session left on, on that thread, for good).
        if profiler is not None and not profiler.broken and here == self.thread:
            try:
                profiled = profiler.step_opened(number)
            except Exception:  # noqa: BLE001 - the profiler's own failure turns the profiler off, not the step
                profiler.fail(_STEP_OPENED)
        return number, profiled, start, between

    def _ended(self) -> tuple:
        """What is read as the running phase ends: the schedstat (where it was read at the start), its GPU event,
        the caching allocator's host counters (also right after an out-of-memory error)."""
        self._phase = None
        return (self._schedstat() if self._phase_reads and self._thread_stat is not None else None,
                None if self._gpu is None else self._gpu.event(),
                None if self._memory is None else self._memory.read())

    def _close(self, engine, now: int, schedstat: bytes | None) -> tuple:
        """What is read as the step closes; ``schedstat``: the optimizer step's end's read, which serves both."""
        # The schedstat first, nearest ``now``, where the emitter takes it as read (stopping a profile takes
        # milliseconds); then the profile stops: the reads below are ours (the gradient norm's item() is an
        # operator), and the step span ends at ``now``, so anything they put in the profile would lie after its step.
        # The bytes only: the emitter parses them. On a quiet host (its phases unread), not at every close of short
        # steps: the next read's share spans the steps between, and is theirs (a clock set back reads at once).
        if schedstat is None and self._thread_stat is not None and (
                self._host_cpu.phase_reads or not 0 <= now - self._read_at < QUIET_READS_EVERY):
            schedstat = self._schedstat()
        if schedstat is not None:
            self._read_at = now
        profile = None
        profiler = self.profiler
        if profiler is not None and not profiler.broken:
            try:
                profile = profiler.step_closed((now - self._step_start) / 1e9)
            except Exception:  # noqa: BLE001 - as at the step's opening
                profiler.fail(_STEP_CLOSED)
        skipped = engine.skipped_steps > self._skipped_before
        grad_norm = scalars.take(engine.get_global_grad_norm(), self._device_scalars)
        copied = None
        if self._device_scalars is not None and (type(grad_norm) is scalars.Pending or self._losses):
            copied = self._device_scalars.event()
        self._number, self._losses, self._no_grad = None, False, 0  # no-grad passes before the close were training's
        return skipped, grad_norm, copied, schedstat, profile

    def _schedstat(self) -> bytes | None:
        """The training thread's schedstat, unparsed (its run-queue delay, for the emitter); None, and no more
        reads, once it is unreadable (the emitter falls back to its samples)."""
        try:
            return os.pread(self._thread_stat, 64, 0)
        except OSError:
            self._thread_stat = self._host_cpu.thread_stat = None  # nor will the emitter wait for a read
            return None


def _row(next_state: str | None, names: tuple[str, ...], actions: dict) -> tuple | None:
    if not names:
        return None
    return (next_state, tuple(actions[name] for name in names), state.OPEN_STEP in names,
            bool(_ENDS.intersection(names)), state.CLOSE_STEP in names, state.FAIL_STEP in names)


class BackwardRoot:
    """What each thread's running ``torch.autograd.backward`` was called on (``loss.backward()``'s loss), while it
    runs: thread id -> tensor.

    DeepSpeed starts a direct backward from a hook on the engine's outputs, on autograd's thread (a device's, on
    CUDA): the hook sees the gradient, never the tensor the backward started from. Set by the calling thread, read
    by the recorder for its training thread; no entry between backwards (no tensor kept)."""

    by_thread: dict = {}  # noqa: RUF012 - one table for the process, shared on purpose


def _loss_entry(output):
    """The ``loss`` of a model output that holds one (a dict, a Hugging Face ``ModelOutput``)."""
    if isinstance(output, dict):
        return output.get("loss")
    return None
