"""How well the ranks' clocks agree once aligned: the residual offset, from collectives joined by sequence.

The reader moves each rank's times by its ``training.clock.offset`` (estimated at start, refreshed by
its ``training.clock.sync`` spans during the run: ``reader.Drift``). A
synchronous all-reduce, all-gather, reduce-scatter or barrier returns on every rank at nearly the
same moment (the last rank's data completes it everywhere), so over many of them the median of
(rank's end - rank 0's end) is what remains of the rank's offset: the drift since the latest
reading plus the estimate's error. It is reported per rank (``clocks`` in the JSON), at no cost beyond the spans
already read: a residual larger than the waits it would distort says the figures across ranks
need care.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.diagnose.reader import Span

_SYMMETRIC = frozenset({"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "barrier",
                        "all_reduce_coalesced", "all_gather_single", "reduce_scatter_single"})
MAX_JOINED = 4096  # collectives kept per job: a median needs no more


class Clocks:
    def __init__(self):
        self._ends: dict[str, dict[tuple, dict[int, int]]] = defaultdict(dict)

    def add(self, span: Span) -> None:
        attributes = span.attributes
        if (not span.name.startswith(semconv.SPAN_COMM_PREFIX) or attributes.get(semconv.COMM_ASYNC)
                or attributes.get(semconv.COMM_OP) not in _SYMMETRIC
                or attributes.get(semconv.COMM_SEQUENCE) is None):
            return
        joined = self._ends[span.job]
        key = (attributes.get(semconv.COMM_GROUP_NAME, "0"), attributes[semconv.COMM_SEQUENCE])
        ends = joined.get(key)
        if ends is None:
            if len(joined) >= MAX_JOINED:
                return
            ends = joined[key] = {}
        ends[span.rank] = span.end

    def residuals(self, job: str) -> dict[int, dict]:
        """Rank -> the median residual offset to rank 0 (seconds) and the collectives it rests on."""
        differences: dict[int, list[int]] = defaultdict(list)
        for ends in self._ends.get(job, {}).values():
            zero = ends.get(0)
            if zero is None:
                continue
            for rank, end in ends.items():
                if rank:
                    differences[rank].append(end - zero)
        return {rank: {"residual_seconds": statistics.median(values) / 1e9, "collectives": len(values)}
                for rank, values in sorted(differences.items())}
