"""export/sdk.py is the one door into OpenTelemetry's private API, and its public fallbacks work."""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import io
import json
import logging
import os
import signal
import time
from pathlib import Path

import opentelemetry
import pytest
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.metrics._internal import _ProxyMeterProvider
from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider, ObservableCounter, UpDownCounter
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    ConsoleMetricExporter,
    InMemoryMetricReader,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation, View
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, TraceIdRatioBased
from opentelemetry.trace import NoOpTracerProvider, ProxyTracerProvider

import opentelemetry_instrumentation_deepspeed as package
from opentelemetry_instrumentation_deepspeed.export import delivery, sdk
from opentelemetry_instrumentation_deepspeed.export.spans import EMPTY_CONTEXT, in_context
from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env

PACKAGE = Path(package.__file__).parent
DOOR = "export/sdk.py"
# Files that still reach into OpenTelemetry's private API outside the door.
NOT_YET_THROUGH_THE_DOOR: set[str] = set()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@functools.cache
def _opentelemetry_private_names() -> frozenset[str]:
    """Every private name the installed OpenTelemetry packages define: attributes set on ``self``,
    functions, methods, classes, module and class variables."""
    names = set()
    for root in opentelemetry.__path__:
        for path in Path(root).rglob("*.py"):
            if path.name.endswith("_pb2.py") or "/proto/" in path.as_posix():
                continue  # generated protobuf modules: no behaviour of the SDK
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
    return frozenset(name for name in names if _private(name))


