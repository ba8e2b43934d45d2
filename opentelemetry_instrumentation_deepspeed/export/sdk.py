"""The one door into the OpenTelemetry SDK's internals.

Every read or write of a private part of ``opentelemetry-sdk``, ``opentelemetry-api`` or an
exporter package is a function here, named for what it does for this project. They were
written against the SDK versions in ``WRITTEN_FOR``; with any other installed version each
function takes its public-API fallback instead (slower, or the feature off where the public
API has no way to it), and one warning per process says so. ``tests/test_sdk_door.py`` keeps
the rest of the package on the public API.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from importlib import metadata

_logger = logging.getLogger(__name__)

WRITTEN_FOR = ("1.45.1", "1.45.2")


def _installed() -> str:
    try:
        return metadata.version("opentelemetry-sdk")
    except metadata.PackageNotFoundError:
        return "unknown"


INSTALLED = _installed()
INTERNALS = INSTALLED in WRITTEN_FOR
_warned = threading.Event()

# What a process gives up on an SDK this module was not written for, said in the one warning.
_WITHOUT_INTERNALS = ("undelivered telemetry is not counted, OTLP logs are not set up, a forked DataLoader "
                      "worker keeps the SDK threads it inherits, spans are made through start_span (slower; rank 0 "
                      "emits no training.global_step root) and metric points carry the time they were recorded")


def use_internals(flag: bool) -> None:
    """For tests: take the internal paths (True, as on a version in ``WRITTEN_FOR``) or the public fallbacks."""
    global INTERNALS  # noqa: PLW0603 - one choice per process
    INTERNALS = flag
    _warned.clear()


def _internals() -> bool:
    """Whether to use the SDK's internals; the first time not, one warning for the process."""
    if INTERNALS:
        return True
    if not _warned.is_set():
        _warned.set()
        _logger.warning(
            "opentelemetry-instrumentation-deepspeed was written for opentelemetry-sdk %s and found %s: it uses "
            "the SDK's public API only, so %s. Traces and metrics are otherwise unchanged.",
            ", ".join(WRITTEN_FOR), INSTALLED, _WITHOUT_INTERNALS,
        )
    return False


# -- set-up ----------------------------------------------------------------------------------------


def api_only(tracer_provider=None, meter_provider=None) -> bool:
    """Whether no tracer or meter provider was set (default: the global ones): spans and measurements are no-ops."""
    from opentelemetry import metrics, trace
    from opentelemetry.metrics import NoOpMeterProvider

    tracer_provider = tracer_provider or trace.get_tracer_provider()
    meter_provider = meter_provider or metrics.get_meter_provider()
    if not isinstance(tracer_provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return False
    if _internals():
        from opentelemetry.metrics._internal import _ProxyMeterProvider

        return isinstance(meter_provider, (_ProxyMeterProvider, NoOpMeterProvider))
    # The API package's own providers (its proxy, its no-op) are the only ones that record nothing.
    return isinstance(meter_provider, NoOpMeterProvider) or type(meter_provider).__module__.startswith(
        "opentelemetry.metrics")


def initialize(arguments: dict, resource_attributes: dict) -> None:
    """Set the global providers up as ``opentelemetry-instrument``'s SDK configurator would, on this resource.

    ``arguments`` are the configurator's (``auto_instrumentation_version``, exporter names).
    """
    if _internals():
        from opentelemetry.sdk._configuration import _initialize_components

        _initialize_components(**arguments, resource_attributes=resource_attributes)
        return
    from opentelemetry import metrics, trace

    tracer_provider, meter_provider = build_providers(arguments, resource_attributes)
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(meter_provider)


# The exporter packages' entry point for "otlp", by OTEL_EXPORTER_OTLP_PROTOCOL (gRPC when unset).
_OTLP_BY_PROTOCOL = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}


def build_providers(arguments: dict, resource_attributes: dict):
    """(tracer provider, meter provider) from the standard variables, with the public API only.

    Traces and metrics as the SDK's configurator sets them up: exporters by name from the
    ``opentelemetry_{traces,metrics}_exporter`` entry points, the sampler and the limits from the
    variables the providers read themselves. Neither registers an exit handler: the lifecycle
    shuts them down, in its order.
    """
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = dict(resource_attributes)
    if arguments.get("auto_instrumentation_version"):
        attributes["telemetry.auto.version"] = arguments["auto_instrumentation_version"]
    resource = Resource.create(attributes)
    from opentelemetry_instrumentation_deepspeed.runtime.environment_variables import ISOLATED_ID_GENERATOR

    id_generator = os.environ.get("OTEL_PYTHON_ID_GENERATOR", ISOLATED_ID_GENERATOR).strip()
    tracer_provider = TracerProvider(
        resource=resource, shutdown_on_exit=False,
        id_generator=None if id_generator == "random" else _entry_point("opentelemetry_id_generator", id_generator)(),
    )
    for exporter in _exporters("traces", arguments.get("trace_exporter_names")):
        tracer_provider.add_span_processor(BatchSpanProcessor(exporter()))
    readers = [exporter() if issubclass(exporter, MetricReader) else PeriodicExportingMetricReader(exporter())
               for exporter in _exporters("metrics", arguments.get("metric_exporter_names"))]
    return tracer_provider, MeterProvider(metric_readers=readers, resource=resource, shutdown_on_exit=False)


