"""One trace per global step across all ranks, with no communication.

The trace id and the root span id of global step N are a hash of (job id, N), so
every rank computes the same ones, and a sampler that decides on the trace id
(``TraceIdRatioBased``, the default's parent) decides the same on every rank.
"""

from __future__ import annotations

import hashlib
import threading

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace.id_generator import IdGenerator


def step_ids(job_id: str, step: int) -> tuple[int, int]:
    """(trace id, root span id) of global step ``step`` of job ``job_id``."""
    digest = hashlib.blake2b(f"{job_id}\0{step}".encode(), digest_size=24, person=b"otel-ds-step").digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:], "big") or 1
    return trace_id, span_id


class PinnableIdGenerator(IdGenerator):
    """Passes through to the SDK's generator, except for the one span it is pinned for.

    Installed on this project's own tracer, so that rank 0 can emit the step's root span
    under the ids that every other rank already uses as its parent.
    """

    def __init__(self, inner: IdGenerator):
        self._inner = inner
        self._pinned = threading.local()

    def pin(self, trace_id: int, span_id: int) -> None:
        self._pinned.ids = (trace_id, span_id)

    def unpin(self) -> None:
        self._pinned.ids = None

    def generate_trace_id(self) -> int:
        ids = getattr(self._pinned, "ids", None)
        return ids[0] if ids else self._inner.generate_trace_id()

    def generate_span_id(self) -> int:
        ids = getattr(self._pinned, "ids", None)
        return ids[1] if ids else self._inner.generate_span_id()

    def is_trace_id_random(self) -> bool:
        return self._inner.is_trace_id_random()


def pinnable(tracer: trace.Tracer) -> PinnableIdGenerator | None:
    """Make ``tracer`` able to emit spans with chosen ids; None if it is not the SDK's."""
    inner = getattr(tracer, "id_generator", None)
    if isinstance(inner, PinnableIdGenerator):
        return inner
    if not isinstance(inner, IdGenerator):
        return None
    tracer.id_generator = PinnableIdGenerator(inner)
    return tracer.id_generator


def sampled(provider: trace.TracerProvider, trace_id: int, name: str) -> bool:
    """The provider's sampler's decision for a root span of this trace, as rank 0 will make it."""
    sampler = getattr(provider, "sampler", None)
    if sampler is None:
        return True
    return sampler.should_sample(Context(), trace_id, name).decision.is_sampled()
