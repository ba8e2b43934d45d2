"""``opentelemetry-instrument`` integration: a distro that sets defaults, a lazy configurator.

With no exporter and no OTLP endpoint configured, traces and metrics go to the embedded
default (``deepspeed_file``: OTLP JSON lines under ``./telemetry``); with an endpoint, to
OTLP. Nothing here imports the SDK: every process of the job runs it, launchers included.
"""

from __future__ import annotations

import os

from opentelemetry.instrumentation.distro import BaseDistro

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.export import sdk
from opentelemetry_instrumentation_deepspeed.runtime import session
from opentelemetry_instrumentation_deepspeed.runtime.environment_variables import (
    DEFAULT_BSP_SCHEDULE_DELAY,
    EMBEDDED_EXPORTER,
    ISOLATED_ID_GENERATOR,
)

_SIGNALS = (
    ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", EMBEDDED_EXPORTER),
    ("OTEL_METRICS_EXPORTER", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", EMBEDDED_EXPORTER),
    # The embedded default has no logs; with an endpoint, logs go where the rest goes.
    ("OTEL_LOGS_EXPORTER", "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", "none"),
)


# Host metrics for the data-loading side, from one rank per host; every rank reports its own process.
_PROCESS_METRICS = {
    semconv.METRIC_PROCESS_CPU_UTILIZATION: ["user", "system"],
    semconv.METRIC_PROCESS_MEMORY_USAGE: None,
    semconv.METRIC_PROCESS_THREAD_COUNT: None,
    semconv.METRIC_PROCESS_OPEN_FILE_DESCRIPTOR_COUNT: None,
}
_HOST_METRICS = {
    semconv.METRIC_SYSTEM_CPU_UTILIZATION: ["idle", "user", "system"],
    semconv.METRIC_SYSTEM_MEMORY_USAGE: ["used", "free", "cached"],
    semconv.METRIC_SYSTEM_MEMORY_UTILIZATION: ["used"],
    semconv.METRIC_SYSTEM_DISK_IO: ["read", "write"],
    semconv.METRIC_SYSTEM_NETWORK_IO: ["transmit", "receive"],
}


def system_metrics_config() -> dict:
    """The host metrics of local rank 0 and the process metrics of every rank (N ranks: not N copies)."""
    local_rank = os.environ.get("LOCAL_RANK", "0").strip()
    return {**_PROCESS_METRICS, **(_HOST_METRICS if local_rank in ("", "0") else {})}


class DeepSpeedDistro(BaseDistro):
    """Only sets defaults, in the environment, so child processes inherit the same choice."""

    def _configure(self, **kwargs):
        # Spans leave the batch processor's queue within a second, not five: objects that live for
        # seconds reach the garbage collector's oldest generation, whose collections stopped the
        # example's training thread for ~0.4 s every ~3000 steps.
        os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", DEFAULT_BSP_SCHEDULE_DELAY)
        # Training scripts seed Python's random identically on every rank, which the SDK's default ids draw from.
        os.environ.setdefault("OTEL_PYTHON_ID_GENERATOR", ISOLATED_ID_GENERATOR)
        for exporter_variable, endpoint_variable, embedded in _SIGNALS:
            if exporter_variable in os.environ:
                continue
            # A blank endpoint is an unset one, as the SDK's variables are read (session settles it before the SDK).
            endpoint = (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
                        or os.environ.get(endpoint_variable, "").strip())
            os.environ[exporter_variable] = "otlp" if endpoint else embedded

    def load_instrumentor(self, entry_point, **kwargs):
        # The system-metrics instrumentation reports ~30 metrics by default; a training host needs these.
        if entry_point.name == "system_metrics":
            instrumentor = entry_point.load()(config=system_metrics_config())
            instrumentor.instrument(**kwargs)
            sdk.start_cpu_utilization(instrumentor)
        else:
            super().load_instrumentor(entry_point, **kwargs)


class DeepSpeedConfigurator:
    """Defers the SDK's standard configuration until this process starts training.

    It duck-types the SDK's ``_BaseConfigurator`` (``configure(**kwargs)``) rather than
    subclassing it: importing the SDK's configuration module costs ~40 ms, which the
    launcher and helper processes must not pay.
    """

    def configure(self, **kwargs):
        session.defer_sdk(kwargs)
