"""Spans from a trace backend's HTTP API: Tempo (search, then trace by id) and Jaeger v2 (``/api/v3``).

Both answer in OTLP JSON; their ids may be hex or base64 (protobuf's JSON mapping), and both are
accepted. Traces are fetched one at a time and streamed to the analysis.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timezone

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.diagnose.reader import ReadStats, Span, spans_of_request

_TIMEOUT = 30


class BackendError(Exception):
    """The backend could not be read: unreachable, an HTTP error, or not the expected JSON."""


def _get(url: str) -> object:
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=_TIMEOUT) as response:
            return json.load(response)
    except urllib.error.HTTPError as error:
        raise BackendError(f"{url}: HTTP {error.code} {error.reason}") from None
    except (urllib.error.URLError, OSError) as error:
        raise BackendError(f"{url}: {getattr(error, 'reason', error)}") from None
    except ValueError:
        raise BackendError(f"{url}: the answer is not JSON") from None


def _hex(value: str) -> str:
    if len(value) in (16, 32) and all(c in "0123456789abcdefABCDEF" for c in value):
        return value.lower()
    return base64.b64decode(value).hex()


def _normalized(request: dict) -> dict:
    """OTLP JSON with hex ids, from Tempo's ``batches`` / ``trace`` or Jaeger's ``result`` wrappers."""
    for key in ("trace", "result"):
        if isinstance(request.get(key), dict):
            request = request[key]
    resource_spans = request.get("resourceSpans") or request.get("batches") or []
    for resource in resource_spans:
        for scope in resource.get("scopeSpans") or resource.get("instrumentationLibrarySpans") or []:
            for span in scope.get("spans") or []:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if span.get(key):
                        span[key] = _hex(span[key])
        if "instrumentationLibrarySpans" in resource and "scopeSpans" not in resource:
            resource["scopeSpans"] = resource.pop("instrumentationLibrarySpans")
    return {"resourceSpans": resource_spans}


def tempo_spans(url: str, job: str, since_seconds: float, limit: int, stats: ReadStats) -> Iterator[Span]:
    end = int(time.time())
    query = urllib.parse.urlencode({"tags": f"training.job.id={job}", "limit": limit,
                                    "start": end - int(since_seconds), "end": end})
    found = _get(f"{url.rstrip('/')}/api/search?{query}")
    traces = found.get("traces") if isinstance(found, dict) else None
    if traces is None:
        raise BackendError(f"{url}: the search answer has no 'traces'")
    for entry in traces:
        trace = _get(f"{url.rstrip('/')}/api/traces/{entry['traceID']}")
        stats.files += 1
        spans = list(spans_of_request(_normalized(trace)))
        stats.spans += len(spans)
        yield from spans


def jaeger_spans(url: str, service: str, job: str | None, *, since_seconds: float, limit: int,
                 stats: ReadStats) -> Iterator[Span]:
    end = datetime.now(timezone.utc)
    start = datetime.fromtimestamp(end.timestamp() - since_seconds, timezone.utc)
    parameters = {"query.service_name": service, "query.start_time_min": start.isoformat(),
                  "query.start_time_max": end.isoformat(), "query.num_traces": limit}
    if job:
        parameters["query.attributes"] = json.dumps({semconv.TRAINING_JOB_ID: job})
    answer = _get(f"{url.rstrip('/')}/api/v3/traces?{urllib.parse.urlencode(parameters)}")
    chunks = answer if isinstance(answer, list) else [answer]
    for chunk in chunks:
        if not isinstance(chunk, dict) or ("result" not in chunk and "resourceSpans" not in chunk):
            raise BackendError(f"{url}: the answer is not OTLP JSON traces")
        stats.files += 1
        spans = list(spans_of_request(_normalized(chunk)))
        stats.spans += len(spans)
        yield from spans
