"""Accounting for telemetry that could not be delivered: counted, reported once, never retried here.

A training job must not notice a dead collector, and its owner must still learn that telemetry
was lost. Once the SDK is set up, each batch span processor's exporter and each periodic metric
reader's exporter is wrapped to count what it exported and what failed, and the batch
processor's queue-full drops are counted too. The counts are observable counters with the
OpenTelemetry semantic-convention names (``otel.sdk.exporter.span.exported``,
``otel.sdk.processor.span.processed``, ``otel.sdk.exporter.metric_data_point.exported``, with
``error.type`` on failures and drops), read at collection: nothing runs on the training thread;
the emitter's thread, which hands spans to the batch processor, increments an integer when its
queue overflows. The exporters' own warnings are let through
once per logger; the rest are counted, and one line at exit says how much was lost.

At exit the flushes are bounded (``lifecycle``): once the spans' flush has ended or been left
behind, the spans still queued (``error.type`` ``exit_timeout`` on the processor's counter) and
those in an export that has not returned (``exit_timeout`` on the exporter's) are counted as lost,
and that exporter exports nothing more; the metrics' flush is settled the same way. A late
answer to an export counted so is not counted again: the counts and the summary line are final.

When the SDK's own self-metrics are on (``OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED=true``), it
reports the same names itself, and only the log summary is done here.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections import Counter

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.export import sdk
from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env
from opentelemetry_instrumentation_deepspeed.runtime import lifecycle
from opentelemetry_instrumentation_deepspeed.runtime.safety import Component, observing

_logger = logging.getLogger(__name__)

# Loggers that warn once per failed batch, or once per dropped span.
_NOISY_LOGGERS = sdk.EXPORT_WARNING_LOGGERS


class Ledger:
    """What each exporter delivered and lost, by (component, error type); thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self.spans: Counter[tuple[str, str]] = Counter()  # (component, error type or "") -> spans exported
        self.processed: Counter[tuple[str, str]] = Counter()  # (component, error type or "") -> spans processed
        self.points: Counter[tuple[str, str]] = Counter()
        self.first_error: str | None = None

    def add(self, table: Counter, component: str, count: int, error: str = "") -> None:
        if count <= 0:
            return
        with self._lock:
            table[component, error] += count
            if error and self.first_error is None:
                self.first_error = error

    def lost(self, table: Counter) -> int:
        with self._lock:
            return sum(count for (_, error), count in table.items() if error)

    def snapshot(self, table: Counter) -> list[tuple[str, str, int]]:
        with self._lock:
            return [(component, error, count) for (component, error), count in table.items()]


LEDGER = Ledger()


EXIT_TIMEOUT = "exit_timeout"  # error.type of what the bounded exit left undelivered


def _error_type(result_or_error) -> str:
    if isinstance(result_or_error, BaseException):
        return type(result_or_error).__name__
    return "export_failed"


_counting = Component("telemetry delivery counting")


class _CountingExporter:
    """Wraps an exporter: every other attribute is the wrapped one's, so readers and processors see no change.
    It exports only from the process that set it up (see lifecycle: forked children)."""

    def __init__(self, inner, component: str, table: Counter, count_items, *, success, failure):
        self._pid = os.getpid()
        self._inner = inner
        self._component = component
        self._table = table
        self._count_items = count_items
        self._success = success
        self._failure = failure
        self._lock = threading.Lock()
        self._in_flight: dict[int, int] = {}  # export call -> its item count, until it returns
        self._failed: bool | None = None  # the last export that returned failed (None: none returned yet)
        self._calls = 0
        self.settled = False  # set at exit: nothing more is exported or counted

    def export(self, batch, *args, **kwargs):
        if os.getpid() != self._pid:  # a forked child's copy of the rank's telemetry: not its to send
            return self._success
        if _counting.broken:
            return self._inner.export(batch, *args, **kwargs)
        try:
            count = self._count_items(batch)
        except Exception:  # noqa: BLE001 - ours: the counting turns off, the batch is exported all the same (a review:
            _counting.fail("delivery count")  # every metric export was lost, and no line said so)
            return self._inner.export(batch, *args, **kwargs)
        with self._lock:
            if self.settled:  # counted as lost when the exit settled: the process is going away
                return self._failure
            self._calls += 1
            call = self._calls
            self._in_flight[call] = count
        try:
            result = self._inner.export(batch, *args, **kwargs)
        except Exception as error:  # an exporter that raises loses the batch like one that fails
            self._returned(call, _error_type(error))
            raise
        self._returned(call, "" if result == self._success else _error_type(result))
        return result

    def answering(self) -> bool | None:
        """Whether the collector answers: False where the last export failed; None where none has returned. (One
        under way for long is no sign: a slow collector's answer comes, and the exit gives it its share.)"""
        return None if self._failed is None else not self._failed

    def _returned(self, call: int, error: str) -> None:
        with self._lock:
            self._failed = bool(error)
            count = self._in_flight.pop(call, None)
        if count is not None and not _counting.broken:  # else: counted as lost when the exit settled
            try:
                LEDGER.add(self._table, self._component, count, error)
            except Exception:  # noqa: BLE001 - ours: the result goes back to the SDK all the same
                _counting.fail("delivery ledger")

    def settle(self) -> int:
        """Count what is in an export that has not returned as lost, and export nothing more: how many."""
        with self._lock:
            self.settled = True
            unreturned = sum(self._in_flight.values())
            self._in_flight.clear()
        LEDGER.add(self._table, self._component, unreturned, EXIT_TIMEOUT)
        return unreturned

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _ProcessorCounts:
    """Stands in for the batch processor's self-metrics: counts hand-offs and drops, cheaply."""

    def __init__(self, component: str, chained):
        self._component = component
        self._chained = chained  # the SDK's own, when its self-metrics are on

    def register_queue_size(self, get_queue_size) -> None:
        self._chained.register_queue_size(get_queue_size)

    def drop_items(self, count: int, error_type: str = "queue_full") -> None:
        LEDGER.add(LEDGER.processed, self._component, count, error_type)
        self._chained.drop_items(count, error_type)

    def finish_items(self, count: int) -> None:
        LEDGER.add(LEDGER.processed, self._component, count)
        self._chained.finish_items(count)


