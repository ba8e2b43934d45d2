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

_KEPT = ("training.step", "training.micro_step", "comm.op", "comm.bytes", "comm.async", "comm.sequence",
         "comm.group.name", "comm.busbw", "training.step.skipped")


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
GPU_METRICS = ("hw.gpu.utilization", "hw.gpu.throttle", "hw.errors")


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
    return inner if kind in ("stringValue", "boolValue", "doubleValue") else None


def _attributes(items, keep) -> dict:
    found = {}
    for item in items or ():
        key = item.get("key") if isinstance(item, dict) else None
        if key in keep:
            found[key] = _value(item.get("value"))
    return found


def spans_of_request(request: dict) -> Iterator[Span]:
    for resource_spans in request.get("resourceSpans") or ():
        resource = _attributes((resource_spans.get("resource") or {}).get("attributes"),
                               ("training.job.id", "training.rank"))
        job, rank = resource.get("training.job.id"), resource.get("training.rank")
        if job is None or rank is None:
            continue  # not a training rank's telemetry
        for scope_spans in resource_spans.get("scopeSpans") or ():
            for span in scope_spans.get("spans") or ():
                yield Span(span["name"], span["traceId"], span["spanId"], span.get("parentSpanId", ""),
                           int(span["startTimeUnixNano"]), int(span["endTimeUnixNano"]), str(job), int(rank),
                           _attributes(span.get("attributes"), _KEPT))


def samples_of_request(request: dict) -> Iterator[Sample]:
    for resource_metrics in request.get("resourceMetrics") or ():
        resource = _attributes((resource_metrics.get("resource") or {}).get("attributes"), ("training.rank",))
        if resource.get("training.rank") is None:
            continue
        for scope_metrics in resource_metrics.get("scopeMetrics") or ():
            for metric in scope_metrics.get("metrics") or ():
                if metric.get("name") not in GPU_METRICS:
                    continue
                data = metric.get("gauge") or metric.get("sum") or {}
                for point in data.get("dataPoints") or ():
                    attributes = _attributes(point.get("attributes"), ("hw.gpu.throttle.reason", "error.type"))
                    value = point.get("asDouble", point.get("asInt", 0))
                    yield Sample(int(resource["training.rank"]), metric["name"], int(point.get("timeUnixNano", 0)),
                                 float(value), attributes.get("hw.gpu.throttle.reason") or
                                 attributes.get("error.type") or "")


def _lines(source) -> Iterator[tuple[str, str]]:
    if source == "-":
        for line in sys.stdin:
            yield "<stdin>", line
        return
    with open(source, encoding="utf-8", errors="replace") as handle:
        for line in handle:
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
                try:
                    request = json.loads(line)
                    spans = list(spans_of_request(request)) if isinstance(request, dict) else None
                    if spans is not None and "resourceMetrics" in request:
                        stats.samples.extend(samples_of_request(request))
                except (ValueError, KeyError, TypeError, RecursionError):
                    spans = None
                if spans is None:
                    stats.bad_lines += 1
                    if stats.bad_lines <= 3:
                        stats.problems.append(f"{where}:{stats.lines}: not an OTLP JSON line, skipped")
                    continue
                stats.spans += len(spans)
                yield from spans
        except OSError as error:
            stats.problems.append(f"{source}: {error.strerror or error}")
