"""Findings: what holds training back, on which rank, how often, what it cost, and how sure we are.

A finding is a dict of one shape for every analysis (``finding()``); they are ranked by the time
they cost, and the verdict is the first. An analysis here reports a finding only when it costs at
least MIN_COST_SHARE of the run and holds beyond chance (a test at ALPHA, named in the finding's
``test``); otherwise the verdict is "none". Three analyses of the steps live here:

- **periodic**: per rank and per part of its own step (data wait, forward, backward, optimizer, an
  earlier collective, host work, the loop's code before the step), a part that grows every k-th step
  (``periodic.find_period``); a pattern one rank's search found is then tested on the other ranks as one fixed
  hypothesis (``periodic.confirms``). When the same pattern is on every rank it is one job-wide finding; on
  some ranks only, it is theirs, and the waits of the other ranks in those steps are its consequence
  and, in a data-parallel job, its cost: a stall the others do not wait for costs nothing;
- **late rank**: a rank whose own part of the step is longer than the other ranks' median, step
  after step (a one-sided Wilcoxon signed-rank test on the per-step excess), costing the time the
  others wait for it in the collectives, up to that excess; unless its training thread's extra wait
  for a CPU accounts for the excess: then its host made it late (a ``host_load`` note);
- **steady shares**: data wait or exposed communication above a share of the run's step time
  (a bootstrap over the steps: the share stays above the threshold in all but ALPHA of resamples).
"""

from __future__ import annotations

import random
import statistics
from collections import defaultdict

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.diagnose import periodic
from opentelemetry_instrumentation_deepspeed.diagnose import waits as waits_module
from opentelemetry_instrumentation_deepspeed.diagnose.waits import OWN_PARTS, Waits

MIN_COST_SHARE = 0.05  # a finding must cost at least this share of the run's step time
ALPHA = periodic.ALPHA  # and hold beyond chance at this level
DATA_WAIT_SHARE = 0.25  # data wait above this share of a step, in most steps
# Exposed communication above half of a step: the step is communication-bound (it waits on transfers
# longer than it does everything else; hiding them would more than double its speed). Below that, a
# data-parallel step's collectives are the price of data parallelism, not a fault: a small model's
# ZeRO-2 step on gloo exposes 22-38% with nothing wrong (docs/diagnose.md, "Accuracy").
COMM_SHARE = 0.50
BOOTSTRAP = 999  # resamples of the steps for a share's test
OUTLIER_STEP = 3.0  # a rare step this many times the median step is a hiccup, no part of a steady share
LATE_STEP_SHARE = 0.20  # a late rank's part must exceed the others' by this share of the median step (median)
THROTTLED_SHARE = 0.2  # a hardware throttle reason active in this share of a GPU's samples

LAYER_OF_PART = {"data_wait": "data loading", "forward": "compute", "backward": "compute", "optimizer": "compute",
                 "exposed_comm": "communication", "unaccounted": "HOST WORK", "between_steps": "HOST WORK"}
WHAT = {"data_wait": "data wait", "forward": "forward", "backward": "backward", "optimizer": "optimizer step",
        "exposed_comm": "an earlier collective", "unaccounted": "host work between phases",
        "between_steps": "the loop's own code before the step (after the previous one)",
        "compute": "compute (forward, backward and optimizer step)"}
COMPUTE = ("forward", "backward", "optimizer")
# Where a rank's wait in a collective no span shows falls: DDP's gradient all-reduce in the backward; a collective
# issued after the step's first fetch and before its first phase outside the phases.
UNTRACED_WAITS = ("backward", "unaccounted")
BEFORE_BACKWARD = ("between_steps", "data_wait", "forward")  # the parts of a step before its gradient all-reduce

REMEDIES = {
    "data loading": ["more DataLoader workers (num_workers) and prefetch_factor", "pin_memory and persistent_workers",
                     "cache or pre-shard the dataset near the GPUs; check the storage the loader reads"],
    "communication": ["larger ZeRO buckets (reduce_bucket_size, allgather_bucket_size) and overlap_comm",
                      "a lower ZeRO stage if memory allows, or hierarchical / hpZ partitioning",
                      "check the interconnect (NCCL_DEBUG=INFO, NVLink/InfiniBand counters)"],
    "straggler": ["look at the named rank's host and GPU: throttling, ECC errors, a noisy neighbour",
                  "uneven data (sequence lengths) or extra work on that rank (logging, checkpointing)"],
    "compute": ["the model's operators: profile a step (touch the trigger file) and read its operator spans",
                "mixed precision, fused kernels, activation checkpointing trade-offs"],
    "HOST WORK": ["Python work between the phases (logging, metrics, checkpoint writes): move it off the step or "
                  "make it asynchronous", "profile a step (touch the trigger file) to see what runs between phases",
                  "batches from a source no wrapper times (a generator, a list) wait here too: a DataLoader around "
                  "it makes that time data wait"],
    # The loop's own code before the step, after the one before (a review: the remedies of host work between phases
    # said the opposite of the finding's words)
    "between_steps": ["the loop's own code between steps on that rank (logging, metrics, a checkpoint's save, an "
                      "evaluation, a callback): move it off the path, make it asynchronous, or run it on every rank "
                      "at once", "py-spy dump (or record) of that rank while it is there: a step's profile does not "
                      "cover the time between steps"],
    "GPU/hardware": ["check cooling, power capping and clocks of the named GPU (nvidia-smi -q -d PERFORMANCE)",
                     "drain the node if ECC errors or hardware slowdown persist"],
}
# A plain PyTorch loop's (training.parallelism): ZeRO's settings are no remedy there.
COMMUNICATION_REMEDIES = {
    "ddp": ["larger gradient buckets (DistributedDataParallel's bucket_cap_mb) and gradient_as_bucket_view=True",
            "no_sync() on the micro-batches before the last under gradient accumulation; static_graph=True",
            REMEDIES["communication"][-1]],
    "fsdp": ["fewer, larger FSDP units (fully_shard calls, or an auto_wrap_policy's), and no resharding after the "
             "forward where memory allows (reshard_after_forward=False; FSDP1: ShardingStrategy.SHARD_GRAD_OP)",
             "no gradient sync on the micro-batches before the last under gradient accumulation "
             "(set_requires_gradient_sync(False); FSDP1: no_sync())",
             REMEDIES["communication"][-1]],
}