def _exporters(signal: str, names: list[str] | None) -> list[type]:
    names = list(names or ())
    configured = os.environ.get(f"OTEL_{signal.upper()}_EXPORTER", "").strip()
    if configured and configured.lower() != "none":
        names += [name.strip() for name in configured.split(",")]
    classes = {}
    for name in names:
        if name == "otlp":
            protocol = (os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL")
                        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip()
            if protocol not in _OTLP_BY_PROTOCOL:
                raise RuntimeError(f"Unsupported OTLP protocol '{protocol}' is configured")
            name = _OTLP_BY_PROTOCOL[protocol]  # noqa: PLW2901 - the name the entry point has
        classes[name] = _entry_point(f"opentelemetry_{signal}_exporter", name)
    return list(classes.values())


def _entry_point(group: str, name: str):
    for entry_point in metadata.entry_points(group=group, name=name):
        return entry_point.load()
    raise RuntimeError(f"Requested component '{name}' not found in entry point '{group}'")


def take_over_exit_handlers(*providers) -> None:
    """Unregister the providers' own exit handlers: the lifecycle shuts them down, in its order.

    Without internals there is nothing to do: the providers built here register none, and a
    provider's ``shutdown`` unregisters its own handler when the lifecycle calls it first.
    """
    if not _internals():
        return
    import atexit

    for provider in providers:
        # The tracer and meter providers call it _atexit_handler, the logger provider _at_exit_handler.
        for handler in (getattr(provider, "_atexit_handler", None), getattr(provider, "_at_exit_handler", None)):
            if handler is not None:
                atexit.unregister(handler)


def logger_provider():
    """The SDK logger provider the configurator set up (OTLP logs with an endpoint), or None."""
    if not _internals():
        return None
    from opentelemetry._logs import get_logger_provider
    from opentelemetry.sdk._logs import LoggerProvider

    provider = get_logger_provider()
    return provider if isinstance(provider, LoggerProvider) else None


def _shut_down_batch_processors(processors, seconds: float) -> None:
    """Shut batch processors down, together within ``seconds``: each gives up waiting for its
    worker by then, stops exporting what is left in its queue, and shuts its exporter down
    (which ends an OTLP exporter's retries). The public ``shutdown`` waits 30 s for each."""
    deadline = time.monotonic() + seconds
    for processor in processors:
        batch = getattr(processor, "_batch_processor", None)
        if batch is not None and hasattr(batch, "shutdown"):
            batch.shutdown(timeout_millis=max(0.0, deadline - time.monotonic()) * 1000)


def shut_down_tracer_provider(provider, seconds: float) -> None:
    """Flush and shut ``provider`` down, its batch processors giving up after ``seconds`` where the
    SDK lets them (with internals); the provider's own shutdown then finds them shut."""
    if _internals():
        _shut_down_batch_processors(span_processors(provider), seconds)
    provider.shutdown()


def shut_down_logger_provider(provider, seconds: float) -> None:
    if _internals():
        multi = getattr(provider, "_multi_log_record_processor", None)
        _shut_down_batch_processors(tuple(getattr(multi, "_log_record_processors", ())), seconds)
    provider.shutdown()


def queued_spans(processor) -> int:
    """Spans a batch span processor still holds in its queue (never handed to its exporter); 0 where unknown."""
    if not _internals():
        return 0
    queue = getattr(getattr(processor, "_batch_processor", None), "_queue", None)
    return len(queue) if queue is not None else 0


# -- delivery accounting ---------------------------------------------------------------------------

# Loggers that warn once per failed batch, or once per dropped span (named for the SDK's modules).
EXPORTER_LOGGERS = (  # their warnings: an export that failed or is retried
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.proto.http._log_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.sdk.metrics._internal.export",
)
EXPORT_WARNING_LOGGERS = (*EXPORTER_LOGGERS, "opentelemetry.sdk._shared_internal")  # and the batch queue's


def span_processors(tracer_provider) -> tuple:
    """The span processors of an SDK tracer provider, in order; () where they cannot be reached."""
    if not _internals():
        return ()
    return tuple(getattr(getattr(tracer_provider, "_active_span_processor", None), "_span_processors", ()))


def metric_readers(meter_provider) -> tuple:
    """The metric readers of an SDK meter provider; () where they cannot be reached."""
    if not _internals():
        return ()
    return tuple(getattr(meter_provider, "_metric_readers", None) or ())


def span_exporter(processor):
    """The exporter behind a batch span processor, or None (another kind of processor)."""
    if not _internals():
        return None
    return getattr(getattr(processor, "_batch_processor", None), "_exporter", None)


def swap_span_exporter(processor, exporter) -> None:
    processor._batch_processor._exporter = exporter


def swap_processor_counts(processor, make) -> None:
    """The batch span processor's self-metrics become ``make(its own)`` (which chains to them)."""
    batch = processor._batch_processor
    if hasattr(batch, "_metrics"):
        batch._metrics = make(batch._metrics)


def metric_exporter(reader):
    """The exporter behind a push metric reader, or None (a pull reader, such as Prometheus's)."""
    if not _internals():
        return None
    return getattr(reader, "_exporter", None)


def swap_metric_exporter(reader, exporter) -> None:
    reader._exporter = exporter


# -- sampling --------------------------------------------------------------------------------------


def root_decision(sampler):
    """``trace_id -> sampled``, answering as ``sampler`` does for a root span, where that answer
    depends on the trace id alone: the SDK's static and ratio samplers, bare or as the root of a
    parent-based one. None for any other sampler, which is then asked at each step."""
    from opentelemetry.sdk.trace.sampling import (
        ALWAYS_OFF,
        ALWAYS_ON,
        Decision,
        ParentBased,
        StaticSampler,
        TraceIdRatioBased,
    )

    internals = _internals()
    if isinstance(sampler, ParentBased):
        if not internals:  # its root is not public: asked at each step
            return None
        sampler = getattr(sampler, "_root", None)
    if internals and type(sampler) is StaticSampler and sampler._decision in (Decision.DROP,
                                                                                Decision.RECORD_AND_SAMPLE):
        sampled = sampler._decision is Decision.RECORD_AND_SAMPLE
        return lambda _trace_id: sampled
    if sampler is ALWAYS_ON or sampler is ALWAYS_OFF:
        sampled = sampler is ALWAYS_ON
        return lambda _trace_id: sampled
    if type(sampler) is TraceIdRatioBased:
        limit, bound = sampler.TRACE_ID_LIMIT, sampler.bound
        return lambda trace_id: trace_id & limit < bound
    return None


# -- the OTLP metric exporters' preferences --------------------------------------------------------


def otlp_temporality(preferred: dict | None) -> dict:
    """Temporality by instrument class, from ``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE``, as the
    OTLP exporters read it; ``preferred`` wins."""
    if _internals():
        from opentelemetry.exporter.otlp.common._aggregation import _get_temporality

        return _get_temporality(preferred)
    from opentelemetry.sdk.metrics import (
        Counter,
        Histogram,
        ObservableCounter,
        ObservableGauge,
        ObservableUpDownCounter,
        UpDownCounter,
    )
    from opentelemetry.sdk.metrics.export import AggregationTemporality

    variable = "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE"
    preference = os.environ.get(variable, "CUMULATIVE").upper().strip()
    delta = {"DELTA": (Counter, Histogram, ObservableCounter), "LOWMEMORY": (Counter, Histogram)}.get(preference)
    if delta is None:
        if preference != "CUMULATIVE":
            _logger.warning("Invalid value for %s: %s, using cumulative temporality aggregation", variable, preference)
        delta = ()
    temporality = {kind: AggregationTemporality.DELTA if kind in delta else AggregationTemporality.CUMULATIVE
                   for kind in (Counter, UpDownCounter, Histogram, ObservableCounter, ObservableUpDownCounter,
                                ObservableGauge)}
    return temporality | (preferred or {})


def otlp_aggregation(preferred: dict | None) -> dict:
    """Histogram aggregation, from ``OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION``, as the OTLP
    exporters read it; ``preferred`` wins."""
    if _internals():
        from opentelemetry.exporter.otlp.common._aggregation import _get_aggregation

        return _get_aggregation(preferred)
    from opentelemetry.sdk.metrics import Histogram
    from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, ExponentialBucketHistogramAggregation

    variable = "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION"
    name = os.environ.get(variable, "explicit_bucket_histogram").upper().strip()
    if name == "BASE2_EXPONENTIAL_BUCKET_HISTOGRAM":
        aggregation = ExponentialBucketHistogramAggregation()
    else:
        if name != "EXPLICIT_BUCKET_HISTOGRAM":
            _logger.warning("Invalid value for %s: %s, using explicit bucket histogram aggregation", variable, name)
        aggregation = ExplicitBucketHistogramAggregation()
    return {Histogram: aggregation} | (preferred or {})


# -- forked children -------------------------------------------------------------------------------


def stop_threads_in_child(tracer_provider, meter_provider, logger_provider=None) -> None:
    """In a forked child: stop the export threads the SDK's own at-fork hooks restart, exporting nothing.

    Whether those hooks ran before this or run after it (they registered when the SDK's objects
    were built), the threads end at once: a batch processor's worker sees it is shut down, a
    reader's ticker sees its event set and its last collection is a no-op (it would take locks a
    parent's thread may have held at fork). No public API stops them without a last export.

    Nothing made in the parent is waited on or set: a parent's thread may have held an Event's lock at
    the fork, and setting it would wait forever (a DataLoader worker that never starts, 2 forks in 1,000
    under load). A batch processor's worker is woken only where the SDK's hook made it, with a fresh
    Event, already; a reader's Event is replaced by a set one, which its ticker reads at each turn.
    """
    if not _internals():
        return
    multi = getattr(logger_provider, "_multi_log_record_processor", None)
    woken = []
    for processor in (*span_processors(tracer_provider), *getattr(multi, "_log_record_processors", ())):
        batch = getattr(processor, "_batch_processor", None)
        if batch is not None:
            batch._shutdown = True
            worker = getattr(batch, "_worker_thread", None)
            if worker is not None and worker.is_alive():  # the child's own: the SDK's hook ran first
                batch._worker_awaken.set()
                woken.append(worker)
    for reader in metric_readers(meter_provider):
        inherited = getattr(reader, "_shutdown_event", None)
        if inherited is not None:
            reader.collect = _nothing
            stopped = threading.Event()
            stopped.set()
            reader._shutdown_event = stopped
            # A ticker the SDK's hook started already waits on the parent's Event: woken where no parent's thread
            # held its lock at the fork (else it ends at its next turn, its collection a no-op).
            lock = getattr(getattr(inherited, "_cond", None), "_lock", None)
            if lock is not None and lock.acquire(False):
                lock.release()
                inherited.set()
    # Their last export is dropped (wrong pid).
    for thread in woken:
        thread.join(timeout=1.0)


def _nothing(*_args, **_kwargs) -> None:
    return None


def reset_global_providers() -> None:
    """The API's global providers back to their unset state: a child's spans and measurements are no-ops.

    The API lets a global provider be set once per process, and never unset."""
    if not _internals():
        return
    from opentelemetry import trace
    from opentelemetry.metrics import _internal as metrics_api
    from opentelemetry.util._once import Once

    trace._TRACER_PROVIDER = None
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    metrics_api._METER_PROVIDER = None
    metrics_api._METER_PROVIDER_SET_ONCE = Once()


# -- spans and measurements, made by the emitter --------------------------------------------------

def span_pipeline(tracer):
    """What finished spans of ``tracer`` are handed to, bypassing ``start_span``: (processor, resource,
    scope, ReadableSpan, Event, is_enabled), or None where only the public API may be used."""
    if not _internals():
        return None
    names = ("sampler", "span_processor", "resource", "id_generator", "_instrumentation_scope")
    if not all(hasattr(tracer, name) for name in names):
        return None
    from opentelemetry.sdk.trace import Event, ReadableSpan

    return (tracer.span_processor, tracer.resource, tracer._instrumentation_scope, ReadableSpan, Event,
            getattr(tracer, "_is_enabled", None))


def decides_by_parent(sampler) -> bool:
    """Whether ``sampler`` only copies a valid parent's decision: a ParentBased with its default delegates."""
    if not _internals():
        return False
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased

    return (isinstance(sampler, ParentBased)
            and getattr(sampler, "_remote_parent_sampled", None) is ALWAYS_ON
            and getattr(sampler, "_local_parent_sampled", None) is ALWAYS_ON
            and getattr(sampler, "_remote_parent_not_sampled", None) is ALWAYS_OFF
            and getattr(sampler, "_local_parent_not_sampled", None) is ALWAYS_OFF)


def measurement_recorder(histogram):
    """``record(value, time_unix_nano, context, attributes)`` for an SDK histogram, keeping the time the
    value was taken (the public ``record`` stamps the time it is called); None: use the public API.

    ``attributes`` is one of a few dicts the caller keeps and never changes (a phase's, a collective
    route's): the first point of each goes the SDK's whole way, which cleans and hashes the attributes
    and finds each reader's aggregation; the next ones go straight to those aggregations (a third of
    the cost), while the readers are the same and none of them drops its aggregations at collection."""
    if not _internals():
        return None
    real = getattr(histogram, "_real_instrument", histogram)  # made before the SDK was set up: a proxy
    consumer = getattr(real, "_measurement_consumer", None)
    enabled = getattr(real, "_is_enabled", None)
    if consumer is None or enabled is None:
        return None
    from opentelemetry.sdk.metrics._internal.measurement import Measurement

    consume = consumer.consume_measurement
    should_sample = consumer._sdk_config.exemplar_filter.should_sample  # fixed with the meter provider
    cleaned = _cleaned_measurement()
    # id(attributes) -> (attributes, the reader storages, their aggregations of the set or None, the attributes
    # as the SDK cleaned them for the first point)
    routes: dict[int, tuple] = {}

    def record(value, taken: int, context, attributes) -> None:
        if not enabled():
            return
        found = routes.get(id(attributes))
        if found is not None and found[0] is attributes and found[1] is consumer._reader_storages:
            if found[2] is not None:
                kept = found[3]
                measurement = cleaned(value, taken, real, context, kept)
                sample = should_sample(value, taken, kept, context)
                for aggregation in found[2]:
                    aggregation.aggregate(measurement, sample)
                return
        else:
            found = None
        measurement = Measurement(value, taken, real, context, attributes)
        consume(measurement)
        if found is None:
            if len(routes) >= _ROUTES_KEPT:  # a caller that makes a new dict per point: no route helps it
                routes.clear()
            routes[id(attributes)] = (attributes, consumer._reader_storages,
                                      _aggregations(consumer, real, measurement), measurement.attributes)

    return record


_ROUTES_KEPT = 256  # attribute sets per histogram


@functools.cache
def _cleaned_measurement():
    """A ``Measurement`` whose attributes are taken as they are: cleaned once, for the first point of their set."""
    from opentelemetry.sdk.metrics._internal.measurement import Measurement

    class Cleaned(Measurement):
        def __post_init__(self) -> None:
            pass

    return Cleaned


def _aggregations(consumer, instrument, measurement) -> tuple | None:
    """Each reader's aggregation that ``measurement`` (just consumed) went to, or None where a later point of its
    attribute set must take the SDK's whole way: a reader that drops its aggregations at each collection (delta
    temporality), a view that keeps some attribute keys only, an attribute set past the cardinality limit."""
    from opentelemetry.sdk.metrics._internal._view_instrument_match import _hash_attributes

    key = _hash_attributes(dict(measurement.attributes) if measurement.attributes else {})
    aggregations = []
    for storage in consumer._reader_storages.values():
        for match in storage._get_or_init_view_instrument_match(instrument):
            if getattr(match, "_reset_on_collect", False) or match._view._attribute_keys is not None:
                return None
            aggregation = match._attributes_aggregation.get(key)
            if aggregation is None:
                return None
            aggregations.append(aggregation)
    return tuple(aggregations)


def instrument_is_unset(histogram) -> bool:
    """A proxy instrument with no SDK behind it yet: whatever it records is dropped by the API."""
    return _internals() and getattr(histogram, "_real_instrument", True) is None


def add_span_processor_first(provider, processor) -> None:
    """Put ``processor`` before ``provider``'s other span processors: its ``force_flush`` and ``shutdown``
    (which emit what is queued) then run before theirs export. The public ``add_span_processor``
    appends, where only a flush that follows sees what ours emitted."""
    active = getattr(provider, "_active_span_processor", None) if _internals() else None
    if active is not None and isinstance(getattr(active, "_span_processors", None), tuple):
        with active._lock:
            active._span_processors = (processor, *active._span_processors)
        return
    provider.add_span_processor(processor)


def start_cpu_utilization(instrumentor) -> None:
    """The system-metrics instrumentation's CPU utilizations (its ``_proc``, a psutil.Process): psutil's percentages
    are over the time since the call before, and 0.0 at the first: every point of a job shorter than the export
    interval read 0. Called once now, the first export has the time since the start."""
    try:
        import psutil

        psutil.cpu_times_percent(percpu=True)
        process = getattr(instrumentor, "_proc", None)  # the instrumentation's own psutil.Process
        if process is not None:
            process.cpu_percent()
    except Exception:  # a psutil that cannot read the host: those metrics say so themselves
        _logger.debug("CPU utilization not started", exc_info=True)
