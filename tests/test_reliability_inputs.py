"""Reliability at the edges (issue #9, cases 9 and 10): untrusted input to ``diagnose``, and what
leaves a training process (attributes, the Prometheus endpoint, OTLP headers and TLS).
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import re
import shutil
import signal
import ssl
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import certifi
import psutil
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from opentelemetry_instrumentation_deepspeed.diagnose import cli
from tests.conftest import BIN, REPO, TRAIN, clean_env, free_port, launch

DIAGNOSE = str(BIN / "opentelemetry-deepspeed")
MEMORY_LIMIT = 1536 * 2**20  # address space for diagnose: ~4x the 200 MB inputs below
BIG = 200_000_000

# -- (9) untrusted input to `opentelemetry-deepspeed diagnose` ---------------------------------------

RESOURCE = {"attributes": [{"key": "training.job.id", "value": {"stringValue": "job"}},
                           {"key": "training.rank", "value": {"intValue": "0"}}]}


def span(name: str, start: int, end: int, number: int | None = None, *, span_id: str = "aa" * 8,
         trace_id: str = "11" * 16, attributes: list | None = None) -> dict:
    items = list(attributes or [])
    if number is not None:
        items.append({"key": "training.step", "value": {"intValue": str(number)}})
    return {"name": name, "traceId": trace_id, "spanId": span_id, "startTimeUnixNano": str(start),
            "endTimeUnixNano": str(end), "attributes": items}


def request(*spans: dict, resource_: dict = RESOURCE) -> str:
    return json.dumps({"resourceSpans": [{"resource": resource_, "scopeSpans": [{"spans": list(spans)}]}]})


# Eight healthy steps of rank 0, one line each: lines 1 to 8 of every input below.
GOOD = "\n".join(request(span("training.step", n * 10**9, n * 10**9 + 10**8, n, span_id=f"{n:016x}",
                              trace_id=f"{n:032x}")) for n in range(1, 9)) + "\n"


def metrics_request(metric: dict) -> str:
    return json.dumps({"resourceMetrics": [{"resource": RESOURCE, "scopeMetrics": [{"metrics": [metric]}]}]})


def _in_resource_spans(**fields) -> str:
    return json.dumps({"resourceSpans": [{"resource": RESOURCE, **fields}]})


def _stepped(attribute: dict) -> str:
    return request(span("comm.all_reduce", 1, 2, attributes=[attribute]))


# name -> (line 9 of the input, what must happen: "bad" = skipped and counted, "ignored" = not a
# training rank's telemetry, skipped silently, "accepted" = read as it is)
SHAPES = {
    "a number": ("42", "bad"),
    "a list": ("[1, 2, 3]", "bad"),
    "a string": ('"resourceSpans"', "bad"),
    "null": ("null", "bad"),
    "resourceSpans a number": ('{"resourceSpans": 5}', "bad"),
    "resourceSpans a string": ('{"resourceSpans": "abc"}', "bad"),
    "resourceSpans of strings": ('{"resourceSpans": ["abc"]}', "bad"),
    "resourceSpans of lists": ('{"resourceSpans": [[1]]}', "bad"),
    "resource a string": ('{"resourceSpans": [{"resource": "abc", "scopeSpans": []}]}', "bad"),
    "scopeSpans a string": (_in_resource_spans(scopeSpans="abc"), "bad"),
    "scopeSpans of strings": (_in_resource_spans(scopeSpans=["abc"]), "bad"),
    "spans a string": (_in_resource_spans(scopeSpans=[{"spans": "abc"}]), "bad"),
    "spans of strings": (_in_resource_spans(scopeSpans=[{"spans": ["abc"]}]), "bad"),
    "span name a number": (request({**span("training.step", 1, 2, 1), "name": 5}), "bad"),
    "span name null": (request({**span("training.step", 1, 2, 1), "name": None}), "bad"),
    "start time not an integer": (request({**span("training.step", 1, 2, 1), "startTimeUnixNano": "1e400"}), "bad"),
    "rank a word": (request(span("training.step", 1, 2, 1), resource_={"attributes": [
        RESOURCE["attributes"][0], {"key": "training.rank", "value": {"stringValue": "zero"}}]}), "bad"),
    "rank of 5000 digits": (request(span("training.step", 1, 2, 1), resource_={"attributes": [
        RESOURCE["attributes"][0], {"key": "training.rank", "value": {"intValue": "9" * 5000}}]}), "bad"),
    "step number a word": (request(span("training.step", 1, 2, attributes=[
        {"key": "training.step", "value": {"stringValue": "abc"}}])), "bad"),
    "bus bandwidth a word": (_stepped({"key": "comm.busbw", "value": {"stringValue": "fast"}}), "bad"),
    "sequence an object": (_stepped({"key": "comm.sequence", "value": {"stringValue": {"a": 1}}}), "bad"),
    "group name a list": (request(span("comm.all_reduce", 1, 2, attributes=[
        {"key": "comm.group.name", "value": {"stringValue": [1]}},
        {"key": "comm.sequence", "value": {"intValue": "1"}}])), "bad"),
    "resourceMetrics a string": ('{"resourceMetrics": "abc"}', "bad"),
    "gauge a string": (metrics_request({"name": "hw.gpu.utilization", "gauge": "abc"}), "bad"),
    "data points of strings": (metrics_request({"name": "hw.gpu.utilization", "gauge": {"dataPoints": ["x"]}}),
                               "bad"),
    "point value a word": (metrics_request({"name": "hw.gpu.utilization", "gauge": {"dataPoints": [
        {"asDouble": "x", "timeUnixNano": "1"}]}}), "bad"),
    "resource attributes a string": ('{"resourceSpans": [{"resource": {"attributes": "abc"}, "scopeSpans": []}]}',
                                     "ignored"),
    "rank an object": (request(span("training.step", 1, 2, 1), resource_={"attributes": [
        RESOURCE["attributes"][0], {"key": "training.rank", "value": {"kvlistValue": {}}}]}), "ignored"),
    "bus bandwidth NaN": (_stepped({"key": "comm.busbw", "value": {"doubleValue": "NaN"}}), "accepted"),
    "step number 2**300": (request(span("training.step", 1, 2, 2**300, trace_id="ee" * 16)), "bad"),  # not an int64
}


def run_main(capsys, *args: str) -> tuple[int, dict]:
    """``diagnose --json`` in this process: the console script is ``sys.exit(cli.main())``."""
    code = cli.main(["diagnose", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(("line", "outcome"), [
    pytest.param(*SHAPES[name], id=name)
    for name in SHAPES])
def test_valid_json_of_the_wrong_shape_is_skipped_and_the_rest_analysed(tmp_path, capsys, line, outcome):
    path = tmp_path / "spans.jsonl"
    path.write_text(GOOD + line + "\n")
    code, report = run_main(capsys, str(path))
    assert code == 0
    assert report["ranks"]["0"]["steps"] >= 8
    if outcome != "accepted":
        assert report["ranks"]["0"]["steps"] == 8
    if outcome == "bad":
        assert report["input"]["bad_lines"] + report["input"]["bad_spans"] == 1
        (problem,) = report["input"]["problems"]
        assert problem.startswith(f"{path}:9: ") and problem.endswith(", skipped"), problem


@pytest.mark.parametrize(("start", "end"), [(10**18, 1), (-5, -(10**18)), (2**200, 2**201)],
                         ids=["end before start", "negative", "beyond fixed64"])
def test_absurd_span_times_are_reported_not_analysed(tmp_path, capsys, start, end):
    path = tmp_path / "spans.jsonl"
    path.write_text(GOOD + request(span("training.step", start, end, 9, trace_id="ff" * 16)) + "\n")
    code, report = run_main(capsys, str(path))
    assert code == 0
    assert report["ranks"]["0"]["steps"] == 8
    assert 0 < report["ranks"]["0"]["step_seconds"]["max"] < 1
    assert report["input"]["problems"], "the absurd span is named"


def test_a_bad_span_in_a_collectors_batch_is_skipped_alone(tmp_path, capsys):
    """One line of a Collector's file holds a batch: one span of another writer's with its times out of order (or an
    attribute of another type) is skipped, not the hundreds of steps beside it."""
    steps = [span("training.step", n * 10**9, n * 10**9 + 10**8, n, span_id=f"{n:016x}", trace_id=f"{n:032x}")
             for n in range(1, 41)]
    steps.insert(7, span("other.work", 10**18, 1, span_id="ee" * 8))
    steps.insert(20, span("training.step", 50 * 10**9, 50 * 10**9 + 1, span_id="dd" * 8, attributes=[
        {"key": "training.step", "value": {"stringValue": "fifty"}}]))
    path = tmp_path / "collector.jsonl"
    path.write_text(request(*steps) + "\n")
    code, report = run_main(capsys, str(path))
    assert code == 0 and report["ranks"]["0"]["steps"] == 40
    assert (report["input"]["bad_lines"], report["input"]["bad_spans"]) == (0, 2), report["input"]["problems"]
    assert [problem.split(": ", 1)[1] for problem in report["input"]["problems"]] == [
        "span 'other.work' has impossible times (1000000000000000000, 1), skipped",
        "attribute training.step is str, not int, skipped"], report["input"]["problems"]


# Sets the limit, then becomes the console script: no preexec_fn in this (threaded) test process.
_LIMITED = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]),) * 2); "
            "os.execv(sys.argv[2], sys.argv[2:])")


def diagnose_bounded(cwd: Path, *args: str) -> tuple[int, str, str, int]:
    """The console script under a 1.5 GB address-space limit: (status, stdout, stderr, peak RSS in bytes)."""
    command = [str(BIN / "python"), "-c", _LIMITED, str(MEMORY_LIMIT), DIAGNOSE, "diagnose", *args]
    with open(cwd / "stdout", "w+") as out, open(cwd / "stderr", "w+") as err:
        process = subprocess.Popen(command, cwd=cwd, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        timer = threading.Timer(120, process.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(process.pid, 0)  # this child's own peak, not the session's
        finally:
            timer.cancel()
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return process.returncode, out.read(), err.read(), usage.ru_maxrss * 1024


def _nested(path: Path) -> None:
    path.write_text(GOOD + "[" * 100_000 + "]" * 100_000 + "\n")


def _garbage_line(path: Path) -> None:
    with path.open("w") as handle:
        handle.write(GOOD)
        for _ in range(BIG // 10_000_000):
            handle.write("x" * 10_000_000)


def _binary(path: Path) -> None:
    path.write_bytes(GOOD.encode() + random.Random(9).randbytes(1 << 20))


def _huge_request(path: Path) -> None:
    # One OTLP request of 66 million empty resourceSpans: valid JSON, and every element an object.
    with path.open("w") as handle:
        handle.write(GOOD + '{"resourceSpans": [{}')
        for _ in range(BIG // 30_000_000):
            handle.write(",{}" * 10_000_000)
        handle.write("]}")


@pytest.mark.parametrize("make", [
    pytest.param(_nested, id="100k nested arrays"),
    pytest.param(_garbage_line, id="200 MB line, no newline"),
    pytest.param(_binary, id="binary garbage"),
    pytest.param(_huge_request, id="200 MB JSON request"),
])
def test_hostile_files_are_skipped_within_bounded_memory(tmp_path, make):
    path = tmp_path / "input.jsonl"
    make(path)
    try:
        code, out, err, peak = diagnose_bounded(tmp_path, str(path), "--json")
    finally:
        path.unlink()
    assert "MemoryError" not in err and "Traceback" not in err, err[-3000:]
    assert code == 0, err[-3000:]
    report = json.loads(out)
    assert report["ranks"]["0"]["steps"] == 8, "the good lines before it are analysed"
    assert report["input"]["bad_lines"] >= 1
    assert any(line.endswith(", skipped") for line in err.splitlines()), err[-2000:]
    assert peak < MEMORY_LIMIT


def test_exit_status_is_as_documented(tmp_path):
    """docs/diagnose.md: 1 when no span was read, 2 for a usage error, else 0."""
    (tmp_path / "garbage.jsonl").write_text("not json\n")
    (tmp_path / "good.jsonl").write_text(GOOD)
    code, _, err, _ = diagnose_bounded(tmp_path, "garbage.jsonl")
    assert code == 1 and "garbage.jsonl:1: not an OTLP JSON line, skipped" in err and "Traceback" not in err
    code, _, err, _ = diagnose_bounded(tmp_path, "--no-such-option")
    assert code == 2 and "usage:" in err and "Traceback" not in err
    code, out, err, _ = diagnose_bounded(tmp_path, "good.jsonl", "garbage.jsonl")
    assert code == 0 and "rank 0: 8 steps" in out and "Traceback" not in err


# -- (10) what leaves the process: attributes ---------------------------------------------------------

ALLOWED_KINDS = {"stringValue", "intValue", "doubleValue", "boolValue"}
MAX_STRING = 200
OUR_SCOPE = "opentelemetry_instrumentation_deepspeed"
# Tensor reprs, and lists of numbers long enough to be data rather than a shape.
TENSOR_DATA = re.compile(r"tensor\(|(?:-?\d+(?:\.\d+)?(?:e-?\d+)?,\s*){16,}")


def _documented() -> tuple[set[str], list[str]]:
    text = (REPO / "docs" / "telemetry.md").read_text()
    names = set(re.findall(r"`([a-z_][\w.]*(?:\.\*)?)`", text))
    return {name for name in names if not name.endswith(".*")}, [name[:-1] for name in names if name.endswith(".*")]


def _is_documented(key: str, names: set[str], prefixes: list[str]) -> bool:
    return key in names or any(key.startswith(prefix) for prefix in prefixes)


class Seen:
    """Every attribute that left the job: (where, scope, metric, key) -> values."""

    def __init__(self):
        self.values: dict[tuple[str, str, str, str], list] = {}
        self.metrics: set[tuple[str, str]] = set()  # (scope, metric), attributes or not

    def add(self, where: str, scope: str, metric: str, items) -> None:
        for item in items or ():
            (kind, inner), = item["value"].items()
            self.values.setdefault((where, scope, metric, item["key"]), []).append((kind, inner))

    def keys(self, predicate) -> set[str]:
        return {key for (where, scope, metric, key) in self.values if predicate(where, scope, metric)}


def _scan_spans(payload: dict, seen: Seen) -> None:
    for resource_spans in payload.get("resourceSpans", []):
        seen.add("resource", "", "", resource_spans["resource"]["attributes"])
        for scope_spans in resource_spans["scopeSpans"]:
            scope = scope_spans["scope"]["name"]
            for item in scope_spans["spans"]:
                seen.add("span", scope, item["name"], item.get("attributes"))
                for where in ("events", "links"):
                    for nested in item.get(where, []):
                        seen.add(where[:-1], scope, item["name"], nested.get("attributes"))


def _scan_metrics(payload: dict, seen: Seen) -> None:
    for resource_metrics in payload.get("resourceMetrics", []):
        seen.add("resource", "", "", resource_metrics["resource"]["attributes"])
        for scope_metrics in resource_metrics["scopeMetrics"]:
            scope = scope_metrics["scope"]["name"]
            for metric in scope_metrics["metrics"]:
                seen.metrics.add((scope, metric["name"]))
                points = [point for kind in ("sum", "gauge", "histogram", "exponentialHistogram", "summary")
                          for point in metric.get(kind, {}).get("dataPoints", [])]
                for point in points:
                    seen.add("metric", scope, metric["name"], point.get("attributes"))
                    for exemplar in point.get("exemplars", []):
                        seen.add("exemplar", scope, metric["name"], exemplar.get("filteredAttributes"))


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("zero3")
    run = launch(workdir, "deepspeed", "--steps", "6", "--zero-stage", "3", "--grad-accum", "2").check()
    run.seen, run.files = Seen(), sorted(workdir.glob("telemetry/*/*.jsonl"))
    for path in run.files:
        for line in path.read_text().splitlines():
            payload = json.loads(line)
            _scan_spans(payload, run.seen)
            _scan_metrics(payload, run.seen)
    return run


@pytest.mark.slow
def test_every_attribute_value_is_a_small_scalar_and_never_tensor_data(zero3_run):
    assert [path.name for path in zero3_run.files] == ["metrics-rank0.jsonl", "metrics-rank1.jsonl",
                                                       "traces-rank0.jsonl", "traces-rank1.jsonl"]
    checked = 0
    for (where, scope, metric, key), values in zero3_run.seen.values.items():
        for kind, inner in values:
            scalars = [kind]
            items = [inner]
            if kind == "arrayValue":
                scalars = [next(iter(value)) for value in inner.get("values", [])]
                items = [next(iter(value.values())) for value in inner.get("values", [])]
            assert set(scalars) <= ALLOWED_KINDS, (where, scope, metric, key, kind)
            for value in items:
                text = str(value)
                assert len(text) <= MAX_STRING, (where, metric, key, text[:300])
                assert not TENSOR_DATA.search(text), (where, metric, key, text[:300])
                checked += 1
    assert checked > 1000


@pytest.mark.slow
def test_the_attributes_and_metrics_seen_are_the_documented_ones(zero3_run):
    names, prefixes = _documented()
    ours = zero3_run.seen.keys(lambda where, scope, metric: where == "resource" or scope.startswith(OUR_SCOPE))
    metrics = {metric for scope, metric in zero3_run.seen.metrics if scope.startswith(OUR_SCOPE)}
    undocumented = sorted(name for name in ours | metrics if not _is_documented(name, names, prefixes))
    assert undocumented == []
    # The scan saw the whole tree: steps, phases, collectives of ZeRO-3, resources, metrics.
    assert {"training.step", "training.micro_step", "training.zero_stage", "comm.sequence", "comm.op",
            "comm.bytes", "training.job.id", "training.rank", "service.instance.id", "training.phase",
            "otel.component.name"} <= ours
    assert {"training.step.duration", "training.comm.duration", "otel.sdk.exporter.span.exported"} <= metrics
    # Everything else is the system-metrics instrumentation's (host and process metrics).
    foreign = {scope for (where, scope, _, _) in zero3_run.seen.values if where == "metric"
               and not scope.startswith(OUR_SCOPE)}
    assert foreign == {"opentelemetry.instrumentation.system_metrics"}


# -- (10) what leaves the process: the Prometheus endpoint ---------------------------------------------


def _listening(pid: int, port: int) -> list[str]:
    addresses = []
    try:
        processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    for process in processes:
        try:
            connections = process.net_connections(kind="inet")
        except psutil.Error:
            continue
        addresses += [c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    return addresses


@pytest.mark.slow
def test_prometheus_endpoint_answers_on_loopback_only(tmp_path):
    port = free_port()
    env = clean_env(OTEL_METRICS_EXPORTER="prometheus", OTEL_EXPORTER_PROMETHEUS_PORT=str(port),
                    MASTER_PORT=str(free_port()))
    # The job blocks in step 10 until SIGUSR1 (the example's --block-in-step): it is still training
    # when the endpoint is read, however slow or fast the machine.
    command = [str(BIN / "opentelemetry-instrument"), str(BIN / "python"), str(TRAIN), "--steps", "20",
               "--block-in-step", "10"]
    with open(tmp_path / "output", "w+") as output:
        process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=output, stderr=subprocess.STDOUT)
        try:
            # 150 s: start-up (DeepSpeed's import and init, ~10 s on a quiet machine) many times over;
            # it only bounds how long a run whose endpoint never answers keeps the suite waiting.
            addresses, page, deadline = [], "", time.monotonic() + 150
            while process.poll() is None and time.monotonic() < deadline:
                addresses = addresses or _listening(process.pid, port)
                if addresses:
                    host = addresses[0]
                    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/metrics"
                    try:
                        page = urllib.request.urlopen(url, timeout=5).read().decode()
                    except OSError:
                        page = ""
                    if "training_step_duration_seconds_count" in page:
                        break
                time.sleep(0.1)
            still_training = process.poll() is None
            while process.poll() is None and time.monotonic() < deadline and \
                    "blocked in step 10" not in (tmp_path / "output").read_text():
                time.sleep(0.1)  # SIGUSR1 before the step installs its handler would kill the job
            process.send_signal(signal.SIGUSR1)
        finally:
            code = process.wait(timeout=150)
        output.seek(0)
        log = output.read()
    assert code == 0, log[-3000:]
    assert still_training, "the endpoint was checked while the job trained"
    assert addresses, f"nothing listened on {port}"
    assert all(ipaddress.ip_address(address).is_loopback for address in addresses), addresses
    assert "127.0.0.1" in addresses or "::1" in addresses
    assert "training_step_duration_seconds_count" in page and 'training_job_id="' in page


# -- (10) what leaves the process: OTLP headers and TLS ------------------------------------------------


class RecordingReceiver:
    """An OTLP/HTTP endpoint on loopback that keeps each request's path, headers and spans."""

    def __init__(self, tls: ssl.SSLContext | None = None):
        self.requests: list[tuple[str, dict, list[str]]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                names = []
                if self.path == "/v1/traces":
                    names = [item.name for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans
                             for scope_spans in resource_spans.scope_spans for item in scope_spans.spans]
                receiver.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}, names))
                # An empty Export*ServiceResponse serializes to no bytes.
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        scheme = "https" if tls else "http"
        self.endpoint = f"{scheme}://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def of(self, path: str) -> list[tuple[str, dict, list[str]]]:
        return [entry for entry in self.requests if entry[0] == path]

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()