def private_uses(path: Path) -> list[str]:
    """Where ``path`` imports a private OpenTelemetry module or name, reads a private attribute of
    something imported from OpenTelemetry, or reads, on anything but ``self``, an attribute whose
    name only OpenTelemetry's private API defines (``getattr`` with a constant name included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bound, found = _imports(tree)
    return found + _attributes(tree, bound)


def _imports(tree: ast.AST) -> tuple[set[str], list[str]]:
    """(names bound to OpenTelemetry modules or objects, imports of private ones)."""
    bound, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "opentelemetry":
                    bound.add((alias.asname or alias.name).split(".")[0])
                    if any(_private(part) for part in alias.name.split(".")):
                        found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "opentelemetry":
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if any(_private(part) for part in [*node.module.split("."), alias.name]):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
    return bound, found


def _attributes(tree: ast.AST, bound: set[str]) -> list[str]:
    theirs = _opentelemetry_private_names()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if (isinstance(root, ast.Name) and root.id in bound) or (node.attr in theirs and not on_self):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in theirs):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_outside_the_door_touches_private_opentelemetry_api():
    outside = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative != DOOR and relative not in NOT_YET_THROUGH_THE_DOOR:
            uses = private_uses(path)
            if uses:
                outside[relative] = uses
    assert outside == {}, "private OpenTelemetry API outside export/sdk.py:\n" + json.dumps(outside, indent=1)


def test_the_scan_sees_what_the_door_does():
    # Not vacuous: the door's own uses are found, of each kind.
    uses = "\n".join(private_uses(PACKAGE / DOOR))
    for expected in ("import _initialize_components", "trace._TRACER_PROVIDER", "batch._metrics",
                     "getattr(provider, '_atexit_handler', None)", "_get_temporality"):
        assert expected in uses


def test_the_allow_list_names_files_that_exist():
    assert all((PACKAGE / relative).exists() for relative in NOT_YET_THROUGH_THE_DOOR)


# -- with the SDK's public API only -------------------------------------------------------------------


@pytest.fixture
def public_only():
    was = sdk.INTERNALS
    sdk.use_internals(False)
    yield
    sdk.use_internals(was)


def _door_warnings(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.name == sdk.__name__ and record.levelno == logging.WARNING]


def _counts(reader) -> dict:
    return {(metric.name, point.attributes.get("kind")): getattr(point, "value", None) or point.count
            for resource in reader.get_metrics_data().resource_metrics
            for scope in resource.scope_metrics for metric in scope.metrics for point in metric.data.data_points}


def test_without_internals_a_pipeline_configures_counts_and_shuts_down(public_only, caplog, monkeypatch):
    monkeypatch.setattr(delivery, "LEDGER", delivery.Ledger())
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider(shutdown_on_exit=False)
    tracer_provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=60_000))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)

    with caplog.at_level(logging.WARNING):
        assert not sdk.api_only(tracer_provider, meter_provider)
        assert sdk.api_only(ProxyTracerProvider(), _ProxyMeterProvider())
        assert sdk.api_only(NoOpTracerProvider(), NoOpMeterProvider())
        assert not sdk.api_only(NoOpTracerProvider(), meter_provider)
        sdk.take_over_exit_handlers(tracer_provider, meter_provider)
        delivery.watch(tracer_provider, meter_provider)  # nothing to wrap: the accounting is off
        assert sdk.span_processors(tracer_provider) == ()
        assert sdk.metric_readers(meter_provider) == ()
        assert sdk.root_decision(ParentBased(TraceIdRatioBased(0.5))) is None  # asked at each step instead
        assert sdk.root_decision(ALWAYS_ON)(1) and not sdk.root_decision(ALWAYS_OFF)(1)
        assert sdk.root_decision(TraceIdRatioBased(1.0))(12345)

        tracer = tracer_provider.get_tracer("test")
        meter = meter_provider.get_meter("test")
        steps, seconds = meter.create_counter("steps"), meter.create_histogram("seconds")
        for number in range(5):
            with tracer.start_as_current_span("training.step", attributes={"training.step": number}):
                steps.add(1, {"kind": "step"})
                seconds.record(0.5, {"kind": "step"})
        assert not exporter.get_finished_spans()  # still in the batch processor's queue

        # What the lifecycle does at exit, the SDK's handlers taken over or not.
        sdk.stop_threads_in_child(tracer_provider, meter_provider)  # a no-op here: no public way
        sdk.reset_global_providers()
        tracer_provider.shutdown()
        assert [span.attributes["training.step"] for span in exporter.get_finished_spans()] == list(range(5))
        assert _counts(reader) == {("steps", "step"): 5, ("seconds", "step"): 5}
        meter_provider.shutdown()

    warnings = _door_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert sdk.INSTALLED in warnings[0] and ", ".join(sdk.WRITTEN_FOR) in warnings[0]


def test_without_internals_the_providers_are_built_from_the_standard_variables(public_only, tmp_path, monkeypatch):
    from opentelemetry_instrumentation_deepspeed.export import output

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "deepspeed_file")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "deepspeed_file")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    monkeypatch.setenv("OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR", str(tmp_path))
    monkeypatch.setenv("OTEL_PYTHON_DEEPSPEED_JOB_ID", "door")
    output.reset()
    env.reset_cache()
    try:
        tracer_provider, meter_provider = sdk.build_providers({"auto_instrumentation_version": "9.9"},
                                                              {"training.rank": 0})
        assert tracer_provider.sampler is ALWAYS_OFF
        assert tracer_provider.resource.attributes["telemetry.auto.version"] == "9.9"
        assert tracer_provider.resource.attributes["training.rank"] == 0
        meter_provider.get_meter("test").create_counter("steps").add(3)
        tracer_provider.shutdown()
        meter_provider.shutdown()
    finally:
        output.reset()
        env.reset_cache()
    lines = (tmp_path / "door" / "metrics-rank0.jsonl").read_text().splitlines()
    assert '"steps"' in lines[-1]


@pytest.mark.parametrize("temporality", ["cumulative", "delta", "lowmemory", "bogus"])
@pytest.mark.parametrize("aggregation", ["explicit_bucket_histogram", "base2_exponential_bucket_histogram"])
def test_the_otlp_preferences_read_without_internals_as_with_them(monkeypatch, temporality, aggregation):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", temporality)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION", aggregation)
    was = sdk.INTERNALS
    try:
        found = []
        for flag in (True, False):
            sdk.use_internals(flag)
            found.append((sdk.otlp_temporality({UpDownCounter: "theirs"}),
                          {kind: type(value) for kind, value in sdk.otlp_aggregation(None).items()}))
    finally:
        sdk.use_internals(was)
    assert found[0] == found[1]
    assert found[0][0][UpDownCounter] == "theirs" and Counter in found[0][0] and ObservableCounter in found[0][0]
    assert Histogram in found[0][1]


# -- histogram points recorded after the fact ---------------------------------------------------------


def _histogram_points(reader) -> list[str]:
    """Every histogram point ``reader`` collects now, as a backend would see it (exemplars included), less the
    times the collection stamps."""
    found = []
    for resource in (reader.get_metrics_data() or MetricsData([])).resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    seen = json.loads(point.to_json())
                    del seen["start_time_unix_nano"], seen["time_unix_nano"]
                    seen["exemplars"].sort(key=json.dumps)
                    found.append(json.dumps([metric.name, seen], sort_keys=True))
    return sorted(found)


@pytest.mark.parametrize(("temporality", "aggregation"), [
    (AggregationTemporality.CUMULATIVE, None), (AggregationTemporality.DELTA, None),
    (AggregationTemporality.CUMULATIVE, ExponentialBucketHistogramAggregation)],
    ids=["cumulative", "delta", "exponential"])
def test_points_after_the_first_go_where_the_sdk_would_put_them(temporality, aggregation):
    """The door's recorder against the SDK's own path, point for point: the same buckets, sums and
    exemplars (their times are the points' own), through collections, a reader added midway, and a view
    that keeps some attribute keys only."""
    from opentelemetry.sdk.metrics._internal.measurement import Measurement

    span = TracerProvider().get_tracer("test").start_span("step")
    contexts = (in_context(span.get_span_context()), EMPTY_CONTEXT)
    phase = {"training.phase": "forward", "deepspeed.zero.stage": 2}
    attribute_sets = (phase, {"training.phase": "backward"}, None)
    arms = []
    for door in (True, False):
        preferred = {Histogram: temporality}
        aggregations = {} if aggregation is None else {Histogram: aggregation()}
        readers = [InMemoryMetricReader(preferred_temporality=preferred, preferred_aggregation=aggregations)]
        provider = MeterProvider(metric_readers=readers, views=[
            View(instrument_name="kept"), View(instrument_name="kept", name="kept.phase",
                                               attribute_keys={"training.phase"})])
        meter = provider.get_meter("test")
        histograms = [meter.create_histogram("duration", unit="s"), meter.create_histogram("kept", unit="s")]
        if door:
            records = [sdk.measurement_recorder(histogram) for histogram in histograms]
        else:
            records = [functools.partial(lambda h, value, taken, context, attributes: h._measurement_consumer
                                         .consume_measurement(Measurement(value, taken, h, context, attributes)),
                                         histogram) for histogram in histograms]
        collected = []
        for index in range(120):
            if index == 40:
                late = InMemoryMetricReader(preferred_temporality=preferred, preferred_aggregation=aggregations)
                provider.add_metric_reader(late)
                readers.append(late)
            for record in records:
                attributes = attribute_sets[index % 3]
                record(0.001 * (index % 17) + 1e-4, 1_000_000 + index, contexts[index % 2], attributes)
            if index % 25 == 24:
                collected.append([_histogram_points(reader) for reader in readers])
        arms.append(collected)
    assert arms[0] == arms[1]
    assert any('"trace_id"' in point for readers in arms[0] for points in readers for point in points), "exemplars"


@pytest.mark.skipif("aggregation_cardinality_limit" not in inspect.signature(View).parameters,
                    reason="an SDK without cardinality limits (1.45.1)")
def test_the_door_keeps_taking_points_past_the_cardinality_limit():
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader],
                             views=[View(instrument_name="h", aggregation_cardinality_limit=2)])
    record = sdk.measurement_recorder(provider.get_meter("test").create_histogram("h"))
    sets = [{"n": n} for n in range(4)]
    for _ in range(3):
        for attributes in sets:
            record(1.0, 1, EMPTY_CONTEXT, attributes)
    counts = {tuple(point.attributes.items()): point.count for point in reader.get_metrics_data().resource_metrics[0]
              .scope_metrics[0].metrics[0].data.data_points}
    assert sum(counts.values()) == 12
    assert counts[(("otel.metric.overflow", True),)] == 6


def test_a_new_attribute_dict_per_point_is_counted_and_does_not_grow_the_door():
    reader = InMemoryMetricReader()
    histogram = MeterProvider(metric_readers=[reader]).get_meter("test").create_histogram("h")
    record = sdk.measurement_recorder(histogram)
    for index in range(3000):
        record(1.0, 1, EMPTY_CONTEXT, {"phase": ("forward", "backward")[index % 2]})
    points = reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics[0].data.data_points
    assert sorted(point.attributes["phase"] for point in points) == ["backward", "forward"]
    assert sum(point.count for point in points) == 3000
    kept = [cell.cell_contents for cell in record.__closure__ if isinstance(cell.cell_contents, dict)]
    assert kept and all(len(routes) <= sdk._ROUTES_KEPT for routes in kept)


@pytest.mark.parametrize("held", [True, False])
def test_a_forked_child_stops_the_export_threads_without_an_event_a_parent_s_thread_held(held):
    """A parent's thread inside an Event (a reader's ticker waking, a span ending) holds its lock at the fork, for
    good in the child: setting that Event there waited forever (a DataLoader worker that never started). Where none
    held it, the reader's ticker, which the SDK's own at-fork hook restarted on it, ends at once."""
    reader = PeriodicExportingMetricReader(ConsoleMetricExporter(out=io.StringIO()), export_interval_millis=60_000)
    meter_provider = MeterProvider([reader])
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(InMemorySpanExporter()))
    try:
        with reader._shutdown_event._cond if held else contextlib.nullcontext():
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    sdk.stop_threads_in_child(tracer_provider, meter_provider)
                    reader._daemon_thread.join(2)
                    code = 0 if held or not reader._daemon_thread.is_alive() else 3
                finally:
                    os._exit(code)
        deadline = time.monotonic() + 20
        while (finished := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if finished[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the child hung stopping the export threads")
        assert os.waitstatus_to_exitcode(finished[1]) == 0
    finally:
        tracer_provider.shutdown()
        meter_provider.shutdown()
