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
    monkeypatch.setattr(delivery, "_exporter_warned", False)
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


def test_a_fault_in_the_counting_turns_it_off_and_the_batches_are_exported_all_the_same(ledger, monkeypatch, caplog):
    """A review: an exception in our count of a batch's metric points lost every metric export of the run, with the
    SDK's traceback and no word of ours."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from opentelemetry_instrumentation_deepspeed.runtime.safety import Component

    monkeypatch.setattr(delivery, "_counting", Component("telemetry delivery counting"), raising=False)
    inner = InMemorySpanExporter()

    def broken(_batch):
        raise ValueError("a count that fails")

    counting = delivery._CountingExporter(inner, "test", delivery.LEDGER.spans, broken,
                                          success=SpanExportResult.SUCCESS, failure=SpanExportResult.FAILURE)
    tracer_provider = TracerProvider()
    spans = []
    for name in ("first", "second"):
        span = tracer_provider.get_tracer("test").start_span(name)
        span.end()
        spans.append(span)
    with caplog.at_level(logging.ERROR):
        assert counting.export([spans[0]]) == SpanExportResult.SUCCESS
        assert counting.export([spans[1]]) == SpanExportResult.SUCCESS
    assert [span.name for span in inner.get_finished_spans()] == ["first", "second"]
    assert sum("telemetry delivery counting" in record.getMessage() for record in caplog.records) == 1


def test_nothing_lost_nothing_said(ledger):
    assert delivery.summary() is None


def test_an_exit_that_left_the_drain_behind_says_so(ledger, monkeypatch):
    """A fault-injection review: a drain stuck at exit lost every step's spans and metrics, and nothing was said: no
    span had reached an exporter, so none was counted as lost."""
    from opentelemetry_instrumentation_deepspeed.runtime import lifecycle

    monkeypatch.setattr(lifecycle, "cut_short", ["drain"])
    line = delivery.summary()
    assert line is not None and "the exit did not wait for: drain" in line


def test_a_collection_does_not_wait_for_a_stuck_drain():
    """The same review: the last metrics collection waited for the stuck drain's lock, and the metrics were lost."""
    import threading
    import time

    from opentelemetry_instrumentation_deepspeed.export import emitter as emitter_module

    emitter = emitter_module.Emitter()
    held, release = threading.Event(), threading.Event()

    def stuck_drain():
        with emitter._lock:
            held.set()
            release.wait(30)

    thread = threading.Thread(target=stuck_drain, daemon=True)
    thread.start()
    try:
        assert held.wait(10)
        started = time.monotonic()
        assert emitter._drain_at_collection(None) == []
        assert time.monotonic() - started < emitter_module.COLLECTION_WAIT_SECONDS + 10  # not the drain's 30 s
    finally:
        release.set()
        thread.join(10)


_BLACK_HOLE_EXIT = """
import json, os, sys, time
sys.path.insert(0, {repo!r})
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry_instrumentation_deepspeed.export import delivery
from opentelemetry_instrumentation_deepspeed.runtime import lifecycle

endpoint = sys.argv[1]
tracer_provider = TracerProvider(shutdown_on_exit=False)
tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(f"{{endpoint}}/v1/traces", timeout=30),
                                                      schedule_delay_millis=50))
metric_exporter = OTLPMetricExporter(f"{{endpoint}}/v1/metrics", timeout=30)
meter_provider = MeterProvider([PeriodicExportingMetricReader(metric_exporter, export_interval_millis=3_600_000)],
                               shutdown_on_exit=False)
delivery.install()
delivery.watch(tracer_provider, meter_provider)
lifecycle.install(tracer_provider, meter_provider)
tracer = tracer_provider.get_tracer("test")
for _ in range(1500):  # the first batch (512) hangs in an export; the rest waits in the queue
    tracer.start_span("step").end()
counter = meter_provider.get_meter("test").create_counter("samples")
for rank in range(3):
    counter.add(1, {{"rank": rank}})
time.sleep(0.5)
print("EXITING", time.monotonic(), flush=True)
"""


