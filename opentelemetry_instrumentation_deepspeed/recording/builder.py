"""The records of one engine's steps, built from the recorder's log on whichever thread reads them.

The training thread (``recording/recorder.py``) keeps only the step's state, reads what can only be read
there and then, and appends one entry per event to its log. This builder replays the entries, in order,
through the actions ``state.TRANSITIONS`` named for them: it numbers micro-batches and data waits, makes
the ``Phase`` and ``StepRecord`` objects, joins collectives to their phase, and hands each closed record to
the emitter. It runs on the emitter's thread (the recorder hands itself over when a step closes) and on
the hang watchdog's (``StepRecorder.open``), one replay at a time.

An entry is a tuple ``(event, actions, now, data, ended, started, step)``:

- ``actions``: the table's actions for the recorder's state at the event, bound to this builder;
- ``now``: the event's time (ns since the epoch); ``data``: a data wait's (start, end), a failure, an
  interruption's reason, a collective;
- ``ended``: what the training thread read as the running phase ended: (schedstat, GPU event, allocator);
- ``started``: as a phase started: (its payload, GPU event, schedstat), the payload being a forward's
  (samples, tokens, input batch), a backward's loss as ``scalars.take`` kept it;
- ``step``: as the step opened, (number, profiled, its first fetch made with no step open, else when it
  opened, ns its thread spent in synchronous collectives since the last step closed); as it closed,
  (skipped, gradient norm, scalars' copy event, schedstat, stopped profiler).
"""

from __future__ import annotations

import threading
import time
from collections import deque

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.recording import state
from opentelemetry_instrumentation_deepspeed.recording.record import Interrupted, Phase, StepRecord
from opentelemetry_instrumentation_deepspeed.recording.state import Event
from opentelemetry_instrumentation_deepspeed.runtime.safety import Component

_PHASE_NAMES = {Event.FORWARD: semconv.PHASE_FORWARD, Event.BACKWARD: semconv.PHASE_BACKWARD,
                Event.DIRECT_BACKWARD: semconv.PHASE_BACKWARD, Event.OPTIMIZER: semconv.PHASE_OPTIMIZER_STEP}
_LOSS_TAKEN = (Event.BACKWARD, Event.DIRECT_BACKWARD)  # their payload: the loss a backward started from
BACKWARD_NOT_COMPLETED = "backward did not complete"
TRACING_FAILED = "step tracing failed; see the log"
COLLECTIVE = "collective"  # not an event of the table: a collective issued in the open step joins it
# A step that does not close (a loop that never calls engine.step(), an optimizer no hook sees) must not grow
# without bound: past these, its phases and collectives are counted, not kept (a step of 4,096 micro-batches, or of
# 16,384 collectives, keeps all of its own).
MAX_PHASES = 8192
_IN_STEP = "in the step"  # the open step's latest fetch went to its own waits (StepBuilder._latest)
MAX_COLLECTIVES = 16384


