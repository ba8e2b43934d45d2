"""Every environment variable of this project: its name, its default, and its parser.

A bad value never stops training: it gets one warning that names the variable,
the value and the default, and the default is used. The warning is given in processes that
train (from ``check_all``, when training starts), never in the launcher and helper processes
that ``opentelemetry-instrument`` also runs in: a value read there (the collective
instrumentation reads its mode when it is set up, in every process) waits until then.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable
from functools import cache
from typing import TypeVar
from urllib.parse import urlsplit

_logger = logging.getLogger(__name__)

T = TypeVar("T")

OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR = "OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR"
"""Directory of the embedded default (OTLP JSON lines, one file per signal and rank).

Used only when no exporter and no OTLP endpoint is configured. Default: ``./telemetry``.
"""

OTEL_PYTHON_DEEPSPEED_OUTPUT_MAX_MB = "OTEL_PYTHON_DEEPSPEED_OUTPUT_MAX_MB"
"""Most megabytes each file of the embedded default keeps on disk, with its one rotated
predecessor (``traces-rank<N>.previous.jsonl``): at half of it the file is rotated, so the
newest telemetry is always kept. 0: no limit. Default: 1024.
"""

OTEL_PYTHON_DEEPSPEED_SIGTERM_FLUSH = "OTEL_PYTHON_DEEPSPEED_SIGTERM_FLUSH"
"""On SIGTERM (when nothing else handles it): end the open step as an error and flush the
telemetry, then die by SIGTERM as before. ``true`` or ``false``. Default: ``true``.
"""

OTEL_PYTHON_DEEPSPEED_EXIT_TIMEOUT = "OTEL_PYTHON_DEEPSPEED_EXIT_TIMEOUT"
"""Most seconds the telemetry adds to a process's exit, or to its death after SIGTERM, whatever the
collector does (refuses, never answers, answers errors, slowly): the last spans get 40% of it,
the last metrics until 70%, the rest is left for the interpreter's own exit; what is not
delivered by then is counted as lost and said in the summary line. 0: no last flush at all.
Default: 5.
"""

OTEL_PYTHON_DEEPSPEED_EXCEPTION_DETAIL = "OTEL_PYTHON_DEEPSPEED_EXCEPTION_DETAIL"
"""What of an exception raised in a step leaves the process (in the span status and the
``exception`` event of the phase, collective and step it ended): ``full``, as OpenTelemetry's
exception conventions record it (type, message, stack trace); ``message`` (type and message, no
stack trace); ``type`` (the type alone: a message that may hold data or secrets stays in the
process). Messages are cut at 1,000 characters and stack traces at 8,000 (their end kept) in
every mode. Default: ``full``.
"""

OTEL_PYTHON_DEEPSPEED_JOB_ID = "OTEL_PYTHON_DEEPSPEED_JOB_ID"
"""The ``training.job.id`` of this run, identical on every rank.

Default: derived from the launcher or scheduler (``TORCHELASTIC_RUN_ID``, ``SLURM_JOB_ID``,
``k8s.job.uid`` in ``OTEL_RESOURCE_ATTRIBUTES``), else agreed through the process group's store.
"""

OTEL_PYTHON_DEEPSPEED_JOB_ID_TIMEOUT = "OTEL_PYTHON_DEEPSPEED_JOB_ID_TIMEOUT"
"""Seconds a rank waits for rank 0 to publish the job id in the process group's store.

After that the rank uses a job id of its own and says so. Default: 60.
"""

EMBEDDED_EXPORTER = "deepspeed_file"
"""Exporter name (traces and metrics) of the embedded default, set by the distro when nothing else is."""

ISOLATED_ID_GENERATOR = "deepspeed_random"
"""The SDK's OTEL_PYTHON_ID_GENERATOR as the distro sets it when unset: random ids that no user seed
reaches (``export/id_generator.py``); the SDK's default draws from Python's global ``random``."""

OTEL_PYTHON_DEEPSPEED_COMM = "OTEL_PYTHON_DEEPSPEED_COMM"
"""Collective telemetry: ``spans`` (spans and metrics), ``metrics`` (metrics and counts only) or ``off``.

