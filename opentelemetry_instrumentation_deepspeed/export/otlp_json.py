"""Spans as one OTLP/JSON ``ExportTraceServiceRequest``, written straight from the SDK's spans.

The general encoders build a protobuf-shaped object per span and convert it to a dict; on
the exporter thread, which holds the GIL while it encodes, that cost is taken from the
training thread. This encoder emits the same JSON (ids in hex, 64-bit integers as strings,
zero values left out, as the OTLP/JSON mapping of proto3 says) in one pass per span, and
encodes each resource and scope once.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping, Sequence

from opentelemetry.trace import SpanContext, SpanKind, StatusCode

# Span flags of OTLP 1.x: the parent's is_remote is known, and its value.
_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200
_STATUS_CODES = {StatusCode.UNSET: 0, StatusCode.OK: 1, StatusCode.ERROR: 2}
_KINDS = {kind: kind.value + 1 for kind in SpanKind}  # OTLP counts from SPAN_KIND_UNSPECIFIED
_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, check_circular=False).encode


def any_value(value) -> dict:  # noqa: PLR0911 - one return per OTLP value type
    # bool before int: bool is an int.
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value if math.isfinite(value) else non_finite(value)}
    if isinstance(value, str):
        return {"stringValue": value}
    if isinstance(value, bytes):
        return {"bytesValue": base64.b64encode(value).decode()}
    if isinstance(value, Mapping):
        return {"kvlistValue": {"values": attributes(value)}}
    if isinstance(value, Sequence):
        return {"arrayValue": {"values": [any_value(item) for item in value]}}
    return {"stringValue": str(value)}


def non_finite(value: float) -> str:
    """NaN and the infinities as protobuf's JSON mapping writes them: strings. JSON has no such numbers, and a strict
    parser refuses the whole line (an exported batch) for Python's bare ``NaN`` or ``Infinity``."""
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def finite_json(value):
    """``value`` (decoded JSON: dicts, lists, numbers) with its non-finite floats written as ``non_finite`` does."""
    if isinstance(value, float):
        return value if math.isfinite(value) else non_finite(value)
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [finite_json(item) for item in value]
    return value


def attributes(items: Mapping | None) -> list[dict]:
    return [{"key": key, "value": any_value(value)} for key, value in items.items()] if items else []


def _flags(parent: SpanContext | None) -> int:
    return _HAS_IS_REMOTE | (_IS_REMOTE if parent is not None and parent.is_remote else 0)


def _links(links) -> list[dict]:
    encoded = []
    for link in links:
        entry = {"traceId": f"{link.context.trace_id:032x}", "spanId": f"{link.context.span_id:016x}",
                 "flags": _flags(link.context)}
        if link.attributes:
            entry["attributes"] = attributes(link.attributes)
        encoded.append(entry)
    return encoded


_strings: dict[tuple[str, str], str] = {}
_keys: dict[str, str] = {}
_CACHE_LIMIT = 4096


def _attributes_text(items: Mapping) -> str:
    """``[{"key":...,"value":...},...]`` as JSON text, in one loop: a span has about seven attributes, and a
    call for each costs as much as formatting it. String pairs repeat from span to span (op, backend, dtype),
    so they are cached; numbers are cheap to format."""
    parts = []
    for key, value in items.items():
        kind = type(value)
        if kind is str:
            fragment = _strings.get((key, value))
            if fragment is None:
                if len(_strings) >= _CACHE_LIMIT:
                    _strings.clear()
                fragment = _strings[key, value] = _dumps({"key": key, "value": {"stringValue": value}})
            parts.append(fragment)
            continue
        key_text = _keys.get(key)
        if key_text is None:
            key_text = _keys[key] = _dumps(key)
        if kind is int:
            parts.append(f'{{"key":{key_text},"value":{{"intValue":"{value}"}}}}')
        elif kind is float and math.isfinite(value):  # as json writes it: repr
            parts.append(f'{{"key":{key_text},"value":{{"doubleValue":{value!r}}}}}')
        elif kind is bool:
            parts.append(f'{{"key":{key_text},"value":{{"boolValue":{"true" if value else "false"}}}}}')
        else:
            parts.append(f'{{"key":{key_text},"value":{_dumps(any_value(value))}}}')
    return "[" + ",".join(parts) + "]"


