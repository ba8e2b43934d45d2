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
import stat
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from opentelemetry.exporter.otlp.json.common.metrics_encoder import encode_metrics
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from opentelemetry_instrumentation_deepspeed.export import sdk
from opentelemetry_instrumentation_deepspeed.export.otlp_json import SpanEncoder, finite_json
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
    """The job id as one directory name inside the output directory, whatever it holds: safe
    characters only (no ``/``, NUL or control character), never ``.`` or ``..`` nor hidden (leading
    dots become ``_``), never empty, and short enough for any file system (255 bytes at most): a
    long id keeps its start and gets a hash of the whole."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", job_id)
    name = re.sub(r"^\.+", lambda dots: "_" * len(dots.group()), name) or "_"
    if len(name) > _MAX_NAME:
        digest = hashlib.blake2b(job_id.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
        name = f"{name[:_MAX_NAME - 17]}-{digest}"
    return name


def _usable(path: Path) -> str | None:
    """Why ``path`` cannot take our files, or None if it can."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"{type(error).__name__}: {error.strerror or error}"
    if path.is_symlink():  # planted at the job's name: the files would land wherever it points
        return "it is a symbolic link"
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
        # An endpoint set for these signals was not taken (not a URL: said above; or their exporter chosen): "set
        # OTEL_EXPORTER_OTLP_ENDPOINT ... instead" misled where it was set.
        also = [signal for signal in signals if "otlp" in env.exporters(signal)]
        named = sorted({name for signal in signals if signal not in also for name in env.OTLP_ENDPOINTS.get(signal, ())
                        if os.environ.get(name, "").strip()})
        if named:
            hint = f"{' and '.join(named)} set, not used for them"
        elif also:
            hint = f"the {' and '.join(also)} over OTLP too"
        else:
            hint = "set OTEL_EXPORTER_OTLP_ENDPOINT to export over OTLP instead"
        print(
            f"opentelemetry-instrumentation-deepspeed: writing {' and '.join(signals)} of job {_identity.job_id} "
            f"as OTLP JSON lines to {folder}/ ({hint})",
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

    The file holds whole lines, whatever happens. Each batch is one line, appended with
    ``os.write`` (no user-space buffer a dying thread could leave half-flushed); a write that fails
    part-way (a full disk, a file-size limit) is rolled back by truncating the file to where it
    was, so the next batch starts on a fresh line, and the batch counts as lost. A file that ends
    inside a line (a process killed mid-write, a rollback that failed) is cut back to its last
    whole line before anything is appended. A file removed while the job runs is created again
    at the next batch. Only a regular file is written: a FIFO, a device or a symbolic link planted
    at the file's name is refused.
    """

    def __init__(self, signal: str):
        self._signal = signal
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._opened = False
        self._path: Path | None = None
        self._rotate_at = env.output_max_mb() * 1_000_000 // 2
        self._check_end = True  # the file may end inside a line: look before appending
        self._failing = False  # the last write failed: said once until one succeeds

    def _open(self) -> None:
        if self._path is None:
            return
        self._path.parent.mkdir(parents=True, exist_ok=True)  # the directory may have been removed too
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        fd = os.open(self._path, flags, 0o644)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(f"{self._path} is not a regular file")
        self._fd, self._check_end = fd, True

    def _close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def _cut_to_whole_lines(self, size: int) -> int:
        """Truncate a file that ends inside a line back to its last newline: its new size."""
        if size == 0 or os.pread(self._fd, 1, size - 1) == b"\n":
            return size
        end = size
        while end > 0:
            start = max(0, end - 65536)
            chunk = os.pread(self._fd, end - start, start)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                end = start + newline + 1
                break
            end = start
        os.ftruncate(self._fd, end)
        return end

    def _append(self, data: bytes) -> None:
        if self._fd is not None and os.fstat(self._fd).st_nlink == 0:  # removed while the job runs
            self._close()
        if self._fd is None:
            self._open()
        size = os.fstat(self._fd).st_size
        if self._check_end:
            size = self._cut_to_whole_lines(size)
            self._check_end = False
        if self._rotate_at and size and size + len(data) > self._rotate_at:
            # One predecessor is kept: the newest telemetry is the one a slow job needs.
            self._close()
            os.replace(self._path, self._path.with_suffix(".previous.jsonl"))
            self._open()
            size = 0
        written = 0
        try:
            while written < len(data):
                written += os.write(self._fd, data[written:])
        except OSError:
            if written:
                try:
                    os.ftruncate(self._fd, size)
                except OSError:
                    self._check_end = True  # cut back before the next batch instead
            raise

    def write(self, line: str) -> bool:
        """False when the line could not be written (the reason is said once, until a line is written again)."""
        data = line.encode() + b"\n"
        with self._lock:
            if not self._opened:
                self._opened = True
                self._path = file_path(self._signal)
            if self._path is None:  # nowhere to write, said once already
                return False
            try:
                self._append(data)
            except (OSError, ValueError) as error:  # disk full, file-size limit, not a regular file, closed
                if not self._failing:
                    self._failing = True
                    _logger.warning("Cannot write %s to %s (%s); this batch and the next ones that fail are counted "
                                    "as lost.", self._signal, self._path, error)
                return False
            self._failing = False
            return True

    def close(self) -> None:
        with self._lock:
            self._close()


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
        request = encoded.to_dict()
        try:
            text = json.dumps(request, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except ValueError:  # a point of NaN or an infinity, where an SDK passes one on (1.45 drops them)
            text = json.dumps(finite_json(request), separators=(",", ":"), ensure_ascii=False)
        written = self._file.write(text)
        return MetricExportResult.SUCCESS if written else MetricExportResult.FAILURE

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        self._file.close()

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True