def remedies_for(found: dict, parallelism: str | None) -> None:
    """A communication finding's remedies for the job's parallelism (a DeepSpeed engine's unless named)."""
    if found.get("layer") == "communication" and parallelism in COMMUNICATION_REMEDIES:
        found["remedies"] = COMMUNICATION_REMEDIES[parallelism]


def finding(layer: str, summary: str, *, evidence: list[str], rank: int | None = None, step: int | None = None,
            cost_seconds: float | None = None, run_seconds: float = 0.0, confidence: float = 1.0,
            trace_ids: list[str] | None = None, remedies: list[str] | None = None, **extra) -> dict:
    """The one shape of a finding; ``extra`` keys (period, phase, steps, chain, ...) are added to it."""
    return {"layer": layer, "summary": summary, "evidence": evidence,
            "remedies": remedies if remedies is not None else REMEDIES.get(
                "between_steps" if extra.get("phase") == "between_steps" else layer, []),
            "rank": rank, "step": step, "cost_seconds": cost_seconds,
            "share_of_run": cost_seconds / run_seconds if cost_seconds is not None and run_seconds > 0 else None,
            "confidence": confidence, "trace_ids": trace_ids or [], **extra}


def none(summary: str) -> dict:
    return {"layer": "none", "summary": summary, "evidence": [], "remedies": [], "rank": None, "step": None,
            "cost_seconds": None, "share_of_run": None, "confidence": 1.0, "trace_ids": []}


def ranked(findings: list[dict]) -> list[dict]:
    """By time lost, most first, then the surer; the findings at least 1 - ALPHA sure (every finding
    of this module) before the less sure ones of other layers, so a heuristic's guess does not
    outrank a tested finding; findings with no measured cost (hardware counters, an out-of-memory
    error) last."""
    return sorted(findings, key=lambda f: (f["cost_seconds"] is None, (f.get("confidence") or 0.0) < 1 - ALPHA,
                                           -(f["cost_seconds"] or 0.0), -(f.get("confidence") or 0.0)))


def _ordinal(number: int) -> str:
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def _ranks_text(ranks: list[int], most: int = 6) -> str:
    if len(ranks) > most:  # a large job: a few names and the count
        return f"{len(ranks)} ranks ({', '.join(str(rank) for rank in ranks[:3])}, ...)"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(rank) for rank in ranks)


