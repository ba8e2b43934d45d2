"""Change points of the input and of the time per token: INPUT, or compute that got slower.

Each ``training.step`` span says how many tokens its batches held (``training.step.padded_tokens``:
samples x padded length, what the model computes on; ``training.step.tokens``: the real ones;
``training.step.sequence_length``). Per step of the job (the ranks of a step summed, its time the
median over ranks, which wait for each other), two series are searched for change points: the
padded tokens per step, which are exact counts, and the time per padded token, which is noisy.

- The tokens per step change at step K, and the step time follows in the same direction: INPUT.
  The token counts are exact, so a looser test suffices for the time: its medians differ by
  ``TIME_FACTOR`` the same way, and a step after the change is slower (faster, when the tokens
  dropped) than one before with probability ``FOLLOWS`` or more (Mann-Whitney's statistic).
  The finding says by how much each changed, and whether the time per token stayed the same
  (the step got slower because it holds more tokens) or changed too (attention grows with the
  sequence length, a device is more efficient on larger batches). Where the step time does not
  follow, the step without its waits for a CPU and for each other (below; its longest rank's, per
  step) is tested the same way: a neighbour's job that left as the sequences grew makes the shorter
  steps as long as the longer ones, and hides the change from the step time, not from the work.
- The time per token rises at step K while the tokens per step do not: the compute got slower per
  token: a hardware or model finding (COMPUTE), not the input's. (Faster is no finding.)
- Unless the job's training threads waited for a CPU from step K: take out of each rank's step the
  time its training thread was ready to run but had no CPU (``training.step.thread.cpu.wait`` times
  the step) and the time it waited for the other ranks in collectives (their waits, or their work),
  and its exposed communication beyond the least of any rank's in that step (a transfer takes the
  same time on every rank: the rest is the rank's delay in taking its result, its threads' wait for
  a CPU), and of that least, the time the native threads that carry the transfer (gloo's) waited for
  a CPU on the rank where they waited most (``training.step.native_threads.cpu.wait``); of the ranks,
  the one left with the most time (the median of its steps on each side of the change: the longest
  rank of each step would grow with the noise) is the step without those waits. The time per
  token that remains does not change by ``PER_TOKEN_FACTOR``; no CPU was idle on its host
  (under ``HOST_IDLE``). The steps are slower because the host is busier (a neighbour's job, more
  competing processes), not because a device or the model got slower: no finding of the job, a
  note on the host instead (``host_load``), which the verdict "none" quotes. A device or model that
  got slower keeps its change once the wait is taken out, however loaded the host was before and
  after; so does a thread that slept or waited for a device while a neighbour filled the idle
  CPUs. Steps without the wait measured (older files, other kernels) keep the finding.

A change point is the split of a segment that best separates the logarithms of its values (least
squares, both sides at least ``MIN_SEGMENT`` steps), searched again inside each side (binary
segmentation); where it fails the test below, the split one step either side is tried (a step
the change reached halfway may pull the least-squares split onto the wrong side of it). It counts
only if it holds beyond the noise: the medians of the two sides differ by
the factor below, and at least ``SEPARATION`` of the steps on each side lie on their side of the
geometric middle of the two medians (a run of a few slow steps, or noise, does not). A stretch of
slow steps in the middle of a run (a neighbour's job on the host for a while) is no single split
that holds, so the time per token makes no finding of it: its findings are "from step K on". The
tokens per step are exact counts: where a segment has no split that holds, the stretch inside it
whose tokens and the rest's are the two least-squares levels is tested the same way against the
rest (longer sequences in steps 10-15 of 30, then back: one finding, "in steps 10-15 (then back)",
costed as the change). The first step is left out: it pays for warm-up.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import defaultdict

from opentelemetry_instrumentation_deepspeed import semconv

MIN_SEGMENT = 3  # steps on each side of a change point, at least
TOKEN_FACTOR = 1.2  # tokens per step change at least this much (either way) to be a change of the input
TIME_FACTOR = 1.15  # and the step time by at least this much, in the same direction, to have cost anything
FOLLOWS = 0.75  # probability that a step after the change is slower (or faster) than one before
PER_TOKEN_FACTOR = 1.5  # the time per token, with the tokens unchanged, to be a compute change
SEPARATION = 0.85  # share of each side's steps that lies on its side of the middle
MAX_CHANGES = 4  # change points searched per series
SPELL_POSITIONS = 400  # starts (and ends) of a stretch tried per segment, at most
UNCHANGED = 1.25  # time per token within this factor (either way) reads "unchanged"
HOST_IDLE = 0.5  # CPUs: fewer idle than this on the host, and the training threads waited for one

REMEDIES = {
    "INPUT": ["check what changed in the data at that step: a new dataset mix or shard, a curriculum or "
              "sequence-length schedule, packing or truncation settings",
              "if longer sequences are intended, budget the step time for them (time per token is the figure "
              "to watch); else restore the sequence length or batch size",
              "bucket sequences by length, or pack them, to cut padding"],
    "COMPUTE": ["look at the ranks' devices from that step on: clocks, throttling, power, a noisy neighbour "
                "(hw.gpu.* metrics, nvidia-smi -q -d PERFORMANCE)",
                "profile a step before and after the change (touch the trigger file) and compare operator times: "
                "a changed kernel, dtype or model path"],
}


class InputSeries:
    """What ``training.step`` spans say about their input, per (job, rank, trace)."""

    def __init__(self):
        self._steps: dict[tuple[str, int, str], tuple[int, dict]] = {}

    def add(self, span) -> None:
        """A ``training.step`` span; a retried step keeps its last attempt."""
        attributes = span.attributes
        if semconv.TRAINING_STEP_PADDED_TOKENS not in attributes:
            return
        key = (span.job, span.rank, span.trace_id)
        known = self._steps.get(key)
        if known is None or span.end > known[0]:
            self._steps[key] = (span.end, attributes)

    def of(self, job: str, rank: int, trace_id: str) -> dict | None:
        found = self._steps.get((job, rank, trace_id))
        return None if found is None else found[1]


def _geometric_middle(low: float, high: float) -> float:
    return math.sqrt(low * high) if low > 0 and high > 0 else (low + high) / 2


def _separation(before: list[float], after: list[float]) -> float:
    """The smaller share, of the two sides, of the steps on their own side of the middle of the medians."""
    first, second = statistics.median(before), statistics.median(after)
    middle = _geometric_middle(first, second)
    if second >= first:
        return min(sum(v < middle for v in before) / len(before), sum(v > middle for v in after) / len(after))
    return min(sum(v > middle for v in before) / len(before), sum(v < middle for v in after) / len(after))


def _follows(before: list[float], after: list[float], up: bool) -> float:
    """Probability that a value after is above (``up``) or below one before, ties counting half."""
    ordered = sorted(before)
    wins = 0.0
    for value in after:  # by bisection: long runs have many steps on each side
        below, not_above = bisect.bisect_left(ordered, value), bisect.bisect_right(ordered, value)
        wins += (below if up else len(ordered) - not_above) + 0.5 * (not_above - below)
    return wins / (len(before) * len(after))


def _best_split(logs: list[float], low: int, high: int) -> int | None:
    """The index in (low, high) that splits logs[low:high] into two least-squares segments."""
    if high - low < 2 * MIN_SEGMENT:
        return None
    prefix, squares = [0.0], [0.0]
    for value in logs[low:high]:
        prefix.append(prefix[-1] + value)
        squares.append(squares[-1] + value * value)

    def cost(a: int, b: int) -> float:  # squared deviations from the mean of logs[low + a: low + b]
        total = prefix[b] - prefix[a]
        return squares[b] - squares[a] - total * total / (b - a)

    size = high - low
    best, where = None, None
    for split in range(MIN_SEGMENT, size - MIN_SEGMENT + 1):
        value = cost(0, split) + cost(split, size)
        if best is None or value < best - 1e-12:
            best, where = value, split
    return None if where is None else low + where


def _holds(before: list[float], after: list[float], factor: float) -> bool:
    """The two sides' medians differ by ``factor`` and each side's steps lie on their side of the middle."""
    if len(before) < MIN_SEGMENT or len(after) < MIN_SEGMENT:
        return False
    ratio = statistics.median(after) / statistics.median(before)
    return max(ratio, 1 / ratio) >= factor and _separation(before, after) >= SEPARATION


def change_points(values: list[float], factor: float, *, spells: bool = False) -> list[int]:
    """Indices where ``values`` (positive) change by ``factor`` or more, beyond the noise, in order. ``spells``: where
    a segment has no split that holds, a stretch inside it that differs from the rest of it (``_best_spell``) gives
    two, its start and its end."""
    logs = [math.log(v) for v in values]
    found: list[int] = []
    segments = [(0, len(values))]
    while segments and len(found) < MAX_CHANGES:
        low, high = segments.pop()
        split = _best_split(logs, low, high)
        if split is None:
            continue
        # The least-squares split, else a neighbour: a step that changed halfway (the change came in its
        # middle, or the host's load moved with it) may pull the split one step off, onto the wrong side.
        split = next((at for at in (split, split - 1, split + 1)
                      if _holds(values[low:at], values[at:high], factor)), None)
        if split is not None:
            found.append(split)
            segments += [(low, split), (split, high)]
            continue
        spell = _best_spell(logs, low, high) if spells and len(found) + 2 <= MAX_CHANGES else None
        if spell is not None and _holds(values[low:spell[0]] + values[spell[1]:high], values[spell[0]:spell[1]],
                                        factor):
            found += spell
            segments += [(low, spell[0]), (spell[0], spell[1]), (spell[1], high)]
    return sorted(found)


def _best_spell(logs: list[float], low: int, high: int) -> tuple[int, int] | None:
    """The stretch (start, end) inside logs[low:high], neither at its start nor at its end, whose values and the
    rest's are the two least-squares segments: longer sequences for some steps, then back. A long segment's starts
    and ends are tried SPELL_POSITIONS apart at most, then every one within a stride of the best: its search stays
    bounded, its edges exact."""
    size = high - low
    if size < 2 * MIN_SEGMENT + 2:
        return None
    prefix, squares = [0.0], [0.0]
    for value in logs[low:high]:
        prefix.append(prefix[-1] + value)
        squares.append(squares[-1] + value * value)
    total, total_squares = prefix[-1], squares[-1]

    def best_of(starts, ends) -> tuple[float, int, int] | None:
        best = None
        for start in starts:
            for end in ends:
                inside = end - start
                if not (1 <= start and end < size and inside >= MIN_SEGMENT and size - inside >= MIN_SEGMENT):
                    continue
                inner, inner_squares = prefix[end] - prefix[start], squares[end] - squares[start]
                outer, outer_squares = total - inner, total_squares - inner_squares
                cost = (inner_squares - inner * inner / inside) + (outer_squares - outer * outer / (size - inside))
                if best is None or cost < best[0] - 1e-12:
                    best = (cost, start, end)
        return best

    stride = max(1, size // SPELL_POSITIONS)
    found = best_of(range(1, size, stride), range(1, size, stride))
    if found is not None and stride > 1:
        _cost, start, end = found
        found = best_of(range(start - stride, start + stride + 1), range(end - stride, end + stride + 1))
    return None if found is None else (low + found[1], low + found[2])


def _segments(count: int, points: list[int], at: int) -> tuple[range, range]:
    """The steps on each side of change point ``at``, bounded by its neighbours in ``points``."""
    index = points.index(at)
    low = points[index - 1] if index > 0 else 0
    high = points[index + 1] if index + 1 < len(points) else count
    return range(low, at), range(at, high)


def _factor(value: float) -> str:
    if value >= 1:
        return f"x{value:.1f}"
    return f"/{1 / value:.1f}"


def _duration(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds >= 1e-6 else f"{seconds * 1e9:.0f} ns"


def _job_steps(series: InputSeries, job: str, by_rank: dict[int, list[dict]]) -> list[dict]:
    """Per step of the job, by number: its time (median over ranks), tokens summed over ranks, longest sequence. A step
    is its trace (a step number run again after a rollback is another step, after the first)."""
    steps: dict[str, dict] = defaultdict(lambda: {"seconds": [], "padded": 0, "tokens": 0, "length": 0, "samples": 0,
                                                  "counted": 0, "ranks": {}, "trace_id": "", "cpus": {},
                                                  "unwaited": {}, "start": None})
    for rank, rank_steps in by_rank.items():
        for step in rank_steps:
            entry = steps[step["trace_id"]]
            entry["number"] = step["step"]
            entry["start"] = step["start"] if entry["start"] is None else min(entry["start"], step["start"])
            entry["seconds"].append(step["seconds"])
            entry["trace_id"] = step["trace_id"]
            attributes = series.of(job, rank, step["trace_id"])
            if attributes is None:
                continue
            padded = attributes[semconv.TRAINING_STEP_PADDED_TOKENS]
            entry["padded"] += padded
            entry["ranks"][rank] = padded
            length = attributes.get(semconv.TRAINING_STEP_SEQUENCE_LENGTH) or 0
            entry["length"] = max(entry["length"], length)
            entry["samples"] += padded / length if length else 0
            tokens = attributes.get(semconv.TRAINING_STEP_TOKENS)
            entry["tokens"] = None if tokens is None or entry["tokens"] is None else entry["tokens"] + tokens
            entry["counted"] += 1
            cpus = tuple(attributes.get(key) for key in _CPUS)
            if None not in cpus:
                entry["cpus"][rank] = (attributes.get(semconv.HOST_NAME), *cpus)
            if step.get("cpu_wait") is not None:
                # What the rank did on its own: the step less its wait for a CPU and its wait for the other
                # ranks in collectives (theirs for a CPU, or their work); and its exposed communication.
                parts = step.get("parts", {})
                entry["unwaited"][rank] = (step["seconds"] - step["cpu_wait"] - parts.get("comm_wait", 0.0),
                                           parts.get("exposed_comm", 0.0), step.get("native_wait") or 0.0)
    ordered = []
    for entry in sorted(steps.values(), key=lambda entry: (entry["number"], entry["start"])):
        # A step counts when every rank has it and counted its input: a rank that died took its last steps' spans
        # along (unexported), and the steps of the others alone held half the job's tokens.
        if entry["counted"] == len(entry["seconds"]) == len(by_rank) and entry["padded"] > 0:
            ordered.append({"step": entry["number"], "seconds": statistics.median(entry["seconds"]), **{
                key: entry[key] for key in ("padded", "tokens", "length", "samples", "ranks", "trace_id")},
                "host": _host(entry["cpus"]) if len(entry["cpus"]) == len(entry["seconds"]) else None,
                "unwaited": _unwaited(entry["unwaited"]) if len(entry["unwaited"]) == len(entry["seconds"])
                else None})
    return ordered[1:] if len(ordered) > 3 else ordered


def _unwaited(ranks: dict[int, tuple[float, float, float]]) -> dict[int, float]:
    """Each rank's own work in the step, without its waits for a CPU and for the other ranks. A collective's
    transfer is the same on every rank: the exposed communication a rank has beyond the least of any rank's is
    its own delay in taking the result (its communication threads', or its training thread's, wait for a CPU),
    not the network's. The least is the transfer, less what the native threads of the rank that waited most for
    a CPU waited (gloo's threads carry the transfer: every rank's waits for the slowest's), down to none."""
    least = min(exposed for _own, exposed, _native in ranks.values())
    transfer = max(least - max(native for _own, _exposed, native in ranks.values()), 0.0)
    return {rank: max(own - (exposed - transfer), 0.0) for rank, (own, exposed, _native) in ranks.items()}


_CPUS = (semconv.TRAINING_STEP_HOST_CPU_BUSY, semconv.TRAINING_STEP_HOST_CPU_IDLE, semconv.TRAINING_STEP_PROCESS_CPU)


def _host(cpus: dict) -> tuple[str | None, float, float]:
    """(host, CPUs other processes used there, CPUs idle there) in a step, on the host whose other processes
    used the most: each host's busy and idle CPUs as its ranks measured them (the median), less the ranks' own."""
    by_host = defaultdict(list)
    for host, busy, idle, process in cpus.values():
        by_host[host].append((busy, idle, process))
    return max(((host, statistics.median(r[0] for r in readings) - sum(r[2] for r in readings),
                 statistics.median(r[1] for r in readings)) for host, readings in by_host.items()),
               key=lambda figures: figures[1])


def findings(series: InputSeries, job: str, by_rank: dict[int, list[dict]]) -> tuple[list[dict], list[dict]]:
    """INPUT and COMPUTE findings of the job, each with the step of its change (``change_step``); and the
    host's load where it, not the job, slowed the steps (``_host_load``)."""
    steps = _job_steps(series, job, by_rank)
    loads: list[dict] = []
    if len(steps) < 2 * MIN_SEGMENT:
        return [], loads
    run_seconds = sum(s["seconds"] for rank_steps in by_rank.values() for s in rank_steps) / max(len(by_rank), 1)
    padded = [s["padded"] for s in steps]
    seconds = [s["seconds"] for s in steps]
    per_token = [s["seconds"] / s["padded"] for s in steps]
    token_changes = change_points(padded, TOKEN_FACTOR, spells=True)
    found = _spells(steps, token_changes, {at: _input_finding(steps, token_changes, at, run_seconds)
                                           for at in token_changes})
    # A change of the time per token where the tokens changed is the input's own (attention, efficiency).
    near_input = {at + shift for at in token_changes for shift in (-1, 0, 1)}
    time_changes = change_points(per_token, PER_TOKEN_FACTOR)
    for at in time_changes:
        if at in near_input:
            continue
        before, after = _segments(len(steps), time_changes, at)
        tokens_before = statistics.median(padded[i] for i in before)
        tokens_after = statistics.median(padded[i] for i in after)
        if max(tokens_after / tokens_before, tokens_before / tokens_after) >= TOKEN_FACTOR:
            continue  # the input changed inside the segment: the split mixes both
        if statistics.median(per_token[i] for i in after) < statistics.median(per_token[i] for i in before):
            continue  # faster per token: nothing lost
        load = _host_load(steps, seconds, before, after)
        if load is not None:
            loads.append(load)
            continue
        found.append(_compute_finding(steps, seconds, per_token, before, after, run_seconds,
                                      _compute_changed_rank(by_rank, steps, before, after)))
    found.sort(key=lambda finding: finding["cost_seconds"], reverse=True)
    return found, loads


def _spells(steps: list[dict], points: list[int], changes: dict[int, dict | None]) -> list[dict]:
    """The input findings of the change ``points`` (``changes``: each one's finding, None where the step time did not
    follow). A change that came back (more tokens from step K, as many as before from step L) is one finding of the
    steps between, costed as the change: a finding of the way back would count its time again, as a gain. Where
    the step time did not follow the change, the way back costs nothing either."""
    found, index = [], 0
    while index < len(points):
        at, finding = points[index], changes[points[index]]
        if index + 1 < len(points) and _came_back(steps, points, at, points[index + 1]):
            end = points[index + 1]
            if finding is not None:
                after = _segments(len(steps), points, end)[1]
                last = steps[end - 1]["step"]
                back = changes[end]
                finding = {**finding, "until_step": last,
                           "summary": finding["summary"].replace(f"from step {finding['change_step']}, ",
                                                                 f"in steps {finding['change_step']}-{last} (then "
                                                                 "back), ", 1),
                           "evidence": [*finding["evidence"], f"from step {steps[end]['step']}, tokens per step "
                                        f"{_median_padded(steps, after):.0f} again"],
                           "trace_ids": [*finding["trace_ids"], *(back["trace_ids"][1:] if back else ())]}
            index += 1
        if finding is not None:
            found.append(finding)
        index += 1
    return found


def _came_back(steps: list[dict], points: list[int], at: int, end: int) -> bool:
    """The tokens per step changed at ``at`` and came back to their level before it at ``end``."""
    before, during = _segments(len(steps), points, at)
    after = _segments(len(steps), points, end)[1]
    first, second, third = (_median_padded(steps, side) for side in (before, during, after))
    return (second > first) == (third < second) and 1 / TOKEN_FACTOR < third / first < TOKEN_FACTOR


def _host_load(steps: list[dict], seconds: list[float], before: range, after: range) -> dict | None:
    """The host's load from the change on, where the job's threads waited for its CPUs; else None."""
    first = [steps[i]["host"] for i in before if steps[i]["host"] is not None]
    second = [steps[i]["host"] for i in after if steps[i]["host"] is not None]
    unwaited = [[steps[i]["unwaited"] for i in side] for side in (before, after)]
    if len(first) < MIN_SEGMENT or len(second) < MIN_SEGMENT or None in unwaited[0] + unwaited[1]:
        return None  # not measured (an older version's files, not Linux): the finding stands
    idle = statistics.median(h[2] for h in first), statistics.median(h[2] for h in second)
    # The step without the waits is the longest of the ranks' own work, which the others wait for (ranks whose
    # threads waited in turn each wait for the other's wait): per side, the rank whose median is the longest. (The
    # longest rank of each step would be biased up by the noise of the estimates, more so where they wait more.)
    ranks = set.intersection(*(set(own) for own in unwaited[0] + unwaited[1]))
    if not ranks:
        return None
    rest = [max(statistics.median(unwaited[side][k][rank] / steps[i]["padded"] for k, i in enumerate(indices))
                for rank in ranks) for side, indices in enumerate((before, after))]
    if idle[1] >= HOST_IDLE or rest[1] >= PER_TOKEN_FACTOR * rest[0]:
        return None  # with the wait taken out the change remains: the job's own steps got slower
    others = (max(statistics.median(h[1] for h in first), 0.0),  # the ranks' own readings may exceed the host's
              max(statistics.median(h[1] for h in second), 0.0))
    hosts = [h[0] for h in second if h[0] is not None]
    host = max(set(hosts), key=hosts.count) if hosts else None
    time_before, time_after, cost = _cost(seconds, before, after)
    waited = [statistics.median(seconds[i] - max(steps[i]["unwaited"].values()) for i in side)
              for side in (before, after)]
    change_step = steps[after[0]]["step"]
    where = f"host {host}" if host else "the host"
    return {"change_step": change_step, "host": host, "other_cpus": [round(others[0], 2), round(others[1], 2)],
            "idle_cpus": [round(idle[0], 2), round(idle[1], 2)],
            "waited_seconds": [round(waited[0], 6), round(waited[1], 6)],
            "step_seconds": [round(time_before, 6), round(time_after, 6)], "cost_seconds": cost,
            "summary": f"from step {change_step} the steps took {_factor(time_after / time_before)} as long "
                       f"({time_before * 1e3:.1f} -> {time_after * 1e3:.1f} ms) while the training thread waited "
                       f"{waited[0] * 1e3:.1f} -> {waited[1] * 1e3:.1f} ms per step for a CPU of {where} (other "
                       f"processes used {others[0]:.1f} -> {others[1]:.1f} CPUs, {idle[1]:.1f} idle); without "
                       f"the waits for a CPU and for each other, the time per token {_factor(rest[1] / rest[0])}: "
                       "a busier host, not this job"}


def _cost(seconds: list[float], before: range, after: range) -> tuple[float, float, float]:
    """(median before, median after, seconds the slower side spent beyond the faster side's median)."""
    first = statistics.median(seconds[i] for i in before)
    second = statistics.median(seconds[i] for i in after)
    slower, baseline = (after, first) if second >= first else (before, second)
    return first, second, sum(max(seconds[i] - baseline, 0.0) for i in slower)


def _followed(values: list[float], before: range, after: range, tokens_factor: float) -> tuple | None:
    """(median before, median after, cost, probability that a step after is slower, or faster, than one before)
    where ``values`` changed the way the tokens did; else None."""
    time_before, time_after, cost = _cost(values, before, after)
    time_factor = time_after / time_before
    follows = _follows([values[i] for i in before], [values[i] for i in after], tokens_factor > 1)
    same_way = (time_factor >= TIME_FACTOR and tokens_factor > 1) or (time_factor <= 1 / TIME_FACTOR and
                                                                      tokens_factor < 1)
    return (time_before, time_after, cost, follows) if same_way and follows >= FOLLOWS else None


def _own_seconds(steps: list[dict], before: range, after: range) -> list[float] | None:
    """Per step, the step without its waits for a CPU and for each other (its longest rank's own work: the
    others wait for it), where every step of both sides measured them; else None."""
    indices = [*before, *after]
    if any(steps[i]["unwaited"] is None for i in indices):
        return None
    return [max(step["unwaited"].values()) if step["unwaited"] else 0.0 for step in steps]


def _input_finding(steps: list[dict], points: list[int], at: int, run_seconds: float) -> dict | None:
    before, after = _segments(len(steps), points, at)
    seconds = [s["seconds"] for s in steps]
    tokens_factor = (statistics.median(steps[i]["padded"] for i in after) /
                     statistics.median(steps[i]["padded"] for i in before))
    measured, raw = "step time", None
    followed = _followed(seconds, before, after, tokens_factor)
    if followed is None:
        raw = _cost(seconds, before, after)
        # The host's load may have changed across the split too (a neighbour's job ended as the sequences grew):
        # the step without the waits for a CPU and for each other follows the tokens, though the step does not.
        own = _own_seconds(steps, before, after)
        followed = None if own is None else _followed(own, before, after, tokens_factor)
        measured = "step time without the waits for a CPU and for each other"
    if followed is None:
        return None  # the input changed, the step time did not follow: it holds nothing back
    time_before, time_after, cost, follows = followed
    time_factor = time_after / time_before
    change_step = steps[at]["step"]
    length_before = statistics.median(steps[i]["length"] for i in before)
    length_after = statistics.median(steps[i]["length"] for i in after)
    per_token = time_factor / tokens_factor
    per_token_text = ("time per token unchanged" if 1 / UNCHANGED <= per_token <= UNCHANGED
                      else f"time per token {_factor(per_token)}")
    shape = f"sequence length {length_before:.0f} -> {length_after:.0f}"
    samples = [statistics.median(steps[i]["samples"] for i in side) for side in (before, after)]
    if length_before == length_after and round(samples[0]) != round(samples[1]):  # a review: "128 -> 128"
        shape = f"samples per step {samples[0]:.0f} -> {samples[1]:.0f}, sequence length {length_after:.0f}"
    summary = (f"from step {change_step}, tokens per step {_factor(tokens_factor)} ({shape}), {measured} "
               f"{_factor(time_factor)}, {per_token_text}")
    ranks_before = statistics.median(len(steps[i]["ranks"]) for i in before)
    changed = sorted(rank for rank in steps[at]["ranks"]
                     if _rank_changed(steps, rank, before, after, tokens_factor))
    rank = changed[0] if len(changed) == 1 and ranks_before > 1 else None
    if rank is not None:
        summary = f"rank {rank}: {summary}"
    evidence = [f"padded tokens per step (all ranks): median {_median_padded(steps, before):.0f} "
                f"in steps {steps[before[0]]['step']}-{steps[before[-1]]['step']}, "
                f"{_median_padded(steps, after):.0f} in steps "
                f"{steps[after[0]]['step']}-{steps[after[-1]]['step']}",
                f"{measured}: median {time_before * 1e3:.1f} ms before, {time_after * 1e3:.1f} ms after; a step "
                f"after is {'slower' if tokens_factor > 1 else 'faster'} than one before in {follows:.0%} of pairs",
                f"time per padded token: {_duration(time_before / _median_padded(steps, before))} before, "
                f"{_duration(time_after / _median_padded(steps, after))} after"]
    if raw is not None:
        evidence.append(f"step time: median {raw[0] * 1e3:.1f} ms before, {raw[1] * 1e3:.1f} ms after: the waits for "
                        "a CPU and for each other changed too (the host's load), and hid the input's change")
    real = _real_share(steps, before, after)
    if real:
        evidence.append(real)
    if rank is not None:
        evidence.append(f"only rank {rank}'s input changed; the other ranks wait for it")
    return {"layer": "INPUT", "summary": summary, "evidence": evidence, "remedies": REMEDIES["INPUT"],
            "rank": rank, "step": change_step, "change_step": change_step, "cost_seconds": cost,
            "share_of_run": cost / run_seconds if run_seconds else None, "confidence": round(follows, 3),
            "trace_ids": [steps[at - 1]["trace_id"], steps[at]["trace_id"]]}


def _median_padded(steps: list[dict], indices: range) -> float:
    return statistics.median(steps[i]["padded"] for i in indices)


def _rank_changed(steps: list[dict], rank: int, before: range, after: range, factor: float) -> bool:
    first = [steps[i]["ranks"][rank] for i in before if rank in steps[i]["ranks"]]
    second = [steps[i]["ranks"][rank] for i in after if rank in steps[i]["ranks"]]
    if not first or not second:
        return False
    ratio = statistics.median(second) / statistics.median(first)
    return (ratio >= TOKEN_FACTOR) if factor > 1 else (ratio <= 1 / TOKEN_FACTOR)


def _real_share(steps: list[dict], before: range, after: range) -> str | None:
    """How much of the padded tokens are real, on each side, where the batches said."""
    shares = []
    for indices in (before, after):
        counted = [steps[i] for i in indices if steps[i]["tokens"] is not None]
        if not counted:
            return None
        shares.append(sum(s["tokens"] for s in counted) / sum(s["padded"] for s in counted))
    if shares[0] > 0.999 and shares[1] > 0.999:
        return None
    return f"real (non-padding) tokens: {shares[0]:.0%} of the padded ones before, {shares[1]:.0%} after"


def _compute_changed_rank(by_rank: dict[int, list[dict]], steps: list[dict], before: range,
                          after: range) -> tuple[int, float] | None:
    """(rank, factor) of the one rank whose own forward and backward grew ``PER_TOKEN_FACTOR`` times or more across
    the split where no other rank's did (a slower device on that rank; the others wait for it); else None."""
    if len(by_rank) < 2:
        return None
    first, second = {steps[i]["step"] for i in before}, {steps[i]["step"] for i in after}
    grown = []
    for rank, rank_steps in by_rank.items():
        compute = {s["step"]: s["parts"].get("forward", 0.0) + s["parts"].get("backward", 0.0) for s in rank_steps}
        was = [value for number, value in compute.items() if number in first]
        now = [value for number, value in compute.items() if number in second]
        if not was or not now or statistics.median(was) <= 0:
            return None
        factor = statistics.median(now) / statistics.median(was)
        if factor >= PER_TOKEN_FACTOR:
            grown.append((rank, factor))
    return grown[0] if len(grown) == 1 else None


def _compute_finding(steps: list[dict], seconds: list[float], per_token: list[float], before: range, after: range,  # noqa: PLR0917
                     run_seconds: float, changed: tuple[int, float] | None = None) -> dict:
    at = after[0]
    change_step = steps[at]["step"]
    time_before, time_after, cost = _cost(seconds, before, after)
    factor = statistics.median(per_token[i] for i in after) / statistics.median(per_token[i] for i in before)
    separated = _separation([per_token[i] for i in before], [per_token[i] for i in after])
    who = "" if changed is None else f"rank {changed[0]}: "
    more = [] if changed is None else [f"only rank {changed[0]}'s forward and backward grew ({_factor(changed[1])}): "
                                       "the other ranks wait for it"]
    return {"layer": "COMPUTE",
            "summary": f"{who}from step {change_step}, time per token {_factor(factor)} with the same tokens per "
                       f"step (step time {time_before * 1e3:.1f} -> {time_after * 1e3:.1f} ms): the compute got "
                       "slower per token (hardware or model), not the input",
            "evidence": [*more, f"padded tokens per step: median {_median_padded(steps, before):.0f} before, "
                         f"{_median_padded(steps, after):.0f} after",
                         f"time per padded token: {_duration(statistics.median(per_token[i] for i in before))} in "
                         f"steps {steps[before[0]]['step']}-{steps[before[-1]]['step']}, "
                         f"{_duration(statistics.median(per_token[i] for i in after))} in steps "
                         f"{change_step}-{steps[after[-1]]['step']}; {separated:.0%} of the steps on each side "
                         "lie on their side of the middle"],
            "remedies": REMEDIES["COMPUTE"], "rank": None if changed is None else changed[0], "step": change_step,
            "change_step": change_step,
            "cost_seconds": cost, "share_of_run": cost / run_seconds if run_seconds else None,
            "confidence": round(separated, 3), "trace_ids": [steps[at - 1]["trace_id"], steps[at]["trace_id"]]}