class StepBuilder(Component):
    """Replays one recorder's log into ``StepRecord``s; ``open`` is the step open as of the last replay.

    Closed records go to ``submit`` while the builder's lock is held (so that they arrive in order): the emitter
    must not drain from there, as its own drain replays under its lock (``Emitter.submit``)."""

    def __init__(self, facts, submit, max_waits: int, micro_batch_size: int, gpu=None):
        super().__init__("step tracing")
        self.facts = facts
        self._submit = submit
        self._max_waits = max_waits
        self._micro_batch_size = micro_batch_size
        self._gpu = gpu
        self.pipelined = False  # a pipeline stage numbers its backwards in their own order (1F1B)
        self.log: deque = deque()  # the recorder appends, the builder pops: both thread-safe on a deque
        self.open: StepRecord | None = None
        # Waits for the next step's micro-batches, fetched before it opens: (start, end, ahead), the
        # most recent G at most; ahead: fetched while the previous step was open (a loader's look-ahead).
        self._waits: list[tuple[int, int, bool]] = []
        # Where the open step's latest fetch since its latest phase started went, for an evaluation forward in the step
        # to undo: None (none made), _IN_STEP, or kept ahead: a 1-tuple of the (index, wait) it put out (or None).
        self._latest: object = None
        self._lock = threading.RLock()  # the emitter's thread and the watchdog's may both replay
        self.actions = {name: getattr(self, "_" + name) for name in (
            state.KEEP_WAIT, state.ADD_WAIT, state.DROP_WAITS, state.OPEN_STEP, state.START_PHASE, state.END_PHASE,
            state.FAIL_PHASE, state.INTERRUPT_PHASE, state.CLOSE_STEP, state.FAIL_STEP)}
        self.joining = (self._join,)  # a collective's actions
        self.keeping = (self._keep_collective,)  # ... one issued after the next step's first fetch, before it opens
        self._early: list = []  # those, until the step opens (its children) or its fetches are dropped (outside any)

    def replay(self) -> StepRecord | None:
        """Apply every entry logged so far; the open record after them. A bug in an action is logged once and turns
        the builder off (its open step ends there); the recorder, on the training thread, then turns itself off at
        the next step's close."""
        with self._lock:
            log = self.log
            if self.broken:
                self._drop_log()
                return None
            try:
                while log:
                    entry = log.popleft()
                    for action in entry[1]:
                        action(entry)
            except Exception:  # noqa: BLE001 - the point is to catch everything ours raises
                self.fail("StepBuilder.replay")
                return None
            return self.open

    def fail(self, where: str) -> None:
        super().fail(where)
        self._drop_log()
        self._end_open(time.time_ns())

    def _drop_log(self) -> None:
        """The log is let go; its collectives are measured still, as issued outside any step (metrics only)."""
        log = self.log
        while log:
            entry = log.popleft()
            if entry[0] == COLLECTIVE:
                self._outside(entry[3])

    def _outside(self, collective) -> None:
        """``collective`` joins no step: it is measured as issued outside any (its wrapper hands it over once it
        completes, this once it has; one completing at this very moment may be counted twice)."""
        collective.in_step = False
        if collective.end is not None:
            self._submit(collective)

    def abandon(self, now: int) -> None:
        """The recorder turned itself off: what it logged is built, and the open step ends there, so nothing later
        (a collective) joins a trace whose spans never end."""
        with self._lock:
            if not self.broken:
                self.replay()
            self._drop_log()
            self._end_open(now)
            self._release_early()

    def _end_open(self, now: int) -> None:
        with self._lock:
            record, self.open = self.open, None
            if record is None:
                return
            try:
                if record.phase is not None:
                    record.phase.end, record.phase.failure = now, Interrupted(TRACING_FAILED)
                record.failure, record.end = Interrupted(TRACING_FAILED), now
                self._submit(record)
            except Exception:  # noqa: BLE001 - already failing: the emitter gets what it can
                pass

    # -- the actions of state.TRANSITIONS --------------------------------------------------------------

    # Waits count fetches, not forwards: the i-th fetch of a step is its micro-batch i, whenever the
    # loop made it. A step holds G fetches at most; a further one, made while it is open, fetched
    # ahead for the next step (a loader's look-ahead) and is kept for it.

    def _keep_wait(self, entry) -> None:
        self._keep(entry[3], False)

    def _keep(self, wait, ahead: bool) -> tuple[int, tuple] | None:
        """Keep ``wait`` for the next step; (index, wait) of the one it put out, if any."""
        waits, out = self._waits, None
        if len(waits) >= self._max_waits:
            # More fetches than a step has micro-batches: the oldest made since the last step goes (a
            # skipped batch, an evaluation's), before a look-ahead, which is the next step's first.
            index = next((index for index, kept in enumerate(waits) if not kept[2]), 0)
            out = (index, waits.pop(index))
        waits.append((wait[0], wait[1], ahead))
        return out

    def _add_wait(self, entry) -> None:
        wait, waits = entry[3], self.open.waits
        if len(waits) < self._max_waits:
            waits.append((wait[0], wait[1], len(waits)))
            self._latest = _IN_STEP
        else:
            self._latest = (self._keep(wait, True),)

    def _drop_waits(self, _entry) -> None:
        # An evaluation forward: what was fetched since the last step fed it; a look-ahead is the next step's. Inside
        # a step (an auxiliary batch through the model in eval mode, between a training forward and its backward), the
        # latest fetch since the step's latest phase started fed it, and only that one: a loop may fetch its next
        # micro-batch first (its next forward's), which stays the step's.
        if self.open is None:
            self._waits = [wait for wait in self._waits if wait[2]]
        else:
            latest, self._latest = self._latest, None
            if latest is _IN_STEP:
                self.open.waits.pop()
            elif latest is not None:  # kept ahead: undone, with the wait it put out back in its place
                self._waits.pop()
                if latest[0] is not None:
                    self._waits.insert(*latest[0])
        self._release_early()

    def _keep_collective(self, entry) -> None:
        if self.open is not None or len(self._early) >= MAX_COLLECTIVES:
            self._outside(entry[3])  # issued as another thread's step opened; or a loop that never steps
        else:
            self._early.append(entry[3])

    def _release_early(self, after: int | None = None) -> list:
        """The collectives kept for the next step: those issued from ``after`` on stay (returned), the others are
        measured as issued outside any step."""
        early, self._early, kept = self._early, [], []
        for collective in early:
            if after is not None and collective.start >= after:
                kept.append(collective)
            else:
                self._outside(collective)
        return kept

    def _open_step(self, entry) -> None:
        number, profiled, fetched_or_opened, between = entry[6]
        self._latest = None
        waits = self._waits
        # The step starts where the loop began fetching for it, not at a look-ahead made in the step before; with no
        # fetch, where it opened (before a profiler started, which its first phase starts after).
        start = next((wait[0] for wait in waits if not wait[2]), fetched_or_opened)
        record = StepRecord(self.facts, number, start, [(w[0], w[1], i) for i, w in enumerate(waits)], [], [])
        waits.clear()
        if self._early:  # issued after its first fetch, before its first phase: the step's own, under no phase
            for collective in self._release_early(after=start):
                collective.in_step, collective.parent = True, None
                record.collectives.append(collective)
        record.gpu = self._gpu
        record.profiled = profiled
        record.between_comm = between
        self.open = record

    def _start_phase(self, entry) -> None:
        event, record = entry[0], self.open
        self._latest = None
        payload, gpu_start, schedstat = entry[5]
        if event == Event.FORWARD:
            micro_step = record.micro_batches
            record.micro_batches += 1
            samples, tokens, inputs = payload
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
        phase = Phase(_PHASE_NAMES[event], micro_step, entry[2], gpu_start, event == Event.DIRECT_BACKWARD)
        phase.schedstat_start = schedstat
        if event == Event.FORWARD:
            phase.inputs = inputs
        if len(record.phases) < MAX_PHASES or event == Event.OPTIMIZER:  # the step's close: always its own span
            record.phases.append(phase)
            if payload is not None and event in _LOSS_TAKEN:
                record.losses.append(payload)
        else:  # it still ends, and its collectives join the step
            record.phases_dropped += 1
        record.phase = phase

    def _end_phase(self, entry) -> None:
        record = self.open
        phase, record.phase = record.phase, None
        phase.end = entry[2]
        phase.schedstat_end, phase.gpu_end, phase.memory = entry[4]

    def _fail_phase(self, entry) -> None:
        if self.open.phase is not None:
            self.open.phase.failure = entry[3]
            self._end_phase(entry)

    def _interrupt_phase(self, entry) -> None:
        if self.open.phase is not None:
            self.open.phase.failure = entry[3] if entry[0] == Event.INTERRUPT else Interrupted(BACKWARD_NOT_COMPLETED)
            self._end_phase(entry)

    def _close_step(self, entry) -> None:
        record, self.open = self.open, None
        record.skipped, record.grad_norm, record.scalars_copied, record.schedstat, record.profile = entry[6]
        record.end = entry[2]
        self._submit(record)

    def _fail_step(self, entry) -> None:
        record, self.open = self.open, None
        record.failure = entry[3]  # a Failure, or an Interrupted
        record.wait_failed = entry[0] == Event.DATA_FAILED
        record.end = entry[2]
        self._submit(record)

    def _join(self, entry) -> None:
        """A collective issued in the open step joins it, under the phase running when it was issued; one that
        another thread issued as the step closed, logged after the close, is measured as issued outside any."""
        record, collective = self.open, entry[3]
        if record is None:
            self._outside(collective)
        elif len(record.collectives) < MAX_COLLECTIVES:
            collective.parent = record.phase
            record.collectives.append(collective)
        else:  # counted in the step, measured as issued outside any
            record.collectives_dropped += 1
            record.latest_dropped = collective
            self._outside(collective)
