"""The one emitter: closed step records become spans and metric points, on a thread of its own.

The training thread only appends to a queue (``submit``): a recorder whose step closed (its log is
replayed here into ``StepRecord``s, queued in turn), or a completed collective issued outside any
step. Every ``DRAIN_SECONDS`` (and when a metric reader collects, so a collection sees everything
recorded before it; when a tracer provider is flushed or shut down; and at exit, through the
lifecycle) ``drain`` turns them into:

- the step's span tree (root on rank 0, ``training.step``, data waits, phases, collectives, the
  operators and kernels of a profiled step), written finished, with the recorded times;
- histogram points that keep the time they were taken and their span (exemplars), and totals;
- the step's loss and gradient norm (read from the host copies once their CUDA event completed: a
  step whose copies are still running waits for a later drain, at most ``SCALARS_WAIT_SECONDS``),
  checked by the numerics watch; the caching allocator's figures of each phase; the training
  thread's wait for a CPU (a step closed unread waits for the read after it, to a later drain, while
  that read could still cover it: ``host_cpu.COVERED_WITHIN``);
- GPU intervals and async collectives that had not completed by then wait in ``_pending`` and are
  emitted by a later drain once their CUDA events completed or their ``wait()`` returned (the final
  drain gives collectives host times and drops what never completed).

Why a thread and not the training thread: a span costs ~20 us and a histogram point ~5-100 us inside
a step, whose tensors keep evicting this code from the CPU's caches; here a drain handles a batch of
records in one loop, off the training thread's critical path (it still takes the GIL: it gives it
back every ``_YIELD_EVERY`` records). Why every half second and not at once: one wake-up per step
would cost a thread switch per step, and objects that live for seconds reach the garbage
collector's oldest generation, whose collections pause training (``benchmarks/README.md``).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque

from opentelemetry.trace import Status, StatusCode

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.export import batches, clock, hangs, kernels, sdk, trace_ids
from opentelemetry_instrumentation_deepspeed.export.spans import remote_parent
from opentelemetry_instrumentation_deepspeed.recording import scalars
from opentelemetry_instrumentation_deepspeed.recording.allocator import is_out_of_memory
from opentelemetry_instrumentation_deepspeed.recording.host_cpu import HostCpu, wait_share
from opentelemetry_instrumentation_deepspeed.recording.record import Collective, Failure, HangReport, Phase, StepRecord
from opentelemetry_instrumentation_deepspeed.recording.recorder import StepRecorder
from opentelemetry_instrumentation_deepspeed.runtime.safety import Component, fail_open, observing

_logger = logging.getLogger(__name__)

DRAIN_SECONDS = 0.5
LIMIT = 1024  # items waiting past which the submitting thread drains (the emitter's thread could not run)
RECENT_STEPS = 64  # closed steps whose slowest the hang watchdog's threshold reads (as its own WINDOW)
MAX_QUEUED = 4 * LIMIT  # items waiting past which steps and collectives are dropped (a drain runs, slower than them)
MAX_PENDING = 4096  # incomplete intervals kept at most: a GPU that never completes must not grow memory
_YIELD_EVERY = 8  # records emitted between two releases of the GIL
SCALARS_WAIT_SECONDS = 30.0  # a step whose loss copies have not completed by then is emitted without them
COLLECTION_WAIT_SECONDS = 0.25  # a collection waits this long at most for a drain running elsewhere
_COLLECTION_INSTRUMENT = "opentelemetry_instrumentation_deepspeed.emitter"

_PHASE_SPANS = {semconv.PHASE_FORWARD: semconv.SPAN_FORWARD, semconv.PHASE_BACKWARD: semconv.SPAN_BACKWARD,
                semconv.PHASE_OPTIMIZER_STEP: semconv.SPAN_OPTIMIZER_STEP}


class StepFacts:
    """What never changes for one engine's steps, and where their telemetry goes."""

    def __init__(self, writer, metrics, identity, engine, *, profile_top: int, comm_span_limit: int):
        self.writer = writer
        _flush_first(writer.provider)
        self.metrics = metrics
        self.emits_root = identity.rank == 0  # rank 0 emits each step's root, under the ids every rank derives
        self._job_id, self._engine_ordinal = identity.job_id, trace_ids.engine_ordinal(identity.job_id, identity.rank)
        self._decide = trace_ids.root_decision(writer.sampler)
        self.step_ids = trace_ids.StepIds(self._job_id, self._decide, self._engine_ordinal)
        # Times the engine's step count went back (a checkpoint loaded mid-run), and the highest step closed since.
        self.rollbacks, self._highest_closed = 0, 0
        self.root_attributes = {semconv.TRAINING_STEP_SAMPLES: engine.train_batch_size(),
                                semconv.TRAINING_WORLD_SIZE: identity.world_size}
        self.static = {
            semconv.TRAINING_GRADIENT_ACCUMULATION_STEPS: engine.gradient_accumulation_steps(),
            semconv.TRAINING_ZERO_STAGE: int(engine.zero_optimization_stage()),
            semconv.TRAINING_MICRO_BATCH_SIZE: engine.train_micro_batch_size_per_gpu(),
        }
        if metrics.precision is not None:
            self.static[semconv.TRAINING_PRECISION] = metrics.precision
        self.profile_top = profile_top
        self.profile_cost = None  # called with the CPU seconds each profile's spans took (the profiler's budget)
        self.comm_span_limit = comm_span_limit  # collective spans per step; the others are counted
        self.summed_losses = getattr(engine, "summed_losses", False)  # a plain loop's backwards get loss / G
        self.host_cpu = HostCpu()
        self.peer_stages: dict | None = None  # a pipeline stage's {global rank: stage} of its pipeline
        # The root of a step that raised, kept open for its retry (same number) until the next step.
        self.held_root: _HeldRoot | None = None
        # The last step written and its end: the hang watchdog's sign of progress between steps.
        self.last_written, self.last_end = 0, 0
        # The slowest of the last RECENT_STEPS steps written that closed without an error: the hang watchdog's
        # threshold reads it (steps that open and close between two of its looks, it never sees open).
        self.recent_seconds: deque = deque(maxlen=RECENT_STEPS)
        self.slowest_recent: float | None = None

    def recorded(self, number: int) -> bool:
        """Whether step ``number``'s spans may be recorded (its root sampled), as every rank decides it. Any thread:
        derived afresh, not from ``step_ids``, whose blocks the emitter's thread renews. True where the sampler's
        decision is not a function of the trace id (a custom sampler): it is not asked ahead, for the emitter asks
        it once for that root, and a second question would cost a rate-limiting sampler a token."""
        if self._decide is None:
            return True
        return self._decide(trace_ids.step_ids(self._job_id, number, self._engine_ordinal, self.rollbacks)[0])

    def numbered(self, number: int, closed: bool) -> None:
        """A step written: one numbered at or below a step closed before it follows a rollback (DeepSpeed's
        ``load_checkpoint()`` set its count back, on every rank alike), and its steps take other traces than the
        ones they run again. A step that failed and is retried keeps its number and its trace."""
        if number <= self._highest_closed:
            self.rollbacks, self._highest_closed = self.rollbacks + 1, 0
            self.step_ids = trace_ids.StepIds(self._job_id, self._decide, self._engine_ordinal, self.rollbacks)
        if closed:
            self._highest_closed = max(self._highest_closed, number)


