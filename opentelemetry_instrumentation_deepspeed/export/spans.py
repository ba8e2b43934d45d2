"""Spans for the training thread's hot path, handed straight to the SDK's span processors.

The SDK's ``Tracer.start_span`` costs 40-90 us per span on the benchmark machine (a lock per
span, attribute validation and limits, ``on_start`` callbacks); a step emits 8 or more. The
spans of this instrumentation are built from values it controls (names, ints, floats, bools,
strings), are never made current, and end once, so this tracer keeps only what the SDK's
output depends on: the provider's sampler is asked exactly as the SDK asks it, ids come from
the tracer's id generator, and a ``ReadableSpan`` (what every processor and exporter
receives) goes to the provider's span processors. About 7 us per span.

Inside a training step each trip through this code and the SDK's finds it evicted from the
CPU caches by the step's tensors, and costs several times its isolated figure. So the work is
gathered: under a parent-based sampler with its default delegates (the SDK's default, and
``parentbased_traceidratio``) a span with a valid parent takes its parent's decision without a
call to the sampler, and ended spans wait in ``_ended`` until ``hand_over()`` (at the close of
each step, and at exit) gives them to the processors in one loop.

Span processors' ``on_start`` is not called for these spans; the tracer falls back to the SDK
path when the provider is not the SDK's.
"""

from __future__ import annotations

import time
import traceback
from collections import deque

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from opentelemetry_instrumentation_deepspeed.export import trace_ids
from opentelemetry_instrumentation_deepspeed.runtime import lifecycle

_INTERNAL = SpanKind.INTERNAL
_UNSET = Status(StatusCode.UNSET)
_EMPTY = Context()
# Ended spans not yet handed to their processors. Past this many they are handed over at once.
_ended: deque = deque()
_HAND_OVER_AT = 256


def hand_over() -> None:
    """Give every ended span to its tracer's span processors."""
    ended = _ended
    while ended:
        try:
            span = ended.popleft()
        except IndexError:  # another thread emptied it
            return
        tracer = span._tracer
        tracer.processor.on_end(tracer.readable_span(
            name=span._name, context=span.get_span_context(), parent=span._parent, resource=tracer.resource,
            attributes=span._attributes, events=span._events or (), kind=_INTERNAL, status=span._status,
            start_time=span._start, end_time=span._end, instrumentation_scope=tracer.scope,
        ))


# A forked child must not hand over (and export twice) what its parent had ended.
lifecycle.in_forked_child(lifecycle.FORGET, _ended.clear)


def _decides_by_parent(sampler) -> bool:
    """Whether ``sampler`` only copies a valid parent's decision: a ParentBased with its default delegates."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased

    return (isinstance(sampler, ParentBased)
            and getattr(sampler, "_remote_parent_sampled", None) is ALWAYS_ON
            and getattr(sampler, "_local_parent_sampled", None) is ALWAYS_ON
            and getattr(sampler, "_remote_parent_not_sampled", None) is ALWAYS_OFF
            and getattr(sampler, "_local_parent_not_sampled", None) is ALWAYS_OFF)


class Tracer:
    """``start_span`` with the subset of the SDK tracer's signature this project uses.

    A recording span keeps the ``attributes`` dict it is given: callers pass a new one.
    """

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
            self._by_parent = _decides_by_parent(sdk_tracer.sampler)

    def start_span(self, name: str, context=None, attributes: dict | None = None,
                   start_time: int | None = None) -> trace.Span:
        if not self._fast:
            return self.sdk.start_span(name, context=context, attributes=attributes, start_time=start_time)
        return self.start_child(name, trace.get_current_span(context), attributes, start_time, context)

    def start_root(self, name: str, trace_id: int, span_id: int, attributes: dict,  # noqa: PLR0917
                   start_time: int, sampled: bool | None = None) -> trace.Span | None:
        """A root span under ids the caller chose, sampled as the SDK samples a root (``sampled``:
        the sampler's answer, known beforehand); None if this tracer cannot choose ids (not the SDK's)."""
        if not self._fast:
            return None
        if self._enabled is not None and not self._enabled():
            return trace.INVALID_SPAN
        trace_state, recording = None, sampled
        if sampled is None:
            sampling = self.sdk.sampler.should_sample(_EMPTY, trace_id, name, _INTERNAL, attributes, ())
            sampled, recording = sampling.decision.is_sampled(), sampling.decision.is_recording()
            trace_state = sampling.trace_state
            if sampling.attributes:
                attributes = {**sampling.attributes, **attributes}
        span_context = SpanContext(trace_id, span_id, False, trace_ids.SAMPLED if sampled else trace_ids.NOT_SAMPLED,
                                   trace_state)
        if not recording:
            return trace.NonRecordingSpan(span_context)
        return Span(self, name, span_context, None, attributes, start_time)

    def start_child(self, name: str, parent: trace.Span, attributes: dict | None = None,
                    start_time: int | None = None, context=None) -> trace.Span:
        """``start_span`` under ``parent`` (a span, not a context: no context object is built)."""
        sdk = self.sdk
        if not self._fast:
            return sdk.start_span(name, context=trace.set_span_in_context(parent, _EMPTY), attributes=attributes,
                                  start_time=start_time)
        parent = parent.get_span_context()
        if self._enabled is not None and not self._enabled():
            return trace.NonRecordingSpan(parent)
        ids = sdk.id_generator
        if self._by_parent and parent.is_valid:
            # What the sampler would answer: the parent's decision, flags and trace state.
            if not parent.trace_flags.sampled:
                return trace.NonRecordingSpan(SpanContext(parent.trace_id, ids.generate_span_id(), False,
                                                          parent.trace_flags, parent.trace_state))
            # Its own context is built when first asked for (a child, the hand-over), not here.
            return Span(self, name, None, parent, {} if attributes is None else attributes,
                        time.time_ns() if start_time is None else start_time)
        if context is None:
            context = trace.set_span_in_context(trace.NonRecordingSpan(parent), _EMPTY)
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

    __slots__ = ("_attributes", "_context", "_end", "_ended", "_events", "_name", "_parent", "_start", "_status",
                 "_tracer")

    def __init__(self, tracer: Tracer, name: str, context: SpanContext | None,  # noqa: PLR0917
                 parent: SpanContext | None, attributes: dict, start_time: int):
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
        context = self._context
        if context is None:  # a child of a parent-based decision: the parent's trace, flags and state
            parent = self._parent
            context = self._context = SpanContext(parent.trace_id, self._tracer.sdk.id_generator.generate_span_id(),
                                                  False, parent.trace_flags, parent.trace_state)
        return context

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
        self._end = time.time_ns() if end_time is None else end_time
        _ended.append(self)
        if len(_ended) >= _HAND_OVER_AT:
            hand_over()
