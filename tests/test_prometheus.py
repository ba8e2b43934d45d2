"""Training metrics through the SDK's Prometheus exporter into a real Prometheus (Debian's 2.42), read with PromQL."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from tests.conftest import free_port, launch

STEPS, GRAD_ACCUM, MICRO_BATCH = 8, 2, 4

pytestmark = [pytest.mark.slow,  # a Prometheus server scraping a real DeepSpeed job
              pytest.mark.skipif(shutil.which("prometheus") is None,
                                 reason="needs Prometheus (apt-get install prometheus; scripts/test.sh does)")]


def free_port_pair(avoid: int) -> int:
    """A free port whose successor is free too (rank r listens on base + r), neither being ``avoid``."""
    while True:
        port = free_port()
        if avoid in (port, port + 1):
            continue
        try:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue


@pytest.fixture
def prometheus(tmp_path):
    port = free_port()
    exporter_port = free_port_pair(avoid=port)
    targets = [f"127.0.0.1:{exporter_port}", f"127.0.0.1:{exporter_port + 1}"]
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({
        "global": {"scrape_interval": "1s", "scrape_timeout": "800ms"},
        "scrape_configs": [{"job_name": "training", "static_configs": [{"targets": targets}]}],
    }))
    server = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(f"{url}/-/ready", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    else:
        server.kill()
        pytest.fail(f"Prometheus did not start: {server.stderr.read().decode()[-2000:]}")
    yield url, exporter_port
    server.terminate()
    server.wait(timeout=10)


def query(url: str, promql: str) -> dict[str, float]:
    """instance -> value of an instant query.

    The ranks have exited: their series are stale now, so queries read their last values.
    """
    with urllib.request.urlopen(f"{url}/api/v1/query?query={urllib.parse.quote(promql)}", timeout=5) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return {sample["metric"].get("instance", ""): float(sample["value"][1]) for sample in body["data"]["result"]}


def test_histograms_and_counters_read_back_with_promql(workdir, prometheus):
    url, exporter_port = prometheus
    run = launch(workdir, "torchrun", "--steps", str(STEPS), "--grad-accum", str(GRAD_ACCUM),
                 "--micro-batch-size", str(MICRO_BATCH), env={
                     "OTEL_METRICS_EXPORTER": "prometheus",
                     "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
                     "OTEL_EXPORTER_PROMETHEUS_PORT": str(exporter_port),
                     "OTEL_PYTHON_DEEPSPEED_PROMETHEUS_FINAL_SCRAPE_TIMEOUT": "15",
                 }).check()
    instances = {f"127.0.0.1:{exporter_port}", f"127.0.0.1:{exporter_port + 1}"}
    steps = query(url, "last_over_time(training_step_duration_seconds_count[5m])")
    assert steps == dict.fromkeys(instances, STEPS), run.stderr[-3000:]
    spans = len([s for s in run.spans if s.name == "training.step"])
    assert sum(steps.values()) == spans == 2 * STEPS
    for phase, count in (("forward", STEPS * GRAD_ACCUM), ("data.wait", STEPS * GRAD_ACCUM),
                         ("optimizer.step", STEPS)):
        promql = f'last_over_time(training_phase_duration_seconds_count{{training_phase="{phase}"}}[5m])'
        assert query(url, promql) == dict.fromkeys(instances, count), phase
    # Both ranks together consumed the dataset slice of STEPS optimizer steps.
    samples = 2 * STEPS * GRAD_ACCUM * MICRO_BATCH
    assert query(url, "sum(last_over_time(training_samples_total[5m]))") == {"": samples}
    assert query(url, "sum(last_over_time(training_tokens_total[5m]))") == {"": samples * 32}
    buckets = "sum by (le) (last_over_time(training_step_duration_seconds_bucket[5m]))"
    median = query(url, f"histogram_quantile(0.5, {buckets})")
    step_seconds = sorted((s.end - s.start) / 1e9 for s in run.spans if s.name == "training.step")
    assert step_seconds[0] / 2.5 <= median[""] <= step_seconds[-1] * 2.5, "within the bucket of the spans' median"
    # The resource becomes target_info: the same job and ranks as the spans.
    last_info = urllib.parse.quote("last_over_time(target_info[5m])")
    with urllib.request.urlopen(f"{url}/api/v1/query?query={last_info}", timeout=5) as response:
        labels = [sample["metric"] for sample in json.load(response)["data"]["result"]]
    assert {label["training_rank"] for label in labels} == {"0", "1"}
    assert {label["training_job_id"] for label in labels} == {run.spans[0].resource["training.job.id"]}


def test_a_taken_port_turns_the_metrics_off_not_the_traces(workdir):
    """A review: with the Prometheus port taken, the reader's OSError aborted the SDK's whole set-up: that rank wrote
    no traces at all, and said "no DeepSpeed engine was built"."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        run = launch(workdir, "python", "--steps", "4", env={
            "OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
            "OTEL_EXPORTER_PROMETHEUS_PORT": str(taken.getsockname()[1])}).check()
    finally:
        taken.close()
    assert len([s for s in run.spans if s.name == "training.step"]) == 4
    assert "the OpenTelemetry SDK's set-up failed (OSError:" in run.stderr and "(traces on, metrics off)" in run.stderr
    assert "not traced" not in run.stderr
