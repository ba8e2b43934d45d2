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
  The search is part of what is shuffled, so trying many periods and offsets is paid for. With
  at least NORMAL_FROM steps in and out of the class, the normal approximation of z with a
  Bonferroni bound over every class tried is computed first, and when it already is at most ALPHA
  (a pattern of many occurrences in a long run), it is the p-value and no shuffle is made.

With few steps the test is honestly weak. A pattern needs MIN_OCCURRENCES = 4 steps: three slow
steps of nineteen line up on some period by chance in about 0.6% of arrangements, and a job's
search runs over several series (each part of each rank), so noise made "every 6th step" of three
spikes in 1 of 104 healthy runs; four line up in about 0.15%. Four occurrences pass at ALPHA =
0.01 from about 15 steps on.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field

MAX_PERIOD = 64
MIN_OCCURRENCES = 4  # a period, its phase, and two more occurrences of it: three line up by chance too often
PERMUTATIONS = 499
CONFIRM_PERMUTATIONS = 4999  # periodic.confirms: one fixed class
ALPHA = 0.01
NORMAL_FROM = 10  # steps in and out of the class from which the normal bound is tried first
LATE_STARTS = 3  # slow steps from which a pattern the whole run does not show is searched


@dataclass
class Pattern:
    period: int
    offset: int  # the pattern's steps are those with number % period == offset
    steps: list[int]
    effect: float  # median over the pattern's steps minus the median of the others
    cost: float  # summed excess of the pattern's steps over the others' median
    p_value: float
    excess: dict[int, float] = field(default_factory=dict)  # step -> its excess
    since: int | None = None  # it starts at this step (a pattern that starts mid-run); None: the whole run
    baseline: float = 0.0  # the median of the other steps' values, which the excess is over


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
        # Up to the longest period whose first class can still hold MIN_OCCURRENCES steps of the span.
        for period in range(2, min(MAX_PERIOD, (self.length - 1) // (MIN_OCCURRENCES - 1)) + 1):
            for start in range(period):
                count = sum(present[start::period])
                if MIN_OCCURRENCES <= count <= n - MIN_OCCURRENCES:
                    self.classes.append((period, start, count, math.sqrt((n + 1) * (n - count) / (12 * count))))
        # Per class, from twice its rank sum S2: AUC = (S2 - c(c+1)) / (2c(n-c)), z = (S2/2c - mean) / sd.
        self.scored = [(period, start, count, count * (count + 1), 2 * count * (n - count),
                        1 / (2 * count * deviation), self.mean / deviation)
                       for period, start, count, deviation in self.classes]

    def best(self, ranks: list[float]) -> tuple[tuple[int, float], int, int]:
        """The class of the highest (AUC, z), its period and start. Ranks are multiples of 1/2, so
        twice a class's rank sum is an integer and its AUC is compared exactly (in parts per 10^9)."""
        dense = [0] * self.length
        for position, rank in zip(self.positions, ranks, strict=True):
            dense[position] = int(2 * rank)
        best = ((-1, -math.inf), 0, 0)
        best_score = best[0]
        for period, start, _count, auc_offset, auc_scale, z_scale, z_offset in self.scored:
            twice = sum(dense[start::period])
            score = ((twice - auc_offset) * 10**9 // auc_scale, twice * z_scale - z_offset)
            if score > best_score:
                best_score, best = score, (score, period, start)
        return best


def find_period(numbers: list[int], values: list[float], min_cost: float, rng: random.Random) -> Pattern | None:
    """The periodic pattern of ``values`` (one per step of ``numbers``), or None.

    Over the whole run first; failing that, from each of the first LATE_STARTS slow steps past the run's first quarter
    on (a value at least halfway from the median to the MIN_OCCURRENCES-th largest): a pattern that starts mid-run (a
    loader that degrades, a program that starts checkpointing) has too few of its class's steps slow over the whole
    run. Those searches share ALPHA (Bonferroni)."""
    if len(numbers) < 2 * MIN_OCCURRENCES or len(set(numbers)) != len(numbers):
        return None
    found = _search(numbers, values, min_cost, rng, ALPHA)
    if found is not None:
        return found
    middle = statistics.median(values)
    # Halfway to the MIN_OCCURRENCES-th largest value: a pattern has that many slow steps, and one far slower step
    # (the host's hiccup in one of them) must not raise the bar above the others.
    slow = middle + (sorted(values)[-MIN_OCCURRENCES] - middle) / 2
    # Mid-run: the first quarter of the run at least without it (else the whole run's search, which failed, stands).
    quarter = len(numbers) // 4
    starts = [index for index, value in enumerate(values) if value >= slow and index >= quarter][:LATE_STARTS]
    for first in starts:
        if len(numbers) - first < 2 * MIN_OCCURRENCES:
            break
        # Shuffles of their own: the draws of the whole-run searches that follow (other parts, other ranks) stay
        # those they were without these searches.
        found = _search(numbers[first:], values[first:], min_cost, random.Random(first), ALPHA / LATE_STARTS)
        if found is None:
            continue
        found.since = numbers[first]
        _back_to_its_start(found, numbers[:first], values[:first])
        # The step searched from was picked for being slow: MIN_OCCURRENCES more after it, or its choice made the test
        if sum(step > numbers[first] for step in found.steps) >= MIN_OCCURRENCES and found.cost >= min_cost:
            return found if found.since >= numbers[quarter] else None
    return None


def _back_to_its_start(pattern: Pattern, numbers: list[int], values: list[float]) -> None:
    """A pattern found from ``numbers``'s end on starts where the stalls did: its first steps that carry less than half
    its effect (its excess over the same baseline) leave it; else its class's earlier steps, latest first, join it
    while they carry that much."""
    while pattern.steps and pattern.excess[pattern.steps[0]] < pattern.effect / 2:
        first = pattern.steps.pop(0)
        pattern.cost -= max(pattern.excess.pop(first), 0.0)
        pattern.since = pattern.steps[0] if pattern.steps else first
        numbers, values = [], []  # it started later than the search: nothing before it
    for number, value in zip(reversed(numbers), reversed(values), strict=True):
        if number % pattern.period != pattern.offset:
            continue
        excess = value - pattern.baseline
        if excess < pattern.effect / 2:
            break
        pattern.steps.insert(0, number)
        pattern.excess[number] = excess
        pattern.cost += excess
        pattern.since = number


def _search(numbers: list[int], values: list[float], min_cost: float, rng: random.Random,
            alpha: float) -> Pattern | None:
    classes = _Classes(numbers)
    if not classes.classes:
        return None
    ranks = _ranks(values)
    observed, period, start = classes.best(ranks)
    pairs = list(zip(numbers, values, strict=True))
    on = [(number, value) for number, value in pairs if (number - classes.first) % period == start]
    baseline = statistics.median(value for number, value in pairs if (number - classes.first) % period != start)
    effect = statistics.median(value for _n, value in on) - baseline
    excess = {number: value - baseline for number, value in on}
    if (effect <= 0 or sum(max(value, 0.0) for value in excess.values()) < min_cost
            or sum(value >= effect / 2 for value in excess.values()) < 0.75 * len(on)):
        return None
    p_value = _p_value(classes, ranks, observed, len(on), rng, alpha=alpha)
    if p_value > alpha:
        return None
    return Pattern(period, (classes.first + start) % period, [number for number, _v in on], effect,
                   sum(max(value, 0.0) for value in excess.values()), p_value, excess, baseline=baseline)


def confirms(numbers: list[int], values: list[float], period: int, offset: int, *, effect: float,
             rng: random.Random, since: int | None = None) -> Pattern | None:
    """The pattern another rank's search found (``period``, ``offset``, its median ``effect``), tested on these
    values as one hypothesis fixed beforehand: there is no search to pay for, so a pattern too short to be
    found by the search on its own (4 occurrences in 12 steps) can still be confirmed on a second rank. It
    holds when at least 3/4 of the class's steps exceed the others' median by half of ``effect`` or more,
    and the class's rank sum is reached by at most ALPHA of the shuffles."""
    pairs = [(number, value) for number, value in zip(numbers, values, strict=True) if since is None or number >= since]
    values = [value for _number, value in pairs]
    inside = [index for index, (number, _value) in enumerate(pairs) if number % period == offset]
    outside = [value for number, value in pairs if number % period != offset]
    if len(inside) < MIN_OCCURRENCES or len(outside) < MIN_OCCURRENCES:
        return None
    baseline = statistics.median(outside)
    excess = {pairs[index][0]: pairs[index][1] - baseline for index in inside}
    if sum(value >= effect / 2 for value in excess.values()) < 0.75 * len(inside):
        return None
    ranks = _ranks(values)
    observed = sum(ranks[index] for index in inside)
    # One class's rank sum per shuffle is cheap: enough shuffles that a p-value near ALPHA is decided by the
    # data, not by the draw (499 passed a pattern of true p ~0.007 in 16 of 20 seeds).
    allowed = int(ALPHA * (CONFIRM_PERMUTATIONS + 1)) - 1
    shuffled, exceeded = list(ranks), 0
    for _ in range(CONFIRM_PERMUTATIONS):
        rng.shuffle(shuffled)
        if sum(shuffled[index] for index in inside) >= observed:
            exceeded += 1
            if exceeded > allowed:
                return None
    return Pattern(period, offset, sorted(excess), statistics.median(excess.values()),
                   sum(max(value, 0.0) for value in excess.values()), (exceeded + 1) / (CONFIRM_PERMUTATIONS + 1),
                   excess, since, baseline)


def _p_value(classes: _Classes, ranks: list[float], observed: tuple, count: int, rng: random.Random,
             *, alpha: float = ALPHA) -> float:
    """How often the search scores at least ``observed`` by chance; above ``alpha`` it may stop early."""
    if min(count, classes.n - count) >= NORMAL_FROM:
        # Long runs: the rank-sum z is close to normal, and a Bonferroni bound over every class tried
        # is a valid p-value; a real pattern of many occurrences passes it without shuffles.
        bound = min(1.0, len(classes.classes) * 0.5 * math.erfc(observed[1] / math.sqrt(2)))
        if bound <= alpha:
            return bound
    # Exceedances that still leave p <= alpha (with alpha / 3, the shuffles can resolve p = 0.002: 499 of them)
    allowed = int(alpha * (PERMUTATIONS + 1)) - 1
    shuffled, exceeded = list(ranks), 0
    for _ in range(PERMUTATIONS):
        rng.shuffle(shuffled)
        if classes.best(shuffled)[0] >= observed:
            exceeded += 1
            if exceeded > allowed:
                break
    return (exceeded + 1) / (PERMUTATIONS + 1)