class StepFindings:
    """The findings of the step breakdowns: ``steady`` is rank -> the steps of the pattern search
    (warm-up left out), each ``{"step", "trace_id", "seconds", "parts"}``."""

    def __init__(self, steady: dict[int, list[dict]], waits: Waits, seed: int = 0, *, stages: bool = False,
                 missing: bool = False):
        for steps in steady.values():
            for step in steps:
                step["parts"].setdefault("between_steps", 0.0)  # a breakdown that had no step before it
        self.steady, self.waits = steady, waits
        # A pipeline's stages wait for each other in transfers, which the waits here do not follow.
        self.stages = stages
        # Ranks the world size counts left no telemetry (a rank killed before its first export): the others' waits for
        # them in collectives cannot be followed, and read as exposed communication.
        self.missing = missing
        self.parts = {rank: {s["step"]: s["parts"] for s in steps} for rank, steps in steady.items()}
        self.traces = {rank: {s["step"]: s["trace_id"] for s in steps} for rank, steps in steady.items()}
        # rank -> step -> seconds its thread spent in collectives before the step (after the one before)
        self.between = {rank: {s["step"]: s.get("between_comm") or 0.0 for s in steps}
                        for rank, steps in steady.items()}
        # The run: its steps and the loop's code between them (a rank's checkpoint, the others' wait for it there).
        totals = [sum(s["seconds"] + s["parts"]["between_steps"] + (s.get("between_comm") or 0.0) for s in steps)
                  for steps in steady.values() if steps]
        self.run_seconds = statistics.median(totals) if totals else 0.0
        self.min_cost = MIN_COST_SHARE * self.run_seconds
        medians = [statistics.median(s["seconds"] for s in steps) for steps in steady.values() if steps]
        self.step_seconds = statistics.median(medians) if medians else 0.0
        self.rng = random.Random(seed)  # the permutation tests: the same report for the same input
        self.patterns: dict[int, periodic.Pattern] = {}  # rank -> its costliest periodic pattern
        self.host_load: list[dict] = []  # late ranks whose lateness was their wait for a CPU (_waited_for_cpu)
        # The loop's own periodic work between steps on every rank (a checkpoint, an evaluation): no finding, no one
        # waits for it, but said with what it costs (the costliest such pattern).
        self.loop_work: dict | None = None
        self.cpu_waits = {rank: {s["step"]: s.get("cpu_wait") for s in steps} for rank, steps in steady.items()}
        self.phase_waits = {rank: {s["step"]: s.get("phase_waits") for s in steps} for rank, steps in steady.items()}

    def all(self) -> list[dict]:
        if not self.run_seconds:
            return []
        found = self.periodic()
        covered = defaultdict(dict)  # (rank, part) -> {step of its periodic stall: the stall's extra seconds}
        for periodic_finding in found:
            for step in periodic_finding.get("steps") or ():
                covered[periodic_finding["rank"], periodic_finding["phase"]][step] = periodic_finding["extra_seconds"]
        found += self.late_ranks(covered=covered)
        found += self.steady_shares(covered={f["phase"] for f in found}
                                    | {part for f in found for part in f["chain"].get("parts", {}).values()})
        return found

    # -- periodic -----------------------------------------------------------------------------------

    def periodic(self) -> list[dict]:
        by_pattern: dict[tuple, list[tuple[int, str, periodic.Pattern]]] = defaultdict(list)
        for rank, steps in sorted(self.steady.items()):
            found = self._searched(steps)
            # One cause per pattern: a stall shows in one part, the noise it stirs in others is not a second cause.
            # A part of the step before the loop's code before it: an evaluation every k steps on every rank must not
            # hide a rank that is slow in the step after it.
            best: dict[tuple[int, int], tuple[str, periodic.Pattern]] = {}
            for part, pattern in found:
                key = (pattern.period, pattern.offset)
                rank_of = ((part != "between_steps"), pattern.cost)
                if key not in best or rank_of > ((best[key][0] != "between_steps"), best[key][1].cost):
                    best[key] = (part, pattern)
            for (period, offset), (part, pattern) in best.items():
                by_pattern[(part, period, offset)].append((rank, part, pattern))
        unseen = self._unseen_waits(by_pattern)
        taken = defaultdict(set)  # rank -> the (period, offset) of its own patterns
        for (_part, period, offset), members in by_pattern.items():
            for rank, _p, _pattern in members:
                taken[rank].add((period, offset))
        for (part, period, offset), members in by_pattern.items():
            self._confirm(part, period, offset, members, taken)
            for rank, _part, pattern in members:
                if rank not in self.patterns or pattern.cost > self.patterns[rank].cost:
                    self.patterns[rank] = pattern
        found = [self._periodic_finding(part, members, unseen.get((period, offset), {})
                                        if part not in UNTRACED_WAITS else {})
                 for (part, period, offset), members in by_pattern.items()]
        found = [finding for finding in found if finding is not None]
        return found + self._shared_stalls(by_pattern, reported={(f["period"], f["offset"]) for f in found})

    def _searched(self, steps: list[dict]) -> list[tuple[str, periodic.Pattern]]:
        """The periodic pattern of each part of one rank's steps, where there is one."""
        found = []
        stalled = set()  # the steps this rank stalls in before its backward, as far as found
        for part in sorted(OWN_PARTS, key=lambda part: part in UNTRACED_WAITS):
            series = steps if part not in UNTRACED_WAITS or self.stages else [
                s for s in steps if s["step"] not in stalled]
            numbers = [s["step"] for s in series]
            values = [s["parts"][part] for s in series]
            # From the lower quartile: stalls in half the steps or more are the median itself.
            low = sorted(values)[len(values) // 4] if values else 0.0
            if sum(max(value - low, 0.0) for value in values) < self.min_cost:
                continue  # no pattern in these values could cost enough: skip the search
            pattern = periodic.find_period(numbers, values, self.min_cost, self.rng)
            if pattern:
                found.append((part, pattern))
                if part in BEFORE_BACKWARD:
                    # Late itself in those steps, the rank waits for no one in the collectives no span shows: their
                    # dips would make the other steps of its backward look like a stall of every 2nd step.
                    stalled.update(pattern.steps)
        return found

    def _unseen_waits(self, by_pattern: dict) -> dict[tuple[int, int], dict[int, tuple[float, str]]]:
        """Ranks that wait for another's stall where no collective shows it. DDP all-reduces the gradients in its
        reducer's C++, untraced, inside the backward; a collective the loop issues between its first fetch and its
        first forward (the Trainer gathers the step's token count there) has no span either, and its wait is the
        step's time outside its phases. A pattern in those parts on some ranks, in the steps of another rank's stall
        in a part that is never a wait for another (its loader, its forward, its loop's code), with no collective
        joined in those steps, is those ranks' wait for it, not a cause of theirs: taken out of ``by_pattern``, and
        returned, {(period, offset): {rank: (its effect, the part it waited in)}}. (Where collectives show the waits,
        they tell; a stall in another's backward cannot be told from the wait: both stay.)"""
        unseen: dict = defaultdict(dict)
        if self.stages:  # a pipeline's stages differ in their phases by design, and wait in their transfers
            return unseen
        causes = defaultdict(set)  # (period, offset) -> the ranks stalling there in a part no wait hides in
        for (part, period, offset), members in by_pattern.items():
            if part not in UNTRACED_WAITS:
                causes[period, offset].update(rank for rank, _part, _pattern in members)
        for key in [key for key in by_pattern if key[0] in UNTRACED_WAITS and key[1:] in causes]:
            members = by_pattern[key]
            ranks = {rank for rank, _part, _pattern in members}
            steps = set().union(*(pattern.steps for _rank, _part, pattern in members))
            if not ranks & causes[key[1:]] and not steps & self.waits.joined_in:
                del by_pattern[key]
                unseen[key[1:]].update({rank: (pattern.effect, key[0]) for rank, _part, pattern in members})
        return unseen

    def _shared_stalls(self, by_pattern: dict, reported: set) -> list[dict]:
        """Every rank stalls in the same steps, each in a part of its own (rank 0 in its loader, rank 1 in its forward:
        one host-wide disturbance meets each rank where it is). No rank waits for another then, so each rank's
        pattern alone costs nothing; together they are one job-wide stall."""
        by_steps: dict[tuple[int, int], list] = defaultdict(list)
        for (_part, period, offset), members in by_pattern.items():
            if (period, offset) not in reported:
                by_steps[period, offset] += members
        found = []
        for (period, offset), members in by_steps.items():
            ranks = sorted({rank for rank, _part, _pattern in members})
            if len(ranks) < 2 or len(ranks) != len(self.steady) or len({part for _r, part, _p in members}) < 2:
                continue
            rank, part, pattern = max(members, key=lambda member: member[2].cost)
            each = {}
            for member_rank, member_part, member in sorted(members, key=lambda m: -m[2].cost):
                each.setdefault(member_rank, (member_part, member))
            p_value = max(member.p_value for _rank, _part, member in members)
            since = f" from step {pattern.steps[0]}" if pattern.since is not None else ""
            summary = (f"every {_ordinal(period)} step{since}, every rank stalls, each in its own part: "
                       + ", ".join(f"rank {r} {_ms(m.effect)} in {WHAT[p]}" for r, (p, m) in sorted(each.items())))
            evidence = [f"slow steps {pattern.steps} (step number = {offset} mod {period})",
                        "no rank waits for another in those steps: each is stalled itself",
                        f"permutation test: p = {p_value:.3f} ({periodic.PERMUTATIONS} shuffles of the steps), the "
                        "largest of the ranks'"]
            traces = self.traces.get(rank, {})
            slowest = sorted(pattern.steps, key=lambda step: -pattern.excess.get(step, 0.0))
            found.append(finding(LAYER_OF_PART[part], summary, evidence=evidence, step=pattern.steps[0],
                                 cost_seconds=pattern.cost, run_seconds=self.run_seconds, confidence=1 - p_value,
                                 trace_ids=[traces[s] for s in slowest[:5] if s in traces], period=period,
                                 offset=offset, phase=part, steps=pattern.steps, extra_seconds=pattern.effect,
                                 ranks=ranks, test="permutation",
                                 chain={"late_ranks": [], "phase": part, "waiting": {},
                                        "parts": {str(r): p for r, (p, _m) in sorted(each.items())}}))
        return [f for f in found if f["cost_seconds"] >= self.min_cost]

    def _confirm(self, part: str, period: int, offset: int, members: list, taken: dict) -> None:
        """The ranks whose own search missed a pattern that another rank's found: tested for that one pattern
        (``periodic.confirms``), they join it. A stall on every rank whose search passed on one rank only is
        then the job's, not that rank's."""
        found = {rank for rank, _part, _pattern in members}
        effect = max(pattern.effect for _rank, _part, pattern in members)
        starts = [pattern.since for _rank, _part, pattern in members]
        since = None if None in starts else min(starts)  # a pattern that starts mid-run: from there
        for rank, steps in sorted(self.steady.items()):
            if rank in found or (period, offset) in taken.get(rank, ()):
                continue  # ... or the rank has its own pattern in those steps, in another part (one cause each)
            pattern = periodic.confirms([s["step"] for s in steps], [s["parts"][part] for s in steps], period, offset,
                                        effect=effect, rng=self.rng, since=since)
            if pattern is not None:
                members.append((rank, part, pattern))

    def _loop_work(self, members: list[tuple[int, str, periodic.Pattern]]) -> None:
        pattern = max((member[2] for member in members), key=lambda each: each.cost)
        if pattern.cost < self.min_cost or (self.loop_work and self.loop_work["cost_seconds"] >= pattern.cost):
            return
        share = pattern.cost / self.run_seconds
        since = f" from step {pattern.steps[0]}" if pattern.since is not None else ""
        self.loop_work = {
            "period": pattern.period, "offset": pattern.offset, "steps": pattern.steps,
            "effect_seconds": round(pattern.effect, 6), "cost_seconds": round(pattern.cost, 6), "share_of_run": share,
            "summary": f"the loop's own code between steps takes {_ms(pattern.effect)} every "
                       f"{_ordinal(pattern.period)} step{since} on every rank, {share:.0%} of the run: the program's "
                       "own periodic work (a checkpoint, an evaluation, logging), which no rank waits for"}

    def _periodic_finding(self, part: str, members: list[tuple[int, str, periodic.Pattern]],
                          unseen: dict[int, tuple[float, str]]) -> dict | None:
        """``unseen``: the ranks that wait for this stall inside a phase of theirs (``_unseen_waits``)."""
        ranks = sorted(rank for rank, _part, _pattern in members)
        everywhere = len(ranks) == len(self.steady) and len(ranks) > 1
        rank, _part, pattern = max(members, key=lambda member: member[2].cost)
        if everywhere and part == "between_steps":
            self._loop_work(members)  # the loop's own work on every rank (a checkpoint): its choice, no one waits
            return None
        waiting = {} if everywhere else self._waiting_in(pattern.steps, exclude=set(ranks), effect=pattern.effect)
        cost = max(member[2].cost for member in members)
        if unseen:  # as below, the others' wait, read from the phase they waited in
            cost = min(cost, max(effect for effect, _phase in unseen.values()) * len(pattern.steps))
        elif not everywhere and self.waits.joined and not self.stages:
            # What some ranks' stall costs a data-parallel job is the others' wait for it, up to the stall (as a
            # late rank's does): a stall the others do not wait for fell into their own lateness, and cost nothing.
            cost = min(cost, max(waiting.values(), default=0.0) * len(pattern.steps))
            if cost < self.min_cost:
                return None
        layer = LAYER_OF_PART[part]
        if layer == "compute" and (waiting or unseen):
            layer = "straggler"
        where = "on every rank" if everywhere else _ranks_text(ranks)
        since = f" from step {pattern.steps[0]}" if pattern.since is not None else ""
        summary = f"every {_ordinal(pattern.period)} step{since}, {where} stalls {_ms(pattern.effect)} in {WHAT[part]}"
        evidence = [f"slow steps {pattern.steps} (step number = {pattern.offset} mod {pattern.period}), "
                    f"{_ms(pattern.effect)} more {WHAT[part]} than in the other steps (median)"]
        for other, (effect, phase) in sorted(unseen.items()):
            inside = "its backward" if phase == "backward" else "its step, outside its phases"
            summary += f"; rank {other} waits for it in {inside}"
            evidence.append(f"in those steps rank {other}'s time in {inside} is {_ms(effect)} longer: its wait for "
                            f"{_ranks_text(ranks)}, in a collective not traced (DDP's gradient all-reduce; one "
                            "issued before the step's first forward, as the Trainer's token-count gather)")
        if waiting:
            summary += f"; {_ranks_text(sorted(waiting))} wait{'s' if len(waiting) == 1 else ''} for it in collectives"
            if len(waiting) > 6:
                evidence.append(f"in those steps {len(waiting)} ranks wait {_ms(statistics.median(waiting.values()))} "
                                "longer in collectives (median over them)")
            else:
                evidence.append("in those steps " + ", ".join(f"rank {r} waits {_ms(s)} longer in collectives"
                                                             for r, s in sorted(waiting.items())))
            late = sum(self.waits.late_rank(step)[0] in ranks for step in pattern.steps)
            evidence.append(f"{_ranks_text(ranks)} arrived last at the collectives in {late} of "
                            f"{len(pattern.steps)} of those steps")
            before = sum(any(self.between[rank].get(step, 0.0) > 0.5 * waiting[rank] for rank in waiting)
                         for step in pattern.steps)
            if before:
                evidence.append(f"in {before} of those steps the wait was in a collective before the step (a barrier "
                                "after the stall), outside any step's span: in the comm metrics, and the steps' "
                                f"{semconv.TRAINING_STEP_BETWEEN_COMM}")
        waited = {**waiting, **{other: effect for other, (effect, _phase) in unseen.items()}}
        p_value = max(member[2].p_value for member in members)
        evidence.append(f"permutation test: p = {p_value:.3f} ({periodic.PERMUTATIONS} shuffles of the steps)")
        if pattern.since is not None:
            evidence.append(f"not over the whole run: from step {pattern.since} on, one of the first "
                            f"{periodic.LATE_STARTS} slow steps searched from, each at p <= "
                            f"{ALPHA / periodic.LATE_STARTS:.4f}")
        traces = self.traces.get(rank, {})
        slowest = sorted(pattern.steps, key=lambda step: -pattern.excess.get(step, 0.0))
        return finding(layer, summary, evidence=evidence, rank=None if everywhere else rank, step=pattern.steps[0],
                       cost_seconds=cost, run_seconds=self.run_seconds,
                       confidence=1 - p_value, trace_ids=[traces[s] for s in slowest[:5] if s in traces],
                       period=pattern.period, offset=pattern.offset, phase=part, steps=pattern.steps,
                       extra_seconds=pattern.effect, ranks=ranks, test="permutation",
                       chain={"late_ranks": [] if everywhere else ranks, "phase": part,
                              "waiting": {str(r): s for r, s in sorted(waited.items())}})

    def _waiting_in(self, steps: list[int], exclude: set[int], effect: float) -> dict[int, float]:
        """Ranks that wait longer in collectives in ``steps`` than in the others: the median difference, at least a
        tenth of the stall's ``effect`` (a pipeline stage waits for another's stall in its transfers, and its 0.4 ms
        more in a collective made the stall a straggler's that "rank 0 waits for in collectives")."""
        chosen = set(steps)
        waiting = {}
        for rank in self.steady:
            if rank in exclude:
                continue
            by_step = self.waits.waited
            inside = [by_step.get(step, {}).get(rank, 0.0) for step in self.parts[rank] if step in chosen]
            outside = [by_step.get(step, {}).get(rank, 0.0) for step in self.parts[rank] if step not in chosen]
            if inside and outside:
                extra = statistics.median(inside) - statistics.median(outside)
                if extra > 0 and extra >= max(0.1 * effect, 0.25 * statistics.median(inside)):
                    waiting[rank] = extra
        return waiting

    # -- a rank the others wait for in most steps -----------------------------------------------------

    def late_ranks(self, covered: dict) -> list[dict]:
        """A rank whose own part (its forward, its data wait, ...) is longer than the other ranks' in
        most steps (a signed-rank test), and whose excess the others wait for in the collectives. Which rank
        arrives last in a given step is noisy on a busy host; the excess of its own part is not. ``covered``:
        (rank, part) -> {step: extra seconds} of a periodic stall of it, found already: the parts are judged without
        the stalls (``_without``), where a rank late at every step besides a stall of its own or another's (a loader
        50 ms slower every step, 100 ms every third) is still late: a stall's steps count with its extra time taken
        out, so that a short run keeps the steps the test needs."""
        if len(self.steady) < 2:
            return []
        numbers = sorted(set.intersection(*(set(parts) for parts in self.parts.values())))
        found = []
        excess_of = waits_module.Excess(self._without(covered))
        # One test per rank and part: at ALPHA each, some rank's part of a healthy job would pass by
        # chance in up to 7 x ranks x ALPHA of runs (a 2-rank job: 13%). Bonferroni keeps the job's
        # false-alarm rate at ALPHA.
        alpha = ALPHA / (len(self.steady) * (len(OWN_PARTS) + 1))
        for rank in sorted(self.steady):
            unseen = self._unseen_held(rank, numbers)
            held = {**unseen, **self.waits.held.get(rank, {})}
            if sum(held.values()) < self.min_cost:
                continue  # its cost is at most the others' wait for it
            excesses = {step: excess_of.of(rank, step) for step in numbers}
            for step_excess in excesses.values():  # a rank slower at everything (a slower device) is slow here
                step_excess["compute"] = sum(step_excess.get(part, 0.0) for part in COMPUTE)
            tested = {}
            for part in (*OWN_PARTS, "compute"):
                excess = {step: excesses[step].get(part, 0.0) for step in numbers}
                p_value = waits_module.signed_rank_p(list(excess.values()))
                # The job loses what the others wait for, up to this part's excess.
                cost = sum(min(max(value, 0.0), held.get(step, 0.0)) for step, value in excess.items())
                if (p_value <= alpha and cost >= self.min_cost
                        and statistics.median(excess.values()) >= LATE_STEP_SHARE * self.step_seconds):
                    tested[part] = (part, cost, p_value, excess, sum(value > 0 for value in excess.values()))
            single = max((tested[part] for part in OWN_PARTS if part in tested), key=lambda t: t[1], default=None)
            # The compute as a whole only when no one phase carries most of it.
            best = tested.get("compute") if "compute" in tested and (
                single is None or single[1] < 0.6 * tested["compute"][1]) else single
            if best is None:
                continue  # smaller per-rank differences are what a shared host makes (docs/diagnose.md)
            part, cost, p_value, excess, longer = best
            # Late because its previous collective ended later: that is communication, judged by its share.
            if part == "exposed_comm":
                continue
            if self._waited_for_cpu(rank, part, numbers, excess):
                continue
            late = [step for step in numbers if self.waits.late_rank(step)[0] == rank or unseen.get(step)]
            lateness = self.waits.lateness.get(rank, [])
            traces = self.traces.get(rank, {})
            slowest = sorted(late, key=lambda step: -held.get(step, 0.0))[:5]
            waiting = {other: statistics.fmean(self.waits.waited.get(step, {}).get(other, 0.0) for step in numbers)
                       for other in self.steady if other != rank}
            extra = statistics.median(excess.values())
            per_step = _ms(sum(held.get(step, 0.0) for step in numbers) / len(numbers))
            if unseen and not lateness:  # no collective joined: the others' wait is in their backward
                where = "their backward"
                arrival = [f"the other ranks' backward is longer than its own in {len(late)} of {len(numbers)} "
                           f"steps, {per_step} per step: their wait for it in the gradient all-reduce, which is not "
                           "traced (DDP's reducer)"]
            else:
                where = "collectives"
                arrival = [f"the last to arrive at the collectives in {len(late)} of {len(numbers)} steps; the "
                           f"others wait {per_step} per step for it",
                           f"arrives {_ms(statistics.fmean(lateness) if lateness else 0.0)} late on average at "
                           f"{len(lateness)} collectives joined across ranks"]
            found.append(finding(
                "straggler" if part in (*COMPUTE, "compute") else LAYER_OF_PART[part],
                f"rank {rank}'s {WHAT[part]} takes {_ms(extra)} longer than the other ranks' (median per step); "
                f"they wait for it in {where}",
                evidence=[f"longer than the other ranks' median in {longer} of {len(numbers)} steps"
                          + (", its periodic stall's extra time taken out"
                             if any(covered.get((rank, p)) for p in (COMPUTE if part == "compute" else (part,)))
                             else "")
                          + f" (Wilcoxon signed-rank test: p = {p_value:.2g})", *arrival],
                rank=rank, step=numbers[0], cost_seconds=cost, run_seconds=self.run_seconds,
                confidence=1 - p_value, trace_ids=[traces[s] for s in slowest if s in traces], phase=part,
                steps=late, extra_seconds=extra, test="signed-rank",
                chain={"late_ranks": [rank], "phase": part,
                       "waiting": {str(r): s for r, s in sorted(waiting.items()) if s > 0}}))
        return found

    def _without(self, covered: dict) -> dict:
        """The ranks' parts with each periodic stall's extra time taken out of its steps: a rank's own stall, and
        another rank's in the same part, which would sink the others' median below a late rank's (a rank 40 ms late
        in its loader at every step beside another's 200 ms loader stall every 4th step read as the stall alone)."""
        if not covered:
            return self.parts
        parts = {rank: {step: dict(values) for step, values in steps.items()} for rank, steps in self.parts.items()}
        for (rank, part), stalls in covered.items():
            for step, extra in stalls.items():
                values = parts.get(rank, {}).get(step)
                if values is not None and part in values:
                    values[part] = max(values[part] - extra, 0.0)
        return parts

    def _unseen_held(self, rank: int, numbers: list[int]) -> dict[int, float]:
        """Per step with no collective joined in it (DDP all-reduces the gradients in its reducer's C++, untraced): how
        much longer the longest of the other ranks' backward took than this rank's. Where the ranks wait for each
        other inside the backward, that is their wait for this rank; a rank late in its own backward holds none
        (the others' wait and its own work cannot be told apart there)."""
        held = {}
        if self.stages:  # a pipeline's stages differ in their backward by design
            return held
        for step in numbers:
            if step in self.waits.joined_in:
                continue
            own = self.parts[rank][step].get("backward", 0.0)
            longest = max(self.parts[other][step].get("backward", 0.0) for other in self.steady if other != rank)
            if longest > own:
                held[step] = longest - own
        return held

    def _waited_for_cpu(self, rank: int, part: str, numbers: list[int], excess: dict[int, float]) -> bool:
        """Whether the rank is late because its training thread waited for a CPU more than the others' did: with
        that extra wait taken out of its excess, the excess no longer reaches the rule's share of the step. Then
        its host, not its compute, made it late: a note (``host_load``), not a finding. Unmeasured waits: False.

        The wait is the part's own where the rank's phases carry theirs (``training.phase.thread.cpu.wait``): a
        rank that sleeps in its forward (a device's wait) and waits for a CPU in its collectives keeps its forward.
        Else it is the whole step's, all of it counted against the part: the recorder reads the phases only
        while its thread waits for a CPU, so a quiet rank's step wait, small, stands for its phases'."""
        extra = {}
        compute = part in (*COMPUTE, "compute")
        for step in numbers:
            waits = {other: self._phase_wait(other, step, part) if compute and self.phase_waits[other].get(step)
                     else self.cpu_waits[other].get(step) for other in self.steady}
            if None in waits.values():
                return False
            extra[step] = waits[rank] - statistics.median(w for other, w in waits.items() if other != rank)
        remaining = statistics.median(excess[step] - max(extra[step], 0.0) for step in numbers)
        if remaining >= LATE_STEP_SHARE * self.step_seconds:
            return False
        waited = statistics.median(extra.values())
        self.host_load.append({
            "rank": rank, "phase": part, "extra_seconds": round(statistics.median(excess.values()), 6),
            "extra_wait_seconds": round(waited, 6),
            "summary": f"rank {rank}'s {WHAT[part]} took {_ms(statistics.median(excess.values()))} longer than the "
                       f"other ranks' (median per step) while its training thread waited {_ms(waited)} more per step "
                       f"for a CPU than theirs: a busier host under rank {rank}, not the rank's own work"})
        return True

    def _phase_wait(self, rank: int, step: int, part: str) -> float:
        """Seconds the rank's training thread waited for a CPU in ``part`` of a step: a compute phase, or all of
        them ("compute")."""
        phases = self.phase_waits[rank][step]
        return sum(phases.get(name, 0.0) for name in COMPUTE) if part == "compute" else phases.get(part, 0.0)

    def straggler(self, findings: list[dict]) -> dict | None:
        """The former ``straggler`` block of the report, from a late-rank finding whose cause is compute."""
        late = [f for f in findings if f.get("test") == "signed-rank" and f["phase"] in (*COMPUTE, "compute")]
        if not late:
            return None
        top = max(late, key=lambda f: f["cost_seconds"])
        rank = top["rank"]
        extra = []
        for step, parts in self.parts[rank].items():
            others = [self.parts[other][step] for other in self.parts if other != rank and step in self.parts[other]]
            if others:
                extra.append(sum(parts[p] for p in COMPUTE) - statistics.median(sum(o[p] for p in COMPUTE)
                                                                                 for o in others))
        lateness = self.waits.lateness.get(rank, [])
        return {"rank": rank, "extra_compute_seconds": statistics.fmean(extra) if extra else 0.0,
                "slowest_in_steps": sum(value > 0 for value in extra), "steps": len(extra),
                "collectives_joined": len(lateness),
                "mean_arrival_lateness_seconds": statistics.fmean(lateness) if lateness else 0.0}

    # -- large shares of most steps -------------------------------------------------------------------

    def steady_shares(self, covered: set) -> list[dict]:
        found = []
        numbers = sorted(set.intersection(*(set(parts) for parts in self.parts.values())))
        for part, threshold, layer in (("data_wait", DATA_WAIT_SHARE, "data loading"),
                                       ("exposed_comm", COMM_SHARE, "communication")):
            if part in covered or not numbers or (part == "exposed_comm" and self.missing):
                continue
            ranks, what = list(self.parts), "data wait" if part == "data_wait" else "exposed communication"
            summary = f"{{share:.0%}} of step time is {what}"
            if part == "data_wait" and len(ranks) > 1:
                # A loader slow on some ranks only is theirs: the others wait for them in collectives, not for
                # data. The rank with the most is named, and tested on its own steps.
                shares = {rank: sum(self.parts[rank][step][part] for step in numbers)
                          / (sum(_step_time(self.parts[rank][step]) for step in numbers) or 1.0) for rank in ranks}
                if min(shares.values()) <= threshold < max(shares.values()):
                    rank = max(shares, key=shares.get)
                    others = max(share for other, share in shares.items() if other != rank)
                    ranks = [rank]
                    summary = (f"rank {rank}: {{share:.0%}} of its step time is {what} (the other ranks' "
                               f"{others:.0%} at most)")
            # Per step, the mean over the ranks of the part and of the step. A rare step three times the median or
            # more (a garbage collection's pause, a neighbour's burst) is no steady share's: one such step among 15
            # put the share of a job whose every other step was 75% exposed communication within chance. Such
            # steps that recur (a stall every 3rd step) are the job's, and stay.
            step_time = {step: statistics.fmean(_step_time(self.parts[rank][step]) for rank in ranks)
                         for step in numbers}
            typical = statistics.median(step_time.values())
            steady = [step for step in numbers if step_time[step] < OUTLIER_STEP * typical]
            if len(numbers) - len(steady) > max(1, len(numbers) // 20):
                steady = numbers
            seconds = [statistics.fmean(self.parts[rank][step][part] for rank in ranks) for step in steady]
            totals = [step_time[step] for step in steady]
            share = sum(seconds) / (sum(totals) or 1.0)
            if share <= threshold or sum(seconds) < self.min_cost:
                continue
            # Bootstrap over the steps: how often a run of such steps would still be above the threshold.
            below = 0
            for _ in range(BOOTSTRAP):
                picks = [self.rng.randrange(len(steady)) for _ in steady]
                below += sum(seconds[i] for i in picks) <= threshold * sum(totals[i] for i in picks)
            p_value = (below + 1) / (BOOTSTRAP + 1)
            if p_value > ALPHA:
                continue
            above = sum(value > threshold * total for value, total in zip(seconds, totals, strict=True))
            one = len(ranks) == 1 and len(self.parts) > 1
            found.append(finding(
                layer, summary.format(share=share),
                evidence=[f"{_ms(statistics.median(seconds))} per step (median{'' if one else ', mean over ranks'}); "
                          f"above {threshold:.0%} of the step in {above} of {len(steady)} steps"
                          + (f" (of {len(numbers)}: {len(numbers) - len(steady)} three times the median step or "
                             "longer left out)" if len(steady) < len(numbers) else ""),
                          f"bootstrap over the steps: the share is at most {threshold:.0%} in {below} of "
                          f"{BOOTSTRAP} resamples (p = {p_value:.3f})"],
                rank=ranks[0] if one else None, cost_seconds=sum(seconds), run_seconds=self.run_seconds,
                confidence=1 - p_value, phase=part, test="bootstrap"))
        return found


def _step_time(parts: dict) -> float:
    """The step's own time: its parts, not the loop's code before it (``between_steps``)."""
    return sum(value for part, value in parts.items() if part != "between_steps")


def hardware_findings(gpu: dict, findings: list[dict]) -> list[dict]:
    """A GPU that throttles or has ECC errors. It takes over a late-rank finding on its rank (its cause,
    and its cost); without one it is reported as observed, with no cost."""
    hardware = {rank: issues for rank, gpu_rank in gpu.items() if (issues := _hardware_issues(gpu_rank))}
    result = []
    for rank, issues in sorted(hardware.items()):
        late = next((f for f in findings if f["rank"] == rank and f.get("test") == "signed-rank"), None)
        slow = f"rank {rank} is the one the others wait for ({late['summary']}); " if late else f"rank {rank}: "
        result.append(finding("GPU/hardware", f"{slow}its GPU reports {'; '.join(issues)}",
                              evidence=[f"rank {r}: {'; '.join(i)}" for r, i in sorted(hardware.items())]
                              + (late["evidence"] if late else []),
                              rank=rank, cost_seconds=late["cost_seconds"] if late else None,
                              run_seconds=late["cost_seconds"] / late["share_of_run"] if late and late["share_of_run"]
                              else 0.0, confidence=1.0, trace_ids=late["trace_ids"] if late else [],
                              test="counters"))
        if late:
            findings.remove(late)
    return result


HARDWARE_THROTTLE = (semconv.THROTTLE_HW_SLOWDOWN, semconv.THROTTLE_HW_THERMAL_SLOWDOWN,
                     semconv.THROTTLE_HW_POWER_BRAKE_SLOWDOWN, semconv.THROTTLE_SW_THERMAL_SLOWDOWN)


def _hardware_issues(gpu: dict) -> list[str]:
    issues = [f"{reason.replace('_', ' ')} in {share:.0%} of samples" for reason, share in gpu["throttled"].items()
              if reason in HARDWARE_THROTTLE and share >= THROTTLED_SHARE]
    if gpu["uncorrected_ecc"]:
        issues.append(f"{gpu['uncorrected_ecc']:.0f} uncorrected ECC errors")
    return issues
