"""collector-config/: the Collector configurations and the local stack, checked without running them.

No Collector binary or Docker daemon is available where the tests run, so these checks stand in for
`otelcol validate` and `docker compose config`, and go further where files must agree with each
other (endpoints and services, mounts and paths, datasource uids and dashboards) or with the
telemetry contract in docs/telemetry.md. The stack's Prometheus configuration does run through
`promtool check config`, with the project's rules.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from opentelemetry_instrumentation_deepspeed.diagnose.reader import ReadStats, read_spans

REPO = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO / "collector-config"
STACK = CONFIG_DIR / "stack"
COMPOSE = STACK / "docker-compose.yaml"
README = CONFIG_DIR / "README.md"
CONTRACT = REPO / "docs" / "telemetry.md"

COLLECTOR_CONFIGS = ("basic.yaml", "agent.yaml", "gateway.yaml", "stack/otel-collector.yaml")

# Component types (the part of an id before "/") of the official contrib distribution, each with the
# Go module that provides it, as listed in open-telemetry/opentelemetry-collector-releases,
# distributions/otelcol-contrib/manifest.yaml, release 0.136.0 (components at v0.136.0): the image
# docker-compose.yaml pins. Only the components these configurations use or mention; extend it
# from the same manifest, never from memory.
CONTRIB_0_136_0 = {
    "receivers": {
        "otlp": "otlpreceiver",
    },
    "processors": {
        "memory_limiter": "memorylimiterprocessor",
        "batch": "batchprocessor",
        "resourcedetection": "resourcedetectionprocessor",
        "k8sattributes": "k8sattributesprocessor",
        "tail_sampling": "tailsamplingprocessor",
        "filter": "filterprocessor",
        "transform": "transformprocessor",
        "resource": "resourceprocessor",
        "deltatocumulative": "deltatocumulativeprocessor",
    },
    "exporters": {
        "otlp": "otlpexporter",
        "otlphttp": "otlphttpexporter",
        "debug": "debugexporter",
        "file": "fileexporter",
        "loadbalancing": "loadbalancingexporter",
        "prometheusremotewrite": "prometheusremotewriteexporter",
    },
    "connectors": {
        "spanmetrics": "spanmetricsconnector",
        "forward": "forwardconnector",
    },
    "extensions": {
        "health_check": "healthcheckextension",
        "pprof": "pprofextension",
        "zpages": "zpagesextension",
        "bearertokenauth": "bearertokenauthextension",
    },
}

# (signal a connector consumes as an exporter, signal it emits as a receiver); None: the same one.
CONNECTOR_SIGNALS = {"spanmetrics": ("traces", "metrics"), "forward": None}

# Defined but in no pipeline, deliberately: it fails the Collector's start off Kubernetes, so
# agent.yaml ships it ready to be added (its comment says how).
UNUSED_ON_PURPOSE = {("agent.yaml", "processors", "k8sattributes")}

SIGNALS = ("traces", "metrics", "logs")
ENV_REFERENCE = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
COMPOSE_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-[^}]*)?\}")
# Datasource uids Grafana itself provides.
GRAFANA_BUILTIN_UIDS = {"grafana", "-- Grafana --", "-- Mixed --", "-- Dashboard --"}


def _yaml_files() -> list[Path]:
    return sorted(p for p in CONFIG_DIR.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())


@functools.cache
def _load(path: Path):
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _collector(name: str) -> dict:
    return _load(CONFIG_DIR / name)


def _type(component_id: str) -> str:
    return component_id.split("/", 1)[0]


def _pipelines(config: dict) -> dict:
    return config["service"]["pipelines"]


def _default(value: str) -> str:
    """The value a ``${env:NAME:-default}`` setting takes when NAME is unset."""
    match = ENV_REFERENCE.fullmatch(value)
    return match.group(2) if match else value


@functools.cache
def _compose() -> dict:
    return _load(COMPOSE)


def _mounts(service: str) -> list[tuple[str, str]]:
    """(source, target) of a compose service's volumes, short syntax."""
    mounts = []
    for volume in _compose()["services"][service].get("volumes", []):
        source, target = volume.split(":")[:2]
        mounts.append((source, target))
    return mounts


