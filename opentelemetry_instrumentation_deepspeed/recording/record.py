"""A step as plain data: what the training thread records, and all the emitter needs.

The wrappers append to the open ``StepRecord`` of their rank and touch no OpenTelemetry object.
Other threads may read an open record (the emitter once it is closed; a watchdog while it is
open): every field is either set once or only appended to, so a reader that copies a list
(``list(record.phases)``) sees a consistent prefix of it. Records hold numbers, strings and CUDA
events, never a tensor or an exception object (whose traceback would keep a step's frames, and so
its tensors, alive): an error is kept as ``Failure``, its type, message and formatted stack.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field

from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env


@dataclass(frozen=True, slots=True)
class Failure:
    """An exception raised inside a phase or a collective, as the span's status and exception event show it."""

    type: str
    message: str
    stacktrace: str
    description: str

    @classmethod
    def of(cls, error: BaseException) -> Failure:
        """What of ``error`` leaves the process: ``OTEL_PYTHON_DEEPSPEED_EXCEPTION_DETAIL`` says (type, message,
        stack trace); messages and stack traces are cut (a message may be a whole tensor's repr)."""
        detail = env.exception_detail()
        kind = type(error).__qualname__
        if detail == "type":
            return cls(kind, "", "", type(error).__name__)
        message = _cut(str(error), MAX_MESSAGE, keep_end=False)
        stacktrace = _cut("".join(traceback.format_exception(error)), MAX_STACKTRACE, keep_end=True) \
            if detail == "full" else ""
        return cls(kind, message, stacktrace, f"{type(error).__name__}: {message}" if message else type(error).__name__)


MAX_MESSAGE = 1000  # characters of an exception's message that are kept
MAX_STACKTRACE = 8000  # characters of a stack trace that are kept: its end, where the error was raised
_CUT = " [...]"


def _cut(text: str, limit: int, *, keep_end: bool) -> str:
    if len(text) <= limit:
        return text
    return (_CUT + text[-(limit - len(_CUT)):]) if keep_end else (text[:limit - len(_CUT)] + _CUT)


@dataclass(frozen=True, slots=True)
class Interrupted:
    """The step or phase stopped without an exception: the process exits, or a direct backward never finished.
    ``unfinished``: the program ended normally with the step open (no error: a loop that ran micro-batches after its
    last optimizer step)."""

    description: str
    unfinished: bool = False
    cause: Failure | None = None  # the exception that ended the process, where one did: its stack on the step's span


class Phase:
    """One forward, backward or optimizer step of the open step."""

    __slots__ = ("direct", "end", "failure", "gpu_end", "gpu_start", "inputs", "memory", "micro_step", "name",
                 "schedstat_end", "schedstat_start", "start")

    def __init__(self, name: str, micro_step: int | None, start: int, gpu_start=None, direct: bool = False):
        self.name = name  # semconv.PHASE_*
        self.micro_step = micro_step
        self.start = start
        self.end: int | None = None
        self.direct = direct  # a backward the user started with loss.backward()
        self.failure: Failure | Interrupted | None = None
        self.gpu_start = gpu_start  # CUDA events bracketing the phase's GPU work, or None
        self.gpu_end = None
        self.memory = None  # the caching allocator at its end (recording.allocator.Memory), on CUDA
        self.inputs: tuple | None = None  # a forward's batch: (samples, padded length, real tokens or None)
        # The training thread's schedstat bytes at its start and end, for the emitter to parse
        self.schedstat_start: bytes | None = None
        self.schedstat_end: bytes | None = None


