"""Histogram points recorded after the fact, by the emitter: each keeps the time it was taken and the
span it belongs to, so its exemplar names the step's trace and the moment, not the emitter's."""

from __future__ import annotations

from opentelemetry_instrumentation_deepspeed.export import sdk
from opentelemetry_instrumentation_deepspeed.export.spans import EMPTY_CONTEXT, in_context


class TimedHistogram:
    def __init__(self, histogram):
        self.histogram = histogram
        self._record = None  # the SDK's measurement path, once an SDK instrument is behind the histogram

    def record(self, value: float, taken: int, span_context=None, attributes=None) -> None:
        context = EMPTY_CONTEXT if span_context is None else in_context(span_context)
        record = self._record
        if record is None:
            if sdk.instrument_is_unset(self.histogram):
                return  # no SDK behind the API yet: the value would be dropped anyway
            record = self._record = sdk.measurement_recorder(self.histogram) or self._public
        record(value, taken, context, attributes)

    def _public(self, value: float, _taken: int, context, attributes) -> None:
        self.histogram.record(value, attributes, context=context)
