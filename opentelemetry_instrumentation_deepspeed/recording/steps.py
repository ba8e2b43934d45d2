"""The span tree of each optimizer step on this rank.

    training.global_step (rank 0 only: the trace's root, ids derived from (job id, step))
    └─ training.step            one per rank
       ├─ training.data.wait    per micro-batch
       ├─ training.forward      per micro-batch
       ├─ training.backward     per micro-batch
       └─ training.optimizer.step

Spans are started with explicit parent spans and times, never made current: that is the
cheap path (no context object per span), and backward hooks may run on autograd's threads.
Phase durations are recorded when the step closes, in one loop. A step opens at its first
observed event (times of data waits before it are kept and become its first spans) and
closes when ``engine.step()`` returns on a gradient-accumulation boundary.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.export import spans, trace_ids
from opentelemetry_instrumentation_deepspeed.export.training_metrics import (
    TrainingMetrics,
    batch_shape,
    flops_per_token,
)
from opentelemetry_instrumentation_deepspeed.recording import kernels
from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env
from opentelemetry_instrumentation_deepspeed.runtime.job import JobIdentity
from opentelemetry_instrumentation_deepspeed.runtime.safety import Component, fail_open
from opentelemetry_instrumentation_deepspeed.version import __version__

_EMPTY = Context()


def _gpu_timeline(engine, cuda):
    device = getattr(engine, "device", None)
    if cuda is None and getattr(device, "type", None) != "cuda":
        return None
    from opentelemetry_instrumentation_deepspeed.recording.gpu_timing import GpuTimeline

    return GpuTimeline(cuda or sys.modules["torch"].cuda)


@dataclass
class _Step:
    number: int
    start: int
    span: trace.Span
    root: trace.Span | None
    micro_batches: int = 0
    tokens: int = 0
    phase: trace.Span | None = None
    phase_name: str = ""
    phase_start: int = 0
    phase_gpu_start: object = None
    # (phase, seconds, span, end) of the phases that ended, recorded as metrics when the step closes.
    durations: list = field(default_factory=list)
    # (function, arguments) of spans to make when the step closes (its collectives').
    later: list = field(default_factory=list)
    direct_backward: trace.Span | None = None
    skipped_before: int = 0
    # Collectives issued in the step / in the running phase, and those beyond the span limit.
    comm_count: int = 0
    comm_spans: int = 0
    comm_dropped: int = 0
    phase_comm_count: int = 0
    phase_comm_dropped: int = 0
    # Phases and collectives of a profiled step, where its operators are placed; None otherwise.
    intervals: list | None = None
    # False for a step the sampler dropped: its phases and collectives then make no span at all.
    recording: bool = True


class StepTracker(Component):
    """Spans of one DeepSpeed engine's steps. Holds no reference to the engine or its tensors."""

    def __init__(self, provider: trace.TracerProvider, identity: JobIdentity, engine, meter=None, cuda=None):
        super().__init__("step tracing")
        self._provider = provider
        sdk_tracer = provider.get_tracer("opentelemetry_instrumentation_deepspeed", __version__)
        self._tracer = spans.Tracer(sdk_tracer)
        # Rank 0 emits each step's root span, under the ids every rank derives.
        self._emits_root = identity.rank == 0
        self._step_ids = trace_ids.StepIds(identity.job_id, trace_ids.root_decision(getattr(provider, "sampler", None)))
        self._world_size = identity.world_size
        self._micro_batch_size = engine.train_micro_batch_size_per_gpu()
        self._global_batch_size = engine.train_batch_size()
        self._static = {
            semconv.TRAINING_GRADIENT_ACCUMULATION_STEPS: engine.gradient_accumulation_steps(),
            semconv.TRAINING_ZERO_STAGE: int(engine.zero_optimization_stage()),
            semconv.TRAINING_MICRO_BATCH_SIZE: self._micro_batch_size,
        }
        self._comm_span_limit = env.comm_span_limit()
        self._profiler = kernels.from_environment()
        # On CUDA, each phase also gets its GPU-side interval (a `.gpu` child span) from CUDA events.
        self._gpu = _gpu_timeline(engine, cuda)
        meter = meter or NoOpMeterProvider().get_meter(__name__)
        self.metrics = TrainingMetrics(meter, flops_per_token(engine.module) if hasattr(engine, "module") else None,
                                       engine)
        self._step: _Step | None = None
        self._waits: list[tuple[int, int]] = []
        # Waits kept before a step opens: the ones that fetch its micro-batches, no older.
        self._max_waits = max(1, engine.gradient_accumulation_steps())
        self._failed_root: tuple[int, trace.Span] | None = None

    # -- what the wrappers call -------------------------------------------------------------

    @fail_open
    def data_waited(self, start: int, end: int) -> None:
        step = self._step
        if step is None:
            if len(self._waits) >= self._max_waits:
                del self._waits[0]
            self._waits.append((start, end))
        else:
            self._data_wait_span(step, start, end)

    @fail_open
    def not_training(self) -> None:
        """An evaluation forward: waits so far fed it, not the next step."""
        self._waits.clear()

    @fail_open
    def forward_started(self, engine, args=(), kwargs=None) -> trace.Span:
        step = self._step or self._open(engine)
        span = self._phase_span(step, semconv.SPAN_FORWARD, semconv.PHASE_FORWARD, step.micro_batches)
        step.micro_batches += 1
        samples, tokens = batch_shape(args, kwargs or {})
        self.metrics.samples += samples or self._micro_batch_size
        if tokens:
            self.metrics.tokens += tokens
            step.tokens += tokens
        return span

    @fail_open
    def backward_started(self, engine, direct: bool = False) -> trace.Span:
        step = self._step or self._open(engine)
        span = self._phase_span(step, semconv.SPAN_BACKWARD, semconv.PHASE_BACKWARD, max(step.micro_batches - 1, 0))
        if direct:
            span.set_attribute(semconv.TRAINING_BACKWARD_DIRECT, True)
            step.direct_backward = span
        return span

    @fail_open
    def direct_backward_ended(self) -> None:
        step = self._step
        if step is not None and step.direct_backward is not None:
            span, step.direct_backward = step.direct_backward, None
            self._end_phase(step, span)

    @fail_open
    def direct_backward_failed(self, error: BaseException) -> None:
        step = self._step
        if step is not None and step.direct_backward is not None:
            span, step.direct_backward = step.direct_backward, None
            self.phase_failed(span, error)

    @fail_open
    def optimizer_step_started(self, engine) -> trace.Span | None:
        """None unless this ``engine.step()`` call is a gradient-accumulation boundary."""
        # Read before step(): micro_steps advances inside it. Unmanaged accumulation makes every step() one.
        managed = getattr(engine, "managed_gradient_accumulation", None)
        if (managed is None or managed()) and not engine.is_gradient_accumulation_boundary():
            return None
        step = self._step or self._open(engine)
        step.skipped_before = engine.skipped_steps
        return self._phase_span(step, semconv.SPAN_OPTIMIZER_STEP, semconv.PHASE_OPTIMIZER_STEP, None)

    @fail_open
    def optimizer_step_ended(self, engine, span: trace.Span | None) -> None:
        step = self._step
        if step is None or span is None:
            return
        self._end_phase(step, span)
        skipped = engine.skipped_steps > step.skipped_before
        step.span.set_attributes({
            semconv.TRAINING_STEP_SAMPLES: step.micro_batches * self._micro_batch_size,
            semconv.TRAINING_STEP_MICRO_BATCHES: step.micro_batches,
            semconv.TRAINING_STEP_SKIPPED: skipped,
        })
        if self._profiler is not None:
            self._profiler.step_closed(self._tracer, step.span, step.intervals, (time.time_ns() - step.start) / 1e9)
        end = self._close(step)
        self.metrics.step((end - step.start) / 1e9, step.span, step.tokens, skipped)

    @fail_open
    def phase_ended(self, span: trace.Span | None) -> None:
        step = self._step
        if step is not None and span is not None:
            self._end_phase(step, span)

    @fail_open
    def phase_failed(self, span: trace.Span | None, error: BaseException) -> None:
        """The step raised inside a phase: both carry the error and end; the next event opens a new step.

        A retry of the step (same number: DeepSpeed did not count it) goes under the same root span.
        """
        description = f"{type(error).__name__}: {error}"
        step = self._step
        if span is not None:
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, description))
            if step is None:
                span.end()
        if step is None:
            return
        if span is not None:
            self._end_phase(step, span)
        if step.direct_backward is not None and step.direct_backward is not span:
            self._interrupt(step)
        step.span.set_status(Status(StatusCode.ERROR, description))
        if self._profiler is not None:
            self._profiler.abandon()
        root, step.root = step.root, None
        self._close(step)
        if root is not None:
            root.set_status(Status(StatusCode.ERROR, description))
            if self._failed_root is not None:
                self._failed_root[1].end()
            self._failed_root = (step.number, root)

    @fail_open
    def interrupted(self, description: str) -> None:
        """The process is going away with a step open (a signal, an error outside DeepSpeed's calls):
        its open phase, the step and its root end with ERROR and ``description``."""
        step = self._step
        if step is None:
            return
        for span in (step.phase, step.direct_backward):
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, description))
                self._end_phase(step, span)
        step.direct_backward = None
        step.span.set_status(Status(StatusCode.ERROR, description))
        if step.root is not None:
            step.root.set_status(Status(StatusCode.ERROR, description))
        if self._profiler is not None:
            self._profiler.abandon()
        self._close(step)

    def _interrupt(self, step: _Step) -> None:
        """A direct loss.backward() that never reached DeepSpeed's epilogue (it raised, and was caught)."""
        span, step.direct_backward = step.direct_backward, None
        span.set_status(Status(StatusCode.ERROR, "backward did not complete"))
        self._end_phase(step, span)

    def fail(self, where: str) -> None:
        # Whatever broke, a profiler must not keep running (and costing) for the rest of the job.
        if self._profiler is not None:
            self._profiler.abandon()
        was_broken = self.broken
        super().fail(where)
        step, self._step = self._step, None
        if step is None or was_broken:
            return
        # The open step ends here, so nothing later (a collective) joins a trace whose spans never end.
        for span in (step.phase, step.direct_backward, step.span, step.root):
            if span is not None:
                try:
                    span.set_status(Status(StatusCode.ERROR, "step tracing failed; see the log"))
                    span.end()
                except Exception:  # noqa: BLE001 - already failing: end what can be ended
                    pass
        try:
            spans.hand_over()
        except Exception:  # noqa: BLE001 - already failing: the processors get what they can
            pass

    def step_number(self) -> int | None:
        step = self._step
        return None if step is None else step.number

    def note_interval(self, start: int, end: int, span: trace.Span) -> None:
        """A collective's span, for placing the operators of a profiled step."""
        step = self._step
        if step is not None and step.intervals is not None:
            step.intervals.append(kernels.Interval(start, end, trace.set_span_in_context(span, _EMPTY)))

    def later(self, emit, *arguments) -> bool:
        """Call ``emit(*arguments)`` when the open step closes, with its other spans; False: no step
        to wait for, or a profiled one (its operators are placed in its spans as they happen)."""
        step = self._step
        if step is None or step.intervals is not None:
            return False
        step.later.append((emit, arguments))
        return True

    def comm_issued(self, want_span: bool) -> trace.Span | None:
        """Count a collective issued now; the parent for its span, or None (no step open, or over the limit)."""
        step = self._step
        if step is None or self.broken:
            return None
        step.comm_count += 1
        in_phase = step.phase is not None
        step.phase_comm_count += in_phase
        if not want_span or not step.recording:
            return None
        if step.comm_spans >= self._comm_span_limit:
            step.comm_dropped += 1
            step.phase_comm_dropped += in_phase
            return None
        step.comm_spans += 1
        return step.phase if in_phase else step.span

    # -- the tree -----------------------------------------------------------------------------

    def _open(self, engine) -> _Step:
        now = time.time_ns()
        start = self._waits[0][0] if self._waits else now
        number = engine.global_steps + 1
        trace_id, root_span_id, sampled = self._step_ids(number)
        root = None
        if self._failed_root is not None:
            failed_number, failed_root = self._failed_root
            self._failed_root = None
            if failed_number == number:
                root = failed_root
            else:
                failed_root.end()
        if root is None and self._emits_root:
            root = self._tracer.start_root(semconv.SPAN_GLOBAL_STEP, trace_id, root_span_id, {
                semconv.TRAINING_STEP: number,
                semconv.TRAINING_STEP_SAMPLES: self._global_batch_size,
                semconv.TRAINING_WORLD_SIZE: self._world_size,
            }, start, sampled)
        if root is not None:
            parent = root
        else:
            if sampled is None:
                sampled = trace_ids.sampled(self._provider, trace_id, semconv.SPAN_GLOBAL_STEP)
            flags = trace_ids.SAMPLED if sampled else trace_ids.NOT_SAMPLED
            parent = NonRecordingSpan(SpanContext(trace_id, root_span_id, is_remote=True, trace_flags=flags))
        span = self._tracer.start_child(semconv.SPAN_STEP, parent, {semconv.TRAINING_STEP: number, **self._static},
                                        start)
        if self._gpu is not None:
            self._gpu.anchor_if_idle()
        step = _Step(number, start, span, root, recording=span.is_recording())
        if self._profiler is not None and self._profiler.step_opened(number):
            step.intervals = []
        self._step = step
        for wait_start, wait_end in self._waits:
            self._data_wait_span(step, wait_start, wait_end)
        self._waits.clear()
        return step

    def _close(self, step: _Step) -> int:
        self._step = None
        for emit, arguments in step.later:
            emit(*arguments)
        if step.comm_count:
            step.span.set_attribute(semconv.COMM_COUNT, step.comm_count)
        if step.comm_dropped:
            step.span.set_attribute(semconv.COMM_SPANS_DROPPED, step.comm_dropped)
        end = time.time_ns()
        step.span.end(end_time=end)
        if step.root is not None:
            step.root.end(end_time=end)
        spans.hand_over()
        self.metrics.phases(step.durations)
        return end

    def _data_wait_span(self, step: _Step, start: int, end: int) -> None:
        span = step.span
        if step.recording:
            span = self._tracer.start_child(semconv.SPAN_DATA_WAIT, span,
                                            {semconv.TRAINING_MICRO_STEP: step.micro_batches}, start)
            span.end(end_time=end)
        step.durations.append((semconv.PHASE_DATA_WAIT, (end - start) / 1e9, span, end))

    def _gpu_span(self, name: str, parent: trace.Span):
        def emit(start: int | None, end: int | None) -> None:
            if start is not None:  # never resolved (dropped, or still running at exit): no GPU times to show
                self._tracer.start_child(name, parent, None, start).end(end_time=end)

        return emit

    def _phase_span(self, step: _Step, name: str, phase: str, micro_step: int | None) -> trace.Span:
        if step.direct_backward is not None:
            self._interrupt(step)
        start = time.time_ns()
        if step.recording:
            attributes = None if micro_step is None else {semconv.TRAINING_MICRO_STEP: micro_step}
            span = self._tracer.start_child(name, step.span, attributes, start)
        else:
            # Its own object: phases are told apart by identity.
            span = NonRecordingSpan(step.span.get_span_context())
        step.phase, step.phase_name, step.phase_start = span, phase, start
        if self._gpu is not None:
            self._gpu.resolve()
            step.phase_gpu_start = self._gpu.event()
        step.phase_comm_count = step.phase_comm_dropped = 0
        return span

    def _end_phase(self, step: _Step, span: trace.Span) -> None:
        end = time.time_ns()
        if step.phase is span:
            if step.phase_comm_count:
                span.set_attribute(semconv.COMM_COUNT, step.phase_comm_count)
            if step.phase_comm_dropped:
                span.set_attribute(semconv.COMM_SPANS_DROPPED, step.phase_comm_dropped)
            step.durations.append((step.phase_name, (end - step.phase_start) / 1e9, span, end))
            if step.intervals is not None:
                step.intervals.append(kernels.Interval(step.phase_start, end, trace.set_span_in_context(span, _EMPTY)))
            if self._gpu is not None and step.phase_gpu_start is not None:
                self._gpu.defer(step.phase_gpu_start, self._gpu.event(),
                                self._gpu_span(semconv.SPAN_PHASE_GPU.format(phase=step.phase_name), span))
                step.phase_gpu_start = None
            step.phase = None
        span.end(end_time=end)
