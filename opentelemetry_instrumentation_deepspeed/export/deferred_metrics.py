"""Histogram measurements taken on the training thread, recorded by the SDK on another thread.

Inside a training step a histogram measurement costs the SDK about 100 us on the benchmark
machine (attribute hashing, the exemplar reservoir, locks, all with caches the step's tensors
keep evicting); queuing the value, its time and its span costs about 1 us. A background thread
hands the queue to the SDK every ``FLUSH_SECONDS``, a few measurements at a time with the GIL
released in between, and so does a metric reader when it collects (by the callback of an
observable instrument that itself reports nothing), so a collection sees every measurement
taken before it. Each measurement keeps the time it was taken and its span (a context is built
only when it is recorded), so exemplars still name the step's trace and its moment.

Why every second, and not at the reader's interval (60 s by default): a queued measurement
keeps its span alive, and objects that live for seconds reach the garbage collector's oldest
generation, whose collections stopped the example's training thread for ~0.4 s every ~3000
steps; living under a second, they die young. Past ``LIMIT`` waiting measurements (the thread
could not run), the training thread records them itself.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from opentelemetry import trace
from opentelemetry.context import Context

from opentelemetry_instrumentation_deepspeed.runtime import lifecycle
from opentelemetry_instrumentation_deepspeed.runtime.safety import Component, observing

LIMIT = 4096
FLUSH_SECONDS = 1.0
_CHUNK = 16  # measurements recorded between two releases of the GIL
_EMPTY = Context()


_FLUSH_INSTRUMENT = "opentelemetry_instrumentation_deepspeed.deferred"
_by_meter: dict[int, tuple] = {}


def for_meter(meter) -> DeferredHistograms:
    """One queue per meter: a meter takes one observable instrument of a name."""
    entry = _by_meter.get(id(meter))
    if entry is None or entry[0] is not meter:
        entry = _by_meter[id(meter)] = (meter, DeferredHistograms(meter))
    return entry[1]


class DeferredHistograms:
    def __init__(self, meter):
        self._queue: deque = deque()
        self._component = Component("histogram recording")
        self._flusher: threading.Thread | None = None
        # A forked child does not have the thread; it records nothing anyway (it does not train).
        lifecycle.in_forked_child(lifecycle.FORGET, self._queue.clear)
        # Its callback returns no observation, so no stream of it is ever exported.
        meter.create_observable_gauge(_FLUSH_INSTRUMENT, [observing(self._component, self._flush_at_collection)],
                                      unit="1",
                                      description="Internal: records queued histogram measurements at collection")

    def record(self, histogram, value: float, attributes=None, span=None, taken: int | None = None) -> None:
        self._append(histogram, (histogram, value, time.time_ns() if taken is None else taken, attributes, span))

    def record_each(self, histogram, measurements: list, attributes_of: dict) -> None:
        """``measurements``: (key, value, span, taken) tuples, each with ``attributes_of[key]``. One entry for all."""
        self._append(histogram, (histogram, measurements, attributes_of))

    def _append(self, histogram, entry: tuple) -> None:
        # Before the SDK is set up, a histogram is a proxy with nothing behind it: the API drops the value.
        if self._component.broken or getattr(histogram, "_real_instrument", True) is None:
            return
        self._queue.append(entry)
        if self._flusher is None:
            self._start_flusher()
        if len(self._queue) > LIMIT:
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - never into the training loop
                self._component.fail("DeferredHistograms.flush")

    def _start_flusher(self) -> None:
        self._flusher = threading.Thread(target=self._flush_every_second, daemon=True,
                                         name="otel-deepspeed-histograms")
        self._flusher.start()

    def _flush_every_second(self) -> None:
        while not self._component.broken:
            time.sleep(FLUSH_SECONDS)
            try:
                self.flush(yielding=True)
            except Exception:  # noqa: BLE001 - a thread of ours must not die with a traceback on stderr
                self._component.fail("DeferredHistograms.flush")

    def _flush_at_collection(self, _options):
        self.flush()
        return []

    def flush(self, yielding: bool = False) -> None:
        queue = self._queue
        done = 0
        while queue:
            try:
                entry = queue.popleft()
            except IndexError:  # another thread emptied it
                return
            done += 1
            if yielding and done % _CHUNK == 0:
                time.sleep(0)  # lets the training thread take the GIL back
            if len(entry) == 3:
                histogram, measurements, attributes_of = entry
                for key, value, span, taken in measurements:
                    _record(histogram, value, taken, attributes_of[key], span)
            else:
                histogram, value, taken, attributes, span = entry
                _record(histogram, value, taken, attributes, span)


def _record(histogram, value: float, taken: int, attributes, span) -> None:
    from opentelemetry.sdk.metrics._internal.measurement import Measurement

    context = _EMPTY if span is None else trace.set_span_in_context(span, _EMPTY)
    # A histogram made before the SDK was set up is a proxy for the real one.
    real = getattr(histogram, "_real_instrument", histogram)
    consumer = getattr(real, "_measurement_consumer", None)
    if consumer is None or not real._is_enabled():
        histogram.record(value, attributes, context=context)
        return
    consumer.consume_measurement(Measurement(value, taken, real, context, attributes))