def _span(span) -> str:
    context = span.context
    parent = span.parent
    parts = [f'{{"traceId":"{context.trace_id:032x}","spanId":"{context.span_id:016x}"']
    if context.trace_state:
        parts.append(f',"traceState":{_dumps(context.trace_state.to_header())}')
    if parent is not None:
        parts.append(f',"parentSpanId":"{parent.span_id:016x}"')
    parts.append(f',"flags":{_flags(parent)},"name":{_dumps(span.name)},"kind":{_KINDS[span.kind]},'
                 f'"startTimeUnixNano":"{span.start_time}","endTimeUnixNano":"{span.end_time}"')
    span_attributes = span.attributes
    if span_attributes:
        parts.append(f',"attributes":{_attributes_text(span_attributes)}')
    if span.dropped_attributes:
        parts.append(f',"droppedAttributesCount":{span.dropped_attributes}')
    events = span.events
    if events:
        events = [{"timeUnixNano": str(event.timestamp), "name": event.name,
                   **({"attributes": attributes(event.attributes)} if event.attributes else {})}
                  for event in events]
        parts.append(f',"events":{_dumps(events)}')
    if span.dropped_events:
        parts.append(f',"droppedEventsCount":{span.dropped_events}')
    links = span.links
    if links:
        parts.append(f',"links":{_dumps(_links(links))}')
    if span.dropped_links:
        parts.append(f',"droppedLinksCount":{span.dropped_links}')
    status = {}
    span_status = span.status
    if span_status is not None:
        code = _STATUS_CODES[span_status.status_code]
        if code:
            status["code"] = code
        if span_status.description:
            status["message"] = span_status.description
    parts.append(f',"status":{_dumps(status) if status else "{}"}}}')
    return "".join(parts)


class SpanEncoder:
    """Encodes batches; remembers the (few) resources and scopes it has seen."""

    def __init__(self):
        self._resources: dict[int, tuple] = {}
        self._scopes: dict[tuple, str] = {}

    def _resource(self, resource) -> str:
        key = id(resource)
        cached = self._resources.get(key)
        if cached is None or cached[0] is not resource:
            encoded = _dumps({"attributes": attributes(resource.attributes)} if resource is not None else {})
            cached = self._resources[key] = (resource, encoded)
        return cached[1]

    def _scope(self, scope) -> str:
        key = (scope.name, scope.version, scope.schema_url) if scope is not None else None
        encoded = self._scopes.get(key)
        if encoded is None:
            encoded = {}
            if scope is not None:
                encoded = {"name": scope.name, **({"version": scope.version} if scope.version else {})}
                if scope.attributes:
                    encoded["attributes"] = attributes(scope.attributes)
            encoded = self._scopes[key] = _dumps(encoded)
        return encoded

    def encode(self, spans: Sequence) -> str:
        """One line of JSON (no newline) holding ``spans``."""
        by_resource: dict[int, tuple] = {}
        for span in spans:
            resource = span.resource
            scope = span.instrumentation_scope
            _, scopes = by_resource.setdefault(id(resource), (resource, {}))
            scope_key = (scope.name, scope.version, scope.schema_url) if scope is not None else None
            scopes.setdefault(scope_key, (scope, []))[1].append(_span(span))
        resource_spans = []
        for resource, scopes in by_resource.values():
            scope_spans = []
            for scope, encoded in scopes.values():
                schema = f',"schemaUrl":{_dumps(scope.schema_url)}' if scope is not None and scope.schema_url else ""
                scope_spans.append(f'{{"scope":{self._scope(scope)},"spans":[{",".join(encoded)}]{schema}}}')
            schema = (f',"schemaUrl":{_dumps(resource.schema_url)}'
                      if resource is not None and resource.schema_url else "")
            resource_spans.append(f'{{"resource":{self._resource(resource)},"scopeSpans":[{",".join(scope_spans)}]'
                                  f'{schema}}}')
        return f'{{"resourceSpans":[{",".join(resource_spans)}]}}'
