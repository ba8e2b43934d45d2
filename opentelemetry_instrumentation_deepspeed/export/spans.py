"""Finished spans from recorded facts, made by the emitter's thread.

The emitter knows a span's name, parent, attributes, times and outcome all at once, after the
fact. Where the SDK's internals may be used (``sdk.span_pipeline``), a ``ReadableSpan`` (what
every processor and exporter receives) is built directly, sampled exactly as the SDK samples:
the provider's sampler is asked as ``start_span`` asks it, except that under a parent-based
sampler with its default delegates (the SDK's default, and ``parentbased_traceidratio``) a span
with a valid parent takes its parent's decision without a call. The spans of one drain reach the
processors together (``flush``). Processors' ``on_start`` is not called for them. Elsewhere (any
other SDK version, a provider that is not the SDK's) spans go through the public
``start_span`` / ``end``, with the recorded times.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.export import sdk
from opentelemetry_instrumentation_deepspeed.export.trace_ids import NOT_SAMPLED, SAMPLED
from opentelemetry_instrumentation_deepspeed.version import __version__

_INTERNAL = SpanKind.INTERNAL
_UNSET = Status(StatusCode.UNSET)
EMPTY_CONTEXT = Context()


class Started:
    """A span whose context is known (children can name it) and whose end is not written yet."""

    __slots__ = ("attributes", "context", "name", "parent", "recording", "sdk_span")

    def __init__(self, name, context: SpanContext, parent: SpanContext | None, attributes: dict | None,  # noqa: PLR0917
                 recording: bool, sdk_span=None):
        self.name = name
        self.context = context
        self.parent = parent
        self.attributes = attributes
        self.recording = recording
        self.sdk_span = sdk_span  # the public API's span, where that path is taken


class SpanWriter:
    """Spans of one tracer provider, written after the fact."""

    def __init__(self, provider: trace.TracerProvider):
        self.provider = provider
        self._tracer = provider.get_tracer(semconv.SCOPE_NAME, __version__)
        pipeline = sdk.span_pipeline(self._tracer)
        self.fast = pipeline is not None
        self._batch: list = []
        if self.fast:
            self._processor, self._resource, self._scope, self._readable, self._event, self._enabled = pipeline
            # Imported here: it imports the SDK, which a process that never trains must not load.
            from opentelemetry_instrumentation_deepspeed.export import id_generator

            self._ids = id_generator.isolated(self._tracer.id_generator)
            self._sampler = self._tracer.sampler
            self._by_parent = sdk.decides_by_parent(self._sampler)

    @property
    def sampler(self):
        return getattr(self._tracer, "sampler", None) or getattr(self.provider, "sampler", None)

    def _off(self) -> bool:
        return self._enabled is not None and not self._enabled()

    def root(self, name: str, trace_id: int, span_id: int, attributes: dict, start: int,  # noqa: PLR0917
             sampled: bool | None = None) -> Started | None:
        """A root span under ids the caller chose, sampled as the SDK samples a root (``sampled``: the
        sampler's answer, known beforehand). None where ids cannot be chosen (the public API's path)."""
        if not self.fast:
            return None
        if self._off():
            return Started(name, SpanContext(trace_id, span_id, False, TraceFlags.DEFAULT), None, None, False)
        trace_state, recording = None, sampled
        if sampled is None:
            sampling = self._sampler.should_sample(EMPTY_CONTEXT, trace_id, name, _INTERNAL, attributes, ())
            sampled, recording = sampling.decision.is_sampled(), sampling.decision.is_recording()
            trace_state = sampling.trace_state
            if sampling.attributes:
                attributes = {**sampling.attributes, **attributes}
        context = SpanContext(trace_id, span_id, False, SAMPLED if sampled else NOT_SAMPLED, trace_state)
        return Started(name, context, None, attributes, recording)

    def child(self, name: str, parent: SpanContext, attributes: dict | None, start: int) -> Started:
        """A span under ``parent``; ``start`` matters only to the public API's path."""
        if not self.fast:
            span = self._tracer.start_span(name, context=trace.set_span_in_context(NonRecordingSpan(parent),
                                                                                   EMPTY_CONTEXT),
                                           attributes=attributes, start_time=start)
            return Started(name, span.get_span_context(), parent, None, span.is_recording(), span)
        ids = self._ids
        if self._off():
            return Started(name, SpanContext(parent.trace_id, ids.generate_span_id(), False, TraceFlags.DEFAULT),
                           parent, None, False)
        if self._by_parent and parent.is_valid:
            # What the sampler would answer: the parent's decision, flags and trace state.
            context = SpanContext(parent.trace_id, ids.generate_span_id(), False, parent.trace_flags,
                                  parent.trace_state)
            return Started(name, context, parent, {} if attributes is None else attributes,
                           parent.trace_flags.sampled)
        if parent.is_valid:
            trace_id, random_trace_id = parent.trace_id, parent.trace_flags.random_trace_id
            sampling_parent = trace.set_span_in_context(NonRecordingSpan(parent), EMPTY_CONTEXT)
        else:
            trace_id, random_trace_id = ids.generate_trace_id(), ids.is_trace_id_random()
            sampling_parent, parent = EMPTY_CONTEXT, None
        sampling = self._sampler.should_sample(sampling_parent, trace_id, name, _INTERNAL, attributes, ())
        flags = TraceFlags.SAMPLED if sampling.decision.is_sampled() else TraceFlags.DEFAULT
        if random_trace_id:
            flags |= TraceFlags.RANDOM_TRACE_ID
        context = SpanContext(trace_id, ids.generate_span_id(), False, TraceFlags(flags), sampling.trace_state)
        merged = dict(sampling.attributes) if sampling.attributes else {}
        if attributes:
            merged.update(attributes)
        return Started(name, context, parent, merged, sampling.decision.is_recording())

    def end(self, started: Started, start: int, end: int, more: dict | None = None,  # noqa: PLR0917
            status: Status | None = None, exception: dict | None = None, events: tuple = ()) -> None:
        """Write ``started`` as it ended: ``more`` attributes, a status, an ``exception`` event's attributes,
        other ``events`` as (name, attributes, time)."""
        if not started.recording:
            return
        span = started.sdk_span
        if span is not None:
            if more:
                span.set_attributes(more)
            if exception is not None:
                span.add_event(semconv.EVENT_EXCEPTION, exception, timestamp=end)
            for name, event_attributes, timestamp in events:
                span.add_event(name, event_attributes, timestamp=timestamp)
            if status is not None:
                span.set_status(status)
            span.end(end_time=end)
            return
        attributes = started.attributes
        if more:
            attributes.update(more)
        written = (self._event(semconv.EVENT_EXCEPTION, exception, end),) if exception is not None else ()
        if events:
            written += tuple(self._event(name, event_attributes, timestamp)
                             for name, event_attributes, timestamp in events)
        self._batch.append(self._readable(
            name=started.name, context=started.context, parent=started.parent, resource=self._resource,
            attributes=attributes, events=written, kind=_INTERNAL, status=status or _UNSET,
            start_time=start, end_time=end, instrumentation_scope=self._scope,
        ))

    def flush(self) -> None:
        """Hand the spans written so far to the processors, in one loop."""
        batch, self._batch = self._batch, []
        on_end = self._processor.on_end if batch else None
        for span in batch:
            on_end(span)


def remote_parent(trace_id: int, span_id: int, sampled: bool) -> SpanContext:
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=SAMPLED if sampled else NOT_SAMPLED)


def in_context(context: SpanContext) -> Context:
    """A context holding ``context`` as its span: what exemplars and the public API's parents read."""
    return trace.set_span_in_context(NonRecordingSpan(context), EMPTY_CONTEXT)
