"""Reading what the project wrote: OTLP JSON lines, or OTLP protobuf requests, as plain records."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start: int
    end: int
    attributes: dict
    resource: dict
    status: str = ""
    status_message: str = ""
    events: list = field(default_factory=list)


def _value(value: dict):
    (kind, inner), = value.items()
    if kind == "intValue":
        return int(inner)
    if kind == "arrayValue":
        return [_value(item) for item in inner.get("values", [])]
    return inner


def _attributes(items) -> dict:
    return {item["key"]: _value(item["value"]) for item in items or []}


def spans_from_request(request: dict) -> list[Span]:
    spans = []
    for resource_spans in request.get("resourceSpans", []):
        resource = _attributes(resource_spans.get("resource", {}).get("attributes"))
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                spans.append(Span(
                    name=span["name"],
                    trace_id=span["traceId"],
                    span_id=span["spanId"],
                    parent_id=span.get("parentSpanId", ""),
                    start=int(span["startTimeUnixNano"]),
                    end=int(span["endTimeUnixNano"]),
                    attributes=_attributes(span.get("attributes")),
                    resource=resource,
                    status=span.get("status", {}).get("code", ""),
                    status_message=span.get("status", {}).get("message", ""),
                    events=[{"name": event["name"], "attributes": _attributes(event.get("attributes"))}
                            for event in span.get("events", [])],
                ))
    return spans


def read_spans(path: Path) -> list[Span]:
    spans = []
    for line in path.read_text().splitlines():
        spans.extend(spans_from_request(json.loads(line)))
    return spans


@dataclass(frozen=True)
class Point:
    metric: str
    attributes: dict
    value: float  # a sum's value, or a histogram's count
    total: float = 0.0  # a histogram's sum
    exemplar_trace_ids: tuple = ()


def read_last_points(path: Path) -> list[Point]:
    """The data points of the last export (cumulative: the run's totals)."""
    lines = path.read_text().splitlines()
    return _points(json.loads(lines[-1])) if lines else []


def read_all_points(path: Path) -> list[Point]:
    """The data points of every export, in order."""
    return [point for line in path.read_text().splitlines() for point in _points(json.loads(line))]


def _points(request: dict) -> list[Point]:
    points = []
    for resource_metrics in request.get("resourceMetrics", []):
        for scope_metrics in resource_metrics.get("scopeMetrics", []):
            for metric in scope_metrics.get("metrics", []):
                if "histogram" in metric:
                    for point in metric["histogram"].get("dataPoints", []):
                        points.append(Point(metric["name"], _attributes(point.get("attributes")),
                                            int(point.get("count", 0)), float(point.get("sum", 0.0)),
                                            tuple(e["traceId"] for e in point.get("exemplars", []) if "traceId" in e)))
                for kind in ("sum", "gauge"):
                    for point in metric.get(kind, {}).get("dataPoints", []):
                        value = point.get("asInt", point.get("asDouble", 0))
                        points.append(Point(metric["name"], _attributes(point.get("attributes")), float(value)))
    return points
