"""From step spans to "which layer holds training back".

Per rank and step: the step time, and its split into data wait, forward, backward and optimizer
compute, exposed communication (synchronous collectives: the rank waits through them), waiting for
other ranks, and time no phase accounts for. Then, over the steps: the step-time distribution, who
waits for whom in the collectives and why (``waits``), the findings (``findings``: periodic stalls
per rank, a rank the others wait for, large shares), ranked by the time they cost, and each
collective's bus bandwidth against the best of the run.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.diagnose import findings as findings_module
from opentelemetry_instrumentation_deepspeed.diagnose import inputs, waits  # inputs: the input layer
from opentelemetry_instrumentation_deepspeed.diagnose.model import ModelFindings  # model and memory layers
from opentelemetry_instrumentation_deepspeed.diagnose.model import series as model_series
from opentelemetry_instrumentation_deepspeed.diagnose.reader import Span

PHASES = {semconv.SPAN_DATA_WAIT: "data_wait", semconv.SPAN_FORWARD: "forward", semconv.SPAN_BACKWARD: "backward",
          semconv.SPAN_OPTIMIZER_STEP: "optimizer"}
PARTS = ("data_wait", "forward", "backward", "optimizer", "exposed_comm", "comm_wait", "unaccounted")



@dataclass
class _Step:
    number: int = 0
    trace_id: str = ""
    start: int = 0
    end: int = 0
    seen: bool = False
    phases: list = field(default_factory=list)  # (part, start, end)
    comm: list = field(default_factory=list)  # synchronous collectives: (start, end, group, sequence)


def _union_overlap(intervals: list[tuple[int, int]], start: int, end: int) -> int:
    """Nanoseconds of [start, end] covered by the union of ``intervals``."""
    covered, cursor = 0, start
    for first, last in sorted(intervals):
        low, high = max(first, cursor), min(last, end)
        if high > low:
            covered += high - low
            cursor = high
    return covered


class Analysis:
    def __init__(self):
        self.jobs: dict[str, int] = defaultdict(int)
        self._steps: dict[tuple[str, int, str], _Step] = {}
        self._collectives: dict[tuple[str, str, int], dict[int, int]] = defaultdict(dict)
        self._busbw: dict[str, list[float]] = defaultdict(list)
        self._samples: list = []
        self.model = ModelFindings()  # model and memory layers
        self._inputs = inputs.InputSeries()  # the input layer

    def add_samples(self, samples) -> None:
        """GPU metric samples (hw.gpu.utilization, hw.gpu.throttle, hw.errors) of the same job's ranks."""
        self._samples.extend(samples)

    def add(self, spans: Iterable[Span]) -> None:
        for span in spans:
            self.jobs[span.job] += 1
            self.model.add(span)  # model and memory layers
            key = (span.job, span.rank, span.trace_id)
            if span.name == semconv.SPAN_STEP:
                step = self._steps.setdefault(key, _Step())
                if not step.seen or span.end > step.end:  # a retried step keeps its last attempt
                    step.number, step.trace_id, step.start, step.end = (span.attributes.get(semconv.TRAINING_STEP, 0),
                                                                        span.trace_id, span.start, span.end)
                    step.seen = True
                self._inputs.add(span)  # the input layer
            elif span.name in PHASES:
                self._steps.setdefault(key, _Step()).phases.append((PHASES[span.name], span.start, span.end))
            elif span.name.startswith(semconv.SPAN_COMM_PREFIX):
                attributes = span.attributes
                group, sequence = attributes.get(semconv.COMM_GROUP_NAME, "0"), attributes.get(semconv.COMM_SEQUENCE)
                if not attributes.get(semconv.COMM_ASYNC):
                    self._steps.setdefault(key, _Step()).comm.append((span.start, span.end, group, sequence))
                if sequence is not None:
                    self._collectives[(span.job, group, sequence)][span.rank] = span.start
                if attributes.get(semconv.COMM_BUSBW):
                    self._busbw[span.name.removeprefix(semconv.SPAN_COMM_PREFIX)].append(
                        float(attributes[semconv.COMM_BUSBW]))

    # -- results ------------------------------------------------------------------------------------

    def result(self, job: str | None = None) -> dict:
        if not self.jobs:
            return {"job_id": None, "ranks": {}, "findings": [],
                    "verdict": findings_module.none("no training spans in the input")}
        job = job if job is not None else max(self.jobs, key=self.jobs.get)
        by_rank: dict[int, list[dict]] = defaultdict(list)
        for (step_job, rank, _trace), step in self._steps.items():
            if step_job == job and step.seen:
                by_rank[rank].append(self._breakdown(step, job))
        for steps in by_rank.values():
            steps.sort(key=lambda s: s["step"])
        ranks = {rank: self._rank_summary(steps) for rank, steps in sorted(by_rank.items())}
        gpu = self._gpu(job, by_rank)
        # -- findings: follow the waits across ranks, then the patterns of each rank's own steps --
        comm = defaultdict(dict)
        for (step_job, rank, _trace), step in self._steps.items():
            if step_job == job and step.seen:
                comm[rank][step.number] = step.comm
        steps = findings_module.StepFindings({rank: _steady(s) for rank, s in by_rank.items()}, waits.follow(comm))
        found = steps.all()
        straggler = steps.straggler(found)
        found += findings_module.hardware_findings(gpu, found)
        for rank, summary in ranks.items():
            summary["anomaly"] = _anomaly(steps.patterns.get(rank), by_rank[rank], found)
        job_summary = self._job_summary(ranks)
        # Other analyses append their findings to ``found`` here.
        found += self.model.findings(job, job_summary.get("step_seconds_p50") if job_summary else None)  # model, memory
        found += inputs.findings(self._inputs, job, by_rank)  # the input layer: INPUT / COMPUTE change points
        found = findings_module.ranked(found)
        result = {
            "job_id": job,
            "other_jobs": sorted(j for j in self.jobs if j != job),
            "ranks": ranks,
            "job": job_summary,
            "straggler": straggler,
            "gpu": gpu,
            "bandwidth": {op: {"median_busbw": statistics.median(values), "best_busbw": max(values),
                               "calls": len(values)} for op, values in sorted(self._busbw.items())},
            "findings": found,
            "verdict": found[0] if found else findings_module.none(_quiet(job_summary)),
            "model_series": model_series(self.model, job),
        }
        result["step_series"] = {rank: [[s["step"], round(s["seconds"], 6)] for s in steps]
                                 for rank, steps in sorted(by_rank.items())}
        result["timelines"] = self._timelines(job, by_rank)
        return result

    def _timelines(self, job: str, by_rank: dict[int, list[dict]]) -> dict:
        """The slowest and a typical step, on every rank: phases and collectives on one clock."""
        steps = {}
        for rank_steps in by_rank.values():
            for step in rank_steps[1:] or rank_steps:
                steps[step["trace_id"]] = max(steps.get(step["trace_id"], 0.0), step["seconds"])
        if not steps:
            return {}
        ordered = sorted(steps, key=steps.get)
        timelines = {}
        for label, trace_id in (("slowest", ordered[-1]), ("typical", ordered[len(ordered) // 2])):
            lanes = {}
            for rank in sorted(by_rank):
                step = self._steps.get((job, rank, trace_id))
                if step is None or not step.seen:
                    continue
                lanes[rank] = {"start": step.start, "end": step.end,
                               "phases": [[part, start, end] for part, start, end in sorted(step.phases,
                                                                                            key=lambda p: p[1])],
                               "comm": [[start, end] for start, end, _group, _sequence in step.comm]}
            number = next((s["step"] for steps_ in by_rank.values() for s in steps_ if s["trace_id"] == trace_id), 0)
            timelines[label] = {"trace_id": trace_id, "step": number, "ranks": lanes}
        return timelines

    def _part_at(self, at: int, steps: list) -> str:
        """The part of the rank's step running at ``at``; "between_steps" outside every step."""
        for step in steps:
            if step.start <= at <= step.end:
                for part, start, end in step.phases:
                    if start <= at <= end:
                        if part != "data_wait" and any(a <= at <= b for a, b, _g, _s in step.comm):
                            return "exposed_comm"
                        return part
                return "unaccounted"
        return "between_steps"

    def _gpu(self, job: str, by_rank: dict) -> dict:
        """Per rank: utilization overall and by the part of the step it was sampled in; throttling; ECC."""
        found = {}
        for rank in sorted({sample.rank for sample in self._samples} & set(by_rank)):
            samples = [s for s in self._samples if s.rank == rank]
            steps = sorted((s for (j, r, _t), s in self._steps.items() if j == job and r == rank and s.seen),
                           key=lambda s: s.start)
            utilization = [s for s in samples if s.metric == semconv.METRIC_HW_GPU_UTILIZATION]
            by_part = defaultdict(list)
            for sample in utilization:
                by_part[self._part_at(sample.time, steps)].append(sample.value)
            throttle = defaultdict(list)
            for sample in samples:
                if sample.metric == semconv.METRIC_HW_GPU_THROTTLE:
                    throttle[sample.detail].append(sample.value)
            found[rank] = {
                "utilization_mean": statistics.fmean(s.value for s in utilization) if utilization else None,
                "utilization_by_part": {part: statistics.fmean(values) for part, values in sorted(by_part.items())},
                "throttled": {reason: statistics.fmean(values) for reason, values in sorted(throttle.items())
                              if any(values)},
                "uncorrected_ecc": max((s.value for s in samples if s.metric == semconv.METRIC_HW_ERRORS
                                        and s.detail == semconv.ECC_UNCORRECTED), default=0),
            }
        return found

    def _breakdown(self, step: _Step, job: str) -> dict:
        """Split a step; a synchronous collective splits into waiting for the last rank to arrive
        (``comm_wait``: load imbalance) and the transfer after it (``exposed_comm``)."""
        parts = dict.fromkeys(PARTS, 0)
        waits, transfers = [], []
        for start, end, group, sequence in step.comm:
            starts = self._collectives.get((job, group, sequence)) if sequence is not None else None
            last = min(max(starts.values()), end) if starts else start
            if last > start:
                waits.append((start, last))
            transfers.append((max(last, start), end))
        comm = [(start, end) for start, end, _group, _sequence in step.comm]
        for part, start, end in step.phases:
            parts[part] += (end - start) - (_union_overlap(comm, start, end) if part != "data_wait" else 0)
        parts["exposed_comm"] = _union_overlap(transfers, step.start, step.end)
        parts["comm_wait"] = _union_overlap(waits, step.start, step.end)
        total = step.end - step.start
        parts["unaccounted"] = max(total - sum(parts.values()), 0)
        return {"step": step.number, "trace_id": step.trace_id, "seconds": total / 1e9,
                "parts": {name: value / 1e9 for name, value in parts.items()}}

    @staticmethod
    def _rank_summary(steps: list[dict]) -> dict:
        durations = [s["seconds"] for s in steps]
        steady = _steady(steps)
        total = sum(s["seconds"] for s in steady) or 1.0
        shares = {part: sum(s["parts"][part] for s in steady) / total for part in PARTS}
        return {
            "steps": len(steps),
            "step_seconds": {"p50": _quantile(durations, 0.5), "p95": _quantile(durations, 0.95),
                             "max": max(durations) if durations else 0.0},
            "shares": shares,
            "anomaly": None,
            "slowest": max(steps, key=lambda s: s["seconds"]) if steps else None,
            "typical": sorted(steady, key=lambda s: s["seconds"])[len(steady) // 2] if steady else None,
        }

    @staticmethod
    def _job_summary(ranks: dict) -> dict:
        if not ranks:
            return {}
        count = len(ranks)
        shares = {part: sum(r["shares"][part] for r in ranks.values()) / count for part in PARTS}
        p50 = statistics.median(r["step_seconds"]["p50"] for r in ranks.values())
        anomalies = [r["anomaly"] for r in ranks.values() if r["anomaly"]]
        anomaly = None
        if anomalies and len(anomalies) * 2 > count:
            anomaly = max(anomalies, key=lambda a: a["extra_seconds"])
        return {"ranks": count, "step_seconds_p50": p50, "shares": shares, "anomaly": anomaly}


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _steady(steps: list[dict]) -> list[dict]:
    """The first step pays for warm-up (allocation, first collectives): not part of the patterns."""
    return steps[1:] if len(steps) > 3 else steps


def _anomaly(pattern, steps: list[dict], found: list[dict]) -> dict | None:
    """A rank's periodic pattern in the report's former shape, if a finding reported it."""
    if pattern is None or not any(f.get("period") == pattern.period and f.get("offset") == pattern.offset
                                  for f in found):
        return None
    slow = set(pattern.steps)
    inside = [s for s in steps if s["step"] in slow]
    outside = [s for s in _steady(steps) if s["step"] not in slow]
    finding = next(f for f in found if f.get("period") == pattern.period and f.get("offset") == pattern.offset)
    return {"period": pattern.period, "offset": pattern.offset, "phase": finding["phase"],
            "extra_seconds": statistics.fmean(s["seconds"] for s in inside) -
            statistics.fmean(s["seconds"] for s in outside) if inside and outside else 0.0,
            "steps": pattern.steps,
            "trace_ids": [s["trace_id"] for s in sorted(inside, key=lambda s: s["seconds"], reverse=True)[:5]]}


def _quiet(job: dict) -> str:
    if not job:
        return "no complete steps in the input"
    shares = job["shares"]
    compute = shares["forward"] + shares["backward"] + shares["optimizer"]
    return (f"no finding costs {findings_module.MIN_COST_SHARE:.0%} of the run beyond chance: median step "
            f"{job['step_seconds_p50'] * 1e3:.1f} ms, {compute:.0%} compute")
