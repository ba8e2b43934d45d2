"""The one door into the OpenTelemetry SDK's internals.

# -- spans and measurements on the hot path: added by the recording rewrite --
"""

from __future__ import annotations

import logging
from importlib import metadata

_logger = logging.getLogger(__name__)

WRITTEN_FOR = ("1.45.0", "1.45.1", "1.45.2")


def _installed() -> str:
    try:
        return metadata.version("opentelemetry-sdk")
    except metadata.PackageNotFoundError:
        return "unknown"


INTERNALS = _installed() in WRITTEN_FOR


# -- spans and measurements on the hot path: added by the recording rewrite --

def span_pipeline(tracer):
    """What finished spans of ``tracer`` are handed to, bypassing ``start_span``: (processor, resource,
    scope, ReadableSpan, Event, is_enabled), or None where only the public API may be used."""
    if not INTERNALS:
        return None
    names = ("sampler", "span_processor", "resource", "id_generator", "_instrumentation_scope")
    if not all(hasattr(tracer, name) for name in names):
        return None
    from opentelemetry.sdk.trace import Event, ReadableSpan

    return (tracer.span_processor, tracer.resource, tracer._instrumentation_scope, ReadableSpan, Event,
            getattr(tracer, "_is_enabled", None))


def decides_by_parent(sampler) -> bool:
    """Whether ``sampler`` only copies a valid parent's decision: a ParentBased with its default delegates."""
    if not INTERNALS:
        return False
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased

    return (isinstance(sampler, ParentBased)
            and getattr(sampler, "_remote_parent_sampled", None) is ALWAYS_ON
            and getattr(sampler, "_local_parent_sampled", None) is ALWAYS_ON
            and getattr(sampler, "_remote_parent_not_sampled", None) is ALWAYS_OFF
            and getattr(sampler, "_local_parent_not_sampled", None) is ALWAYS_OFF)


def measurement_recorder(histogram):
    """``record(value, time_unix_nano, context, attributes)`` for an SDK histogram, keeping the time the
    value was taken (the public ``record`` stamps the time it is called); None: use the public API."""
    if not INTERNALS:
        return None
    real = getattr(histogram, "_real_instrument", histogram)  # made before the SDK was set up: a proxy
    consumer = getattr(real, "_measurement_consumer", None)
    enabled = getattr(real, "_is_enabled", None)
    if consumer is None or enabled is None:
        return None
    from opentelemetry.sdk.metrics._internal.measurement import Measurement

    consume = consumer.consume_measurement

    def record(value, taken: int, context, attributes) -> None:
        if enabled():
            consume(Measurement(value, taken, real, context, attributes))

    return record


def instrument_is_unset(histogram) -> bool:
    """A proxy instrument with no SDK behind it yet: whatever it records is dropped by the API."""
    return INTERNALS and getattr(histogram, "_real_instrument", True) is None


def add_span_processor_first(provider, processor) -> None:
    """Put ``processor`` before ``provider``'s other span processors: its ``force_flush`` and ``shutdown``
    (which emit what is queued) then run before theirs export. The public ``add_span_processor``
    appends, where only a flush that follows sees what ours emitted."""
    active = getattr(provider, "_active_span_processor", None) if INTERNALS else None
    if active is not None and isinstance(getattr(active, "_span_processors", None), tuple):
        with active._lock:
            active._span_processors = (processor, *active._span_processors)
        return
    provider.add_span_processor(processor)