STEPS = 4


def _otlp_run(workdir: Path, receiver: RecordingReceiver, **env: str):
    return launch(workdir, "python", "--steps", str(STEPS), env={
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", **env})


@pytest.mark.slow
def test_otlp_headers_reach_the_collector_on_every_request(workdir):
    with RecordingReceiver() as receiver:
        run = _otlp_run(workdir, receiver, OTEL_EXPORTER_OTLP_HEADERS="authorization=Bearer abc,x-tenant=t1").check()
    traces, metrics = receiver.of("/v1/traces"), receiver.of("/v1/metrics")
    assert traces and metrics, [entry[0] for entry in receiver.requests]
    for path, headers, _ in traces + metrics:
        assert headers.get("authorization") == "Bearer abc" and headers.get("x-tenant") == "t1", (path, headers)
    assert sum(names.count("training.step") for _, _, names in traces) == STEPS
    assert not (workdir / "telemetry").exists(), "with an endpoint nothing is written locally"
    assert run.trained() == (STEPS, 0)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command to make a self-signed certificate (`cryptography` is not installed)")
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


# requests lets these replace a session's own CA file (psf/requests#3829); many images set them.
_NO_CA_BUNDLE = {"REQUESTS_CA_BUNDLE": "", "CURL_CA_BUNDLE": ""}


def _tls_run(tmp_path: Path, certificate, **env: str):
    cert, key = certificate
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    workdir = tmp_path / "job"
    workdir.mkdir()
    with RecordingReceiver(context) as receiver:
        assert receiver.endpoint.startswith("https://")
        run = _otlp_run(workdir, receiver, OTEL_EXPORTER_OTLP_CERTIFICATE=str(cert), **env).check()
    return run, receiver


@pytest.mark.slow
def test_otlp_over_tls_with_a_private_certificate(tmp_path, certificate):
    run, receiver = _tls_run(tmp_path, certificate, **_NO_CA_BUNDLE)
    traces = receiver.of("/v1/traces")
    assert sum(names.count("training.step") for _, _, names in traces) == STEPS, run.stderr[-3000:]
    assert receiver.of("/v1/metrics")
    assert "CERTIFICATE_VERIFY_FAILED" not in run.stderr and "not delivered" not in run.stderr


@pytest.fixture(scope="module")
def tls_with_ca_bundle(tmp_path_factory, certificate):
    # The public CAs, as a conda environment or a corporate image points requests at them.
    return _tls_run(tmp_path_factory.mktemp("ca-bundle"), certificate, REQUESTS_CA_BUNDLE=certifi.where(),
                    CURL_CA_BUNDLE="", OTEL_EXPORTER_OTLP_TIMEOUT="2")


@pytest.mark.slow
def test_a_tls_failure_is_reported_once_and_training_goes_on(tls_with_ca_bundle):
    run, _ = tls_with_ca_bundle
    assert run.trained() == (STEPS, 0)
    assert len(re.findall(r"spans and \d+ metric data points of this process were not delivered", run.stderr)) == 1
    assert 1 <= run.stderr.count("CERTIFICATE_VERIFY_FAILED") <= 2, "one warning per exporter, the rest counted"


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason=(
    "upstream bug (opentelemetry-exporter-otlp-proto-http, not this package): RequestsHTTPTransport sets "
    "session.verify = OTEL_EXPORTER_OTLP_CERTIFICATE, and requests replaces a session's verify with "
    "REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE when either is set: the private CA is ignored and every export fails"))
def test_otlp_certificate_wins_over_requests_ca_bundle(tls_with_ca_bundle):
    _, receiver = tls_with_ca_bundle
    assert sum(names.count("training.step") for _, _, names in receiver.of("/v1/traces")) == STEPS


@pytest.mark.parametrize(("flag", "value", "said"), [("--limit", "abc", "'abc' is not a count in [1, 1000000]"),
                                                     ("--limit", "0", "'0' is not a count in [1, 1000000]"),
                                                     ("--since", "abc", "'abc' is not a number of seconds"),
                                                     ("--since", "nan", "'nan' is not a number of seconds")])
def test_a_bad_flag_value_is_named_with_what_was_expected(capsys, flag, value, said):
    """A review: "invalid _count value: 'abc'" named a function of the program's, not what it wanted."""
    from opentelemetry_instrumentation_deepspeed.diagnose.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["diagnose", flag, value, "telemetry"])
    error = capsys.readouterr().err
    assert exited.value.code == 2 and f"argument {flag}: {said}" in error and "_" not in error.splitlines()[-1], error


def test_an_input_with_no_span_says_what_diagnose_reads(tmp_path, capsys):
    """A review: an empty folder, or one of metrics files only, read "Read 0 spans from 0/2 file(s)" and no more."""
    empty = tmp_path / "empty"
    empty.mkdir()
    code, report = run_main(capsys, str(empty))
    assert code == 1 and report["input"]["problems"] == [f"no .json or .jsonl file in {empty}"]
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    (metrics / "metrics-rank0.jsonl").write_text(json.dumps({"resourceMetrics": []}) + "\n")
    code, report = run_main(capsys, str(metrics))
    assert code == 1 and report["input"]["problems"][0].startswith("no span in the files read: diagnose reads the "
                                                                   "traces (traces-rank<N>.jsonl")
