"""Streams spans out of OTLP JSON lines: the embedded default's files, the Collector's file exporter, stdin.

Only what the analysis needs is kept of each span, and spans are yielded one by one: memory is
bounded by the analysis, not by the input. Lines that are not OTLP JSON are counted, not fatal.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from opentelemetry_instrumentation_deepspeed import semconv

_KEPT = (semconv.TRAINING_STEP, semconv.TRAINING_MICRO_STEP, semconv.COMM_OP, semconv.COMM_BYTES, semconv.COMM_ASYNC,
         semconv.COMM_SEQUENCE, semconv.COMM_GROUP_NAME, semconv.COMM_BUSBW, semconv.TRAINING_STEP_SKIPPED)
# The model and memory layers (diagnose/model.py)
_MODEL_TYPES = {semconv.TRAINING_LOSS: (int, float), semconv.TRAINING_GRAD_NORM: (int, float),
                semconv.TRAINING_MEMORY_OOM: str, semconv.TRAINING_MEMORY_ALLOCATED: int,
                semconv.TRAINING_MEMORY_RESERVED: int,
                **{semconv.TRAINING_MEMORY_PHASE_PEAK.format(phase=phase): int for phase in semconv.PHASES[1:]}}
# The input layer (diagnose/inputs.py)
_INPUT_TYPES = {semconv.TRAINING_STEP_TOKENS: int, semconv.TRAINING_STEP_PADDED_TOKENS: int,
                semconv.TRAINING_STEP_SEQUENCE_LENGTH: int}
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

    @property
    def seconds(self) -> float:
        return (self.end - self.start) / 1e9


# GPU metrics the analysis lines up with the steps.
GPU_METRICS = (semconv.METRIC_HW_GPU_UTILIZATION, semconv.METRIC_HW_GPU_THROTTLE, semconv.METRIC_HW_ERRORS)


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
    spans: int = 0
    files: int = 0
    problems: list = field(default_factory=list)
    samples: list = field(default_factory=list)  # GPU metric samples: a few per collection interval


def _value(value: dict):
    if not isinstance(value, dict) or len(value) != 1:
        return None
    (kind, inner), = value.items()
    if kind == "intValue":
        return int(inner)
    if kind == "doubleValue":
        return float(inner)  # OTLP JSON writes NaN and the infinities as strings
    return inner if kind in ("stringValue", "boolValue", "doubleValue") else None


def _attributes(items, keep) -> dict:
    found = {}
    for item in items or ():
        key = item.get("key") if isinstance(item, dict) else None
        if key in keep:
            found[key] = _value(item.get("value"))
    return found


class Shape(ValueError):
    """A line that is OTLP JSON but holds something the analysis cannot take."""


# The attributes the analysis uses, and the types it can take for them.
_TYPES = {semconv.TRAINING_STEP: int, semconv.TRAINING_MICRO_STEP: int, semconv.COMM_OP: str, semconv.COMM_BYTES: int,
          semconv.COMM_ASYNC: bool, semconv.COMM_SEQUENCE: int, semconv.COMM_GROUP_NAME: str,
          semconv.COMM_BUSBW: (int, float), semconv.TRAINING_STEP_SKIPPED: bool, **_MODEL_TYPES, **_INPUT_TYPES}
_MAX_TIME = 2**64 - 1  # OTLP's fixed64


def _checked(span: dict, attributes: dict) -> tuple[int, int]:
    for key, value in attributes.items():
        if value is not None and (not isinstance(value, _TYPES[key]) or
                                  (_TYPES[key] is int and isinstance(value, bool))):
            raise Shape(f"attribute {key} is {type(value).__name__}, not {_TYPES[key]}")
    if not all(isinstance(span.get(key), str) for key in ("name", "traceId", "spanId")):
        raise Shape("a span without a string name and ids")
    start, end = int(span["startTimeUnixNano"]), int(span["endTimeUnixNano"])
    if not 0 < start <= end <= _MAX_TIME:
        raise Shape(f"span {span['name']} has impossible times ({start}, {end})")
    return start, end


def spans_of_request(request: dict) -> Iterator[Span]:
    for resource_spans in request.get("resourceSpans") or ():
        resource = _attributes((resource_spans.get("resource") or {}).get("attributes"),
                               (semconv.TRAINING_JOB_ID, semconv.TRAINING_RANK))
        job, rank = resource.get(semconv.TRAINING_JOB_ID), resource.get(semconv.TRAINING_RANK)
        if job is None or rank is None:
            continue  # not a training rank's telemetry
        for scope_spans in resource_spans.get("scopeSpans") or ():
            for span in scope_spans.get("spans") or ():
                attributes = _attributes(span.get("attributes"), _KEPT)
                start, end = _checked(span, attributes)
                yield Span(span["name"], span["traceId"], span["spanId"], span.get("parentSpanId", ""),
                           start, end, str(job), int(rank), attributes)


def samples_of_request(request: dict) -> Iterator[Sample]:
    for resource_metrics in request.get("resourceMetrics") or ():
        resource = _attributes((resource_metrics.get("resource") or {}).get("attributes"), (semconv.TRAINING_RANK,))
        if resource.get(semconv.TRAINING_RANK) is None:
            continue
        for scope_metrics in resource_metrics.get("scopeMetrics") or ():
            for metric in scope_metrics.get("metrics") or ():
                if metric.get("name") not in GPU_METRICS:
                    continue
                data = metric.get("gauge") or metric.get("sum") or {}
                for point in data.get("dataPoints") or ():
                    attributes = _attributes(point.get("attributes"),
                                             (semconv.HW_GPU_THROTTLE_REASON, semconv.ERROR_TYPE))
                    value = point.get("asDouble", point.get("asInt", 0))
                    yield Sample(int(resource[semconv.TRAINING_RANK]), metric["name"],
                                 int(point.get("timeUnixNano", 0)), float(value),
                                 attributes.get(semconv.HW_GPU_THROTTLE_REASON) or
                                 attributes.get(semconv.ERROR_TYPE) or "")


# One exported batch per line: 512 spans (the SDK's batch) take ~0.6 MB, a Collector's 8192 ~10 MB.
# A longer line is skipped unread: parsing JSON takes ~25 times its size in memory.
MAX_LINE = 16 * 2**20
TOO_LONG = "\0too long"


def _bounded(handle) -> Iterator[str]:
    while True:
        line = handle.readline(MAX_LINE)
        if not line:
            return
        if len(line) == MAX_LINE and not line.endswith("\n"):
            while (rest := handle.readline(MAX_LINE)) and not rest.endswith("\n"):
                pass
            line = TOO_LONG
        yield line


def _lines(source) -> Iterator[tuple[str, str]]:
    if source == "-":
        for line in _bounded(sys.stdin):
            yield "<stdin>", line
        return
    with open(source, encoding="utf-8", errors="replace") as handle:
        for line in _bounded(handle):
            yield str(source), line


def expand(paths: Iterable[str]) -> list[str]:
    """Files to read: a directory stands for its ``traces*.jsonl`` / ``*.json*`` files, recursively."""
    files = []
    for path in paths:
        if path == "-":
            files.append(path)
            continue
        candidate = Path(path)
        if candidate.is_dir():
            found = sorted(p for p in candidate.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl"))
            files += [str(p) for p in found]
        else:
            files.append(path)
    return files


def read_spans(paths: Iterable[str], stats: ReadStats) -> Iterator[Span]:
    for source in expand(paths):
        stats.files += 1
        try:
            for where, raw in _lines(source):
                stats.lines += 1
                line = raw.strip()
                if not line:
                    continue
                why = "not an OTLP JSON line"
                try:
                    if line == TOO_LONG:
                        why = f"a line longer than {MAX_LINE // 2**20} MiB"
                        raise ValueError(why)
                    request = json.loads(line)
                    spans = list(spans_of_request(request)) if isinstance(request, dict) else None
                    if spans is not None and "resourceMetrics" in request:
                        stats.samples.extend(samples_of_request(request))
                except Shape as error:
                    why, spans = str(error), None
                # Whatever the shape of a line (strings where objects belong, deep nesting), it is
                # only skipped: MemoryError too, once a line is larger than it looked.
                except (ValueError, KeyError, TypeError, AttributeError, RecursionError, MemoryError):
                    spans = None
                if spans is None:
                    stats.bad_lines += 1
                    if stats.bad_lines <= 3:
                        stats.problems.append(f"{where}:{stats.lines}: {why}, skipped")
                    continue
                stats.spans += len(spans)
                yield from spans
        except OSError as error:
            stats.problems.append(f"{source}: {error.strerror or error}")
