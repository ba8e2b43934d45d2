"""Follow the wait: who arrives last at each collective, whom it holds, and why it was late.

A synchronous collective joined across ranks by (group, sequence) ends for nobody before its last
rank arrives: every other rank waits from its own arrival to that moment (or to its own end, if it
left first). That wait is charged to the last rank, in the step in which the last rank issued the
collective. Per step, the rank that held the others longest is the step's late rank, and the parts
of its own step (data wait, forward, backward, optimizer, an earlier collective, host work) that
exceed the other ranks' median for that step say what made it late.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

# The parts of a step a rank spends on its own; ``comm_wait`` is the others' doing.
OWN_PARTS = ("data_wait", "forward", "backward", "optimizer", "exposed_comm", "unaccounted")


@dataclass
class Waits:
    # step -> rank -> seconds the rank waited in collectives for a later rank
    waited: dict[int, dict[int, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    # rank -> step -> seconds the rank held the others (the longest any of them waited, per collective)
    held: dict[int, dict[int, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    # rank -> arrival lateness (seconds after the first rank) at every collective it joined with others
    lateness: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    joined: int = 0  # collectives seen on at least two ranks

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
            waits.lateness[rank].append((start - first) / 1e9)
            if rank != last_rank:
                waited = max(min(last, end) - start, 0) / 1e9
                waits.waited[own_step][rank] += waited
                longest = max(longest, waited)
        if longest > 0:
            waits.held[last_rank][step] += longest
    return waits


def excess_parts(parts: dict[int, dict[int, dict]], rank: int, step: int) -> dict[str, float]:
    """How much longer each of ``rank``'s own parts took in ``step`` than the other ranks' median."""
    mine = parts.get(rank, {}).get(step)
    others = [by_step[step] for other, by_step in parts.items() if other != rank and step in by_step]
    if mine is None or not others:
        return {}
    return {part: mine[part] - statistics.median(other[part] for other in others) for part in OWN_PARTS}


def binomial_tail(successes: int, trials: int, probability: float) -> float:
    """P(X >= successes) for X ~ Binomial(trials, probability)."""
    if successes <= 0:
        return 1.0
    if probability >= 1.0:
        return 1.0
    log_p, log_q = math.log(probability), math.log1p(-probability)
    total = 0.0
    for count in range(successes, trials + 1):
        total += math.exp(math.lgamma(trials + 1) - math.lgamma(count + 1) - math.lgamma(trials - count + 1)
                          + count * log_p + (trials - count) * log_q)
    return min(total, 1.0)
