"""The embedded default: OTLP JSON lines in a local directory, one file per signal and rank.

Files are ``<OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR>/<job id>/{traces,metrics}-rank<N>.jsonl`` in the
format of the official ``opentelemetry-exporter-otlp-json-file`` (one ``ExportTraceServiceRequest``
or ``ExportMetricsServiceRequest`` as OTLP JSON per line; spans through this project's faster
encoder, metrics through the official one). A file is opened on the first export, so a process
that never trains writes nothing; it is rotated once it holds half of
``OTEL_PYTHON_DEEPSPEED_OUTPUT_MAX_MB``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from opentelemetry.exporter.otlp.json.common.metrics_encoder import encode_metrics
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from opentelemetry_instrumentation_deepspeed.export import sdk
from opentelemetry_instrumentation_deepspeed.export.otlp_json import SpanEncoder
from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env
from opentelemetry_instrumentation_deepspeed.runtime.job import JobIdentity

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
    from opentelemetry_instrumentation_deepspeed.runtime.job import job_id_from_environment

    rank = int(os.environ.get("RANK", "0") or 0)
    return JobIdentity(job_id_from_environment() or f"pid{os.getpid()}", rank, rank,
                       int(os.environ.get("WORLD_SIZE", "1") or 1))


_MAX_NAME = 128


def _directory_name(job_id: str) -> str:
    """The job id as a directory name: safe characters, and short enough for any file system
    (255 bytes at most); a long id keeps its start and gets a hash of the whole."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", job_id)
    if len(name) > _MAX_NAME:
        digest = hashlib.blake2b(job_id.encode(), digest_size=8).hexdigest()
        name = f"{name[:_MAX_NAME - 17]}-{digest}"
    return name


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
        job = _directory_name(_identity.job_id)
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


class _JsonLines:
    """This rank's file of one signal: opened at the first line, rotated at half the size limit.

    Each line is written with one call and flushed, so the file holds whole lines whenever the
    process stops between batches.
    """

    def __init__(self, signal: str):
        self._signal = signal
        self._lock = threading.Lock()
        self._stream = None
        self._opened = False
        self._path: Path | None = None
        self._size = 0
        self._rotate_at = env.output_max_mb() * 1_000_000 // 2

    def _open(self) -> None:
        self._opened = True
        self._path = file_path(self._signal)
        if self._path is None:
            return
        try:
            self._stream = open(self._path, "ab")
            self._size = self._stream.tell()
        except OSError as error:
            _logger.warning("Cannot open %s (%s); %s are not written.", self._path, error, self._signal)

    def _rotate(self) -> None:
        # One predecessor is kept: the newest telemetry is the one a slow job needs.
        self._stream.close()
        os.replace(self._path, self._path.with_suffix(".previous.jsonl"))
        self._stream = open(self._path, "ab")
        self._size = 0

    def write(self, line: str) -> bool:
        """False when the line could not be written (nowhere to write has been said once already)."""
        data = line.encode() + b"\n"
        with self._lock:
            if not self._opened:
                self._open()
            if self._stream is None:
                return self._path is None
            try:
                if self._rotate_at and self._size and self._size + len(data) > self._rotate_at:
                    self._rotate()
                self._stream.write(data)
                self._stream.flush()
            except (OSError, ValueError) as error:  # disk full, file removed, closed at shutdown
                _logger.warning("Cannot write %s to %s: %s", self._signal, self._path, error)
                return False
            self._size += len(data)
            return True

    def close(self) -> None:
        with self._lock:
            if self._stream is not None:
                self._stream.close()
                self._stream = None


class JsonLinesSpanExporter(SpanExporter):
    """Spans of this rank as OTLP JSON lines in ``traces-rank<N>.jsonl``."""

    def __init__(self):
        self._file = _JsonLines("traces")
        self._encoder = SpanEncoder()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        written = self._file.write(self._encoder.encode(spans))
        return SpanExportResult.SUCCESS if written else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self._file.close()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


class JsonLinesMetricExporter(MetricExporter):
    """Metrics of this rank as OTLP JSON lines in ``metrics-rank<N>.jsonl``."""

    def __init__(self, preferred_temporality=None, preferred_aggregation=None):
        # The OTLP temporality and aggregation variables apply, as to the official exporters.
        super().__init__(
            preferred_temporality=sdk.otlp_temporality(preferred_temporality),
            preferred_aggregation=sdk.otlp_aggregation(preferred_aggregation),
        )
        self._file = _JsonLines("metrics")

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        encoded = encode_metrics(metrics_data)
        if not encoded.resource_metrics:
            return MetricExportResult.SUCCESS
        written = self._file.write(json.dumps(encoded.to_dict(), separators=(",", ":"), ensure_ascii=False))
        return MetricExportResult.SUCCESS if written else MetricExportResult.FAILURE

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        self._file.close()

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True
