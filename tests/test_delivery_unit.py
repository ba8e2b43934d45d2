"""Undelivered telemetry is counted per exporter and said once (delivery.py), with the SDK's real processors."""

from __future__ import annotations

import logging

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from opentelemetry_instrumentation_deepspeed.export import delivery


class _Failing(SpanExporter):
    def export(self, spans):
        logging.getLogger("opentelemetry.exporter.otlp.proto.http.trace_exporter").warning("Failed to export")
        return SpanExportResult.FAILURE


@pytest.fixture
def ledger(monkeypatch):
    monkeypatch.setattr(delivery, "LEDGER", delivery.Ledger())
    monkeypatch.setattr(delivery, "_filters", [])
    yield delivery.LEDGER
    for name in delivery._NOISY_LOGGERS:
        logging.getLogger(name).filters.clear()


def _points(reader) -> dict:
    found = {}
    for resource in reader.get_metrics_data().resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    found[metric.name, point.attributes.get("error.type", "")] = point.value
    return found


def test_drops_and_failed_exports_are_counted_and_reported_once(ledger, caplog):
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    tracer_provider = TracerProvider()
    processor = BatchSpanProcessor(_Failing(), max_queue_size=4, max_export_batch_size=4, schedule_delay_millis=60_000)
    tracer_provider.add_span_processor(processor)
    delivery.quiet_repeated_warnings()
    delivery.watch(tracer_provider, meter_provider)
    tracer = tracer_provider.get_tracer("test")
    with caplog.at_level(logging.WARNING):
        # The processor's thread waits (as behind a slow export) while 10 spans meet a queue of 4.
        with processor._batch_processor._export_lock:
            for _ in range(10):
                tracer.start_span("step").end()
        tracer_provider.force_flush()
        for _ in range(3):
            tracer.start_span("step").end()
        tracer_provider.force_flush()
    points = _points(reader)
    assert points["otel.sdk.processor.span.processed", "queue_full"] == 6
    assert points["otel.sdk.processor.span.processed", ""] == 7
    assert points["otel.sdk.exporter.span.exported", "export_failed"] == 7
    assert ("otel.sdk.exporter.span.exported", "") not in points
    # The exporter warned once per batch; one got through, as did one of the queue's warnings.
    assert sum("Failed to export" in record.getMessage() for record in caplog.records) == 1
    assert sum("Queue full" in record.getMessage() for record in caplog.records) == 1
    line = delivery.summary()
    assert line.startswith("opentelemetry-instrumentation-deepspeed: 13 spans and 0 metric data points")
    assert "repeated warnings suppressed" in line
    tracer_provider.shutdown()
    meter_provider.shutdown()


def test_nothing_lost_nothing_said(ledger):
    assert delivery.summary() is None
