"""Streams spans out of OTLP JSON lines: the embedded default's files, the Collector's file exporter, stdin.

Only what the analysis needs is kept of each span, and spans are yielded one by one: memory is
bounded by the analysis, not by the input. Lines that are not OTLP JSON are counted, not fatal.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import math
import os
import stat
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from opentelemetry_instrumentation_deepspeed import semconv

_KEPT = (semconv.TRAINING_STEP, semconv.TRAINING_MICRO_STEP, semconv.COMM_OP, semconv.COMM_BYTES, semconv.COMM_ASYNC,
         semconv.COMM_SEQUENCE, semconv.COMM_GROUP_NAME, semconv.COMM_BUSBW, semconv.TRAINING_STEP_SKIPPED,
         semconv.TRAINING_STEP_UNFINISHED, semconv.TRAINING_PARALLELISM,
         # hangs and desyncs (diagnose/hangs.py)
         semconv.COMM_DTYPE, semconv.TRAINING_PHASE, semconv.HANG_REASON, semconv.HANG_DURATION,
         semconv.HANG_THRESHOLD, semconv.HANG_COMM_DURATION, semconv.HANG_COMM_SEQUENCES, semconv.HANG_BETWEEN_STEPS,
         # pipeline parallelism (diagnose/pipeline.py)
         semconv.TRAINING_PIPELINE_STAGE, semconv.TRAINING_PIPELINE_STAGES, semconv.TRAINING_STEP_MICRO_BATCHES,
         semconv.COMM_PEER_STAGE)
# The model and memory layers (diagnose/model.py)
_MODEL_TYPES = {semconv.TRAINING_LOSS: (int, float), semconv.TRAINING_GRAD_NORM: (int, float),
                semconv.TRAINING_MEMORY_OOM: str, semconv.TRAINING_MEMORY_ALLOCATED: int,
                semconv.TRAINING_MEMORY_RESERVED: int, semconv.TRAINING_PRECISION: str,
                **{semconv.TRAINING_MEMORY_PHASE_PEAK.format(phase=phase): int for phase in semconv.PHASES[1:]}}
# The input layer (diagnose/inputs.py)
_INPUT_TYPES = {semconv.TRAINING_STEP_TOKENS: int, semconv.TRAINING_STEP_PADDED_TOKENS: int,
                semconv.TRAINING_STEP_SEQUENCE_LENGTH: int,
                # the host's CPUs during the step, and the resource's host.name, copied onto training.step
                semconv.TRAINING_STEP_HOST_CPU_BUSY: (int, float), semconv.TRAINING_STEP_HOST_CPU_IDLE: (int, float),
                semconv.TRAINING_STEP_PROCESS_CPU: (int, float), semconv.TRAINING_STEP_THREAD_CPU_WAIT: (int, float),
                semconv.TRAINING_STEP_NATIVE_THREADS_CPU_WAIT: (int, float), semconv.HOST_NAME: str,
                semconv.TRAINING_STEP_BETWEEN_COMM: (int, float), semconv.TRAINING_WORLD_SIZE: int,
                semconv.TRAINING_PHASE_THREAD_CPU_WAIT: (int, float)}
_KEPT += tuple(_MODEL_TYPES) + tuple(_INPUT_TYPES)


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start: int
    end: int
    job: str
    rank: int
    attributes: dict = field(default_factory=dict)
    # Status ERROR: its description ("" where it has none); None: no error. A step that raised, or that the process's
    # exit or a signal ended (diagnose/crashes.py).
    error: str | None = None

    @property
    def seconds(self) -> float:
        return (self.end - self.start) / 1e9


# GPU metrics the analysis lines up with the steps.
GPU_METRICS = (semconv.METRIC_HW_GPU_UTILIZATION, semconv.METRIC_NVIDIA_GPU_THROTTLE, semconv.METRIC_HW_ERRORS)
# Names metrics had before their rename, read as the new ones (files written by an older version).
_RENAMED = {old: new for new, old in semconv.ALIASES.items()}


@dataclass(frozen=True)
class Sample:
    """One data point of a GPU metric: rank, metric, time, value and the attribute that matters."""

    rank: int
    metric: str
    time: int
    value: float
    detail: str = ""


@dataclass
class ReadStats:
    lines: int = 0
    bad_lines: int = 0
    bad_spans: int = 0  # spans skipped alone, the rest of their line read
    spans: int = 0
    files: int = 0
    problems: list = field(default_factory=list)
    samples: list = field(default_factory=list)  # GPU metric samples: a few per collection interval
    clocks: dict = field(default_factory=dict)  # (job, rank) -> its latest clock readings (``Drift``)

    def bad(self, problem: str, span: bool = False) -> None:
        """A line (or a backend's answer), or one span of it, skipped: counted, and the first few named."""
        if span:
            self.bad_spans += 1
        else:
            self.bad_lines += 1
        if self.bad_lines + self.bad_spans <= 3:
            self.problems.append(problem)


_INT64 = (-(2**63), 2**63 - 1)
_MAX_TIME = 2**64 - 1  # OTLP's fixed64
_MAX_RANK = 2**31 - 1


class Shape(ValueError):
    """A line that is OTLP JSON but holds something the analysis cannot take."""


def _integer(value, low: int, high: int, what: str) -> int:
    """An OTLP JSON integer (a number, or a string of digits for 64-bit ones) within [low, high].

    Anything else is a Shape error: a float such as ``1e999`` (inf) or ``1.5``, a word, a bool, and a
    400-digit string (checked by length before it is converted: Python limits that to 4,300 digits).
    """
    if isinstance(value, str) and 0 < len(value) <= 21:
        try:
            value = int(value, 10)
        except ValueError:
            pass
    elif isinstance(value, float) and value.is_integer():  # 3.0: JSON has one number type
        value = int(value)
    if type(value) is not int or not low <= value <= high:
        raise Shape(f"{what} {_shown(value)} is not an integer in [{low}, {high}]")
    return value


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:24]}...({len(text)} characters)"