def _mount_target(service: str, source: str) -> str:
    targets = [target for src, target in _mounts(service) if src == source]
    assert len(targets) == 1, f"{service} should mount {source} once: {_mounts(service)}"
    return targets[0]


def _host_port(endpoint: str) -> tuple[str, int]:
    endpoint = re.sub(r"^[a-z]+://", "", endpoint).split("/", 1)[0]
    host, port = endpoint.rsplit(":", 1)
    return host, int(port)


# ---- every file parses ----

@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_yaml_parses(path):
    documents = [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc is not None]
    assert documents and all(isinstance(doc, dict) for doc in documents), f"{path}: not a YAML mapping"


def test_every_collector_config_is_checked():
    found = {str(p.relative_to(CONFIG_DIR)) for p in _yaml_files()
             if isinstance(_load(p), dict) and {"receivers", "service"} <= set(_load(p))}
    assert found == set(COLLECTOR_CONFIGS)


# ---- Collector configurations ----

@pytest.mark.parametrize("name", COLLECTOR_CONFIGS)
def test_pipelines_name_defined_components(name):
    config = _collector(name)
    connectors = set(config.get("connectors") or {})
    for pipeline, spec in _pipelines(config).items():
        assert _type(pipeline) in SIGNALS, f"{name}: pipeline {pipeline}"
        assert spec.get("receivers") and spec.get("exporters"), f"{name}: {pipeline} needs receivers and exporters"
        for section in ("receivers", "processors", "exporters"):
            defined = set(config.get(section) or {}) | (connectors if section != "processors" else set())
            for component in spec.get(section) or ():
                assert component in defined, f"{name}: {pipeline} names {section[:-1]} {component}, not defined"
    for extension in config["service"].get("extensions", ()):
        assert extension in (config.get("extensions") or {}), f"{name}: extension {extension} not defined"


@pytest.mark.parametrize("name", COLLECTOR_CONFIGS)
def test_every_defined_component_is_used(name):
    config = _collector(name)
    used = {section: set() for section in ("receivers", "processors", "exporters", "connectors")}
    for spec in _pipelines(config).values():
        for section in ("receivers", "processors", "exporters"):
            used[section].update(spec.get(section) or ())
    used["connectors"] = (used["receivers"] | used["exporters"]) & set(config.get("connectors") or {})
    used["extensions"] = set(config["service"].get("extensions", ()))
    for section, components in used.items():
        for component in config.get(section) or {}:
            if (name, section, component) not in UNUSED_ON_PURPOSE:
                assert component in components, f"{name}: {section[:-1]} {component} is defined but unused"
    for file_name, section, component in UNUSED_ON_PURPOSE:
        if file_name == name:
            assert component in (config.get(section) or {}), f"stale UNUSED_ON_PURPOSE entry {component}"


@pytest.mark.parametrize("name", COLLECTOR_CONFIGS)
def test_component_types_are_in_the_contrib_distribution(name):
    config = _collector(name)
    for section, known in CONTRIB_0_136_0.items():
        for component in config.get(section) or {}:
            assert _type(component) in known, f"{name}: {section[:-1]} {component}: type not in contrib 0.136.0"


@pytest.mark.parametrize("name", COLLECTOR_CONFIGS)
def test_connectors_join_the_right_signals(name):
    config = _collector(name)
    for connector in config.get("connectors") or {}:
        into = {_type(p) for p, spec in _pipelines(config).items() if connector in (spec.get("exporters") or ())}
        out_of = {_type(p) for p, spec in _pipelines(config).items() if connector in (spec.get("receivers") or ())}
        expected = CONNECTOR_SIGNALS[_type(connector)]
        assert into and out_of, f"{name}: connector {connector} must end one pipeline and start another"
        if expected is None:
            assert into == out_of, f"{name}: {connector} joins {into} to {out_of}"
        else:
            assert (into, out_of) == ({expected[0]}, {expected[1]}), f"{name}: {connector} joins {into} to {out_of}"