Default: ``spans``.
"""

OTEL_PYTHON_DEEPSPEED_COMM_SPAN_LIMIT = "OTEL_PYTHON_DEEPSPEED_COMM_SPAN_LIMIT"
"""Most ``comm.*`` spans per optimizer step and rank; later collectives of the step are only
counted (``comm.count`` / ``comm.spans_dropped`` on the phase and step spans) and measured. Default: 64.
"""

OTEL_PYTHON_DEEPSPEED_FLOPS_PER_TOKEN = "OTEL_PYTHON_DEEPSPEED_FLOPS_PER_TOKEN"
"""Training FLOPs per token of the model, for ``training.mfu``. Default: 6 x its parameter count."""

OTEL_PYTHON_DEEPSPEED_PEAK_FLOPS = "OTEL_PYTHON_DEEPSPEED_PEAK_FLOPS"
"""Peak FLOP/s of one device, for ``training.mfu``. Default: the dense bf16 figure of known GPUs
(H200, H100, A100, L40S, A10G, V100, B200); elsewhere no MFU is reported.
"""

OTEL_PYTHON_DEEPSPEED_PROMETHEUS_FINAL_SCRAPE_TIMEOUT = "OTEL_PYTHON_DEEPSPEED_PROMETHEUS_FINAL_SCRAPE_TIMEOUT"
"""With the SDK's Prometheus exporter: seconds a rank waits at exit for one last scrape. Default: 0 (no wait)."""

OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY = "OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY"
"""Profile every N-th optimizer step with torch.profiler (operator and kernel spans); 0 turns it off."""

OTEL_PYTHON_DEEPSPEED_PROFILE_TRIGGER = "OTEL_PYTHON_DEEPSPEED_PROFILE_TRIGGER"
"""A file whose modification (``touch``) makes each rank profile the next step it starts. Empty: none."""

OTEL_PYTHON_DEEPSPEED_PROFILE_TOP = "OTEL_PYTHON_DEEPSPEED_PROFILE_TOP"
"""Operators (by self time), and kernels (by time), that become spans per profiled step."""

OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR = "OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR"
"""Profile the next step when one takes more than this times the recent median; 0 turns it off."""

OTEL_PYTHON_DEEPSPEED_HANG_TIMEOUT = "OTEL_PYTHON_DEEPSPEED_HANG_TIMEOUT"
"""The hang watchdog's floor, in seconds: a step open longer than the larger of this and 10 times the
slowest recent step (10 times this before a step has closed) is reported as a hang: the open step, its
phase, the collective in flight and the training thread's stack (docs/telemetry.md, ``training.hang``).
0 turns the reports off; the watchdog's thread still reads signals, so that a SIGTERM reaches a rank blocked in
native code. Default: 30.
"""

OTEL_PYTHON_DEEPSPEED_TEST_CLOCK_SKEW = "OTEL_PYTHON_DEEPSPEED_TEST_CLOCK_SKEW"
"""For tests only: ``<rank>:<seconds>[:<rate>]`` moves that rank's ``time.time_ns()`` by that many seconds, as a
skewed host clock would, and from then on by ``rate`` seconds more per second (a drifting clock; default 0)
(the clock alignment's tests). Unset: nothing changes.
"""

OTEL_PYTHON_DEEPSPEED_CLOCK_REFRESH = "OTEL_PYTHON_DEEPSPEED_CLOCK_REFRESH"
"""Seconds between two estimates of each rank's clock offset to rank 0 during the run (a few store round
trips on a thread of its own; ``training.clock.sync`` spans; beyond 256 ranks each round takes a share of
them in turns, so each rank is measured every ``ceil((ranks - 1) / 256)`` rounds). 0 turns the refresh off
(the start estimate only). Default: 60.
"""