@pytest.mark.slow  # 2.7 s: an exit bounded against a collector that never answers waits out its bound
def test_a_bounded_exit_against_a_black_hole_counts_every_span_and_point(tmp_path):
    """Real SDK, real OTLP/HTTP exporters, a collector that never answers: the exit ends within its
    budget, and the summary counts exactly the spans made and the points of the last collection."""
    import os
    import subprocess
    import sys
    import time

    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    from tests.conftest import REPO
    from tests.otlp_receiver import Misbehaving

    server = Misbehaving(status=None)
    try:
        result = subprocess.run([sys.executable, "-c", _BLACK_HOLE_EXIT.format(repo=str(REPO)), server.endpoint],
                                capture_output=True, text=True, timeout=120, check=False,
                                env={**os.environ, "OTEL_PYTHON_DEEPSPEED_EXIT_TIMEOUT": "2"})
        ended = time.monotonic()
    finally:
        server.close()
    assert result.returncode == 0, result.stderr
    exiting = float(result.stdout.split("EXITING ")[1].split()[0])
    assert ended - exiting < 2 + 10, "the budget (2 s), and a loaded machine's slack"
    (line,) = [line for line in result.stderr.splitlines() if "were not delivered" in line]
    (metrics_body,) = [body for path, body in server.bodies if path == "/v1/metrics"]
    request = ExportMetricsServiceRequest.FromString(metrics_body)
    points = sum(len(getattr(metric, metric.WhichOneof("data")).data_points)
                 for resource in request.resource_metrics for scope in resource.scope_metrics
                 for metric in scope.metrics)
    assert points >= 3 + 2  # the three counter points, and the self-metrics of the lost spans
    assert f"1500 spans and {points} metric data points" in line, line
    assert "exit_timeout" in line


@pytest.mark.slow  # a subprocess with the SDK and its exporters: 2 s
def test_ctrl_c_during_the_exit_flush_leaves_the_collector_and_says_what_was_lost(tmp_path):
    """A second Ctrl-C while the telemetry is flushed at exit: a traceback out of the exit handler, the stages after it
    skipped, nothing said about what was lost. Now what waits on the collector is left behind, as at the deadline,
    and the summary says so."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO
    from tests.otlp_receiver import Misbehaving

    server = Misbehaving(status=None)
    try:
        # A terminal's foreground process: a shell's background job (a CI runner's) starts with SIGINT ignored.
        script = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n" + _BLACK_HOLE_EXIT
        process = subprocess.Popen([sys.executable, "-c", script.format(repo=str(REPO)), server.endpoint],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, "OTEL_PYTHON_DEEPSPEED_EXIT_TIMEOUT": "60"})
        assert process.stdout.readline().startswith("EXITING")
        time.sleep(1.0)  # in the flush of the spans, which waits on the black hole
        pressed = time.monotonic()
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
        ended = time.monotonic()
    finally:
        process.kill()
        server.close()
    assert ended - pressed < 10, "not the exit's 60 s budget"
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    (line,) = [line for line in stderr.splitlines() if "were not delivered" in line]
    assert "1500 spans" in line and "the exit did not wait for: flush spans" in line and "(a second Ctrl-C)" in line


def test_an_exporter_answers_until_an_export_fails(ledger):
    """What the exit's flushes are shortened by (lifecycle.UNANSWERED_SECONDS): a collector that refused the last
    export, or whose exporter warned (a retry) before any export returned; a slow one is no sign."""
    results = [SpanExportResult.SUCCESS, SpanExportResult.FAILURE, SpanExportResult.SUCCESS]

    class Inner(SpanExporter):
        def export(self, spans):
            return results.pop(0)

    counting = delivery._CountingExporter(Inner(), "test", delivery.LEDGER.spans, len,
                                          success=SpanExportResult.SUCCESS, failure=SpanExportResult.FAILURE)
    assert counting.answering() is None and not delivery._silent([counting])
    delivery.quiet_repeated_warnings()
    logging.getLogger("opentelemetry.sdk._shared_internal").warning("Queue full")  # not the collector's doing
    assert not delivery._silent([counting])
    logging.getLogger("opentelemetry.exporter.otlp.proto.grpc.exporter").warning("Transient error, retrying")
    assert delivery._silent([counting]), "no export returned yet, and the exporter retries"
    answers = []
    for _ in range(3):
        counting.export([])
        answers.append((counting.answering(), delivery._silent([counting])))
    assert answers == [(True, False), (False, True), (True, False)]

    class File(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    results.append(SpanExportResult.FAILURE)
    counting.export([])
    answered = delivery._CountingExporter(File(), "file", delivery.LEDGER.spans, len,
                                          success=SpanExportResult.SUCCESS, failure=SpanExportResult.FAILURE)
    answered.export([])
    assert delivery._silent([counting]) and not delivery._silent([counting, answered]), \
        "another exporter of the signal answers: the flush gets its full share"
