"""The Grafana dashboard and the Prometheus alerting rules, against a real Prometheus (Debian's 2.42)
fed by real instrumented 2-rank runs: a healthy one, one whose loader stalls while its telemetry
endpoint is dead, and one with a straggler rank on a sick GPU.

There is no GPU here: tests/fake_nvml makes NVML answer for one GPU per rank, at the pynvml boundary.
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import time
import urllib.parse
import uuid
from dataclasses import dataclass

import pytest

from tests.conftest import Run, free_port, launch
from tests.dashboards_support import (
    DASHBOARD,
    FAKE_NVML,
    RULES,
    RULES_TEST,
    Prometheus,
    PrometheusError,
    finite,
    free_port_pairs,
    label_values_query,
    prometheus_config,
    promtool,
    substitute,
)
from tests.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("promtool") is None,
                                reason="needs Prometheus and promtool (apt-get install prometheus)")

RANKS = 2
TRAIN = ("--zero-stage", "2", "--grad-accum", "2")
ALERTS = ("TrainingStepTimeRegression", "TrainingDataWaitHigh", "TrainingStragglerRank",
          "TrainingCollectiveBandwidthDrop", "TrainingGpuIdle", "TrainingGpuThrottled", "TrainingGpuEccErrors",
          "TrainingTelemetryDropped", "TrainingNumericsNonFinite", "TrainingNumericsAnomaly", "TrainingGpuOutOfMemory",
          "TrainingAllocatorCacheFlushes", "TrainingNoStepProgress")
# The model layer has three rows: the step's phases, loss and numerics, GPU memory.
LAYERS = ("Business", "Model", "Model", "Model", "Framework", "Hardware", "Host", "Telemetry")
# A window that holds many 1 s scrapes of a run of a minute, as Grafana's $__rate_interval would.
RATE_INTERVAL = "30s"
# Panels a CPU run cannot feed, and why; their queries must still execute.
NO_DATA_ON_CPU = {
    "Loss scale (fp16)": "DeepSpeed refuses fp16 on a CPU device, and the loss scale exists only with fp16",
    **dict.fromkeys(("Allocated and reserved", "Peak by phase", "Fragmentation (reserved minus allocated)",
                     "Allocator cache flushes and OOMs"), "PyTorch's caching allocator serves CUDA devices only"),
}


@dataclass
class Job:
    name: str
    id: str
    run: Run
    start: float = 0.0  # first and last instants at which both ranks were scraped
    end: float = 0.0


@dataclass
class Runs:
    prometheus: Prometheus
    jobs: dict[str, Job]


def _otlp(endpoint: str, timeout: str) -> dict[str, str]:
    """Traces and (besides Prometheus) metrics pushed over OTLP/HTTP, failing fast when nobody listens."""
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{endpoint}/v1/traces",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": timeout,
        "OTEL_BSP_SCHEDULE_DELAY": "500",
        "OTEL_METRICS_EXPORTER": "prometheus,otlp",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": f"{endpoint}/v1/metrics",
        "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": timeout,
        "OTEL_METRIC_EXPORT_INTERVAL": "2000",
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    directory = tmp_path_factory.mktemp("dashboards")
    names = ("healthy", "stall", "straggler")
    prometheus_port, dead_port = free_port(), free_port()
    bases = dict(zip(names, free_port_pairs(len(names), avoid={prometheus_port, dead_port}), strict=True))
    targets = [f"127.0.0.1:{base + rank}" for base in bases.values() for rank in range(RANKS)]
    prometheus = Prometheus.start(directory, targets, [str(RULES)], prometheus_port)
    dead = f"http://127.0.0.1:{dead_port}"  # nothing listens there: connections are refused at once
    plans = {
        # Loader workers, so that the DataLoader panels have someone to show. 300 steps: on a quiet
        # machine 80 trained in ~1.5 s, within one 2 s metric export, and the rate of exported metric
        # points (a counter that first appears after an export) had no two scrapes to compare.
        "healthy": (("--steps", "300", "--workers", "1"), None, {}),
        # The loader stalls on the main thread (no workers) every 2nd step; telemetry goes nowhere. 120 steps: its
        # first failed exports come seconds into the run, and a 60-step run (9 s) held TrainingTelemetryDropped
        # for 5 of its 9 s on one rank (CI, a loaded host), short of the share the rule manager's test asks.
        "stall": (("--steps", "120", "--stall-every", "2", "--stall-ms", "200"), dead, {}),
        # Rank 1 computes longer in each forward, on a GPU that NVML says is idle, hot and failing.
        "straggler": (("--steps", "60", "--slow-rank", "1", "--slow-ms", "100"), None,
                      {"FAKE_NVML_FAULTY_RANKS": "1"}),
    }
    jobs: dict[str, Job] = {}
    try:
        with OtlpReceiver() as receiver:
            for name, (arguments, endpoint, extra) in plans.items():
                job_id = f"dashboards-{name}-{uuid.uuid4().hex[:8]}"
                env = {
                    "PYTHONPATH": str(FAKE_NVML),
                    "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
                    "OTEL_EXPORTER_PROMETHEUS_PORT": str(bases[name]),
                    "OTEL_PYTHON_DEEPSPEED_PROMETHEUS_FINAL_SCRAPE_TIMEOUT": "15",
                    "OTEL_PYTHON_DEEPSPEED_JOB_ID": job_id,
                    # MFU needs a peak; a CPU has none the package knows.
                    "OTEL_PYTHON_DEEPSPEED_PEAK_FLOPS": "1e12",
                    # Profiling the step after a slow one would add its own slow steps to the fault runs.
                    "OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR": "0",
                    # The dead endpoint refuses at once: 1 s keeps its exporter from retrying for long.
                    # The receiver lives in this test's process: at a load of 17 on 2 cores it took
                    # over 1 s to answer, the healthy run counted exports as lost and raised
                    # TrainingTelemetryDropped. 10 s is the exporter's own default.
                    **_otlp(endpoint or receiver.endpoint, "1" if endpoint else "10"),
                    **extra,
                }
                workdir = directory / name
                workdir.mkdir()
                run = launch(workdir, "torchrun", *TRAIN, *arguments, env=env).check()
                jobs[name] = Job(name, job_id, run)
        until = time.time()
        for job in jobs.values():
            job.start, job.end = prometheus.live_window(job.id, RANKS, until)
        yield Runs(prometheus, jobs)
    finally:
        prometheus.stop()


# -- the files alone --------------------------------------------------------------------------------


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels() -> list[dict]:
    return [panel for panel in _dashboard()["panels"] if panel["type"] != "row"]


def test_rules_pass_promtool_check():
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in checked.stdout, checked.stdout


def test_a_config_loading_the_rules_passes_promtool_check(tmp_path):
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps(prometheus_config(["127.0.0.1:9464"], [str(RULES)])))
    checked = promtool("check", "config", str(config))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 1 rule files found" in checked.stdout, checked.stdout


def test_rule_unit_tests_pass():
    """for: semantics, both name spellings and the thresholds, on synthetic series (rules.test.yaml)."""
    tested = promtool("test", "rules", str(RULES_TEST))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout, tested.stdout


def test_every_panel_has_a_datasource_a_query_and_a_unit():
    dashboard = _dashboard()
    assert dashboard["schemaVersion"] >= 39
    panels = _panels()
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"]), "unique panel ids"
    for panel in panels:
        title = panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "prometheus"}, title
        assert panel["targets"], title
        for target in panel["targets"]:
            assert target["expr"].strip(), title
            assert target["datasource"]["uid"] == "prometheus", title
        assert panel["fieldConfig"]["defaults"]["unit"], title
    rows = [panel["title"] for panel in dashboard["panels"] if panel["type"] == "row"]
    assert [row.split(":")[0].split()[0] for row in rows] == list(LAYERS)
    (step_time,) = [panel for panel in panels if panel["title"].startswith("Step time p50")]
    assert [target["exemplar"] for target in step_time["targets"]] == [True, True, True]
    assert {variable["name"] for variable in dashboard["templating"]["list"]} == {"job", "host", "rank"}


def _links(dashboard: dict) -> list[dict]:
    links = list(dashboard["links"])
    for panel in dashboard["panels"]:
        links += panel.get("links", []) + panel.get("fieldConfig", {}).get("defaults", {}).get("links", [])
    return links


def test_trace_links_open_a_traceql_search_of_the_job_in_tempo():
    links = _links(_dashboard())
    assert len(links) >= 4
    values = {"job": "job-7", "__from": "1700000000000", "__to": "1700000600000", "__value.raw": "0.25",
              "__field.labels.training_rank": "3"}
    for link in links:
        url = urllib.parse.urlsplit(link["url"])
        assert url.path == "/explore", link
        # Grafana interpolates first (job ids go through percentencode), then the browser decodes.
        interpolated = link["url"].replace("${job:percentencode}", values["job"])
        for name, value in values.items():
            interpolated = interpolated.replace("${" + name + "}", value)
        assert "${" not in interpolated, link
        panes = json.loads(urllib.parse.parse_qs(urllib.parse.urlsplit(interpolated).query)["panes"][0])
        (pane,) = panes.values()
        (query,) = pane["queries"]
        assert pane["datasource"] == "tempo" and query["datasource"] == {"type": "tempo", "uid": "tempo"}, link
        assert query["queryType"] == "traceql"
        assert query["query"].startswith('{ resource.training.job.id = "job-7" && ')
        assert ' && name = "training.' in query["query"] and query["query"].endswith(" }"), query
        assert pane["range"] == {"from": values["__from"], "to": values["__to"]}
    queries = [link["url"] for link in links]
    assert any("duration%20%3E%20${__value.raw}s" in url for url in queries), "a link to steps slower than a point"


# -- against the runs ---------------------------------------------------------------------------------


def _variables(job: Job, runs: Runs) -> dict[str, str]:
    (host,) = runs.prometheus.label_values("host_name", f'target_info{{training_job_id="{job.id}"}}',
                                           job.start, job.end)
    return {"job": job.id, "host": host, "rank": "(0|1)", "__rate_interval": RATE_INTERVAL,
            "__interval": "2s", "__range": f"{max(1, round(job.end - job.start))}s"}


@pytest.mark.slow
def test_template_variables_list_the_runs_values(runs):
    healthy = runs.jobs["healthy"]
    values = _variables(healthy, runs)
    start, end = min(job.start for job in runs.jobs.values()), max(job.end for job in runs.jobs.values())
    found = {}
    for variable in _dashboard()["templating"]["list"]:
        selector, label = label_values_query(variable["query"]["query"])
        assert variable["definition"] == variable["query"]["query"]
        assert variable["datasource"]["uid"] == "prometheus"
        found[variable["name"]] = runs.prometheus.label_values(label, substitute(selector, values), start, end)
    assert set(found["job"]) == {job.id for job in runs.jobs.values()}
    assert found["host"] == [socket.gethostname()]
    assert found["rank"] == ["0", "1"]


@pytest.mark.slow
def test_every_panel_query_returns_data_for_the_healthy_run(runs):
    healthy = runs.jobs["healthy"]
    values = _variables(healthy, runs)
    empty, unfiltered = [], []
    for panel in _panels():
        for target in panel["targets"]:
            name = f"{panel['title']} [{target['refId']}]"
            promql = substitute(target["expr"], values)
            data = [s for s in runs.prometheus.range(promql, healthy.start, healthy.end, 2) if finite(s["values"])]
            if panel["title"] in NO_DATA_ON_CPU:
                assert not data, f"{name} has data now: drop it from NO_DATA_ON_CPU"
            elif not data:
                empty.append(f"{name}: {promql}")
            # The job variable reaches every query: another job's selection shows nothing of this one.
            other = substitute(target["expr"], {**values, "job": "no-such-job"})
            if any(finite(s["values"]) for s in runs.prometheus.range(other, healthy.start, healthy.end, 2)):
                unfiltered.append(name)
    assert not empty, "panels without data:\n" + "\n".join(empty)
    assert not unfiltered, f"panels that ignore $job: {unfiltered}"


def _rules(runs: Runs) -> dict[str, dict]:
    groups = runs.prometheus.api("rules")["groups"]
    return {rule["name"]: rule for group in groups for rule in group["rules"]}


@pytest.mark.slow
def test_every_rule_loads_and_evaluates_cleanly(runs):
    rules = _rules(runs)
    assert sorted(rules) == sorted(ALERTS)
    for name, rule in rules.items():
        assert rule["type"] == "alerting", name
        assert rule["health"] == "ok" and not rule.get("lastError"), (name, rule.get("lastError"))
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["labels"]["layer"] in ("business", "model", "framework", "hardware", "telemetry"), name
        assert rule["annotations"]["summary"] and "$labels" in rule["annotations"]["description"], name


def _alert(runs: Runs, name: str, job: Job) -> list[dict]:
    """The alert's expression at the last instant the job's ranks were up, for that job only."""
    query = _rules(runs)[name]["query"]
    return [s for s in runs.prometheus.instant(query, job.end) if s["metric"].get("training_job_id") == job.id]


def _ranks(series: list[dict]) -> set[str]:
    return {s["metric"]["training_rank"] for s in series}


@pytest.mark.slow
def test_data_wait_alert_fires_for_the_stalling_loader_only(runs):
    (stall,) = _alert(runs, "TrainingDataWaitHigh", runs.jobs["stall"])
    assert stall["value"] > 0.25
    for name in ("healthy", "straggler"):
        assert _alert(runs, "TrainingDataWaitHigh", runs.jobs[name]) == [], name


@pytest.mark.slow
def test_straggler_alert_names_the_slow_rank(runs):
    straggler = _alert(runs, "TrainingStragglerRank", runs.jobs["straggler"])
    assert _ranks(straggler) == {"1"}
    assert straggler[0]["metric"]["host_name"] == socket.gethostname()
    for name in ("healthy", "stall"):
        assert _alert(runs, "TrainingStragglerRank", runs.jobs[name]) == [], name


@pytest.mark.slow
def test_dropped_telemetry_alert_fires_for_the_dead_endpoint(runs):
    dropped = _alert(runs, "TrainingTelemetryDropped", runs.jobs["stall"])
    assert _ranks(dropped) == {"0", "1"}, dropped
    assert all(s["metric"]["error_type"] for s in dropped)
    for name in ("healthy", "straggler"):
        assert _alert(runs, "TrainingTelemetryDropped", runs.jobs[name]) == [], name


@pytest.mark.slow
def test_gpu_alerts_fire_for_the_sick_gpu_only(runs):
    sick = runs.jobs["straggler"]
    assert _ranks(_alert(runs, "TrainingGpuIdle", sick)) == {"1"}
    throttled = _alert(runs, "TrainingGpuThrottled", sick)
    assert {(s["metric"]["training_rank"], s["metric"]["nvidia_gpu_throttle_reason"]) for s in throttled} == {
        ("1", "hw_thermal_slowdown"), ("1", "hw_power_brake_slowdown")}
    (ecc,) = _alert(runs, "TrainingGpuEccErrors", sick)
    assert ecc["metric"]["training_rank"] == "1" and ecc["value"] >= 1
    assert ecc["metric"]["hw_id"].startswith("GPU-")
    for name in ("healthy", "stall"):
        for alert in ("TrainingGpuIdle", "TrainingGpuThrottled", "TrainingGpuEccErrors"):
            assert _alert(runs, alert, runs.jobs[name]) == [], (name, alert)


@pytest.mark.slow
def test_baseline_alerts_stay_quiet_on_steady_runs(runs):
    """A run shorter than the windows has no baseline to regress from: these fire in rules.test.yaml."""
    for job in runs.jobs.values():
        for alert in ("TrainingStepTimeRegression", "TrainingCollectiveBandwidthDrop"):
            assert _alert(runs, alert, job) == [], (job.name, alert)
    # Their building blocks do see the runs: the recent and the run-long bandwidth of every op agree.
    healthy = runs.jobs["healthy"]
    ratio = runs.prometheus.instant(
        f"""sum by (comm_op) (rate(training_comm_bus_size_bytes_total[10m]) * on (job, instance) group_left
              target_info{{training_job_id="{healthy.id}"}})
            / sum by (comm_op) (rate(training_comm_duration_seconds_sum[10m]) * on (job, instance) group_left
              target_info{{training_job_id="{healthy.id}"}})""", healthy.end)
    assert {s["metric"]["comm_op"] for s in ratio} >= {"all_reduce"}
    assert all(s["value"] > 0 and math.isfinite(s["value"]) for s in ratio), ratio


@pytest.mark.slow
def test_the_rule_manager_raised_the_alerts_while_the_runs_trained(runs):
    """Prometheus's own evaluations, every second of the runs: pending, or firing for a rule without for:.

    In a run's first seconds a rate rests on two samples and may cross a threshold for a moment (what
    `for:` is for): other jobs and ranks may show such a blip, the faulty one must hold the alert.
    """
    def evaluations(alert: str) -> dict[tuple[str, str], float]:
        series = runs.prometheus.instant(
            f'sum by (training_job_id, training_rank) (count_over_time(ALERTS{{alertname="{alert}"}}[30m]))',
            time.time())
        return {(s["metric"]["training_job_id"], s["metric"].get("training_rank", "")): s["value"] for s in series}

    live = {job.id: job.end - job.start + 1 for job in runs.jobs.values()}
    stall, straggler = runs.jobs["stall"].id, runs.jobs["straggler"].id
    expected = {
        "TrainingDataWaitHigh": {(stall, "")},
        "TrainingStragglerRank": {(straggler, "1")},
        "TrainingGpuIdle": {(straggler, "1")},
        "TrainingGpuThrottled": {(straggler, "1")},
        "TrainingGpuEccErrors": {(straggler, "1")},
        "TrainingTelemetryDropped": {(stall, "0"), (stall, "1")},
        # Healthy, stalling and straggling runs have sound numerics: no model alert, not even for a moment.
        "TrainingNumericsNonFinite": set(),
        "TrainingNumericsAnomaly": set(),
    }
    for alert, holders in expected.items():
        counts = evaluations(alert)
        for holder in holders:
            assert counts.get(holder, 0) >= 0.6 * live[holder[0]], (alert, holder, counts)
        blips = {key: count for key, count in counts.items() if key not in holders and count > 0.25 * live[key[0]]}
        assert not blips, (alert, blips)


@pytest.mark.slow
def test_an_expression_error_is_reported_not_swallowed(runs):
    """The helpers fail on a broken query: an empty answer above means no series, not an error."""
    with pytest.raises(PrometheusError):
        runs.prometheus.instant("sum(rate(training_samples_total[1m]) +", runs.jobs["healthy"].end)