@pytest.mark.parametrize("name", COLLECTOR_CONFIGS)
def test_memory_limiter_first_and_batch_last(name):
    for pipeline, spec in _pipelines(_collector(name)).items():
        processors = [_type(p) for p in spec.get("processors") or ()]
        assert processors and processors[0] == "memory_limiter", f"{name}: {pipeline} starts with {processors}"
        if "batch" in processors:
            assert processors[-1] == "batch", f"{name}: {pipeline}: batch must come last, after {processors}"


@pytest.mark.parametrize("name", COLLECTOR_CONFIGS)
def test_otlp_receivers_listen_on_every_interface(name):
    # Since 0.104 an endpoint left out binds localhost: unreachable from ranks on other hosts.
    for receiver, settings in _collector(name)["receivers"].items():
        if _type(receiver) == "otlp":
            protocols = settings["protocols"]
            assert set(protocols) == {"grpc", "http"}
            assert protocols["grpc"]["endpoint"] == "0.0.0.0:4317"
            assert protocols["http"]["endpoint"] == "0.0.0.0:4318"


@pytest.mark.parametrize("name", COLLECTOR_CONFIGS)
def test_every_signal_the_ranks_send_is_accepted(name):
    # With an OTLP endpoint the distro sets OTLP exporters for traces, metrics and logs; a signal
    # with no pipeline is refused (gRPC "unimplemented"), and the rank logs export errors.
    pipelines = _pipelines(_collector(name))
    for signal in SIGNALS:
        assert any(_type(p) == signal and "otlp" in spec["receivers"] for p, spec in pipelines.items()), \
            f"{name}: nothing receives OTLP {signal}"


def test_agent_routes_whole_steps_to_one_gateway():
    agent = _collector("agent.yaml")
    assert agent["exporters"]["loadbalancing"]["routing_key"] == "traceID"
    traces = _pipelines(agent)["traces"]
    assert traces["exporters"] == ["loadbalancing"]
    assert not any(_type(p) == "tail_sampling" for spec in _pipelines(agent).values()
                   for p in spec.get("processors") or ())
    metrics_exporter = _pipelines(agent)["metrics"]["exporters"]
    assert metrics_exporter == ["otlp/gateway"]
    host = _default(agent["exporters"]["loadbalancing"]["resolver"]["dns"]["hostname"])
    assert agent["exporters"]["otlp/gateway"]["endpoint"].startswith(f"dns:///${{env:GATEWAY_HOSTNAME:-{host}}}")


@pytest.mark.parametrize("name", COLLECTOR_CONFIGS)
def test_span_metrics_see_every_span(name):
    # Sampled input would undercount every rate; and on the gateway, whose replicas each see some
    # steps only, replicas would write colliding series.
    config = _collector(name)
    for pipeline, spec in _pipelines(config).items():
        if any(_type(e) == "spanmetrics" for e in spec["exporters"]):
            assert not any(_type(p) == "tail_sampling" for p in spec.get("processors") or ()), f"{name}: {pipeline}"
    if name == "gateway.yaml":
        assert not any(_type(c) == "spanmetrics" for c in config.get("connectors") or {})


@pytest.mark.parametrize("name", ["gateway.yaml", "stack/otel-collector.yaml"])
def test_tail_sampling_policies(name):
    config = _collector(name)
    sampling = config["processors"]["tail_sampling"]
    policies = {policy["type"]: policy for policy in sampling["policies"]}
    assert set(policies) == {"status_code", "latency", "boolean_attribute", "string_attribute", "probabilistic"}
    assert policies["status_code"]["status_code"]["status_codes"] == ["ERROR"]
    assert policies["latency"]["latency"]["threshold_ms"].startswith("${env:SLOW_STEP_THRESHOLD_MS:-")
    assert policies["boolean_attribute"]["boolean_attribute"] == {"key": "training.step.skipped", "value": True}
    assert policies["probabilistic"]["probabilistic"]["sampling_percentage"].startswith(
        "${env:BASELINE_SAMPLING_PERCENT:-")
    assert int(_default(policies["latency"]["latency"]["threshold_ms"])) > 0
    assert 0 < float(_default(policies["probabilistic"]["probabilistic"]["sampling_percentage"])) <= 100
    # Every span of a step must be in before the decision: well beyond the SDK's 5 s export delay.
    wait = _default(sampling["decision_wait"])
    assert re.fullmatch(r"\d+s", wait) and int(wait[:-1]) >= 15
    sampled = [p for p, spec in _pipelines(config).items() if "tail_sampling" in (spec.get("processors") or ())]
    assert sampled == ["traces"]


