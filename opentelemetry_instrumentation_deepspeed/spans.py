"""Spans for the training thread's hot path, handed straight to the SDK's span processors.

The SDK's ``Tracer.start_span`` costs 40-90 us per span on the benchmark machine (a lock per
span, attribute validation and limits, ``on_start`` callbacks); a step emits 8 or more. The
spans of this instrumentation are built from values it controls (names, ints, floats, bools,
strings), are never made current, and end once, so this tracer keeps only what the SDK's
output depends on: the provider's sampler is asked exactly as the SDK asks it, ids come from
the tracer's id generator, and at ``end()`` a ``ReadableSpan`` (what every processor and
exporter receives) goes to the provider's span processors. About 7 us per span.

Span processors' ``on_start`` is not called for these spans; the tracer falls back to the SDK
path when the provider is not the SDK's.
"""

from __future__ import annotations

import time
import traceback

from opentelemetry import trace
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

_INTERNAL = SpanKind.INTERNAL
_UNSET = Status(StatusCode.UNSET)


class Tracer:
    """``start_span`` with the subset of the SDK tracer's signature this project uses."""

    def __init__(self, sdk_tracer):
        self.sdk = sdk_tracer
        self._fast = all(hasattr(sdk_tracer, name) for name in ("sampler", "span_processor", "resource",
                                                                "id_generator", "_instrumentation_scope"))
        if self._fast:
            from opentelemetry.sdk.trace import Event, ReadableSpan

            self.readable_span, self.event = ReadableSpan, Event
            # Fixed for the tracer's life: looked up once, not per span.
            self._enabled = getattr(sdk_tracer, "_is_enabled", None)
            self.processor, self.resource = sdk_tracer.span_processor, sdk_tracer.resource
            self.scope = sdk_tracer._instrumentation_scope

    def start_span(self, name: str, context=None, attributes: dict | None = None,
                   start_time: int | None = None) -> trace.Span:
        sdk = self.sdk
        if not self._fast:
            return sdk.start_span(name, context=context, attributes=attributes, start_time=start_time)
        parent = trace.get_current_span(context).get_span_context()
        if self._enabled is not None and not self._enabled():
            return trace.NonRecordingSpan(parent)
        ids = sdk.id_generator
        if parent is None or not parent.is_valid:
            parent = None
            trace_id = ids.generate_trace_id()
            random_trace_id = ids.is_trace_id_random()
        else:
            trace_id = parent.trace_id
            random_trace_id = parent.trace_flags.random_trace_id
        sampling = sdk.sampler.should_sample(context, trace_id, name, _INTERNAL, attributes, ())
        flags = TraceFlags.SAMPLED if sampling.decision.is_sampled() else TraceFlags.DEFAULT
        if random_trace_id:
            flags |= TraceFlags.RANDOM_TRACE_ID
        span_context = SpanContext(trace_id, ids.generate_span_id(), is_remote=False,
                                   trace_flags=TraceFlags(flags), trace_state=sampling.trace_state)
        if not sampling.decision.is_recording():
            return trace.NonRecordingSpan(span_context)
        merged = dict(sampling.attributes) if sampling.attributes else {}
        if attributes:
            merged.update(attributes)
        return Span(self, name, span_context, parent, merged, time.time_ns() if start_time is None else start_time)


class Span(trace.Span):
    """A recording span of this project's: mutable until ``end()``, then handed on once."""

    __slots__ = ("_attributes", "_context", "_ended", "_events", "_name", "_parent", "_start", "_status", "_tracer")

    def __init__(self, tracer: Tracer, name: str, context: SpanContext, parent: SpanContext | None,  # noqa: PLR0917
                 attributes: dict, start_time: int):
        self._tracer = tracer
        self._name = name
        self._context = context
        self._parent = parent
        self._attributes = attributes
        self._start = start_time
        self._status = _UNSET
        self._events: list | None = None
        self._ended = False

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return not self._ended

    def set_attribute(self, key: str, value) -> None:
        self._attributes[key] = value

    def set_attributes(self, attributes) -> None:
        self._attributes.update(attributes)

    def update_name(self, name: str) -> None:
        self._name = name

    def set_status(self, status, description: str | None = None) -> None:
        self._status = status if isinstance(status, Status) else Status(status, description)

    def add_event(self, name: str, attributes=None, timestamp: int | None = None) -> None:
        if self._events is None:
            self._events = []
        when = time.time_ns() if timestamp is None else timestamp
        self._events.append(self._tracer.event(name, attributes or {}, when))

    def record_exception(self, exception: BaseException, attributes=None, timestamp: int | None = None,
                         escaped: bool = False) -> None:
        self.add_event("exception", {
            "exception.type": type(exception).__qualname__,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
            **(attributes or {}),
        }, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        tracer = self._tracer
        tracer.processor.on_end(tracer.readable_span(
            name=self._name, context=self._context, parent=self._parent, resource=tracer.resource,
            attributes=self._attributes, events=self._events or (), kind=_INTERNAL, status=self._status,
            start_time=self._start, end_time=time.time_ns() if end_time is None else end_time,
            instrumentation_scope=tracer.scope,
        ))
