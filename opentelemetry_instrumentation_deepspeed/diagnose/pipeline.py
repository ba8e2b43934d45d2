"""Pipeline parallelism: bubble time per stage, and the stage the others wait for.

Each rank of a ``PipelineEngine`` job carries its stage on its ``training.step`` spans. Per stage and
step: its compute (forward and backward spans), and its bubble: the step's time not spent computing,
loading data or in the optimizer step. That is the time the stage idles in the pipeline's
fill and drain and waiting on its neighbours, in its point-to-point receives (``comm.recv`` with
``training.pipeline.peer_stage``) and sends.

A pipeline runs at the pace of its slowest stage: with ``m`` micro-batches and ``p`` stages a step
takes about ``(m + p - 1)`` times the slowest stage's time per micro-batch. What an imbalance costs
is what the other stages wait for: the time the steps would save were the compute spread evenly,
``(m + p - 1) / m`` times the slowest stage's compute above the stages' mean, per step. A stage is
imbalanced when that time is a material share of the step, its compute clearly exceeds the
others' (consistently, step after step) and the others idle more than it does: a finding of its own.

Judging the time lost, not the compute ratio, matters because stages with identical layers do not
compute alike: the last stage also computes the loss and keeps its running total in each forward,
and starts each backward from the loss through ``DeepSpeedEngine.backward`` (loss scaling, hooks),
where the others call ``backward`` on a received gradient; the first stage computes no gradient
for its input. On a small model that fixed work is a large ratio (the last stage measures
1.2-1.7x the first's work on 2 CPU stages of width 64-1024, all of it CPU work, not waits) but a
small share of the step. The compute judged is each stage's work: its micro-batch count times its
shortest forward and backward (over its steady steps; per step, ``_Step.work``, to find the slowest
stage of each), because on a loaded host the scheduler stretches some stages' spans more than
others' (most the last stage's, likely because under 1F1B its backwards overlap the first stage's
next forward), and that is the host's doing, not the partition's.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from opentelemetry_instrumentation_deepspeed import semconv

LAYER = "PIPELINE"
IMBALANCE_RATIO = 1.3  # the slowest stage computes at least this many times the other stages' median
IMBALANCE_SHARE = 0.10  # ... and the time the others wait for it is at least this share of the median step
CONSISTENCY = 0.7  # ... in at least this share of the steps
STRAGGLER_SHARE = 0.20  # a rank computing this much longer than its stage's other ranks, per step (as analysis.py)

_COMPUTE = (semconv.SPAN_FORWARD, semconv.SPAN_BACKWARD)
_PHASE_NAMES = {semconv.SPAN_FORWARD: "forward", semconv.SPAN_BACKWARD: "backward"}
_OTHER_WORK = (semconv.SPAN_OPTIMIZER_STEP, semconv.SPAN_DATA_WAIT)

REMEDIES = [
    "rebalance the stages by compute, not parameter count: PipelineModule(partition_method=...) "
    "('type:<layer class>' or explicit boundaries) so the named stage gets fewer layers",
    "activation checkpointing or a cheaper layer placement on the named stage only",
    "more micro-batches per step (gradient_accumulation_steps) shrink the fill-and-drain bubble, "
    "(p - 1) / (m + p - 1) of the step",
]


class _Step:
    __slots__ = ("compute", "end", "micro_batches", "number", "other", "phases", "recv", "stage", "stages", "start",
                 "trace_id")

    def __init__(self):
        self.number = None
        self.trace_id = ""
        self.stage = None
        self.stages = 0
        self.micro_batches = 0
        self.start = self.end = 0
        self.compute = 0
        self.phases: dict[str, list[int]] = {}  # forward / backward -> [count, shortest ns]
        self.other = 0  # optimizer step and data waits: work, not bubble
        self.recv: dict[int, int] = defaultdict(int)  # peer stage -> ns blocked receiving from it

    @property
    def work(self) -> int:
        """The step's compute at its micro-batches' quickest: each phase's count x its shortest span."""
        return sum(count * shortest for count, shortest in self.phases.values())


def is_transfer(span) -> bool:
    """A pipeline's send or receive between stages: its time is the bubble's, not exposed communication."""
    return semconv.COMM_PEER_STAGE in span.attributes