def _count_points(metrics_data) -> int:
    return sum(
        len(metric.data.data_points)
        for resource_metrics in metrics_data.resource_metrics
        for scope_metrics in resource_metrics.scope_metrics
        for metric in scope_metrics.metrics
    )


def _sdk_reports_itself() -> bool:
    return os.environ.get("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "").strip().lower() == "true"


def watch(tracer_provider, meter_provider) -> None:
    """Wrap the exporters of the SDK just set up. Where the SDK's exporters cannot be reached
    (an SDK version ``sdk`` was not written for), only this accounting is lost."""
    from opentelemetry.sdk.trace.export import SpanExportResult

    for index, processor in enumerate(sdk.span_processors(tracer_provider)):
        exporter = sdk.span_exporter(processor)
        if exporter is None or isinstance(exporter, _CountingExporter):
            continue
        component = f"{type(exporter).__name__}/{index}"
        counting = _CountingExporter(exporter, component, LEDGER.spans, len, success=SpanExportResult.SUCCESS,
                                     failure=SpanExportResult.FAILURE)
        sdk.swap_span_exporter(processor, counting)
        processor_component = f"{type(processor).__name__}/{index}"
        sdk.swap_processor_counts(processor, functools.partial(_ProcessorCounts, processor_component))
        _span_pipes.append((processor, processor_component, counting))

    from opentelemetry.sdk.metrics.export import MetricExportResult

    for index, reader in enumerate(sdk.metric_readers(meter_provider)):
        exporter = sdk.metric_exporter(reader)
        if exporter is None or isinstance(exporter, _CountingExporter):
            continue
        component = f"{type(exporter).__name__}/{index}"
        counting = _CountingExporter(exporter, component, LEDGER.points, _count_points,
                                     success=MetricExportResult.SUCCESS, failure=MetricExportResult.FAILURE)
        sdk.swap_metric_exporter(reader, counting)
        _point_pipes.append(counting)

    spans = [counting for _processor, _component, counting in _span_pipes]
    lifecycle.unanswered_when(lifecycle.FLUSH_SPANS, lambda: _silent(spans))
    # No metric export yet (a job shorter than the export interval): the spans' collector is theirs too, as a rule.
    lifecycle.unanswered_when(lifecycle.FLUSH_METRICS, lambda: _silent(_point_pipes) or (
        all(counting.answering() is None for counting in _point_pipes) and _silent(spans)))
    if not _sdk_reports_itself() and hasattr(meter_provider, "get_meter"):
        _observe(meter_provider)


def _silent(pipes: list[_CountingExporter]) -> bool:
    """Some of these exporters were tried, and none of those answers; or none returned yet, and an exporter warned
    (a job that ends within its first exports: a refused connection's retries)."""
    known = [answering for answering in (counting.answering() for counting in pipes) if answering is not None]
    return not any(known) if known else _exporter_warned


# What watch() wrapped: (batch span processor, its component name, its counting exporter); counting metric exporters.
_span_pipes: list[tuple[object, str, _CountingExporter]] = []
_point_pipes: list[_CountingExporter] = []


def count_unsent_spans(_reason: str = "") -> None:
    """After the spans' last flush (ended, or left behind at its deadline): what it did not deliver is lost."""
    for processor, component, counting in _span_pipes:
        # The settled exporter refuses (uncounted) a batch taken off the queue after the queue's
        # length is read here: those spans are counted once, as queued. The SDK's shutdown has
        # stopped its worker taking batches by now (its timeout ended before this stage's).
        counting.settle()
        LEDGER.add(LEDGER.processed, component, sdk.queued_spans(processor), EXIT_TIMEOUT)


def count_unsent_points(_reason: str = "") -> None:
    for counting in _point_pipes:
        counting.settle()


def _observe(meter_provider) -> None:
    from opentelemetry.metrics import Observation

    from opentelemetry_instrumentation_deepspeed.version import __version__

    meter = meter_provider.get_meter(semconv.SCOPE_NAME, __version__)

    accounting = Component("telemetry delivery accounting")

    def observer(table: Counter):
        def observe(_options):
            return [
                Observation(count, {semconv.OTEL_COMPONENT_NAME: component,
                                    **({semconv.ERROR_TYPE: error} if error else {})})
                for component, error, count in LEDGER.snapshot(table)
            ]
        return observing(accounting, observe)

    meter.create_observable_counter(semconv.METRIC_SPANS_EXPORTED, [observer(LEDGER.spans)], unit="{span}",
                                    description="Spans handed to an exporter; error.type when the export failed")
    meter.create_observable_counter(semconv.METRIC_SPANS_PROCESSED, [observer(LEDGER.processed)], unit="{span}",
                                    description="Spans a batch processor handed on; error.type when it dropped them")
    meter.create_observable_counter(semconv.METRIC_POINTS_EXPORTED, [observer(LEDGER.points)], unit="{data_point}",
                                    description="Metric data points handed to an exporter; error.type when it failed")


class _OncePerLogger(logging.Filter):
    """Lets a logger's first warning through and counts the rest, for the summary at exit; an exporter's warning (a
    retry, a failed export) says its collector does not answer, before any export returned."""

    def __init__(self, exporter: bool = False):
        super().__init__()
        self.seen = False
        self.suppressed = 0
        self.exporter = exporter

    def filter(self, record: logging.LogRecord) -> bool:
        global _exporter_warned  # noqa: PLW0603 - one process, one set of exporters
        if record.levelno < logging.WARNING:
            return True
        if self.exporter:
            _exporter_warned = True
        if not self.seen:
            self.seen = True
            record.msg = f"{record.msg} (further messages like this are counted, and summarized at exit)"
            return True
        self.suppressed += 1
        return False


_filters: list[_OncePerLogger] = []


_exporter_warned = False  # an exporter warned (a retry, a failed export): _silent's evidence before any answer


def quiet_repeated_warnings() -> None:
    for name in _NOISY_LOGGERS:
        log_filter = _OncePerLogger(exporter=name in sdk.EXPORTER_LOGGERS)
        logging.getLogger(name).addFilter(log_filter)
        _filters.append(log_filter)


def summary() -> str | None:
    spans = LEDGER.lost(LEDGER.spans) + LEDGER.lost(LEDGER.processed)
    points = LEDGER.lost(LEDGER.points)
    if not spans and not points and not lifecycle.cut_short:  # a stage left behind (the drain) lost what it held
        return None
    suppressed = sum(log_filter.suppressed for log_filter in _filters)
    why = lifecycle.cut_by or f"{env.OTEL_PYTHON_DEEPSPEED_EXIT_TIMEOUT}={env.exit_timeout():g} s"
    cut = f"; the exit did not wait for: {', '.join(lifecycle.cut_short)} ({why})" if lifecycle.cut_short else ""
    return (f"opentelemetry-instrumentation-deepspeed: {spans} spans and {points} metric data points of this "
            f"process were not delivered (first error: {LEDGER.first_error}; {suppressed} repeated warnings "
            f"suppressed{cut}); training was not affected.")


_reported = threading.Event()


def report() -> None:
    """The summary line, once per process: at exit, or at SIGTERM."""
    if _reported.is_set():
        return
    _reported.set()
    line = summary()
    if line:
        _logger.warning(line)


def install() -> None:
    """When this project sets the SDK up: quiet the exporters' repeated warnings, and report at exit."""
    quiet_repeated_warnings()
    lifecycle.at_exit(lifecycle.COUNT_UNSENT_SPANS, count_unsent_spans)
    lifecycle.at_exit(lifecycle.COUNT_UNSENT_POINTS, count_unsent_points)
    lifecycle.at_exit(lifecycle.REPORT, _report_at_exit)


def _report_at_exit(_reason: str) -> None:
    report()
