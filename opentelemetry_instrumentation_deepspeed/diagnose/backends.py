"""Spans from a trace backend's HTTP API: Tempo (search, then trace by id) and Jaeger v2 (``/api/v3``).

Both answer in OTLP JSON; their ids may be hex or base64 (protobuf's JSON mapping), and both are
accepted. Traces are fetched one at a time and streamed to the analysis. An answer that cannot be
read (too large, too slow, not the expected shape) is skipped and counted like a bad line of a file.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timezone

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.diagnose.reader import UNREADABLE, ReadStats, Span, take

_TIMEOUT = 30  # seconds per socket operation
_DEADLINE = 120  # seconds for one answer, however slowly it trickles
# One trace of a 1,024-rank step is a few MB; parsing takes ~25 times the answer's size in memory.
MAX_ANSWER = 256 * 2**20
_CHUNK = 2**20


class BackendError(Exception):
    """The backend could not be read: unreachable, an HTTP error, or not the expected JSON."""


class _Skipped(ValueError):
    """One answer is not read; the others are."""


def check_url(url: str) -> str | None:
    """Why ``url`` is not a backend's base URL, or None."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return f"{url!r} is not an http:// or https:// URL"
    return None


def _read(response) -> bytes:
    deadline = time.monotonic() + _DEADLINE
    chunks, size = [], 0
    while chunk := response.read(_CHUNK):
        size += len(chunk)
        if size > MAX_ANSWER:
            raise _Skipped(f"an answer larger than {MAX_ANSWER // 2**20} MiB")
        if time.monotonic() > deadline:
            raise _Skipped(f"an answer that took more than {_DEADLINE} s")
        chunks.append(chunk)
    return b"".join(chunks)


def _get(url: str) -> object:
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=_TIMEOUT) as response:
            body = _read(response)
    except urllib.error.HTTPError as error:
        raise BackendError(f"{url}: HTTP {error.code} {error.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as error:  # ValueError: http.client's bad status line
        if isinstance(error, _Skipped):
            raise BackendError(f"{url}: {error}") from None
        raise BackendError(f"{url}: {getattr(error, 'reason', error)}") from None
    try:
        return json.loads(body)
    except UNREADABLE:
        raise BackendError(f"{url}: the answer is not JSON") from None


def _hex(value: str) -> str:
    if len(value) in (16, 32) and all(c in "0123456789abcdefABCDEF" for c in value):
        return value.lower()
    try:
        return base64.b64decode(value, validate=True).hex()
    except (binascii.Error, ValueError):
        raise _Skipped(f"an id {value[:40]!r} neither hex nor base64") from None


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
                    if isinstance(span.get(key), str) and span[key]:
                        span[key] = _hex(span[key])
        if "instrumentationLibrarySpans" in resource and "scopeSpans" not in resource:
            resource["scopeSpans"] = resource.pop("instrumentationLibrarySpans")
    return {"resourceSpans": resource_spans}


def _spans(answer, stats: ReadStats, where: str) -> list[Span]:
    try:
        if not isinstance(answer, dict):
            raise _Skipped("not an OTLP JSON object")
        request = _normalized(answer)
    except _Skipped as error:
        stats.bad(f"{where}: {error}, skipped")
        return []
    except UNREADABLE:
        stats.bad(f"{where}: not OTLP JSON traces, skipped")
        return []
    return take(request, stats, where)


def tempo_spans(url: str, job: str, since_seconds: float, limit: int, stats: ReadStats) -> Iterator[Span]:
    end = int(time.time())
    query = urllib.parse.urlencode({"tags": f"training.job.id={job}", "limit": limit,
                                    "start": end - int(since_seconds), "end": end})
    found = _get(f"{url.rstrip('/')}/api/search?{query}")
    traces = found.get("traces") if isinstance(found, dict) else None
    if not isinstance(traces, list):
        raise BackendError(f"{url}: the search answer has no 'traces'")
    for entry in traces:
        trace_id = entry.get("traceID") if isinstance(entry, dict) else None
        if not isinstance(trace_id, str) or not trace_id:
            stats.bad(f"{url}/api/search: an entry without a traceID, skipped")
            continue
        where = f"{url.rstrip('/')}/api/traces/{urllib.parse.quote(trace_id, safe='')}"
        try:
            trace = _get(where)
        except BackendError as error:  # one trace gone (retention) or broken: the others are read
            stats.bad(f"{error}, skipped")
            continue
        stats.files += 1
        yield from _spans(trace, stats, where)


def jaeger_spans(url: str, service: str, job: str | None, *, since_seconds: float, limit: int,
                 stats: ReadStats) -> Iterator[Span]:
    end = datetime.now(timezone.utc)
    start = datetime.fromtimestamp(end.timestamp() - since_seconds, timezone.utc)
    parameters = {"query.service_name": service, "query.start_time_min": start.isoformat(),
                  "query.start_time_max": end.isoformat(), "query.num_traces": limit}
    if job:
        parameters["query.attributes"] = json.dumps({semconv.TRAINING_JOB_ID: job})
    where = f"{url.rstrip('/')}/api/v3/traces"
    answer = _get(f"{where}?{urllib.parse.urlencode(parameters)}")
    chunks = answer if isinstance(answer, list) else [answer]
    if not any(isinstance(chunk, dict) and ("result" in chunk or "resourceSpans" in chunk) for chunk in chunks):
        raise BackendError(f"{url}: the answer is not OTLP JSON traces")
    for chunk in chunks:
        stats.files += 1
        yield from _spans(chunk, stats, where)