OTEL_PYTHON_DEEPSPEED_MEMORY_PEAK_RESET = "OTEL_PYTHON_DEEPSPEED_MEMORY_PEAK_RESET"
"""On CUDA: reset the caching allocator's peak at each phase start, so every phase reports its own
peak (``training.memory.peak``). ``torch.cuda.max_memory_allocated()`` then tells the peak since the
last phase start. ``false``: the peak is left alone, and phases report the running peak. Default: ``true``.
"""

OTEL_PYTHON_DEEPSPEED_PAD_TOKEN_ID = "OTEL_PYTHON_DEEPSPEED_PAD_TOKEN_ID"
"""The token id that pads sequences, for counting real tokens in batches that carry no
``attention_mask``. Default: the model's ``config.pad_token_id`` (Hugging Face models), else none
(every token of such a batch counts as real).
"""

DEFAULT_OUTPUT_DIR = "telemetry"
DEFAULT_OUTPUT_MAX_MB = 1024
DEFAULT_JOB_ID_TIMEOUT = 60.0
DEFAULT_EXIT_TIMEOUT = 5.0
EXCEPTION_DETAILS = ("full", "message", "type")
DEFAULT_EXCEPTION_DETAIL = "full"
DEFAULT_COMM_MODE = "spans"
COMM_MODES = ("spans", "metrics", "off")
DEFAULT_COMM_SPAN_LIMIT = 64
# The SDK's OTEL_BSP_SCHEDULE_DELAY as the distro sets it when unset (milliseconds; the SDK's is 5000).
DEFAULT_BSP_SCHEDULE_DELAY = "1000"
DEFAULT_PROFILE_EVERY = 1000
DEFAULT_PROFILE_TRIGGER = "otel-profile-trigger"
DEFAULT_PROFILE_TOP = 64
DEFAULT_PROFILE_SLOW_FACTOR = 3.0
DEFAULT_HANG_TIMEOUT = 30.0
DEFAULT_CLOCK_REFRESH = 60.0


_deferred: dict[str, tuple] = {}  # variable -> its warning's arguments, until this process trains
_training = False  # check_all() ran: this process trains, and hears about bad values at once


def _warn_default(name: str, raw: str, default: object, why: str, using: str = "the default") -> None:
    """``using`` names what stands in, before the value; empty: ``default`` says it all, as written."""
    instead = f"{using} {default!r}" if using else str(default)
    arguments = ("%s=%r is not valid (%s); using %s.", name, raw, why, instead)
    if _training:
        _logger.warning(*arguments)
    else:
        _deferred[name] = arguments