def _finite(value) -> float | None:
    """A measured double as a finite float; None for NaN, the infinities and numbers beyond a double."""
    try:
        number = float(value)
    except OverflowError:  # an integer of 400 digits
        return None
    return number if math.isfinite(number) else None


def _value(value: dict):
    if not isinstance(value, dict) or len(value) != 1:
        return None
    (kind, inner), = value.items()
    if kind == "intValue":
        return _integer(inner, *_INT64, "intValue")
    if kind == "doubleValue":
        if isinstance(inner, bool) or not isinstance(inner, (int, float, str)):
            raise Shape(f"doubleValue {_shown(inner)} is not a number")
        return float(inner) if not isinstance(inner, int) else inner  # OTLP JSON writes NaN, inf as strings
    if kind == "arrayValue":  # one level: a hang report's sequences per group
        items = inner.get("values") if isinstance(inner, dict) else None
        if not isinstance(items, list):
            return None
        return tuple(_value(item) if not (isinstance(item, dict) and "arrayValue" in item) else None
                     for item in items)
    return inner if kind in ("stringValue", "boolValue") else None


def _attributes(items, keep) -> dict:
    found = {}
    for item in items or ():
        if type(item) is not dict or (key := item.get("key")) not in keep:
            continue
        value = item.get("value")
        # The shapes every exporter writes, read here: a span has up to ten attributes, a million
        # spans ten million; anything else is read by _value.
        if type(value) is dict and len(value) == 1:
            inner = value.get("stringValue")
            if type(inner) is str:
                found[key] = inner
                continue
            inner = value.get("intValue")
            if type(inner) is str and 0 < len(inner) <= 18 and inner.isascii() and inner.isdigit():
                found[key] = int(inner)
                continue
        if (value := _value(value)) is not None:
            found[key] = value  # a value of no OTLP type (an object, null) is no value
    return found


# The attributes the analysis uses, and the types it can take for them.
_TYPES = {semconv.TRAINING_STEP: int, semconv.TRAINING_MICRO_STEP: int, semconv.COMM_OP: str, semconv.COMM_BYTES: int,
          semconv.COMM_ASYNC: bool, semconv.COMM_SEQUENCE: int, semconv.COMM_GROUP_NAME: str,
          semconv.COMM_BUSBW: (int, float), semconv.TRAINING_STEP_SKIPPED: bool, semconv.TRAINING_STEP_UNFINISHED: bool,
          semconv.TRAINING_PARALLELISM: str,
          semconv.COMM_DTYPE: str, semconv.TRAINING_PHASE: str, semconv.HANG_REASON: str,
          semconv.HANG_DURATION: (int, float), semconv.HANG_THRESHOLD: (int, float),
          semconv.HANG_COMM_DURATION: (int, float), semconv.HANG_COMM_SEQUENCES: tuple,
          semconv.HANG_BETWEEN_STEPS: bool, semconv.CODE_STACKTRACE: str, **_MODEL_TYPES, **_INPUT_TYPES,
          semconv.TRAINING_PIPELINE_STAGE: int, semconv.TRAINING_PIPELINE_STAGES: int,
          semconv.TRAINING_STEP_MICRO_BATCHES: int, semconv.COMM_PEER_STAGE: int}


