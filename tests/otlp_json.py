"""Reading what the project wrote: OTLP JSON lines, or OTLP protobuf requests, as plain records."""

from __future__ import annotations

import json
from dataclasses import dataclass
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
                ))
    return spans


def read_spans(path: Path) -> list[Span]:
    spans = []
    for line in path.read_text().splitlines():
        spans.extend(spans_from_request(json.loads(line)))
    return spans