def _contract_attributes(config: dict) -> set[str]:
    """Span attribute names the configuration relies on."""
    names = set()
    for policy in (config.get("processors") or {}).get("tail_sampling", {}).get("policies", ()):
        settings = policy.get(policy["type"])
        if isinstance(settings, dict) and "key" in settings:
            names.add(settings["key"])
    for connector, settings in (config.get("connectors") or {}).items():
        if _type(connector) == "spanmetrics":
            names.update(dimension["name"] for dimension in settings.get("dimensions", ()))
    for processor, settings in (config.get("processors") or {}).items():
        if _type(processor) == "filter":
            for condition in settings["traces"]["span"]:
                names.update(re.findall(r'attributes\["([^"]+)"\]', condition))
    return names


@pytest.mark.parametrize("name", COLLECTOR_CONFIGS)
def test_attributes_relied_on_are_in_the_telemetry_contract(name):
    contract = CONTRACT.read_text(encoding="utf-8")
    config = _collector(name)
    for attribute in _contract_attributes(config):
        assert f"`{attribute}`" in contract, f"{name}: {attribute} is not in docs/telemetry.md"
    for policy in (config.get("processors") or {}).get("tail_sampling", {}).get("policies", ()):
        for value in (policy.get("string_attribute") or {}).get("values", ()):
            assert f"`{value}`" in contract, f"{name}: value {value} of {policy['name']} is not in docs/telemetry.md"


def test_contract_check_sees_the_policies():
    assert {"training.step.skipped", "profile.kind", "comm.op"} <= _contract_attributes(_collector("gateway.yaml"))\
        | _contract_attributes(_collector("agent.yaml"))


@pytest.mark.parametrize("name", COLLECTOR_CONFIGS)
def test_remote_write_keeps_the_names_the_dashboards_use(name):
    for exporter, settings in _collector(name)["exporters"].items():
        if _type(exporter) == "prometheusremotewrite":
            assert settings["add_metric_suffixes"] is True
            assert settings["target_info"] == {"enabled": True}
            assert settings["resource_to_telemetry_conversion"] == {"enabled": False}
            assert _default(settings["endpoint"]).endswith("/api/v1/write")


# The agent forwards everything to the gateways, which write the file.
@pytest.mark.parametrize("name", [name for name in COLLECTOR_CONFIGS if name != "agent.yaml"])
def test_file_exporter_writes_json_lines(name):
    # diagnose reads one JSON object per line: proto or compressed output would be unreadable.
    files = {e: s for e, s in _collector(name)["exporters"].items() if _type(e) == "file"}
    assert files, f"{name}: no file exporter"
    for settings in files.values():
        assert settings.get("format", "json") == "json" and "compression" not in settings
        assert _default(settings["path"]).endswith(".jsonl")