def _checked(span: dict, attributes: dict) -> tuple[int, int]:
    for key, value in attributes.items():
        if value is not None and (not isinstance(value, _TYPES[key]) or
                                  (_TYPES[key] is int and isinstance(value, bool))):
            expected = _TYPES[key] if isinstance(_TYPES[key], tuple) else (_TYPES[key],)
            raise Shape(f"attribute {key} is {type(value).__name__}, not {' or '.join(t.__name__ for t in expected)}")
    if semconv.COMM_BUSBW in attributes:
        # A bandwidth that is not a finite double (NaN from a zero-length timing, a 400-digit
        # integer) is no measurement: left out, as if the attribute were absent.
        attributes[semconv.COMM_BUSBW] = _finite(attributes[semconv.COMM_BUSBW])
    if type(span.get("name")) is not str or type(span.get("traceId")) is not str or type(span.get("spanId")) is not str:
        raise Shape("a span without a string name and ids")
    if type(span.get("parentSpanId", "")) is not str:
        raise Shape("a span whose parentSpanId is not a string")
    start, end = _time(span.get("startTimeUnixNano")), _time(span.get("endTimeUnixNano"))
    if not 0 < start <= end <= _MAX_TIME:
        raise Shape(f"span {_shown(span['name'])} has impossible times ({start}, {end})")
    return start, end


def _time(value) -> int:
    if type(value) is str and 0 < len(value) <= 20 and value.isascii() and value.isdigit():
        return int(value)  # as every exporter writes it: the fast path
    return _integer(value, -_MAX_TIME, _MAX_TIME, "a time in nanoseconds")


_DAY = 86_400 * 10**9


def aligned(start: int, end: int, offset) -> tuple[int, int]:
    """A span's times on rank 0's clock: less the rank's ``training.clock.offset``, when it has one."""
    if type(offset) is not int or not -_DAY < offset < _DAY:  # beyond a day: a broken clock, left as it is
        return start, end
    return start - offset, end - offset


def _event_stack(events, name: str, key: str) -> dict:
    """The first ``name`` event's stack (its attribute ``key``), as the attribute ``code.stacktrace``: a hang report's
    (``training.hang.stack``), or where a span raised (``exception``)."""
    for event in events if isinstance(events, list) else ():
        if isinstance(event, dict) and event.get("name") == name:
            stack = _attributes(event.get("attributes"), (key,))
            return {semconv.CODE_STACKTRACE: stack[key]} if stack else {}
    return {}


def _resource(attributes, keys) -> tuple:
    """(job id, rank, the attributes ``keys``) of a resource; the rank is None when it is not a training rank's."""
    resource = _attributes(attributes, tuple(key for key in keys if key != semconv.TRAINING_CLOCK_OFFSET))
    if semconv.TRAINING_CLOCK_OFFSET in keys:
        try:  # a correction, not a fact: one that is not an int64 is left out, the spans are read
            resource.update(_attributes(attributes, (semconv.TRAINING_CLOCK_OFFSET,)))
        except Shape:
            pass
    job, rank = resource.get(semconv.TRAINING_JOB_ID), resource.get(semconv.TRAINING_RANK)
    if rank is None:
        return job, None, resource
    if isinstance(job, int) and not isinstance(job, bool):
        job = str(job)
    if job is not None and not isinstance(job, str):
        raise Shape(f"training.job.id is a {type(job).__name__}, not a string")
    return job, _integer(rank, 0, _MAX_RANK, "training.rank"), resource