class PipelineAnalysis:
    def __init__(self):
        self._steps: dict[tuple[str, int, str], _Step] = {}

    def add(self, span) -> None:
        name, key = span.name, (span.job, span.rank, span.trace_id)
        if name == semconv.SPAN_STEP:
            stage = span.attributes.get(semconv.TRAINING_PIPELINE_STAGE)
            if stage is None:
                return
            step = self._steps.setdefault(key, _Step())
            if span.end >= step.end:  # a retried step keeps its last attempt
                step.number, step.stage, step.start, step.end = (span.attributes.get(semconv.TRAINING_STEP),
                                                                 stage, span.start, span.end)
                step.trace_id = span.trace_id
                step.stages = span.attributes.get(semconv.TRAINING_PIPELINE_STAGES) or 0
                step.micro_batches = span.attributes.get(semconv.TRAINING_STEP_MICRO_BATCHES) or 0
        elif name in _COMPUTE:
            step, duration = self._steps.setdefault(key, _Step()), span.end - span.start
            step.compute += duration
            phase = step.phases.setdefault(name, [0, duration])
            phase[0] += 1
            phase[1] = min(phase[1], duration)
        elif name in _OTHER_WORK:
            self._steps.setdefault(key, _Step()).other += span.end - span.start
        elif name == semconv.SPAN_COMM_PREFIX + "recv":
            peer = span.attributes.get(semconv.COMM_PEER_STAGE)
            if peer is not None:
                self._steps.setdefault(key, _Step()).recv[peer] += span.end - span.start

    def ran(self, job: str) -> bool:
        """Whether ``job`` ran a pipeline: some step of it carried a stage."""
        return any(key[0] == job and step.stage is not None for key, step in self._steps.items())

    def result(self, job: str) -> dict:
        """{} unless ``job`` ran a pipeline; else its stages and findings."""
        by_rank: dict[int, list[_Step]] = defaultdict(list)
        for (step_job, rank, _trace), step in self._steps.items():
            if step_job == job and step.stage is not None and step.number is not None:
                by_rank[rank].append(step)
        if not by_rank:
            return {}
        stage_of = {}
        per_stage: dict[int, dict[int, list[_Step]]] = defaultdict(lambda: defaultdict(list))
        for rank, steps in by_rank.items():
            steps.sort(key=lambda s: s.number)
            steady = steps[1:] if len(steps) > 3 else steps  # the first step pays for warm-up
            stage_of[rank] = steps[-1].stage
            for step in steady:
                per_stage[step.stage][step.number].append(step)
        stages = {stage: _stage_summary(sorted(r for r, s in stage_of.items() if s == stage), by_number)
                  for stage, by_number in sorted(per_stage.items())}
        found = _imbalance(stages, per_stage, by_rank)
        compute_by_rank = {rank: _seconds(statistics.median(s.compute for s in steps[1:] or steps))
                           for rank, steps in by_rank.items()}
        return {"stages": stages, "ranks": {rank: stage_of[rank] for rank in sorted(stage_of)},
                "compute_by_rank": compute_by_rank, "findings": [found] if found else []}


def _seconds(ns: float) -> float:
    return ns / 1e9


def _stage_summary(ranks: list[int], by_number: dict[int, list[_Step]]) -> dict:
    compute, bubble, seconds, recv = [], [], [], defaultdict(list)
    counts, shortest = defaultdict(list), {}
    for steps in by_number.values():
        compute.append(statistics.fmean(s.compute for s in steps))
        for s in steps:
            for name, (count, duration) in s.phases.items():
                counts[name].append(count)
                shortest[name] = min(shortest.get(name, duration), duration)
        seconds.append(statistics.fmean(s.end - s.start for s in steps))
        bubble.append(statistics.fmean(max(s.end - s.start - s.compute - s.other, 0) for s in steps))
        for peer in {peer for s in steps for peer in s.recv}:
            recv[peer].append(statistics.fmean(s.recv.get(peer, 0) for s in steps))
    step = statistics.median(seconds)
    return {"ranks": ranks, "steps": len(by_number),
            "step_seconds": _seconds(step),
            "compute_seconds": _seconds(statistics.median(compute)),
            # Every micro-batch of a stage does the same work; on a loaded host a span also holds the
            # time the scheduler ran something else (a 0.8 ms median forward had a 4.7 ms 90th
            # percentile here), the host's doing, not the partition's: each phase at its quickest.
            "work_seconds": _seconds(sum(statistics.median(counts[name]) * shortest[name] for name in shortest)),
            "work_seconds_by_phase": {_PHASE_NAMES[name]: _seconds(statistics.median(counts[name]) * shortest[name])
                                      for name in sorted(shortest)},
            "bubble_seconds": _seconds(statistics.median(bubble)),
            "bubble_share": statistics.median(bubble) / step if step else 0.0,
            "recv_seconds_by_peer_stage": {peer: _seconds(statistics.median(values))
                                           for peer, values in sorted(recv.items())}}