def test_diagnose_reads_the_collector_file_exporter_format(tmp_path):
    # As the Collector's JSON marshaler writes them: ids in hex, 64-bit integers as strings, span
    # kind as a number, empty fields left out; and a rotated file beside the live one.
    resource = {"attributes": [{"key": "service.name", "value": {"stringValue": "train"}},
                               {"key": "training.job.id", "value": {"stringValue": "job-7"}},
                               {"key": "training.rank", "value": {"intValue": "1"}}]}
    span = {"traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174",
            "parentSpanId": "eee19b7ec3c1b173", "flags": 257, "name": "training.step", "kind": 1,
            "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": "1700000000250000000",
            "attributes": [{"key": "training.step", "value": {"intValue": "12"}},
                           {"key": "training.step.skipped", "value": {"boolValue": True}}],
            "status": {}}
    traces = {"resourceSpans": [{"resource": resource, "scopeSpans": [
        {"scope": {"name": "opentelemetry_instrumentation_deepspeed", "version": "0.1.0"}, "spans": [span]}]}]}
    metrics = {"resourceMetrics": [{"resource": resource, "scopeMetrics": [{"scope": {"name": "gpu"}, "metrics": [
        {"name": "hw.gpu.utilization", "unit": "1", "gauge": {"dataPoints": [
            {"timeUnixNano": "1700000000100000000", "asDouble": 0.75,
             "attributes": [{"key": "hw.id", "value": {"stringValue": "GPU-1"}}]}]}}]}]}]}
    (tmp_path / "training.jsonl").write_text(json.dumps(traces, separators=(",", ":")) + "\n", encoding="utf-8")
    (tmp_path / "training-2025-01-01T00-00-00.000.jsonl").write_text(
        json.dumps(metrics, separators=(",", ":")) + "\n", encoding="utf-8")
    stats = ReadStats()
    spans = list(read_spans([str(tmp_path)], stats))
    assert stats.files == 2 and stats.bad_lines == 0
    assert len(spans) == 1
    assert (spans[0].job, spans[0].rank, spans[0].name) == ("job-7", 1, "training.step")
    assert spans[0].attributes == {"training.step": 12, "training.step.skipped": True}
    assert spans[0].seconds == pytest.approx(0.25)
    assert [(s.rank, s.metric, s.value) for s in stats.samples] == [(1, "hw.gpu.utilization", 0.75)]


# ---- documentation ----

def test_environment_variables_are_documented():
    readme = README.read_text(encoding="utf-8")
    names = set()
    for path in _yaml_files():
        names.update(match.group(1) for match in ENV_REFERENCE.finditer(path.read_text(encoding="utf-8")))
    names.update(COMPOSE_REFERENCE.findall(COMPOSE.read_text(encoding="utf-8")))
    assert {"GATEWAY_HOSTNAME", "TEMPO_OTLP_ENDPOINT", "HOST_UID"} <= names
    undocumented = sorted(name for name in names if f"`{name}`" not in readme)
    assert not undocumented, f"not in collector-config/README.md: {undocumented}"


def test_compose_passes_only_documented_variables_to_the_collector():
    collector_env = set(_compose()["services"]["otel-collector"].get("environment", []))
    used = set(ENV_REFERENCE.findall((STACK / "otel-collector.yaml").read_text(encoding="utf-8")))
    assert collector_env and collector_env <= {name for name, _ in used}


# ---- the compose stack ----

def test_compose_images_are_pinned():
    for service, spec in _compose()["services"].items():
        image = spec["image"]
        assert ":" in image and not image.endswith(":latest"), f"{service}: {image}"
    assert _compose()["services"]["otel-collector"]["image"] == "otel/opentelemetry-collector-contrib:0.136.0"


def test_compose_mounts_exist_in_the_repository():
    named = set(_compose().get("volumes") or {})
    ignored = []
    for service in _compose()["services"]:
        for source, _target in _mounts(service):
            if source.startswith((".", "/")):
                path = (STACK / source).resolve()
                assert path.exists(), f"{service} mounts {source}, missing"
                assert CONFIG_DIR in path.parents or path == CONFIG_DIR, f"{service} mounts {source} outside"
                ignored.append(path)
            else:
                assert source in named, f"{service}: volume {source} is not declared"
    # A mount source git ignores is absent from a fresh clone, and Docker would create it as root.
    if shutil.which("git") and (REPO / ".git").exists():
        checked = subprocess.run(["git", "check-ignore", *map(str, ignored)], cwd=REPO,
                                 capture_output=True, text=True, check=False)
        assert checked.stdout.strip() == "", f"git ignores mounted paths: {checked.stdout}"