class Drift:
    """A rank's clock offset as its ``training.clock.sync`` spans refresh it: the latest reading read,
    carried forward (and back to the one before) along the line through the last two, so a clock that
    drifts steadily stays aligned between two readings."""

    MAX_RATE = 0.1  # seconds per second: beyond it, two readings are noise, not drift

    __slots__ = ("last", "previous")

    def __init__(self):
        self.previous = self.last = None  # (the reading's time on the rank's clock, offset), nanoseconds

    def add(self, at: int, offset: int) -> None:
        if self.last is not None and at <= self.last[0]:
            return  # read out of order: the later one stands
        self.previous, self.last = self.last, (at, offset)

    def at(self, time: int) -> int:
        last_at, last = self.last
        if self.previous is None:
            return last
        previous_at, previous = self.previous
        rate = max(-self.MAX_RATE, min(self.MAX_RATE, (last - previous) / (last_at - previous_at)))
        return last + int(rate * (max(time, previous_at) - last_at))


def _clock_reading(span: dict, job: str, rank: int, clocks: dict) -> None:
    try:
        offset = _attributes(span.get("attributes"), (semconv.TRAINING_CLOCK_OFFSET,)).get(
            semconv.TRAINING_CLOCK_OFFSET)
        end = _time(span.get("endTimeUnixNano", 0))
    except Shape:
        return  # a correction, not a fact: one that cannot be read is left out
    if type(offset) is int and -_DAY < offset < _DAY:
        clocks.setdefault((job, rank), Drift()).add(end, offset)


_ERROR_CODES = (2, "2", "STATUS_CODE_ERROR")
MAX_ERROR = 1000  # characters of a status description kept (the instrumentation cuts messages there too)


def _error(status) -> str | None:
    """A span status's description where its code is ERROR, else None."""
    if type(status) is not dict or status.get("code") not in _ERROR_CODES:
        return None
    message = status.get("message")
    return message[:MAX_ERROR] if type(message) is str else ""


def spans_of_request(request: dict, clocks: dict | None = None, skipped: list | None = None) -> Iterator[Span]:
    """``clocks``: (job, rank) -> ``Drift``, kept across the requests of one reading (the refreshed offsets).
    ``skipped``: where a span the analysis cannot take goes (why), the request's other spans read; None: it raises.
    One line of a Collector's file holds a whole batch, hundreds of spans of many steps: one span of another writer's,
    with times out of order, must not take them all along."""
    clocks = {} if clocks is None else clocks
    for resource_spans in request.get("resourceSpans") or ():
        job, rank, resource = _resource((resource_spans.get("resource") or {}).get("attributes"),
                                        (semconv.TRAINING_JOB_ID, semconv.TRAINING_RANK, semconv.TRAINING_CLOCK_OFFSET,
                                         semconv.HOST_NAME, semconv.TRAINING_WORLD_SIZE))
        if job is None or rank is None:
            continue  # not a training rank's telemetry
        for scope_spans in resource_spans.get("scopeSpans") or ():
            spans = scope_spans.get("spans") or ()
            if not isinstance(spans, list | tuple):
                raise Shape("spans that are not a list")
            for span in spans:
                try:
                    read = _span(span, job, rank, resource, clocks)
                except UNREADABLE as error:
                    if skipped is None:
                        raise
                    skipped.append(str(error) if isinstance(error, Shape) else "a span of another shape")
                    continue
                yield read


def _span(span: dict, job: str, rank: int, resource: dict, clocks: dict) -> Span:
    attributes = _attributes(span.get("attributes"), _KEPT)
    host = resource.get(semconv.HOST_NAME)
    if span.get("name") == semconv.SPAN_STEP:
        if type(host) is str:
            attributes[semconv.HOST_NAME] = host  # which ranks share the host's CPUs (diagnose/inputs.py)
        if type(world := resource.get(semconv.TRAINING_WORLD_SIZE)) is int:
            attributes[semconv.TRAINING_WORLD_SIZE] = world  # ranks with no telemetry (crashes.py)
    error = _error(span.get("status"))
    if span.get("name") == semconv.SPAN_HANG:
        attributes.update(_event_stack(span.get("events"), semconv.EVENT_HANG_STACK, semconv.CODE_STACKTRACE))
    elif error is not None and span.get("events"):  # where it raised (crashes.py)
        attributes.update(_event_stack(span["events"], semconv.EVENT_EXCEPTION, semconv.EXCEPTION_STACKTRACE))
    elif span.get("name") == semconv.SPAN_CLOCK_SYNC:
        _clock_reading(span, job, rank, clocks)
    times = _checked(span, attributes)
    drift = clocks.get((job, rank))
    start, end = aligned(*times, resource.get(semconv.TRAINING_CLOCK_OFFSET) if drift is None else drift.at(times[0]))
    return Span(span["name"], span["traceId"], span["spanId"], span.get("parentSpanId", ""),
                start, end, job, rank, attributes, error)