class Collective:
    """One collective call. ``end`` is set when it completed on the host (a synchronous call's return,
    an async one's ``wait()``); the GPU events, when there are any, give the times it ran there."""

    # Slots: 216 bytes a collective where an instance dict made it 560 (a ZeRO-3 step issues hundreds, and a slow
    # exporter holds thousands of steps' records); its 7 fewer stores, without them, were not resolved in time.
    __slots__ = ("bytes", "coalesced", "dtype", "end", "failure", "gpu_end", "gpu_start", "in_step", "is_async",
                 "parent", "peer", "peer_stage", "remaining", "route", "sequence", "spanned", "start", "timeline")

    def __init__(self, route, sequence: int, data_bytes: int, dtype: str, is_async: bool,  # noqa: PLR0917
                 start: int, spanned: bool = False):
        self.route = route  # what never changes for its (op, group): names, attributes, factors, instruments
        self.sequence = sequence
        self.bytes = data_bytes
        self.dtype = dtype
        self.is_async = is_async
        self.start = start
        self.end: int | None = None
        self.failure: Failure | None = None
        # Issued in an open step, whose record holds it (no reference back: no cycle); None: after the next step's
        # first fetch, kept for it until it opens.
        self.in_step: bool | None = False
        self.parent: Phase | None = None  # the phase it was issued in; None: the step (or no step)
        # It asks for a span (OTEL_PYTHON_DEEPSPEED_COMM=spans); the emitter clears it past the step's span limit
        self.spanned = spanned
        self.gpu_start = None
        self.gpu_end = None
        self.timeline = None  # the GpuTimeline of its events
        self.remaining = 1  # async work handles not waited for yet
        self.peer: int | None = None  # send / recv: the global rank at the other end
        self.peer_stage: int | None = None  # ... and its pipeline stage, set by the emitter
        self.coalesced = 0  # a coalescing block's: the calls torch ran as this one


@dataclass(slots=True)
class StepRecord:
    """One optimizer step of one engine on this rank, open from its first event to its close."""

    facts: object  # what never changes for the engine: static attributes, sinks (export.emitter.StepFacts)
    number: int
    start: int
    waits: list  # (start, end, micro_step) of each data wait
    phases: list  # Phase, in the order they started
    collectives: list  # Collective, in the order they were issued
    micro_batches: int = 0
    backwards: int = 0  # backward phases started (a pipeline numbers its backwards by this)
    samples: int = 0
    tokens: int = 0
    skipped: bool = False
    end: int | None = None
    failure: Failure | Interrupted | None = None
    wait_failed: bool = False  # the failure was its last data wait's (a loader that raised)
    phase: Phase | None = None  # the phase running now
    profile: object = None  # the stopped torch.profiler of a profiled step, for the emitter to read
    profiled: bool = False
    # ns the training thread spent in synchronous collectives after the previous step closed, before this one started
    between_comm: int = 0
    gpu: object = None  # the GpuTimeline of its phases' events, on CUDA
    # Each micro-batch's loss and the step's gradient norm, as recording.scalars.take kept them: host
    # floats, or copies of CUDA scalars readable once ``scalars_copied`` (a CUDA event) has completed.
    losses: list = field(default_factory=list)
    grad_norm: object = None
    scalars_copied: object = None
    # The training thread's schedstat as the step closed, raw (recording/host_cpu.py); None where unreadable, or
    # not read (a quiet host's short steps: the read after it covers it).
    schedstat: bytes | None = None
    # Past the builder's MAX_PHASES and MAX_COLLECTIVES (a step that does not close), counted, not kept; the latest
    # collective not kept, for the hang watchdog's collective in flight.
    phases_dropped: int = 0
    collectives_dropped: int = 0
    latest_dropped: Collective | None = None

    @property
    def closed(self) -> bool:
        return self.end is not None


@dataclass(slots=True)
class HangReport:
    """What the watchdog saw of a step that does not close, for the emitter to write as a ``training.hang``
    span: plain data copied from the open record, and the training thread's stack as text."""

    facts: object  # the step's engine facts: where the span goes, the step's trace ids
    number: int  # the open step
    step_start: int
    at: int  # when the report was made
    reason: str
    threshold: float  # seconds
    phase: str | None  # semconv.PHASE_* of the open phase; None between phases
    micro_step: int | None
    phase_start: int | None
    collective: Collective | None  # the latest one not completed (in flight), if any
    sequences: dict  # group name -> last sequence issued on this rank
    stacks: list  # (thread id, thread name, formatted stack)
    between_steps: bool = False  # no step open: ``number`` is the next step, ``step_start`` when the thread stopped
    error: str | None = None  # the exception that ended the process there (its type and message), if one did
