"""The embedded default: OTLP JSON lines in a local directory, one file per signal and rank.

Files are ``<OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR>/<job id>/{traces,metrics}-rank<N>.jsonl`` in the
format of the official ``opentelemetry-exporter-otlp-json-file`` (one ``ExportTraceServiceRequest``
or ``ExportMetricsServiceRequest`` as OTLP JSON per line). A file is opened on the first export,
so a process that never trains writes nothing.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from opentelemetry.exporter.otlp.common._aggregation import _get_aggregation, _get_temporality
from opentelemetry.exporter.otlp.json.file import FileMetricExporter, FileSpanExporter
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from opentelemetry_instrumentation_deepspeed import environment_variables as env
from opentelemetry_instrumentation_deepspeed.job import JobIdentity

_logger = logging.getLogger(__name__)

_lock = threading.Lock()
_identity: JobIdentity | None = None
_directory: Path | None = None
_resolved = False


def use_identity(identity: JobIdentity) -> None:
    global _identity  # noqa: PLW0603 - one job identity per process
    _identity = identity


def _fallback_identity() -> JobIdentity:
    # Reached only when these exporters are used without this project's configurator.
    from opentelemetry_instrumentation_deepspeed.job import job_id_from_environment

    rank = int(os.environ.get("RANK", "0") or 0)
    return JobIdentity(job_id_from_environment() or f"pid{os.getpid()}", rank, rank,
                       int(os.environ.get("WORLD_SIZE", "1") or 1))


def _usable(path: Path) -> str | None:
    """Why ``path`` cannot take our files, or None if it can."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"{type(error).__name__}: {error.strerror or error}"
    if not os.access(path, os.W_OK | os.X_OK):
        return "it is not writable"
    return None


def directory() -> Path | None:
    """This job's output directory, created; None when neither the configured one nor the default works."""
    global _directory, _resolved, _identity  # noqa: PLW0603 - resolved once per process
    with _lock:
        if _resolved:
            return _directory
        _resolved = True
        _identity = _identity or _fallback_identity()
        job = re.sub(r"[^A-Za-z0-9._-]", "_", _identity.job_id)
        configured = env.output_dir()
        candidates = [configured] if configured == env.DEFAULT_OUTPUT_DIR else [configured, env.DEFAULT_OUTPUT_DIR]
        for candidate in candidates:
            path = Path(candidate) / job
            why = _usable(path)
            if why is None:
                _directory = path
                break
            fallback = " The default is tried next." if candidate != candidates[-1] else ""
            _logger.warning(
                "%s=%r: cannot write telemetry to %s (%s); the default is %r.%s",
                env.OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR, configured, path, why, env.DEFAULT_OUTPUT_DIR, fallback,
            )
        else:
            _logger.warning("Telemetry of this process is not written anywhere; training goes on.")
        return _directory


def file_path(signal: str) -> Path | None:
    folder = directory()
    return None if folder is None else folder / f"{signal}-rank{_identity.rank}.jsonl"


def announce(signals: list[str]) -> None:
    """Say once, on rank 0, where the telemetry goes."""
    folder = directory()
    if folder is not None and _identity is not None and _identity.rank == 0:
        print(
            f"opentelemetry-instrumentation-deepspeed: writing {' and '.join(signals)} of job {_identity.job_id} "
            f"as OTLP JSON lines to {folder}/ (set OTEL_EXPORTER_OTLP_ENDPOINT to export over OTLP instead)",
            file=sys.stderr,
            flush=True,
        )


def reset() -> None:
    """Forget the resolved directory and identity (tests run several jobs in one process)."""
    global _directory, _resolved, _identity
    with _lock:
        _directory, _resolved, _identity = None, False, None


class _LazyFile:
    """Builds the official file exporter for this rank's file on first use."""

    def __init__(self, signal: str, factory):
        self._signal = signal
        self._factory = factory
        self._exporter = None
        self._opened = False
        self._lock = threading.Lock()

    def get(self):
        with self._lock:
            if not self._opened:
                self._opened = True
                path = file_path(self._signal)
                if path is not None:
                    try:
                        self._exporter = self._factory(path)
                    except OSError as error:
                        _logger.warning("Cannot open %s (%s); %s are not written.", path, error, self._signal)
            return self._exporter

    def shutdown(self):
        with self._lock:
            if self._exporter is not None:
                self._exporter.shutdown()


class JsonLinesSpanExporter(SpanExporter):
    """Spans of this rank as OTLP JSON lines in ``traces-rank<N>.jsonl``."""

    def __init__(self):
        self._file = _LazyFile("traces", FileSpanExporter)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        exporter = self._file.get()
        # Nowhere to write has been said once already; failing every batch would only add noise.
        return SpanExportResult.SUCCESS if exporter is None else exporter.export(spans)

    def shutdown(self) -> None:
        self._file.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


class JsonLinesMetricExporter(MetricExporter):
    """Metrics of this rank as OTLP JSON lines in ``metrics-rank<N>.jsonl``."""

    def __init__(self, preferred_temporality=None, preferred_aggregation=None):
        # The reader asks this wrapper, so it must resolve the OTLP temporality variables as the official one does.
        super().__init__(
            preferred_temporality=_get_temporality(preferred_temporality),
            preferred_aggregation=_get_aggregation(preferred_aggregation),
        )
        self._file = _LazyFile(
            "metrics",
            lambda path: FileMetricExporter(
                path,
                preferred_temporality=preferred_temporality,
                preferred_aggregation=preferred_aggregation,
            ),
        )

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        exporter = self._file.get()
        return MetricExportResult.SUCCESS if exporter is None else exporter.export(metrics_data)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        self._file.shutdown()

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True