def samples_of_request(request: dict) -> Iterator[Sample]:
    for resource_metrics in request.get("resourceMetrics") or ():
        _job, rank, _ = _resource((resource_metrics.get("resource") or {}).get("attributes"), (semconv.TRAINING_RANK,))
        if rank is None:
            continue
        for scope_metrics in resource_metrics.get("scopeMetrics") or ():
            for metric in scope_metrics.get("metrics") or ():
                name = _RENAMED.get(metric.get("name"), metric.get("name"))
                if name not in GPU_METRICS:
                    continue
                data = metric.get("gauge") or metric.get("sum") or {}
                for point in data.get("dataPoints") or ():
                    attributes = _attributes(point.get("attributes"),
                                             (semconv.NVIDIA_GPU_THROTTLE_REASON, semconv.HW_GPU_THROTTLE_REASON,
                                              semconv.ERROR_TYPE))
                    raw = point.get("asDouble", point.get("asInt", 0))
                    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
                        raise Shape(f"{name}: a point value {_shown(raw)} is not a number")
                    value = _finite(raw)
                    time = _time(point.get("timeUnixNano", 0))
                    if value is None:
                        continue  # no reading: NaN, an infinity, beyond a double
                    detail = (attributes.get(semconv.NVIDIA_GPU_THROTTLE_REASON) or
                              attributes.get(semconv.HW_GPU_THROTTLE_REASON) or attributes.get(semconv.ERROR_TYPE))
                    yield Sample(rank, name, time, value, detail if isinstance(detail, str) else "")


# One exported batch per line: 512 spans (the SDK's batch) take ~0.6 MB, a Collector's 8192 ~10 MB.
# A longer line is skipped unread: parsing JSON takes ~25 times its size in memory.
MAX_LINE = 16 * 2**20
TOO_LONG = "\0too long"


# A line that has not ended after this many more chunks of MAX_LINE ends its file: nothing that
# writes OTLP JSON lines writes that, and a device or an endless pipe must not keep diagnose busy.
_SKIPPED_CHUNKS = 4


class _Endless(ValueError):
    pass


def _bounded(handle) -> Iterator[str]:
    while True:
        line = handle.readline(MAX_LINE)
        if not line:
            return
        if len(line) == MAX_LINE and not line.endswith("\n"):
            for _ in range(_SKIPPED_CHUNKS):
                rest = handle.readline(MAX_LINE)
                if not rest or rest.endswith("\n"):
                    break
            else:
                raise _Endless(f"a line longer than {(_SKIPPED_CHUNKS + 1) * MAX_LINE // 2**20} MiB: "
                               "it and the rest of the input, skipped")
            line = TOO_LONG
        yield line


class Refused(OSError):
    """A path that is not read: a device, a socket (its reads might never end)."""


_READABLE = "not a regular file or pipe"


def _stdin():
    try:
        descriptor = sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a stream with no descriptor
        return contextlib.nullcontext(sys.stdin)
    mode = os.fstat(descriptor).st_mode
    if stat.S_ISCHR(mode) and os.isatty(descriptor):
        print("opentelemetry-deepspeed diagnose: reading OTLP JSON lines from the terminal (end with Ctrl-D)",
              file=sys.stderr)
    elif not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        raise Refused(f"standard input: {_READABLE}")
    # Bytes that are not UTF-8 make a line that is not JSON, not a decoding error.
    return open(descriptor, encoding="utf-8", errors="replace", closefd=False)


def _file(path: str):
    # Opened without blocking: a FIFO with no writer would block the open for ever. Then checked
    # on the open descriptor: /dev/zero never ends, /dev/tty waits for a human.
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(descriptor).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
            raise Refused(f"{path}: {_READABLE}")
        os.set_blocking(descriptor, True)  # a FIFO's writer may pause: wait for it, as for a pipe
        return open(descriptor, encoding="utf-8", errors="replace")
    except BaseException:
        os.close(descriptor)
        raise


