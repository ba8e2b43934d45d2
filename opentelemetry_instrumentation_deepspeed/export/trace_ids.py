"""One trace per global step across all ranks, with no communication.

The trace id and the root span id of global step N are a hash of (job id, N), so
every rank computes the same ones, and a sampler that decides on the trace id
(``TraceIdRatioBased``, the default's parent) decides the same on every rank.
"""

from __future__ import annotations

import hashlib

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import TraceFlags

# The flags of a step's root on every rank. The ids are a hash, as random as generated ones.
_RANDOM = getattr(TraceFlags, "RANDOM_TRACE_ID", 0)
SAMPLED = TraceFlags(TraceFlags.SAMPLED | _RANDOM)
NOT_SAMPLED = TraceFlags(_RANDOM)


def step_ids(job_id: str, step: int, engine: int = 0, rollbacks: int = 0) -> tuple[int, int]:
    """(trace id, root span id) of global step ``step`` of job ``job_id``; of the rank's ``engine``-th engine after
    its first (a second engine's step 1, or a rebuilt one's, is another step than the first's); after the engine's
    step count went back ``rollbacks`` times (a checkpoint loaded: the steps it runs again are other steps)."""
    if rollbacks:
        key = f"{job_id}\0{step}\0{engine}\0{rollbacks}"
    else:
        key = f"{job_id}\0{step}" if not engine else f"{job_id}\0{step}\0{engine}"
    digest = hashlib.blake2b(key.encode(), digest_size=24, person=b"otel-ds-step").digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:], "big") or 1
    return trace_id, span_id


_engines: dict[tuple[str, int], int] = {}  # (job id, rank) -> engines whose steps it traced so far


def engine_ordinal(job_id: str, rank: int) -> int:
    """How many engines this rank built before this one: the same on every rank where every rank builds the same
    engines in the same order (DeepSpeed builds them collectively); docs/telemetry.md says what an engine only some
    ranks build does to it."""
    ordinal = _engines.get((job_id, rank), 0)
    _engines[job_id, rank] = ordinal + 1
    return ordinal


class StepIds:
    """``step_ids`` of one job and the root sampling decision of each step, derived 64 steps at a
    time: the emitter's thread shares the GIL with the training thread, and one warm loop per 64
    steps costs less of it than a hash and a sampler call per step."""

    _BLOCK = 64

    def __init__(self, job_id: str, decide=None, engine: int = 0, rollbacks: int = 0):
        self._job_id = job_id
        self._engine, self._rollbacks = engine, rollbacks
        self._decide = decide  # from root_decision(); None: the sampler is asked at each step
        self._first = 0
        self._block: list[tuple[int, int, bool | None]] = []

    def __call__(self, step: int) -> tuple[int, int, bool | None]:
        """(trace id, root span id, whether the root is sampled, or None: ask the sampler)."""
        index = step - self._first
        if not 0 <= index < len(self._block):
            self._first, index = step, 0
            decide = self._decide
            ids = (step_ids(self._job_id, number, self._engine, self._rollbacks)
                   for number in range(step, step + self._BLOCK))
            self._block = [(trace_id, span_id, None if decide is None else decide(trace_id))
                           for trace_id, span_id in ids]
        return self._block[index]


def root_decision(sampler):
    """``trace_id -> sampled``, answering as ``sampler`` does for a root span, where that answer
    depends on the trace id alone; None for any other sampler, which is then asked at each step."""
    from opentelemetry_instrumentation_deepspeed.export import sdk

    return sdk.root_decision(sampler)


def sampled(provider: trace.TracerProvider, trace_id: int, name: str) -> bool:
    """The provider's sampler's decision for a root span of this trace, as rank 0 will make it."""
    sampler = getattr(provider, "sampler", None)
    if sampler is None:
        return True
    return sampler.should_sample(Context(), trace_id, name).decision.is_sampled()
