"""A real Prometheus on loopback for the dashboard and alerting-rule tests, and PromQL helpers."""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO, free_port

RULES = REPO / "collector-config" / "prometheus" / "rules.yaml"
RULES_TEST = REPO / "collector-config" / "prometheus" / "rules.test.yaml"
DASHBOARD = REPO / "collector-config" / "dashboards" / "training.json"
FAKE_NVML = REPO / "tests" / "fake_nvml"


def free_port_pairs(count: int, avoid: set[int]) -> list[int]:
    """``count`` free ports whose successors are free too (rank r listens on base + r), all distinct."""
    bases: list[int] = []
    taken = set(avoid)
    while len(bases) < count:
        port = free_port()
        if {port, port + 1} & taken:
            continue
        try:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        bases.append(port)
        taken |= {port, port + 1}
    return bases


def prometheus_config(targets: list[str], rule_files: list[str]) -> dict:
    # One-second scrapes and evaluations: a run of a minute gives rate() plenty of samples.
    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "800ms", "evaluation_interval": "1s"},
        "rule_files": rule_files,
        "scrape_configs": [{"job_name": "training", "static_configs": [{"targets": targets}]}],
    }


class PrometheusError(AssertionError):
    pass


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen

    @classmethod
    def start(cls, directory: Path, targets: list[str], rule_files: list[str], port: int) -> Prometheus:
        config = directory / "prometheus.yml"
        config.write_text(json.dumps(prometheus_config(targets, rule_files)))
        process = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        server = cls(f"http://127.0.0.1:{port}", process)
        for _ in range(200):
            try:
                urllib.request.urlopen(f"{server.url}/-/ready", timeout=1)
                return server
            except OSError:
                if process.poll() is not None:
                    break
                time.sleep(0.1)
        process.kill()
        raise PrometheusError(f"Prometheus did not start: {process.stderr.read().decode()[-2000:]}")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=20)

    def api(self, path: str, **params) -> object:
        pairs = [(key, item) for key, value in params.items()
                 for item in (value if isinstance(value, list) else [value])]
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(pairs)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                body = json.load(response)
        except urllib.error.HTTPError as error:
            body = json.load(error)
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def instant(self, promql: str, at: float) -> list[dict]:
        """Series of an instant query at ``at``: [{"metric": labels, "value": float}]."""
        data = self.api("query", query=promql, time=f"{at:.3f}")
        return [{"metric": series["metric"], "value": float(series["value"][1])} for series in data["result"]]

    def range(self, promql: str, start: float, end: float, step: float) -> list[dict]:
        data = self.api("query_range", query=promql, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step}")
        return [{"metric": series["metric"], "values": [float(value) for _, value in series["values"]]}
                for series in data["result"]]

    def label_values(self, label: str, selector: str, start: float, end: float) -> list[str]:
        return self.api(f"label/{label}/values", **{"match[]": selector, "start": f"{start:.3f}",
                                                      "end": f"{end:.3f}"})

    def live_window(self, job_id: str, ranks: int, until: float) -> tuple[float, float]:
        """First and last instants at which every rank of the job was being scraped.

        Instant selectors (``target_info`` in every join) see nothing of a job once its ranks have
        exited: queries about a finished run are evaluated inside this window.
        """
        result = self.api("query_range", query=f'count(target_info{{training_job_id="{job_id}"}})',
                          start=f"{until - 600:.3f}", end=f"{until:.3f}", step="1")["result"]
        assert result, f"no target_info for job {job_id}"
        live = [float(at) for at, value in result[0]["values"] if float(value) == ranks]
        assert live, f"job {job_id} never had {ranks} ranks up"
        return live[0], live[-1]


def finite(values: list[float]) -> bool:
    return any(math.isfinite(value) for value in values)


_VARIABLE = re.compile(r"\$(\w+)|\$\{(\w+)(?::\w+)?\}")


def substitute(text: str, values: dict[str, str]) -> str:
    """Grafana's variable interpolation, for the variables this project's dashboard uses."""
    def replace(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"no value for ${name} in {text!r}")
        return values[name]

    return _VARIABLE.sub(replace, text)


def label_values_query(query: str) -> tuple[str, str]:
    """(selector, label) of Grafana's ``label_values(selector, label)``."""
    match = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\)\s*", query, re.S)
    assert match, query
    return match.group(1), match.group(2)


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120, check=False)