def _lines(source) -> Iterator[str]:
    with _stdin() if source == "-" else _file(source) as handle:
        yield from _bounded(handle)


def expand(paths: Iterable[str], problems: list | None = None) -> list[str]:
    """Files to read: a directory stands for its ``*.json`` / ``*.jsonl`` regular files, recursively."""
    files = []
    for path in paths:
        if path == "-":
            files.append(path)
            continue
        candidate = Path(path)
        if fnmatch.fnmatch(candidate.name, NATIVE_CRASH_FILES):
            continue  # read by native_crashes
        try:
            if candidate.is_dir():
                found = sorted(p for p in candidate.rglob("*") if p.suffix in (".json", ".jsonl") and p.is_file())
                files += [str(p) for p in found]
                continue
        except (OSError, ValueError) as error:
            if problems is not None:
                problems.append(f"{path}: {getattr(error, 'strerror', None) or error}")
            continue
        files.append(path)
    return files


NATIVE_CRASH_FILES = "native-crash-rank*.txt"  # export/native_crash.py: a JSON line, then faulthandler's words
_NATIVE_CRASH_BYTES = 1 << 20


def native_crashes(paths: Iterable[str]) -> list[tuple[str, int, str, int]]:
    """(job, rank, what faulthandler wrote, when: the file's last change, ns) of each crash file in the directories
    given that holds more than its first line (a rank that exited without a crash leaves none, or that line alone)."""
    found = []
    for path in paths:
        try:
            candidate = Path(path)
            files = (sorted(candidate.rglob(NATIVE_CRASH_FILES)) if path != "-" and candidate.is_dir() else
                     [candidate] if fnmatch.fnmatch(candidate.name, NATIVE_CRASH_FILES) else [])
        except (OSError, ValueError):
            continue  # said where its spans are read
        for file in files:
            try:
                with file.open(encoding="utf-8", errors="replace") as handle:
                    header = json.loads(handle.readline())
                    text = handle.read(_NATIVE_CRASH_BYTES).strip()
                job, rank = header["job"], header["rank"]
                if text and isinstance(job, str) and type(rank) is int:
                    found.append((job, rank, text, file.stat().st_mtime_ns))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # not one of ours
    return found


# Whatever the shape of a request (strings where objects belong, deep nesting, numbers beyond any
# type), it is only skipped: MemoryError too, once a line is larger than it looked.
UNREADABLE = (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError, RecursionError,
              MemoryError)


def take(request, stats: ReadStats, where: str) -> list[Span]:
    """The spans of one parsed OTLP JSON request (its GPU samples go to ``stats``); [] and a problem
    in ``stats`` when it is not a request the analysis can take."""
    why = "not an OTLP JSON request"
    skipped: list[str] = []
    try:
        if not isinstance(request, dict):
            raise ValueError(why)
        spans = list(spans_of_request(request, stats.clocks, skipped))
        if "resourceMetrics" in request:
            stats.samples.extend(samples_of_request(request))
    except Shape as error:
        why, spans = str(error), None
    except UNREADABLE:
        spans = None
    if spans is None:
        stats.bad(f"{where}: {why}, skipped")
        return []
    for problem in skipped:
        stats.bad(f"{where}: {problem}, skipped", span=True)
    stats.spans += len(spans)
    return spans


def read_spans(paths: Iterable[str], stats: ReadStats) -> Iterator[Span]:
    for source in expand(paths, stats.problems):
        stats.files += 1
        shown = "<stdin>" if source == "-" else source
        number = 0
        try:
            for raw in _lines(source):
                number += 1
                stats.lines += 1
                line = raw.strip()
                if not line:
                    continue
                if line == TOO_LONG:
                    stats.bad(f"{shown}:{number}: a line longer than {MAX_LINE // 2**20} MiB, skipped")
                    continue
                try:
                    request = json.loads(line)
                except UNREADABLE:
                    stats.bad(f"{shown}:{number}: not an OTLP JSON line, skipped")
                    continue
                yield from take(request, stats, f"{shown}:{number}")
        except _Endless as error:
            stats.bad(f"{shown}:{number + 1}: {error}")
        except OSError as error:
            stats.problems.append(str(error) if isinstance(error, Refused) else f"{shown}: {error.strerror or error}")
