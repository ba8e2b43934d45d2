"""A collector that is down, black-holed, slow or refusing: training never notices, loss is counted once.

Traces go over OTLP/HTTP to a loopback server that misbehaves; metrics go to the local files,
where the self-metrics about the lost spans can be read back.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.conftest import BIN, TRAIN, clean_env, free_port, launch
from tests.otlp_json import read_last_points
from tests.otlp_receiver import Misbehaving, OtlpReceiver

pytestmark = pytest.mark.slow  # real DeepSpeed jobs

STEPS = 30
# The standard variable bounds each export; the exit is bounded by OTEL_PYTHON_DEEPSPEED_EXIT_TIMEOUT
# (5 s): the bound allowed here over a healthy run leaves a loaded machine's slack on top.
EXPORT_TIMEOUT_S = 2
EXIT_BOUND_S = 5 + 25
# The slow collector answers after 1.5 s: each export may wait 10 s, and the exit 30 s, so that
# everything arrives however loaded the machine (the defaults would count a late answer as lost).
SLOW_ANSWER_S = 1.5
SLOW = {"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "10", "OTEL_PYTHON_DEEPSPEED_EXIT_TIMEOUT": "30"}


def _closed_port_endpoint() -> str:
    return f"http://127.0.0.1:{free_port()}"


def _traces_to(endpoint: str) -> dict:
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "deepspeed_file",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{endpoint}/v1/traces",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": str(EXPORT_TIMEOUT_S),
        # Batches leave during the run, so failures are seen before exit too.
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """Losses of an uninstrumented run, and how long a healthy instrumented run takes."""
    workdir = tmp_path_factory.mktemp("baseline")
    launch(workdir, "python", "--steps", str(STEPS), "--loss-file", "loss.json", instrument=False).check()
    started = time.monotonic()
    launch(workdir, "python", "--steps", str(STEPS)).check()
    return json.loads((workdir / "loss.json").read_text()), time.monotonic() - started


def _lost_spans(workdir) -> int:
    """Spans lost by the exporter (failed, or in an export at exit) and the processor (dropped, or queued at exit)."""
    (metrics,) = workdir.glob("telemetry/*/metrics-rank0.jsonl")
    return sum(int(point.value) for point in read_last_points(metrics)
               if point.metric in ("otel.sdk.exporter.span.exported", "otel.sdk.processor.span.processed")
               and point.attributes.get("error.type"))


@pytest.mark.parametrize("mode", ["refused", "black hole", "503", "429", "slow"])
def test_training_is_unaffected_and_loss_is_reported_once(workdir, baseline, mode):
    losses, healthy_seconds = baseline
    server = None
    if mode == "refused":
        endpoint = _closed_port_endpoint()
    else:
        server = Misbehaving(status={"black hole": None, "503": 503, "429": 429, "slow": 200}[mode],
                              delay=SLOW_ANSWER_S if mode == "slow" else 0.0)
        endpoint = server.endpoint
    try:
        started = time.monotonic()
        run = launch(workdir, "python", "--steps", str(STEPS), "--loss-file", "loss.json",
                     env={**_traces_to(endpoint), **(SLOW if mode == "slow" else {})}).check()
        seconds = time.monotonic() - started
    finally:
        if server is not None:
            server.close()
    assert json.loads((workdir / "loss.json").read_text()) == losses, "numerics are untouched"
    assert seconds - healthy_seconds < EXIT_BOUND_S, f"{mode}: {seconds:.1f} s vs {healthy_seconds:.1f} s healthy"
    summaries = [line for line in run.output.splitlines() if "were not delivered" in line]
    if mode == "slow":
        # Slow but within the export timeout: everything arrives, nothing to report.
        assert summaries == [], run.stderr[-2000:]
        assert _lost_spans(workdir) == 0
        return
    assert len(summaries) == 1, run.stderr[-3000:]
    lost = int(summaries[0].split(": ", 1)[1].split(" spans")[0])
    assert lost >= 8 * STEPS * 0.9, summaries[0]  # nearly all 8 spans a step (the first batches may be in flight)
    # The exporter's own warnings: the first one, not one per batch.
    exporter_warnings = [line for line in run.output.splitlines()
                         if "exporting spans" in line or "export span" in line.lower()]
    assert len(exporter_warnings) <= 2, exporter_warnings
    # The final metrics are collected after the spans were flushed: they count every lost span.
    assert _lost_spans(workdir) == lost


def test_export_resumes_after_the_receiver_restarts(workdir):
    """The receiver goes away for a while mid-run; spans of the steps after its return arrive."""
    port = free_port()
    first = OtlpReceiver(port).__enter__()
    env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=first.endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
                    OTEL_BSP_SCHEDULE_DELAY="200", OTEL_EXPORTER_OTLP_TIMEOUT=str(EXPORT_TIMEOUT_S),
                    MASTER_PORT=str(free_port()))
    process = subprocess.Popen([str(BIN / "opentelemetry-instrument"), str(BIN / "python"), str(TRAIN),
                                "--steps", "1500", "--loss-file", "loss.json"],
                               cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    second = None
    try:
        _wait_for(lambda: _steps(first) and max(_steps(first)) >= 20, process, "spans of 20 steps")
        first.__exit__(None, None, None)
        down_at = max(_steps(first))
        time.sleep(3)
        second = OtlpReceiver(port).__enter__()
        output, _ = process.communicate(timeout=600)
    finally:
        process.kill()
        if second is not None:
            second.__exit__(None, None, None)
    assert process.returncode == 0, output[-3000:]
    after = _steps(second)
    assert after and min(after) > down_at, "the second receiver got the later steps"
    assert max(after) == 1500, "through the last step"
    # Steps while it was down are lost, and said so once.
    assert output.count("were not delivered") <= 1


def _steps(receiver: OtlpReceiver) -> set[int]:
    return {span.attributes["training.step"] for span in receiver.spans() if span.name == "training.step"}


def _wait_for(condition, process, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if process.poll() is not None:
            pytest.fail(f"the run ended before {what}: {process.stdout.read()[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"no {what} within {timeout} s")

