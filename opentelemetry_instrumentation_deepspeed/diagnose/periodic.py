"""Every k-th step slower: a periodic pattern in one series of per-step values, tested against chance.

The candidates are the residue classes of the step numbers: period k (2 to MAX_PERIOD, at least
MIN_OCCURRENCES steps in the class and as many outside it) and offset r. Each is scored on the
ranks of its steps' values (ranks make one huge noise spike count no more than any slow step):
first by how cleanly its steps stand above the others (the rank-sum AUC, 1 when every step of the
class is slower than every other step), then by the standardized mean rank (a Wilcoxon rank-sum
z, which prefers the larger of two clean classes: period 5 over period 10). The best class must then

- cost enough: its steps' values exceed the median of the other steps by, summed, at least
  ``min_cost`` seconds, with the median of its steps above that median (so a few spikes that fall
  into a class do not make it slow);
- be consistent: at least 3/4 of its steps carry at least half the median excess;
- hold beyond chance: the same search (the best z over every period and offset) on the values
  shuffled across the steps reaches the observed z in at most ALPHA of PERMUTATIONS shuffles.
  The search is part of what is shuffled, so trying many periods and offsets is paid for.

With few steps the test is honestly weak: three slow steps in eighteen line up periodically by
chance in about 2% of arrangements, so a pattern needs at least 4 occurrences in about 20 steps to
pass at ALPHA = 0.01, and 3 in about 30.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field

MAX_PERIOD = 64
MIN_OCCURRENCES = 3
PERMUTATIONS = 499
ALPHA = 0.01


@dataclass
class Pattern:
    period: int
    offset: int  # the pattern's steps are those with number % period == offset
    steps: list[int]
    effect: float  # median over the pattern's steps minus the median of the others
    cost: float  # summed excess of the pattern's steps over the others' median
    p_value: float
    excess: dict[int, float] = field(default_factory=dict)  # step -> its excess


def _ranks(values: list[float]) -> list[float]:
    """Ranks 1..n, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    index = 0
    while index < len(order):
        end = index
        while end + 1 < len(order) and values[order[end + 1]] == values[order[index]]:
            end += 1
        for position in order[index:end + 1]:
            ranks[position] = (index + end) / 2 + 1
        index = end + 1
    return ranks


class _Classes:
    """The residue classes of a set of step numbers, laid out densely so a class is a slice."""

    def __init__(self, numbers: list[int]):
        self.first = min(numbers)
        self.length = max(numbers) - self.first + 1
        self.positions = [number - self.first for number in numbers]
        present = [0] * self.length
        for position in self.positions:
            present[position] = 1
        self.n = n = len(numbers)
        self.mean = (n + 1) / 2
        self.classes = []  # (period, start, count, standard deviation of the class's mean rank)
        for period in range(2, min(MAX_PERIOD, n // MIN_OCCURRENCES) + 1):
            for start in range(period):
                count = sum(present[start::period])
                if MIN_OCCURRENCES <= count <= n - MIN_OCCURRENCES:
                    self.classes.append((period, start, count, math.sqrt((n + 1) * (n - count) / (12 * count))))

    def best(self, ranks: list[float]) -> tuple[tuple[float, float], int, int]:
        """The class of the highest (AUC, z), its period and start."""
        dense = [0.0] * self.length
        for position, rank in zip(self.positions, ranks, strict=True):
            dense[position] = rank
        mean, n = self.mean, self.n
        best = ((-math.inf, -math.inf), 0, 0)
        for period, start, count, deviation in self.classes:
            mean_rank = sum(dense[start::period]) / count
            score = (round((mean_rank - (count + 1) / 2) / (n - count), 9), (mean_rank - mean) / deviation)
            if score > best[0]:
                best = (score, period, start)
        return best


def find_period(numbers: list[int], values: list[float], min_cost: float, rng: random.Random) -> Pattern | None:
    """The periodic pattern of ``values`` (one per step of ``numbers``), or None."""
    if len(numbers) < 2 * MIN_OCCURRENCES or len(set(numbers)) != len(numbers):
        return None
    classes = _Classes(numbers)
    if not classes.classes:
        return None
    ranks = _ranks(values)
    observed, period, start = classes.best(ranks)
    pairs = list(zip(numbers, values, strict=True))
    on = [(number, value) for number, value in pairs if (number - classes.first) % period == start]
    off = [value for number, value in pairs if (number - classes.first) % period != start]
    baseline = statistics.median(off)
    effect = statistics.median(value for _n, value in on) - baseline
    excess = {number: value - baseline for number, value in on}
    cost = sum(max(value, 0.0) for value in excess.values())
    if effect <= 0 or cost < min_cost:
        return None
    if sum(value >= effect / 2 for value in excess.values()) < 0.75 * len(on):
        return None
    allowed = int(ALPHA * (PERMUTATIONS + 1)) - 1  # exceedances that still leave p <= ALPHA
    shuffled, exceeded = list(ranks), 0
    for _ in range(PERMUTATIONS):
        rng.shuffle(shuffled)
        if classes.best(shuffled)[0] >= observed:
            exceeded += 1
            if exceeded > allowed:
                return None
    return Pattern(period, (classes.first + start) % period, [number for number, _v in on], effect, cost,
                   (exceeded + 1) / (PERMUTATIONS + 1), excess)