def test_stack_collector_runs_the_mounted_config():
    service = _compose()["services"]["otel-collector"]
    target = _mount_target("otel-collector", "./otel-collector.yaml")
    assert service["command"] == [f"--config={target}"]
    ports = {int(p.split(":")[0]) for p in service["ports"]}
    assert {4317, 4318} <= ports
    # The file exporter writes into the mounted directory, which is on the host.
    file_path = _default(_collector("stack/otel-collector.yaml")["exporters"]["file"]["path"])
    output_dir = _mount_target("otel-collector", "./collector-output")
    assert Path(file_path).parent == Path(output_dir)


def test_stack_collector_exports_to_the_stack_services():
    services = _compose()["services"]
    exporters = _collector("stack/otel-collector.yaml")["exporters"]
    tempo = _load(STACK / "tempo.yaml")
    tempo_grpc = _host_port(tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])
    assert _host_port(_default(exporters["otlp/tempo"]["endpoint"])) == ("tempo", tempo_grpc[1])
    assert _host_port(_default(exporters["otlp/jaeger"]["endpoint"])) == ("jaeger", 4317)
    host, port = _host_port(_default(exporters["prometheusremotewrite"]["endpoint"]))
    assert (host, port) == ("prometheus", 9090) and host in services
    command = services["prometheus"]["command"]
    assert "--web.enable-remote-write-receiver" in command and "--enable-feature=exemplar-storage" in command
    # The same defaults as the gateway: the stack is the gateway on one machine.
    gateway = _collector("gateway.yaml")["exporters"]
    for exporter in ("otlp/tempo", "otlp/jaeger", "prometheusremotewrite"):
        assert gateway[exporter]["endpoint"] == exporters[exporter]["endpoint"]


def test_tempo_listens_for_the_collector_and_stores_on_its_volume():
    tempo = _load(STACK / "tempo.yaml")
    protocols = tempo["distributor"]["receivers"]["otlp"]["protocols"]
    assert all(settings["endpoint"].startswith("0.0.0.0:") for settings in protocols.values())
    data = _mount_target("tempo", "tempo-data")
    assert _mount_target("tempo-init", "tempo-data") == data
    storage = tempo["storage"]["trace"]
    for path in (storage["wal"]["path"], storage["local"]["path"]):
        assert Path(data) in Path(path).parents
    assert _mount_target("tempo", "./tempo.yaml") in " ".join(_compose()["services"]["tempo"]["command"])
    published = {int(p.split(":")[0]) for p in _compose()["services"]["tempo"]["ports"]}
    assert tempo["server"]["http_listen_port"] in published


def test_prometheus_loads_the_mounted_rules_and_scrapes_stack_services():
    config = _load(STACK / "prometheus.yaml")
    rules_dir = _mount_target("prometheus", "../prometheus")
    # Named, not globbed: the promtool unit tests (rules.test.yaml) sit in the same directory.
    assert config["rule_files"] == [f"{rules_dir}/rules.yaml"]
    config_target = _mount_target("prometheus", "./prometheus.yaml")
    assert f"--config.file={config_target}" in _compose()["services"]["prometheus"]["command"]
    collector_port = _collector("stack/otel-collector.yaml")["service"]["telemetry"]["metrics"]["readers"][0]
    expected = {"otel-collector": collector_port["pull"]["exporter"]["prometheus"]["port"], "tempo": 3200}
    for job in config["scrape_configs"]:
        for target in (t for group in job["static_configs"] for t in group["targets"]):
            host, port = _host_port(target)
            assert host == "localhost" or host in _compose()["services"], f"scrape target {target}"
            if host in expected:
                assert port == expected[host], f"scrape target {target}"


def test_stack_prometheus_config_passes_promtool(tmp_path):
    promtool = shutil.which("promtool") or ("/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None)
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    # The rules live at /etc/prometheus/rules only inside the container: check them from a copy.
    rules = tmp_path / "rules"
    rules.mkdir()
    for path in (CONFIG_DIR / "prometheus").glob("*.yaml"):
        shutil.copy(path, rules)
    config = _load(STACK / "prometheus.yaml")
    copied = [str(rules / Path(name).name) for name in config["rule_files"]]
    config = {**config, "rule_files": copied}
    (tmp_path / "prometheus.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    checked = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yaml")],
                             capture_output=True, text=True, timeout=60, check=False)
    output = checked.stdout + checked.stderr
    assert checked.returncode == 0, output
    assert output.count("rules found") == len(copied), output