class _HeldRoot:
    __slots__ = ("description", "end", "number", "start", "started")

    def __init__(self, number: int, started, start: int, end: int, description: str):
        self.number, self.started, self.start, self.end, self.description = number, started, start, end, description


_NEVER = (0, 0, False)  # an async collective never waited for: no span, not in the metrics


def span_attributes(collective: Collective, seconds: float, on_gpu: bool) -> dict:
    """A collective's span attributes: what never changes for its (op, group), and what this call measured."""
    route = collective.route
    attributes = {
        **route.span_attributes,
        semconv.COMM_BYTES: collective.bytes,
        semconv.COMM_DTYPE: collective.dtype,
        semconv.COMM_ASYNC: collective.is_async,
        semconv.COMM_SEQUENCE: collective.sequence,
    }
    if collective.failure is None:  # one that failed (its peer gone) moved no data in that time
        algbw = collective.bytes * route.size_factor / seconds
        attributes[semconv.COMM_ALGBW] = algbw
        attributes[semconv.COMM_BUSBW] = algbw * route.bus_factor
    if on_gpu:
        attributes[semconv.COMM_TIMING] = semconv.COMM_TIMING_GPU
    if collective.peer is not None:
        attributes[semconv.COMM_PEER_RANK] = collective.peer
        if collective.peer_stage is not None:
            attributes[semconv.COMM_PEER_STAGE] = collective.peer_stage
    if collective.coalesced:
        attributes[semconv.COMM_COALESCED] = collective.coalesced
    return attributes


def _comm_counts(collectives: list, span_limit: int) -> dict:
    """Parent (a phase, or None: the step between phases) -> [collectives issued there, of which past the step's span
    limit]. Spans go to the first ``span_limit`` collectives that ask for one, in the order they were issued; the
    others lose theirs (``spanned``) and are counted: the training thread only lists them."""
    counts: dict = {}
    spans = 0
    for collective in collectives:
        parent = collective.parent
        kept = counts.get(parent)
        if kept is None:
            kept = counts[parent] = [0, 0]
        kept[0] += 1
        if collective.spanned:
            if spans < span_limit:
                spans += 1
            else:
                collective.spanned = False
                kept[1] += 1
    return counts