def _imbalance(stages: dict, per_stage: dict, by_rank: dict) -> dict | None:
    if len(stages) < 2:
        return None
    common = set.intersection(*(set(by_number) for by_number in per_stage.values()))
    if len(common) < 3:
        return None
    slowest_in: dict[int, int] = defaultdict(int)
    for number in common:
        computes = {stage: statistics.fmean(s.work for s in per_stage[stage][number]) for stage in per_stage}
        slowest_in[max(computes, key=computes.get)] += 1
    compute = {stage: summary["work_seconds"] for stage, summary in stages.items()}
    slow = max(compute, key=compute.get)
    others = [stage for stage in stages if stage != slow]
    reference = statistics.median(compute[stage] for stage in others)
    step_seconds = statistics.median(summary["step_seconds"] for summary in stages.values())
    consistency = slowest_in[slow] / len(common)
    other_bubble = statistics.median(stages[stage]["bubble_seconds"] for stage in others)
    count = len(stages)
    micro_batches = max((s.micro_batches for steps in by_rank.values() for s in steps), default=0) or 1
    # What the other stages wait for: the time per step an even split of the compute would save.
    excess = (compute[slow] - statistics.fmean(compute.values())) * (micro_batches + count - 1) / micro_batches
    if (compute[slow] < IMBALANCE_RATIO * reference or excess < IMBALANCE_SHARE * step_seconds
            or consistency < CONSISTENCY or other_bubble <= stages[slow]["bubble_seconds"]):
        return None
    steps = max(len(steps) for steps in by_rank.values())
    ratio = compute[slow] / reference if reference else float("inf")
    ranks = stages[slow]["ranks"]
    slowest_steps = sorted((s for rank in ranks for s in by_rank[rank]), key=lambda s: s.work, reverse=True)
    waits = [f"stage {stage} idles {stages[stage]['bubble_seconds'] * 1e3:.1f} ms per step "
             f"({stages[stage]['bubble_share']:.0%} of it), "
             + ", ".join(f"{seconds * 1e3:.1f} ms receiving from stage {peer}"
                         for peer, seconds in stages[stage]["recv_seconds_by_peer_stage"].items())
             for stage in others]
    # The phase that holds most of its excess over the other stages (a layer slow in its backward only).
    by_phase = stages[slow]["work_seconds_by_phase"]
    extra = {phase: seconds - statistics.median(stages[stage]["work_seconds_by_phase"].get(phase, 0.0)
                                                for stage in others) for phase, seconds in by_phase.items()}
    phase = max(extra, key=extra.get) if extra else None
    if phase is not None and extra[phase] <= 0:  # medians of the phases need not add up to the whole's excess
        phase = None
    return {
        "layer": LAYER,
        "summary": f"pipeline stage {slow} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}) "
                   f"computes {compute[slow] * 1e3:.1f} ms per step, {ratio:.1f}x the other stages' "
                   f"{reference * 1e3:.1f} ms (micro-batches at their quickest)"
                   + (f", {extra[phase] / (sum(max(v, 0.0) for v in extra.values()) or 1.0):.0%} of the difference "
                      f"in its {phase}" if phase is not None else "")
                   + ": the pipeline runs at its pace and the other stages wait for it",
        "evidence": [f"stage {slow} is the slowest stage in {slowest_in[slow]} of {len(common)} steps",
                     f"stage {slow} idles {stages[slow]['bubble_seconds'] * 1e3:.1f} ms per step "
                     f"({stages[slow]['bubble_share']:.0%})", *waits,
                     f"{micro_batches} micro-batches over {count} stages: a balanced split would save about "
                     f"{excess * 1e3:.1f} ms per step ({excess / step_seconds:.0%} of it)"],
        "remedies": REMEDIES,
        "rank": ranks[0],
        "stage": slow,
        "phase": phase,
        "step": None,
        "cost_seconds": excess * steps,
        "confidence": round(min(1.0, consistency * (0.9 if ratio >= 1.6 else 0.7)), 2),
        "trace_ids": list(dict.fromkeys(step.trace_id for step in slowest_steps))[:3],
    }


def reconcile(result: dict, pipeline: dict, verdict_of) -> None:
    """In a pipeline job stages differ by design: a rank is a straggler only against its own stage's
    data-parallel peers (``verdict_of`` decides again without one that is not); the imbalanced stage
    is the verdict where nothing else stands out."""
    if not pipeline:
        return
    straggler = result.get("straggler")
    if straggler is not None and not _straggles_in_its_stage(straggler["rank"], pipeline):
        result["straggler"] = None
        result["verdict"] = verdict_of(result)
    findings = pipeline["findings"]
    result.setdefault("findings", []).extend(findings)
    if findings and result["verdict"].get("layer") == "none":
        result["verdict"] = findings[0]


def _straggles_in_its_stage(rank: int, pipeline: dict) -> bool:
    stage = pipeline["ranks"].get(rank)
    compute = pipeline["compute_by_rank"]
    peers = [compute[other] for other, other_stage in pipeline["ranks"].items()
             if other_stage == stage and other != rank and other in compute]
    if not peers or rank not in compute:
        return False
    step = pipeline["stages"][stage]["step_seconds"]
    return compute[rank] - statistics.median(peers) >= STRAGGLER_SHARE * step