# ---- Grafana ----

@functools.cache
def _datasources() -> dict:
    provisioning = _load(STACK / "grafana" / "datasources.yaml")
    return {source["uid"]: source for source in provisioning["datasources"]}


def _dashboard_uids(node) -> set[str]:
    """Literal datasource uids a dashboard names (variables such as ${DS} are resolved by Grafana)."""
    uids = set()
    if isinstance(node, dict):
        source = node.get("datasource")
        if isinstance(source, dict) and isinstance(source.get("uid"), str):
            uids.add(source["uid"])
        for value in node.values():
            uids |= _dashboard_uids(value)
    elif isinstance(node, list):
        for value in node:
            uids |= _dashboard_uids(value)
    return {uid for uid in uids if not uid.startswith("$")}


def test_grafana_datasources_have_fixed_uids_and_link_each_other():
    sources = _datasources()
    assert {uid: s["type"] for uid, s in sources.items()} == {"prometheus": "prometheus", "tempo": "tempo",
                                                               "jaeger": "jaeger"}
    prometheus = sources["prometheus"]["jsonData"]
    assert prometheus["exemplarTraceIdDestinations"] == [{"name": "trace_id", "datasourceUid": "tempo"}]
    for uid in ("tempo", "jaeger"):
        assert sources[uid]["jsonData"]["tracesToMetrics"]["datasourceUid"] in sources
    assert sources["tempo"]["jsonData"]["serviceMap"]["datasourceUid"] in sources
    for source in sources.values():
        host, _ = _host_port(source["url"])
        assert host in _compose()["services"], source["url"]
    assert _host_port(sources["tempo"]["url"])[1] == _load(STACK / "tempo.yaml")["server"]["http_listen_port"]


def test_grafana_provisioning_escapes_query_variables():
    # Grafana expands $NAME in provisioning files; a query's $__tags must be written $$__tags.
    def strings(node):
        if isinstance(node, dict):
            return [s for value in node.values() for s in strings(value)]
        if isinstance(node, list):
            return [s for value in node for s in strings(value)]
        return [node] if isinstance(node, str) else []

    values = strings(_load(STACK / "grafana" / "datasources.yaml"))
    assert any("{$$__tags}" in value for value in values)
    unescaped = [value for value in values if "$" in value.replace("$$", "")]
    assert not unescaped, f"unescaped $ in datasources.yaml: {unescaped}"


def test_grafana_provisioning_is_mounted_where_grafana_reads_it():
    assert _mount_target("grafana", "./grafana/datasources.yaml").startswith("/etc/grafana/provisioning/datasources/")
    assert _mount_target("grafana", "./grafana/dashboards.yaml").startswith("/etc/grafana/provisioning/dashboards/")
    provider = _load(STACK / "grafana" / "dashboards.yaml")["providers"][0]
    assert provider["options"]["path"] == _mount_target("grafana", "../dashboards")


def test_dashboards_use_provisioned_datasource_uids():
    dashboards = sorted((CONFIG_DIR / "dashboards").glob("*.json"))
    assert dashboards, "collector-config/dashboards/ has no dashboard"
    provisioned = set(_datasources()) | GRAFANA_BUILTIN_UIDS
    named = set()
    for path in dashboards:
        uids = _dashboard_uids(json.loads(path.read_text(encoding="utf-8")))
        assert uids <= provisioned, f"{path.name} names datasources {sorted(uids - provisioned)}"
        named |= uids
    assert "prometheus" in named


def test_dashboard_uid_walk_finds_nested_references():
    dashboard = {"panels": [{"type": "row", "panels": [{"datasource": {"type": "prometheus", "uid": "prom-x"},
                                                          "targets": [{"datasource": {"uid": "tempo"}}]}]}],
                 "templating": {"list": [{"datasource": {"uid": "${DS}"}}]}}
    assert _dashboard_uids(dashboard) == {"prom-x", "tempo"}
