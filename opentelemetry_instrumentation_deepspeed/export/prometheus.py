"""The SDK's Prometheus exporter on a multi-rank host: one port per rank, and a last scrape.

Every rank of a host would bind ``OTEL_EXPORTER_PROMETHEUS_PORT``; rank ``local_rank`` binds that
port plus ``local_rank`` instead. Prometheus pulls, so the values of a job's last seconds are
lost when the process exits before the next scrape: with
``OTEL_PYTHON_DEEPSPEED_PROMETHEUS_FINAL_SCRAPE_TIMEOUT`` set, the process waits at exit, up to
that many seconds, until one more scrape has been delivered.
"""

from __future__ import annotations

import os
import threading

from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env
from opentelemetry_instrumentation_deepspeed.runtime import lifecycle

DEFAULT_PORT = 9464


def in_use() -> bool:
    return "prometheus" in env.exporters("metrics")


def assign_port(local_rank: int) -> int:
    """Before the SDK starts the exporter's server: this rank's port."""
    try:
        base = int(os.environ.get("OTEL_EXPORTER_PROMETHEUS_PORT", DEFAULT_PORT))
    except ValueError:
        base = DEFAULT_PORT
    port = base + local_rank
    os.environ["OTEL_EXPORTER_PROMETHEUS_PORT"] = str(port)
    return port


class _ScrapeWatch:
    """A collector that only counts the scrapes of this process."""

    def __init__(self):
        self.scraped = threading.Condition()
        self.scrapes = 0

    def collect(self):
        with self.scraped:
            self.scrapes += 1
            self.scraped.notify_all()
        return []

    def wait_for_scrape(self, timeout: float) -> None:
        # A scrape is seen when it starts: the first one after exit began has been delivered
        # once the next one starts (a target is scraped one request at a time).
        with self.scraped:
            target = self.scrapes + 2
            self.scraped.wait_for(lambda: self.scrapes >= target, timeout=timeout)


def wait_for_final_scrape_at_exit() -> None:
    timeout = env.prometheus_final_scrape_timeout()
    if not timeout:
        return
    from prometheus_client import REGISTRY

    watch = _ScrapeWatch()
    REGISTRY.register(watch)
    # Before the meter provider shuts down: the exporter still serves. A wait the user asked for
    # comes on top of the exit budget.
    lifecycle.allow_extra_exit_time(timeout)
    lifecycle.at_exit(lifecycle.FINAL_SCRAPE, lambda _reason: watch.wait_for_scrape(timeout))