def _read(name: str, default: T, parse: Callable[[str], T], said: str | None = None) -> T:
    """``said``: what the message names for the default where its value would not tell (None: derived)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return parse(raw)
    except ValueError as error:
        if said is not None:
            _warn_default(name, raw, said, str(error), "")
        else:  # a boolean as it is written: true, not True
            _warn_default(name, raw, str(default).lower() if isinstance(default, bool) else default, str(error))
        return default


def _non_empty(raw: str) -> str:
    value = raw.strip()
    if not value:
        raise ValueError("it is empty")
    return value


def _positive_seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("expected a number of seconds") from None
    if not 0 < value <= 86_400:
        raise ValueError("expected seconds in (0, 86400]")
    return value


def _one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return value

    return parse


def _count(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError("expected a whole number") from None
    if not 0 <= value <= 1_000_000:
        raise ValueError("expected 0 to 1000000")
    return value


@cache
def output_dir() -> str:
    return _read(OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR, DEFAULT_OUTPUT_DIR, _non_empty)


def _megabytes(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError("expected a whole number of megabytes") from None
    if not 0 <= value <= 10_000_000:
        raise ValueError("expected 0 (no limit) to 10000000")
    return value


@cache
def output_max_mb() -> int:
    return _read(OTEL_PYTHON_DEEPSPEED_OUTPUT_MAX_MB, DEFAULT_OUTPUT_MAX_MB, _megabytes)


def _boolean(raw: str) -> bool:
    value = raw.strip().lower()
    if value not in ("true", "false"):
        raise ValueError("expected true or false")
    return value == "true"


@cache
def sigterm_flush() -> bool:
    return _read(OTEL_PYTHON_DEEPSPEED_SIGTERM_FLUSH, True, _boolean)


def _exit_seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("expected a number of seconds") from None
    if not 0 <= value <= 3600:
        raise ValueError("expected seconds in [0, 3600]")
    return value


@cache
def exit_timeout() -> float:
    return _read(OTEL_PYTHON_DEEPSPEED_EXIT_TIMEOUT, DEFAULT_EXIT_TIMEOUT, _exit_seconds)


@cache
def memory_peak_reset() -> bool:
    return _read(OTEL_PYTHON_DEEPSPEED_MEMORY_PEAK_RESET, True, _boolean)


@cache
def exception_detail() -> str:
    return _read(OTEL_PYTHON_DEEPSPEED_EXCEPTION_DETAIL, DEFAULT_EXCEPTION_DETAIL, _one_of(EXCEPTION_DETAILS))


@cache
def job_id() -> str | None:
    return _read(OTEL_PYTHON_DEEPSPEED_JOB_ID, None, _non_empty,
                 "the default: an id from the launcher's or the scheduler's, else a random one rank 0 shares")


@cache
def job_id_timeout() -> float:
    return _read(OTEL_PYTHON_DEEPSPEED_JOB_ID_TIMEOUT, DEFAULT_JOB_ID_TIMEOUT, _positive_seconds)


def _positive_number(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("expected a number") from None
    if not 0 < value < 1e30:
        raise ValueError("expected a positive number")
    return value


@cache
def flops_per_token() -> float | None:
    return _read(OTEL_PYTHON_DEEPSPEED_FLOPS_PER_TOKEN, None, _positive_number, "the default: 6 x parameters")


@cache
def peak_flops() -> float | None:
    return _read(OTEL_PYTHON_DEEPSPEED_PEAK_FLOPS, None, _positive_number,
                 "the default: the device's known peak (none elsewhere: no training.mfu)")


def _seconds_or_zero(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("expected a number of seconds") from None
    if not 0 <= value <= 3600:
        raise ValueError("expected seconds in [0, 3600]")
    return value


@cache
def prometheus_final_scrape_timeout() -> float:
    return _read(OTEL_PYTHON_DEEPSPEED_PROMETHEUS_FINAL_SCRAPE_TIMEOUT, 0.0, _seconds_or_zero)


def _path_or_nothing(raw: str) -> str | None:
    return raw.strip() or None


def _top(raw: str) -> int:
    value = _count(raw)
    if value < 1:
        raise ValueError("expected at least 1")
    return value


@cache
def profile_every() -> int:
    return _read(OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY, DEFAULT_PROFILE_EVERY, _count)


@cache
def profile_trigger() -> str | None:
    return _read(OTEL_PYTHON_DEEPSPEED_PROFILE_TRIGGER, DEFAULT_PROFILE_TRIGGER, _path_or_nothing)


def _factor(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("expected a number") from None
    if not (value == 0 or 1 < value <= 1000):
        raise ValueError("expected 0 (off) or a factor above 1")
    return value


@cache
def profile_slow_factor() -> float:
    return _read(OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR, DEFAULT_PROFILE_SLOW_FACTOR, _factor)


@cache
def profile_top() -> int:
    return _read(OTEL_PYTHON_DEEPSPEED_PROFILE_TOP, DEFAULT_PROFILE_TOP, _top)


@cache
def comm_mode() -> str:
    return _read(OTEL_PYTHON_DEEPSPEED_COMM, DEFAULT_COMM_MODE, _one_of(COMM_MODES))


@cache
def comm_span_limit() -> int:
    return _read(OTEL_PYTHON_DEEPSPEED_COMM_SPAN_LIMIT, DEFAULT_COMM_SPAN_LIMIT, _count)


def _seconds_or_off(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("expected a number of seconds") from None
    if not 0 <= value <= 86_400:
        raise ValueError("expected 0 (off) or seconds up to 86400")
    return value


def _token_id(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError("expected a whole number") from None
    if not 0 <= value < 2**31:
        raise ValueError("expected 0 to 2147483647")
    return value


@cache
def hang_timeout() -> float:
    return _read(OTEL_PYTHON_DEEPSPEED_HANG_TIMEOUT, DEFAULT_HANG_TIMEOUT, _seconds_or_off)


@cache
def clock_refresh() -> float:
    return _read(OTEL_PYTHON_DEEPSPEED_CLOCK_REFRESH, DEFAULT_CLOCK_REFRESH, _seconds_or_off)


def _rank_seconds_and_rate(raw: str) -> tuple[int, float, float]:
    rank, separator, rest = raw.partition(":")
    seconds, _, rate = rest.partition(":")
    try:
        if not separator or not -86_400 <= float(seconds) <= 86_400 or not -0.5 <= float(rate or 0) <= 0.5:
            raise ValueError
        return int(rank), float(seconds), float(rate or 0)
    except ValueError:
        raise ValueError("expected <rank>:<seconds>[:<rate>], seconds within a day, rate within 0.5 s/s") from None


@cache
def test_clock_skew() -> tuple[int, float, float] | None:
    return _read(OTEL_PYTHON_DEEPSPEED_TEST_CLOCK_SKEW, None, _rank_seconds_and_rate, "the default: no skew")


@cache
def pad_token_id() -> int | None:
    return _read(OTEL_PYTHON_DEEPSPEED_PAD_TOKEN_ID, None, _token_id, "the default: the model's config.pad_token_id")


_READERS = (output_dir, output_max_mb, sigterm_flush, exit_timeout, exception_detail, job_id, job_id_timeout,
            comm_mode, comm_span_limit, flops_per_token, peak_flops, prometheus_final_scrape_timeout, profile_every,
            profile_trigger, profile_top, profile_slow_factor, memory_peak_reset, pad_token_id, hang_timeout,
            test_clock_skew, clock_refresh)


# The standard OTLP endpoint variables of each signal, the signal's own first (the SDK's order).
_SIGNALS = ("traces", "metrics", "logs")
OTLP_ENDPOINTS = {signal: (f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
                  for signal in _SIGNALS}
# A gRPC target without a scheme: host:port (the exporter's own parsing keeps it whole), or a named resolver.
_GRPC_TARGET = re.compile(r"(?:[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}|(?:dns|unix|unix-abstract|ipv4|ipv6):\S+")


def exporters(signal: str) -> list[str]:
    """The exporter names ``OTEL_<SIGNAL>_EXPORTER`` lists ("traces", "metrics", "logs"), as the SDK splits them."""
    return [name.strip() for name in os.environ.get(f"OTEL_{signal.upper()}_EXPORTER", "").split(",")]


def unusable_otlp_endpoint(signal: str) -> tuple[str, str, str] | None:
    """(variable, value, why) when the endpoint the OTLP exporter of ``signal`` would use cannot be
    reached by any retry (a malformed URL, which the exporters treat as a transient failure); else None."""
    for name in OTLP_ENDPOINTS[signal]:
        raw = os.environ.get(name)
        if raw is None or not raw.strip():
            continue
        value = raw.strip()
        protocol = (os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL")
                    or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip()
        parsed = urlsplit(value) if not any(char.isspace() for char in value) else None
        if parsed is not None and parsed.scheme in ("http", "https"):
            try:
                usable = bool(parsed.hostname) and (parsed.port or 0) >= 0
            except ValueError:  # a port that is not a number
                usable = False
            if usable:
                return None
            return name, raw, "expected http://host:port or https://host:port"
        if protocol == "grpc" and _GRPC_TARGET.fullmatch(value):
            return None
        expected = "http(s)://host:port" + (" or host:port" if protocol == "grpc" else "")
        return name, raw, f"not a URL: expected {expected}"
    return None


# The SDK's own settings that its set-up fails on (a negative batch size raised deep in the providers' set-up, and took
# every signal's telemetry with it), or that lose telemetry silently (an OTLP export retried for ever with a negative
# timeout). Each is read as the SDK reads it: the batch processor's with int(), the metric reader's with float().
_OTLP_PROTOCOLS = ("grpc", "http/protobuf")


def _otlp_protocol(raw: str) -> str:
    if raw.strip() not in _OTLP_PROTOCOLS:
        raise ValueError("the Python exporters speak grpc or http/protobuf")
    return raw


def _sdk_integer(raw: str) -> str:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError("expected a positive integer") from None
    if value <= 0:
        raise ValueError("expected a positive integer")
    return raw


def _sdk_number(raw: str, unbounded: bool = False) -> str:
    """A positive float; ``unbounded``: infinity too (a metric reader with no periodic collection)."""
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("expected a positive number") from None
    if not (0 < value < math.inf or (unbounded and value == math.inf)):
        raise ValueError("expected a positive number")
    return raw


# (variable, parse, the value set instead, or None to unset it and leave the SDK's default; what stands in, as said)
_SDK_SETTINGS = (
    ("OTEL_EXPORTER_OTLP_PROTOCOL", _otlp_protocol, None, "the default 'grpc'"),
    ("OTEL_EXPORTER_OTLP_TIMEOUT", _sdk_number, None, "the default '10'"),
    ("OTEL_BSP_SCHEDULE_DELAY", _sdk_integer, DEFAULT_BSP_SCHEDULE_DELAY,
     f"the default '{DEFAULT_BSP_SCHEDULE_DELAY}'"),
    ("OTEL_BSP_EXPORT_TIMEOUT", _sdk_integer, None, "the default '30000'"),
    ("OTEL_BSP_MAX_QUEUE_SIZE", _sdk_integer, None, "the default '2048'"),
    ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", _sdk_integer, None, "the default '512'"),
    ("OTEL_METRIC_EXPORT_INTERVAL", lambda raw: _sdk_number(raw, unbounded=True), None, "the default '60000'"),
    ("OTEL_METRIC_EXPORT_TIMEOUT", lambda raw: _sdk_number(raw, unbounded=True), None, "the default '30000'"),
    # A signal's own: unset, the general one applies.
    *((f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL", _otlp_protocol, None, "OTEL_EXPORTER_OTLP_PROTOCOL's value")
      for signal in _SIGNALS),
    *((f"OTEL_EXPORTER_OTLP_{signal.upper()}_TIMEOUT", _sdk_number, None, "OTEL_EXPORTER_OTLP_TIMEOUT's value")
      for signal in _SIGNALS),
)
# Exporter names: the entry point group each is looked up in, and what stands in for an unknown one.
_SDK_NAMES = (("OTEL_TRACES_EXPORTER", "opentelemetry_traces_exporter", EMBEDDED_EXPORTER),
              ("OTEL_METRICS_EXPORTER", "opentelemetry_metrics_exporter", EMBEDDED_EXPORTER),
              ("OTEL_LOGS_EXPORTER", "opentelemetry_logs_exporter", "none"))


def settle_sdk_variables() -> None:
    """The SDK's variables made usable in this process's environment before the SDK reads them, each bad value said
    once, as ours are: an OTLP endpoint trimmed of spaces (blank: unset); a setting the SDK would fail on unset (its
    default then applies; a signal's own falls back to the general one) or set to the distro's default; an unknown
    exporter name dropped, the others kept (none left: the embedded default)."""
    for names in OTLP_ENDPOINTS.values():
        for name in names:
            raw = os.environ.get(name)
            if raw is not None and raw != raw.strip():
                if raw.strip():
                    os.environ[name] = raw.strip()
                else:
                    del os.environ[name]
    for name, parse, instead, said in _SDK_SETTINGS:
        raw = os.environ.get(name)
        if raw is None:
            continue
        try:
            parse(raw)
        except ValueError as error:
            _warn_default(name, raw, said, str(error), "")
            if instead is None:
                del os.environ[name]
            else:
                os.environ[name] = instead
    _settle_batch_size()
    _settle_compression()
    _settle_names()


def _settle_batch_size() -> None:
    """The batch processor refuses a batch larger than its queue (the SDK's defaults: 512 and 2048)."""
    queue = int(os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE", "2048"))
    raw = os.environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE")
    if raw is not None and int(raw) > queue:
        _warn_default("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", raw, queue, f"larger than OTEL_BSP_MAX_QUEUE_SIZE, {queue}",
                      "the queue's size,")
    elif raw is None and queue < 512:
        _warn_default("OTEL_BSP_MAX_QUEUE_SIZE", str(queue), queue, "smaller than the default batch of "
                      "OTEL_BSP_MAX_EXPORT_BATCH_SIZE, 512", "batches of")
    else:
        return
    os.environ["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"] = str(queue)


def _settle_compression() -> None:
    """gzip, for any exporter; deflate and none only over HTTP (the gRPC exporters raise on anything but gzip). A
    value that does not do is unset: no compression (a signal's own: the general one's)."""
    for kind in ("", *(f"_{signal.upper()}" for signal in _SIGNALS)):
        name = f"OTEL_EXPORTER_OTLP{kind}_COMPRESSION"
        raw = os.environ.get(name)
        if raw is None:
            continue
        protocol = (os.environ.get(f"OTEL_EXPORTER_OTLP{kind}_PROTOCOL")
                    or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip()
        value = raw.strip().lower()
        if value == "gzip" or (protocol == "http/protobuf" and value in ("deflate", "none")):
            continue
        why = ("expected gzip, or over http/protobuf deflate or none" if value in ("deflate", "none") else
               "expected gzip, deflate or none")
        _warn_default(name, raw, "OTEL_EXPORTER_OTLP_COMPRESSION's value" if kind else "no compression", why, "")
        del os.environ[name]


def _settle_names() -> None:
    from importlib.metadata import entry_points

    for name, group, instead in _SDK_NAMES:
        raw = os.environ.get(name)
        if raw is None or raw.strip().lower() == "none":  # the SDK turns the signal off, in any case
            continue
        known = {point.name for point in entry_points(group=group)} | {"otlp"}
        given = [part.strip() for part in raw.split(",")]
        unknown = [part for part in given if part not in known]
        if unknown:
            kept = list(dict.fromkeys(part for part in given if part in known))
            _warn_default(name, raw, ",".join(kept or [instead]),
                          f"no exporter named {', '.join(map(repr, unknown))}; known: {', '.join(sorted(known))}",
                          "the others" if kept else "the default")
            os.environ[name] = ",".join(kept or [instead])
    raw = os.environ.get("OTEL_PYTHON_ID_GENERATOR")
    if raw is not None and raw.strip() != "random" and raw.strip() not in {
            point.name for point in entry_points(group="opentelemetry_id_generator")}:
        _warn_default("OTEL_PYTHON_ID_GENERATOR", raw, ISOLATED_ID_GENERATOR, "no id generator of that name")
        os.environ["OTEL_PYTHON_ID_GENERATOR"] = ISOLATED_ID_GENERATOR


def check_all() -> None:
    """Parse every variable now, so a bad value is reported when training starts, whether used or not:
    once, in a process that trains (the warnings of values read before are given now)."""
    global _training  # noqa: PLW0603 - this process trains from now on
    _training = True
    for reader in _READERS:
        reader()
    for arguments in _deferred.values():
        _logger.warning(*arguments)
    _deferred.clear()


def reset_cache() -> None:
    """Forget parsed values (tests change the environment between cases)."""
    global _training  # noqa: PLW0603
    _training = False
    _deferred.clear()
    for reader in _READERS:
        reader.cache_clear()
