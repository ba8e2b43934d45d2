"""Follow the wait: who arrives last at each collective, whom it holds, and why it was late.

A synchronous collective joined across ranks by (group, sequence) ends for nobody before its last
rank arrives: every other rank waits from its own arrival to that moment (or to its own end, if it
left first). That wait is charged to the last rank, in the step in which the last rank issued the
collective. Per step, the rank that held the others longest is the step's late rank, and the parts
of its own step (data wait, forward, backward, optimizer, an earlier collective, host work, and the loop's code
before the step) that exceed the other ranks' median for that step say what made it late.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass, field

# The parts of a step a rank spends on its own; ``comm_wait`` is the others' doing. ``between_steps``: the loop's own
# code before the step opened (from the rank's previous step's end), which a rank that lingers there (a checkpoint, an
# evaluation, logging) makes the others wait for in the step's first collectives.
OWN_PARTS = ("data_wait", "forward", "backward", "optimizer", "exposed_comm", "unaccounted", "between_steps")


@dataclass
class Waits:
    # step -> rank -> seconds the rank waited in collectives for a later rank
    waited: dict[int, dict[int, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    # rank -> step -> seconds the rank held the others (the longest any of them waited, per collective)
    held: dict[int, dict[int, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    # rank -> arrival lateness (seconds after the first rank) at every collective it joined with others
    lateness: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    joined: int = 0  # collectives seen on at least two ranks
    joined_in: set[int] = field(default_factory=set)  # the steps that hold one of them

    def late_rank(self, step: int) -> tuple[int | None, float]:
        """The rank that held the others longest in ``step``, and for how long."""
        best, seconds = None, 0.0
        for rank, steps in self.held.items():
            if steps.get(step, 0.0) > seconds:
                best, seconds = rank, steps[step]
        return best, seconds


def follow(comm: dict[int, dict[int, list]]) -> Waits:
    """``comm``: rank -> step -> the step's synchronous collectives as (start, end, group, sequence)."""
    joined: dict[tuple, dict[int, tuple[int, int, int]]] = defaultdict(dict)
    for rank, steps in comm.items():
        for step, collectives in steps.items():
            for start, end, group, sequence in collectives:
                if sequence is not None:
                    joined[(group, sequence)][rank] = (start, end, step)
    waits = Waits()
    for arrivals in joined.values():
        if len(arrivals) < 2:
            continue
        waits.joined += 1
        last_rank = max(arrivals, key=lambda rank: arrivals[rank][0])
        last, _end, step = arrivals[last_rank]
        first = min(start for start, _e, _s in arrivals.values())
        longest = 0.0
        for rank, (start, end, own_step) in arrivals.items():
            waits.joined_in.add(own_step)
            waits.lateness[rank].append((start - first) / 1e9)
            if rank != last_rank:
                waited = max(min(last, end) - start, 0) / 1e9
                waits.waited[own_step][rank] += waited
                longest = max(longest, waited)
        if longest > 0:
            waits.held[last_rank][step] += longest
    return waits


class Excess:
    """How much longer each of a rank's own parts took in a step than the other ranks' median.

    Each step's values of each part are sorted once; the median without one rank is then read off
    the sorted list around that rank's value, so a query costs O(log ranks), not a sort."""

    def __init__(self, parts: dict[int, dict[int, dict]]):
        self.parts = parts
        self.sorted: dict[int, dict[str, list[float]]] = {}
        for by_step in parts.values():
            for step in by_step:
                if step not in self.sorted:
                    values = [other[step] for other in parts.values() if step in other]
                    self.sorted[step] = {part: sorted(v[part] for v in values) for part in OWN_PARTS}

    def of(self, rank: int, step: int) -> dict[str, float]:
        mine = self.parts.get(rank, {}).get(step)
        if mine is None or len(self.sorted.get(step, {}).get(OWN_PARTS[0], ())) < 2:
            return {}
        return {part: mine[part] - _median_without(self.sorted[step][part], mine[part]) for part in OWN_PARTS}


def _median_without(ordered: list[float], value: float) -> float:
    """The median of ``ordered`` (sorted) with one occurrence of ``value`` left out."""
    skip = bisect.bisect_left(ordered, value)
    count = len(ordered) - 1

    def at(index: int) -> float:
        return ordered[index if index < skip else index + 1]

    middle = count // 2
    return at(middle) if count % 2 else (at(middle - 1) + at(middle)) / 2


def signed_rank_p(differences: list[float]) -> float:
    """One-sided Wilcoxon signed-rank test that ``differences`` lean positive: P(W+ >= observed).

    Exact (every sign pattern counted) up to 60 non-zero differences, the normal approximation
    beyond. Ties in magnitude take consecutive ranks: a little conservative or liberal by one rank."""
    nonzero = sorted((d for d in differences if d), key=abs)
    n = len(nonzero)
    if not n:
        return 1.0
    observed = sum(rank for rank, d in enumerate(nonzero, 1) if d > 0)
    if n > 60:
        mean, variance = n * (n + 1) / 4, n * (n + 1) * (2 * n + 1) / 24
        return 0.5 * math.erfc((observed - 0.5 - mean) / math.sqrt(2 * variance))
    counts = [1] + [0] * (n * (n + 1) // 2)  # counts[s]: sign patterns whose positive ranks sum to s
    for rank in range(1, n + 1):
        for total in range(len(counts) - 1, rank - 1, -1):
            counts[total] += counts[total - rank]
    return sum(counts[observed:]) / 2**n