def _comm_attributes(issued: int, dropped: int) -> dict:
    attributes = {semconv.COMM_COUNT: issued} if issued else {}
    if dropped:
        attributes[semconv.COMM_SPANS_DROPPED] = dropped
    return attributes


def _counts(record: StepRecord, kept: int, comm: dict) -> dict:
    """The step's collectives (``kept`` in its record; ``comm``: ``_comm_counts``'s), those that got no span, the
    phases it did not keep, and the time its thread spent in collectives before it. Past the builder's
    MAX_COLLECTIVES a collective is counted, and has no span (all of them ask for one, or none do: the process's
    comm mode)."""
    dropped = record.collectives_dropped
    spans_dropped = dropped if dropped and record.latest_dropped.spanned else 0
    attributes = _comm_attributes(kept + dropped, sum(counts[1] for counts in comm.values()) + spans_dropped)
    if record.phases_dropped:
        attributes[semconv.TRAINING_STEP_PHASES_DROPPED] = record.phases_dropped
    if record.between_comm:
        attributes[semconv.TRAINING_STEP_BETWEEN_COMM] = round(record.between_comm / 1e9, 6)
    return attributes


def _status(failure) -> Status | None:
    if failure is None or getattr(failure, "unfinished", False):  # an unfinished step is no error
        return None
    return Status(StatusCode.ERROR, failure.description)


def _exception(failure) -> dict | None:
    if not isinstance(failure, Failure):
        return None
    # Message and stack trace only where OTEL_PYTHON_DEEPSPEED_EXCEPTION_DETAIL kept them.
    attributes = {semconv.EXCEPTION_TYPE: failure.type, semconv.EXCEPTION_MESSAGE: failure.message,
                  semconv.EXCEPTION_STACKTRACE: failure.stacktrace, semconv.EXCEPTION_ESCAPED: True}  # re-raised
    return {key: value for key, value in attributes.items() if value}


class Emitter(Component):
    def __init__(self):
        super().__init__("telemetry emission")
        self._queue: deque = deque()
        self._pending: deque = deque()  # emit(writers, final) -> done, of intervals still running
        self._lock = threading.RLock()  # one drain at a time (a collection may drain while the thread does)
        self._draining = False  # a drain holds the lock (a submitter past LIMIT then leaves the queue to it)
        self._thread: threading.Thread | None = None
        self._meters: list = []
        self._held: set[StepFacts] = set()  # engines whose last step raised: its root waits for a retry
        # A bug in one kind of telemetry stops that kind only.
        self._collectives = Component("collective tracing")
        self._kernels = Component("kernel profiling")
        self._gpu = Component("GPU timing")
        self._scalars = Component("loss and gradient norm copies")
        self._model_values = Component("step loss and gradient norm")
        self._starting = threading.Lock()
        self.dropped = 0  # incomplete intervals given up beyond MAX_PENDING
        self.dropped_records = 0  # steps and collectives let go past MAX_QUEUED

    # -- any thread -----------------------------------------------------------------------------

    @property
    def emits_profiles(self) -> bool:
        """A profiled step's operators and kernels can still become spans (neither this emitter nor its kernel
        emission failed): the profiler starts no profile that nothing would emit."""
        return not self.broken and not self._kernels.broken

    def submit(self, item: StepRecord | StepRecorder | Collective, drain: bool = True) -> None:
        """``drain`` False: the submitting thread never drains, whatever waits (a backend's thread, in a future's
        callback, must not export)."""
        if self.broken:
            return
        queue = self._queue
        if len(queue) >= MAX_QUEUED and (type(item) is StepRecord or type(item) is Collective):
            self._drop(item)
            return
        queue.append(item)
        if self._thread is None:
            with self._starting:  # an autograd thread may submit too
                if self._thread is None:
                    self._start()
        # Past LIMIT the submitter drains, unless a drain runs (it empties the queue): the training thread never
        # waits for one (a span processor that exports as spans end, at a slow collector, would stop it for as long),
        # and a submitter that holds a builder's lock (a failed builder hands over the collectives it drops) never
        # meets one that waits for that lock to replay. A record comes from a replay: it drains nothing.
        if len(queue) > LIMIT and type(item) is not StepRecord and not self._draining and drain:
            self.drain(blocking=False)

    def _drop(self, item) -> None:
        """``item`` is let go: the queue is full, its drain running elsewhere slower than the steps close."""
        self.dropped_records += 1
        if self.dropped_records == 1:
            _logger.warning("opentelemetry-instrumentation-deepspeed: the telemetry of some steps is dropped: it is "
                            "made more slowly than the steps close (%s items waiting; a span processor that exports "
                            "as each span ends, to a slow endpoint?)", len(self._queue))

    def watch_collections(self, meter) -> None:
        """Drain whenever ``meter``'s reader collects: its totals and histograms then include every record."""
        if any(known is meter for known in self._meters):
            return
        self._meters.append(meter)
        # Its callback returns no observation, so no stream of it is ever exported.
        meter.create_observable_gauge(_COLLECTION_INSTRUMENT, [observing(self, self._drain_at_collection)], unit="1",
                                      description="Internal: emits the queued step records at collection")

    def forget(self) -> None:
        """In a forked child: the parent's records are not the child's to emit, and its thread is not there;
        its locks may have been held by a parent's thread at the fork."""
        self._queue.clear()
        self._pending.clear()
        for facts in self._held:
            facts.held_root = None
        self._held.clear()
        self._thread = None
        self._lock = threading.RLock()
        self._starting = threading.Lock()

    def fail(self, where: str) -> None:
        super().fail(where)
        # Nothing will emit them: the records (and a profiled step's events) are let go.
        self._queue.clear()
        self._pending.clear()

    @fail_open
    def drain(self, final: bool = False, read_waits: bool = True, *, blocking: bool = True,
              timeout: float = -1) -> bool:
        """Emit everything submitted so far; ``final``: also what never completed (host times, or nothing);
        ``read_waits`` False (a flush, a collection): a step closed unread does not wait for the read after it;
        ``blocking`` False: nothing where another thread drains now, ``timeout``: where it still does then.
        Whether this drain ran."""
        if not self._lock.acquire(blocking, timeout if blocking else -1):
            return False
        draining, self._draining = self._draining, True
        try:
            self._drain(final, read_waits)
        finally:
            self._draining = draining
            self._lock.release()
        return True

    def _drain(self, final: bool, read_waits: bool) -> None:
        writers: set = set()
        try:
            self._emit_queued(writers, final, read_waits)
        finally:  # what was made before a failure is kept: a run whose only drain is at exit had lost all of it
            for writer in writers:
                writer.flush()

    def _emit_queued(self, writers: set, final: bool, read_waits: bool) -> None:
        queue, yielding, done = self._queue, threading.current_thread() is self._thread, 0
        while queue:
            try:
                item = queue.popleft()
            except IndexError:
                break
            if type(item) is StepRecord:
                uncovered = self._uncovered(item)
                if not final and (self._scalars_wait(item, len(queue))
                                  or (uncovered and read_waits and self._read_wait(item, len(queue)))):
                    queue.appendleft(item)  # its successors wait with it: steps stay in order
                    self._reports_behind(queue, writers)
                    break
                self._step(item, writers)
            elif type(item) is StepRecorder:  # a step closed: its records are built here, and queued
                item.replay()
            elif type(item) is HangReport:  # the hang watchdog's (runtime/watchdog.py)
                hangs.emit(item, writers)
            elif type(item) is clock.ClockReading:  # the clock refresher's (runtime/clock.py)
                clock.emit(item, writers)
            else:
                self._collective(item, None, None, None, writers)
            done += 1
            if yielding and done % _YIELD_EVERY == 0:
                time.sleep(0)  # lets the training thread take the GIL back
        self._resolve(final, writers)
        if final:
            for facts in list(self._held):
                self._end_root(facts, writers)

    @staticmethod
    def _reports_behind(queue: deque, writers: set) -> None:
        """Hang reports do not wait behind a step held for its loss copies: on a GPU that hangs, the last step's
        copies may not complete (they run after the stuck collective), and it is held SCALARS_WAIT_SECONDS. The rest
        keep their order: other threads only append meanwhile, and what was taken goes back in front of that."""
        if not any(type(item) is HangReport for item in list(queue)):  # a copy: the training thread appends
            return
        kept = []
        for _ in range(len(queue)):
            item = queue.popleft()
            if type(item) is HangReport:
                hangs.emit(item, writers)
            else:
                kept.append(item)
        queue.extendleft(reversed(kept))

    # -- the emitter's thread ---------------------------------------------------------------------

    def _start(self) -> None:
        from opentelemetry_instrumentation_deepspeed.runtime import lifecycle

        lifecycle.in_forked_child(lifecycle.FORGET, self.forget)
        self._thread = threading.Thread(target=self._run, daemon=True, name="otel-deepspeed-emitter")
        self._thread.start()

    def _run(self) -> None:
        while not self.broken:
            time.sleep(DRAIN_SECONDS)
            self.drain()

    def _scalars_readable(self, record: StepRecord) -> bool:
        copied = record.scalars_copied
        if copied is None or self._scalars.broken:
            return copied is None
        try:
            return copied.query()
        except Exception:  # noqa: BLE001 - the CUDA runtime's: device losses stop, the rest goes on
            self._scalars.fail("Emitter._scalars_readable")
            return False

    def _scalars_wait(self, record: StepRecord, behind: int) -> bool:
        """Whether ``record``'s loss copies are still running on the GPU and worth waiting for."""
        if record.scalars_copied is None or behind >= LIMIT or self._scalars.broken:  # broken: never readable
            return False
        return not self._scalars_readable(record) and time.time_ns() - record.end < SCALARS_WAIT_SECONDS * 1e9

    def _uncovered(self, record: StepRecord) -> bool:
        """Whether ``record`` closed unread with the read after it not queued (yet). Found queued, that read becomes
        its host's ``covering``, whose share is the record's (one engine's records are queued in the order their
        steps closed)."""
        host = getattr(record.facts, "host_cpu", None)
        if record.schedstat is not None or host is None or host.thread_stat is None \
                or host.covered(record.end) is not None:
            return False
        facts = record.facts
        for queued in list(self._queue):  # copies: the training thread appends meanwhile
            if type(queued) is StepRecorder and queued.facts is facts:
                queued.replay()  # the steps its log holds closed after this one: their records queue behind it
        for queued in list(self._queue):
            if type(queued) is StepRecord and queued.facts is facts and queued.schedstat is not None:
                host.covering = (queued.end, queued.schedstat)
                return False
        return True

    @staticmethod
    def _read_wait(record: StepRecord, behind: int) -> bool:
        """Whether ``record``, uncovered, waits for a later drain: not a failed step (the next one may be far off,
        or never come), and only while a read could still cover it."""
        return record.failure is None and behind < LIMIT and record.facts.host_cpu.may_be_covered(record.end)

    def _model(self, record: StepRecord, more: dict) -> None:
        """The step's loss, gradient norm and what the numerics watch finds in them."""
        loss = grad_norm = None
        if not self._model_values.broken:
            try:
                readable = self._scalars_readable(record)
                # A step past MAX_PHASES kept the losses of its first phases only: its mean is not the step's.
                if (readable or record.scalars_copied is None) and not record.phases_dropped:
                    loss = scalars.step_loss(record.losses, record.facts.summed_losses)
                grad_norm = record.grad_norm
                grad_norm = scalars.value(grad_norm) if readable or type(grad_norm) is not scalars.Pending else None
            except Exception:  # noqa: BLE001 - ours (a value of a kind not foreseen): the losses go, not the steps
                self._model_values.fail("Emitter._model")
                loss = grad_norm = None
        if loss is not None:
            more[semconv.TRAINING_LOSS] = loss
        if grad_norm is not None:
            more[semconv.TRAINING_GRAD_NORM] = grad_norm
        kinds = record.facts.metrics.model(loss, grad_norm, record.skipped)
        if kinds:
            more[semconv.TRAINING_NUMERICS_ANOMALY] = ",".join(kinds)

    @staticmethod
    def _memory(record: StepRecord, more: dict) -> None:
        """The phase an out-of-memory error ended; the allocator's figures at the step's end (or failure) and
        each phase's peak."""
        failure = record.failure
        if isinstance(failure, Failure) and is_out_of_memory(failure.type):
            failed = next((phase for phase in reversed(record.phases) if phase.failure is not None), None)
            more[semconv.TRAINING_MEMORY_OOM] = failed.name if failed is not None else "step"
        last, peaks = None, {}
        for phase in record.phases:
            memory = phase.memory
            if memory is not None:
                last = memory
                peaks[phase.name] = max(peaks.get(phase.name, 0), memory.peak)
        if last is None:
            return
        more[semconv.TRAINING_MEMORY_ALLOCATED] = last.allocated
        more[semconv.TRAINING_MEMORY_RESERVED] = last.reserved
        for name, peak in peaks.items():
            more[semconv.TRAINING_MEMORY_PHASE_PEAK.format(phase=name)] = peak
        first = next(phase.memory for phase in record.phases if phase.memory is not None)
        more[semconv.TRAINING_MEMORY_ALLOC_RETRIES] = last.retries - first.retries

    def _drain_at_collection(self, _options):
        # Not for as long as a drain elsewhere takes: the metrics (the last ones at exit among them) would wait for
        # a stuck one, and be lost with it.
        self.drain(read_waits=False, timeout=COLLECTION_WAIT_SECONDS)
        return []

    # -- a step ---------------------------------------------------------------------------------

    def _step(self, record: StepRecord, writers: set) -> None:
        facts, writer = record.facts, record.facts.writer
        writers.add(writer)
        root, held, parent = self._root(record, writers)
        step = writer.child(semconv.SPAN_STEP, parent, {semconv.TRAINING_STEP: record.number, **facts.static},
                            record.start)
        facts.last_written, facts.last_end = record.number, record.end
        if record.failure is None:
            facts.recent_seconds.append((record.end - record.start) / 1e9)
            facts.slowest_recent = max(facts.recent_seconds)
        intervals: list | None = [] if record.profile is not None and step.recording else None
        by_micro_step, batch_sums, counted = batches.summarize(list(record.phases))
        collectives = list(record.collectives)
        comm = _comm_counts(collectives, facts.comm_span_limit)
        phases = self._phases(record, step, intervals, writers, by_micro_step, comm)
        peer_stages = facts.peer_stages
        for collective in collectives:
            if peer_stages is not None and collective.peer is not None:
                collective.peer_stage = peer_stages.get(collective.peer)
            spanned = step.recording and collective.spanned
            parent_context = phases.get(collective.parent, step.context) if spanned else None
            self._collective(collective, writer if parent_context is not None else None, parent_context, intervals,
                             writers)

        facts.metrics.batches(record.samples, record.tokens)
        facts.metrics.inputs(counted, record.end, step.context)
        more = {} if record.phases_dropped else dict(batch_sums)  # sums of some of its batches would read as a drop
        if record.failure is None:
            # Each forward's batch as it left the loader (an epoch's partial last batch, a loop feeding fewer samples
            # than configured), the configured micro-batch size where a batch was not read: as training.samples counts.
            if record.samples:  # none: no forward's batch was seen (a compiled forward, batches of no known shape)
                more[semconv.TRAINING_STEP_SAMPLES] = record.samples
            more.update({semconv.TRAINING_STEP_MICRO_BATCHES: record.micro_batches,
                         semconv.TRAINING_STEP_SKIPPED: record.skipped})
            facts.metrics.step(record.start, record.end, step.context, record.tokens, record.skipped)
            self._model(record, more)
        self._memory(record, more)
        cpus = facts.host_cpu.over(record.start, record.end)
        if cpus is not None:
            more[semconv.TRAINING_STEP_HOST_CPU_BUSY] = round(cpus[0], 3)
            more[semconv.TRAINING_STEP_HOST_CPU_IDLE] = round(cpus[1], 3)
            more[semconv.TRAINING_STEP_PROCESS_CPU] = round(cpus[2], 3)
            waited = facts.host_cpu.waited(record.schedstat, record.end)
            if waited is None:
                waited = cpus[3]  # the samples' average around the step
            if waited is not None:
                more[semconv.TRAINING_STEP_THREAD_CPU_WAIT] = round(waited, 3)
            if cpus[4] is not None:
                more[semconv.TRAINING_STEP_NATIVE_THREADS_CPU_WAIT] = round(cpus[4], 3)
        more.update(_counts(record, len(collectives), comm))
        if getattr(record.failure, "unfinished", False):
            more[semconv.TRAINING_STEP_UNFINISHED] = True
        if intervals is not None and not self._kernels.broken:
            more.update(self._operators(record, intervals, step.context))
        record.profile = None  # the profiler's events are large: not kept any longer than this
        # A step the process's exit ended by an exception no wrapper saw: its stack, as a failed phase has its own.
        writer.end(step, record.start, record.end, more, _status(record.failure),
                   _exception(getattr(record.failure, "cause", None)))
        if root is not None:
            self._end_or_hold_root(record, root, held)

    def _root(self, record: StepRecord, writers: set):
        """(root started here or held from a failed try of this step, the held one, the step's parent context)."""
        facts, writer, number = record.facts, record.facts.writer, record.number
        facts.numbered(number, record.failure is None)
        trace_id, root_span_id, sampled = facts.step_ids(number)
        held = facts.held_root
        if held is not None and held.number != number:
            self._end_root(facts, writers)
            held = None
        root = held.started if held is not None else None
        if root is None and facts.emits_root:
            root = writer.root(semconv.SPAN_GLOBAL_STEP, trace_id, root_span_id,
                               {semconv.TRAINING_STEP: number, **facts.root_attributes}, record.start, sampled)
        if root is not None:
            return root, held, root.context
        if sampled is None:
            sampled = trace_ids.sampled(writer.provider, trace_id, semconv.SPAN_GLOBAL_STEP)
        return None, None, remote_parent(trace_id, root_span_id, sampled)

    def _operators(self, record: StepRecord, intervals: list, context) -> dict:
        """A profiled step's operator and kernel spans; their CPU time goes to the profiler's budget."""
        facts = record.facts
        try:
            started = time.thread_time()
            counts = kernels.emit(facts.writer, record.profile, intervals, context, facts.profile_top)
            if facts.profile_cost is not None:
                facts.profile_cost(time.thread_time() - started)
        except Exception:  # noqa: BLE001 - ours (or a new Kineto's): profiles stop, steps go on
            self._kernels.fail("kernels.emit")
            return {}
        return counts

    def _phases(self, record: StepRecord, step, intervals: list | None, writers: set,  # noqa: PLR0917
                by_micro_step: dict, comm: dict) -> dict:
        """Data wait and phase spans and durations; each phase's span context (the step's, when not sampled).
        ``comm``: ``_comm_counts``'s, by phase."""
        writer, metrics, recording = record.facts.writer, record.facts.metrics, step.recording
        failed = record.waits[-1] if record.wait_failed and record.waits else None  # the fetch that raised
        for wait in record.waits:
            wait_start, wait_end, micro_step = wait
            wait_context = step.context
            if recording:
                started = writer.child(semconv.SPAN_DATA_WAIT, step.context,
                                       {semconv.TRAINING_MICRO_STEP: micro_step}, wait_start)
                failure = record.failure if wait is failed else None
                writer.end(started, wait_start, wait_end, None, _status(failure), _exception(failure))
                wait_context = started.context
            metrics.phase(semconv.PHASE_DATA_WAIT, wait_start, wait_end, wait_context)
        contexts: dict[Phase, object] = {}
        for phase in list(record.phases):
            context, end = step.context, phase.end or record.end
            if recording:
                context = self._phase_span(record, phase, step.context, end, intervals, writers,
                                           by_micro_step.get(phase.micro_step), comm.get(phase))
                contexts[phase] = context
            metrics.phase(phase.name, phase.start, end, context)
            if phase.memory is not None:
                metrics.memory_read(phase.memory, phase.name)
        return contexts

    def _phase_span(self, record: StepRecord, phase: Phase, parent, end: int,  # noqa: PLR0917
                    intervals: list | None, writers: set, batch: dict | None = None, comm: list | None = None):
        """``batch``: what the phase's micro-batch held (forward and backward); ``comm``: [collectives issued in
        it, of which past the span limit]."""
        writer = record.facts.writer
        attributes = {} if phase.micro_step is None else {semconv.TRAINING_MICRO_STEP: phase.micro_step}
        if batch:
            attributes.update(batch)
        if phase.direct:
            attributes[semconv.TRAINING_BACKWARD_DIRECT] = True
        started = writer.child(_PHASE_SPANS[phase.name], parent, attributes, phase.start)
        more = {}
        if comm is not None:
            more.update(_comm_attributes(*comm))
        if phase.schedstat_end is not None:
            waited = wait_share(phase.schedstat_start, phase.schedstat_end, end - phase.start)
            if waited is not None:
                more[semconv.TRAINING_PHASE_THREAD_CPU_WAIT] = round(min(waited, 1.0), 3)
        memory = phase.memory
        if memory is not None:
            more[semconv.TRAINING_MEMORY_ALLOCATED] = memory.allocated
            more[semconv.TRAINING_MEMORY_RESERVED] = memory.reserved
            more[semconv.TRAINING_MEMORY_PEAK] = memory.peak
        writer.end(started, phase.start, end, more, _status(phase.failure), _exception(phase.failure))
        if intervals is not None:
            intervals.append(kernels.Interval(phase.start, end, started.context))
        if phase.gpu_start is not None and phase.gpu_end is not None:
            self._gpu_phase(record.gpu, writer, phase, started.context, writers)
        return started.context

    def _end_or_hold_root(self, record: StepRecord, root, held: _HeldRoot | None) -> None:
        facts = record.facts
        start = held.start if held is not None else record.start
        if isinstance(record.failure, Failure):  # a retry of the same step would join this root
            facts.held_root = _HeldRoot(record.number, root, start, record.end, record.failure.description)
            self._held.add(facts)
            return
        facts.held_root = None
        self._held.discard(facts)
        status = _status(record.failure)
        if status is None and held is not None:  # the retry succeeded: the step had failed all the same
            status = Status(StatusCode.ERROR, held.description)
        facts.writer.end(root, start, record.end, None, status)

    def _end_root(self, facts: StepFacts, writers: set) -> None:
        held, facts.held_root = facts.held_root, None
        self._held.discard(facts)
        writers.add(facts.writer)
        facts.writer.end(held.started, held.start, held.end, None, Status(StatusCode.ERROR, held.description))

    # -- collectives and GPU intervals --------------------------------------------------------------

    def _collective(self, collective: Collective, writer, parent, intervals, writers: set) -> None:
        """Emit ``collective`` if it completed, else keep it pending until it does."""
        times = self._completed(collective, final=False)
        if times is None:
            def emit(writers, final):
                times = self._completed(collective, final)
                if times is None:
                    return False
                if times is not _NEVER:
                    self._emit_collective(collective, times, writer, parent, None, writers)
                return True

            self._add_pending(emit, writers)
        else:
            self._emit_collective(collective, times, writer, parent, intervals, writers)

    def _completed(self, collective: Collective, final: bool) -> tuple[int, int, bool] | None:
        """(start, end, on the GPU) of a collective that completed; None while it runs; ``final``: host
        times for a GPU interval that did not complete, ``_NEVER`` for a call never waited for."""
        end = collective.end
        if end is None:  # running (an async call not waited for yet), or its failure still being written
            return _NEVER if final else None
        if collective.failure is None and collective.gpu_end is not None and not self._gpu.broken:
            try:
                times = collective.timeline.times(collective.gpu_start, collective.gpu_end)
            except Exception:  # noqa: BLE001 - ours (or the CUDA runtime's): host times from now on
                self._gpu.fail("GpuTimeline.times")
                times = None
            if times is not None:
                return times[0], times[1], True
            if not final and not self._gpu.broken:
                return None
        return collective.start, end, False

    def _emit_collective(self, collective: Collective, times, writer, parent, intervals,  # noqa: PLR0917
                         writers: set) -> None:
        """Its metrics and, with a ``writer``, its span; a bug here turns collectives off, not steps."""
        guard = self._collectives
        if guard.broken:
            return
        try:
            start, end, on_gpu = times
            route = collective.route
            seconds = max(end - start, 1) / 1e9
            if collective.failure is None:  # one that failed (its peer gone) moved no data: its time is still spent
                totals = route.totals
                totals[0] += collective.bytes
                totals[1] += int(collective.bytes * route.size_factor * route.bus_factor)
            started = None
            try:
                if writer is not None:
                    writers.add(writer)
                    started = writer.child(route.span_name, parent, span_attributes(collective, seconds, on_gpu),
                                           start)
                    writer.end(started, start, end, None, _status(collective.failure), _exception(collective.failure))
            finally:  # its span, if made, is its exemplar; a bug in the span's making leaves the metric whole
                route.duration.record(seconds, end, None if started is None else started.context,
                                      route.metric_attributes)
            if intervals is not None and started is not None and not on_gpu:  # operators: host clock, the call's step
                intervals.append(kernels.Interval(start, end, started.context))
        except Exception:  # noqa: BLE001 - ours: logged once, and collectives stop, steps go on
            guard.fail("Emitter._emit_collective")

    def _gpu_phase(self, timeline, writer, phase: Phase, parent, writers: set) -> None:
        name = semconv.SPAN_PHASE_GPU.format(phase=phase.name)
        start_event, end_event = phase.gpu_start, phase.gpu_end

        guard = self._gpu

        def emit(writers, final):
            if guard.broken:
                return True
            try:
                times = timeline.times(start_event, end_event)
            except Exception:  # noqa: BLE001 - ours (or the CUDA runtime's): GPU intervals stop, the rest goes on
                guard.fail("GpuTimeline.times")
                return True
            if times is None:
                return final  # never resolved (dropped, or still running at exit): no GPU times to show
            started = writer.child(name, parent, None, times[0])
            writer.end(started, times[0], times[1])
            writers.add(writer)
            return True

        if not emit(writers, False):
            self._add_pending(emit, writers)

    def _add_pending(self, emit, writers: set) -> None:
        pending = self._pending
        if len(pending) >= MAX_PENDING:
            self.dropped += 1
            pending.popleft()(writers, True)
        pending.append(emit)

    def _resolve(self, final: bool, writers: set) -> None:
        pending = self._pending
        for _ in range(len(pending)):
            emit = pending.popleft()
            if not emit(writers, final):
                pending.append(emit)


_flushed_first: weakref.WeakSet = weakref.WeakSet()


def _flush_first(provider) -> None:
    """The provider's ``force_flush`` and ``shutdown`` first emit what the emitter holds, so a flush (and
    the SDK's own exit handler, where this project's lifecycle does not run) exports every step."""
    if not hasattr(provider, "add_span_processor") or provider in _flushed_first:
        return
    _flushed_first.add(provider)
    from opentelemetry.sdk.trace import SpanProcessor

    class EmitFirst(SpanProcessor):
        def force_flush(self, timeout_millis: int = 30_000) -> bool:
            emitter().drain(read_waits=False)
            return True

        def shutdown(self) -> None:
            # Not the final drain: another provider (a test's, a library's) may shut down mid-training;
            # the lifecycle's exit stage gives what never completed its host times.
            emitter().drain(read_waits=False)

    sdk.add_span_processor_first(provider, EmitFirst())


_emitter: Emitter | None = None


def emitter() -> Emitter:
    """The process's emitter (one for every engine and collective)."""
    global _emitter  # noqa: PLW0603 - one per process
    if _emitter is None:
        _emitter = Emitter()
    return _emitter
