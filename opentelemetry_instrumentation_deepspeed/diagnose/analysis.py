"""From step spans to "which layer holds training back".

Per rank and step: the step time, and its split into data wait, forward, backward and optimizer
compute, exposed communication (synchronous collectives: the rank waits through them), waiting for
other ranks, and time no phase accounts for. Then, over the steps: the step-time distribution, who
waits for whom in the collectives and why (``waits``), the findings (``findings``: periodic stalls
per rank, a rank the others wait for, large shares), ranked by the time they cost, and each
collective's bus bandwidth against the best of the run.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.diagnose import clocks, crashes, hangs, inputs, pipeline, waits
from opentelemetry_instrumentation_deepspeed.diagnose import findings as findings_module
from opentelemetry_instrumentation_deepspeed.diagnose.model import BROKEN_RUN, ModelFindings  # model, memory
from opentelemetry_instrumentation_deepspeed.diagnose.model import series as model_series
from opentelemetry_instrumentation_deepspeed.diagnose.reader import Span

PHASES = {semconv.SPAN_DATA_WAIT: "data_wait", semconv.SPAN_FORWARD: "forward", semconv.SPAN_BACKWARD: "backward",
          semconv.SPAN_OPTIMIZER_STEP: "optimizer"}
PARTS = ("data_wait", "forward", "backward", "optimizer", "exposed_comm", "comm_wait", "unaccounted")
WHOSE_COLLECTIVE = ("the collectives the time went to (evidence): one whose size is neither the gradients' buckets "
                    "nor the parameters' is the program's own, or a library's: does it need to run every step, and at "
                    "that size")
# Shares a "none" verdict names: above what healthy runs on the 2-core test machine show (data wait 0-2%, waits for
# each other up to 22%: docs/diagnose.md, "Accuracy")
UNEXPLAINED_DATA_WAIT = 0.10
UNEXPLAINED_COMM_WAIT = 0.25
UNEXPLAINED_CPU_WAIT = 0.15  # a training thread's wait for a CPU, of its steps' time

_STOPPED_LAYERS = ("HANG", "DESYNC", "CRASH")
# The group of a pipeline's transfer in ``_Step.comm`` (joined to no other rank's): a wait for the neighbouring stage.
_NEIGHBOUR = object()


@dataclass
class _Step:
    number: int = 0
    trace_id: str = ""
    start: int = 0
    end: int = 0
    seen: bool = False
    cpu_wait: float | None = None  # the share of the step its training thread waited for a CPU
    native_wait: float | None = None  # ... and its native threads (gloo's), summed
    between_comm: float = 0.0  # seconds its thread spent in collectives before it (after the step before it)
    phases: list = field(default_factory=list)  # (part, start, end, share of it the training thread waited for a CPU)
    comm: list = field(default_factory=list)  # synchronous collectives: (start, end, group or _NEIGHBOUR, sequence)


def _union_overlap(intervals: list[tuple[int, int]], start: int, end: int) -> int:
    """Nanoseconds of [start, end] covered by the union of ``intervals``."""
    return _Coverage(intervals).overlap(start, end)


class _Coverage:
    """The union of intervals, merged once (n log n); then how much of [start, end] it covers, or
    whether it holds a time, in log n: a step's phases are each measured against all its
    collectives, and a run's GPU samples against all its steps."""

    def __init__(self, intervals):
        self.starts, self.ends, self.before = [], [], [0]  # before[i]: covered up to starts[i]
        for first, last in sorted(intervals):
            if last <= first:
                continue
            if self.ends and first <= self.ends[-1]:
                self.ends[-1] = max(self.ends[-1], last)
                continue
            if self.starts:
                self.before.append(self.before[-1] + self.ends[-1] - self.starts[-1])
            self.starts.append(first)
            self.ends.append(last)

    def _upto(self, at: int) -> int:
        """Nanoseconds covered before ``at``."""
        index = bisect.bisect_right(self.starts, at) - 1
        if index < 0:
            return 0
        return self.before[index] + min(at, self.ends[index]) - self.starts[index]

    def overlap(self, start: int, end: int) -> int:
        return self._upto(end) - self._upto(start) if end > start else 0

    def holds(self, at: int) -> bool:
        index = bisect.bisect_right(self.starts, at) - 1
        return index >= 0 and at <= self.ends[index]


class _Intervals:
    """Intervals sorted by start, to find the latest-starting one that holds a time by bisection
    (nearly always the one just before it: a rank's steps and a step's phases do not overlap)."""

    def __init__(self, items: list, start, end):
        self.items = sorted(items, key=start)
        self.starts = [start(item) for item in self.items]
        self.ends = [end(item) for item in self.items]
        self.reach, latest = [], None  # the latest end among the items up to each index
        for last in self.ends:
            latest = last if latest is None else max(latest, last)
            self.reach.append(latest)

    def holding(self, at: int):
        index = bisect.bisect_right(self.starts, at) - 1
        while index >= 0 and self.reach[index] >= at:
            if self.ends[index] >= at:
                return self.items[index]
            index -= 1
        return None


class _PartIndex:
    """Which part of a rank's step runs at a time, for GPU samples: steps, phases and collectives
    indexed once, then looked up by bisection. Where steps or phases overlap, the latest to start wins."""

    def __init__(self, steps: list):
        self.steps = _Intervals(steps, lambda s: s.start, lambda s: s.end)
        self._phases = {}

    def at(self, at: int) -> str:
        step = self.steps.holding(at)
        if step is None:
            return "between_steps"
        found = self._phases.get(id(step))
        if found is None:
            found = self._phases[id(step)] = (_Intervals(step.phases, lambda p: p[1], lambda p: p[2]),
                                              _Coverage((a, b) for a, b, _g, _s in step.comm))
        phases, comm = found
        phase = phases.holding(at)
        if phase is None:
            return "unaccounted"
        return "exposed_comm" if phase[0] != "data_wait" and comm.holds(at) else phase[0]


class Analysis:
    def __init__(self):
        self.jobs: dict[str, int] = defaultdict(int)
        self._steps: dict[tuple[str, int, str], _Step] = {}
        self._collectives: dict[tuple[str, str, int], dict[int, int]] = defaultdict(dict)
        # (job, op, bytes or None where a span has none) -> [calls, seconds, [bus bandwidths], seconds of the
        # synchronous ones] of the collectives that completed: the bandwidth table, and which ones the time went to
        # (a review: "71% of step time is exposed communication", and no word of the 55.6 MB all-reduce a loop issued
        # in its backward; a median bus bandwidth that mixed it with 4-byte all-reduces).
        self._comm_sizes: dict[tuple[str, str, int], list] = {}
        self._parallelism: dict[str, str] = {}  # job -> a plain PyTorch loop's training.parallelism
        self._samples: list = []
        self.hangs = hangs.Hangs()  # HANG and DESYNC (hangs.py)
        self.crashes = crashes.Crashes()  # CRASH (crashes.py)
        self.clocks = clocks.Clocks()  # the ranks' residual clock offsets (clocks.py)
        self.model = ModelFindings()  # model and memory layers
        self._inputs = inputs.InputSeries()  # the input layer
        self.pipeline = pipeline.PipelineAnalysis()  # pipeline parallelism (diagnose/pipeline.py)
        self._arrivals: dict[tuple[str, str, int], int] = {}  # filled by result(), from _collectives
        self._seen: set[int] = set()  # the spans read, by (trace id, span id, job, rank, name, start), hashed
        self.duplicates = 0

    def add_native_crash(self, job: str, rank: int, text: str, at: int) -> None:
        """What faulthandler wrote as a fault in native code killed ``rank`` (export/native_crash.py), at ``at``."""
        self.jobs[job] += 0  # a job whose ranks died before their first export is still one to diagnose
        self.crashes.native(job, rank, text, at)

    def add_samples(self, samples) -> None:
        """GPU metric samples (hw.gpu.utilization, hw.gpu.throttle, hw.errors) of the same job's ranks."""
        self._samples.extend(samples)

    def add(self, spans: Iterable[Span]) -> None:
        seen = self._seen
        for span in spans:
            # A span delivered twice (a Collector retries an export it could not confirm; files given twice) is
            # counted once: every part of a step it would double. Its hash only, kept: ~60 MB for a million spans.
            key = hash((span.trace_id, span.span_id, span.job, span.rank, span.name, span.start))
            if key in seen:
                self.duplicates += 1
                continue
            seen.add(key)
            self.jobs[span.job] += 1
            if span.name == semconv.SPAN_STEP and span.attributes.get(semconv.TRAINING_STEP_UNFINISHED):
                continue  # work after the last optimizer step of a run that ended normally: neither a step nor a crash
            self.hangs.add(span)  # HANG and DESYNC (hangs.py)
            self.crashes.add(span)  # CRASH (crashes.py)
            self.clocks.add(span)  # clocks.py
            self.model.add(span)  # model and memory layers
            self.pipeline.add(span)  # pipeline parallelism (diagnose/pipeline.py)
            key = (span.job, span.rank, span.trace_id)
            if span.name == semconv.SPAN_STEP:
                if span.error is not None:
                    continue  # cut short (an exception, the exit, a signal): crashes.py's, not a step to time
                parallelism = span.attributes.get(semconv.TRAINING_PARALLELISM)
                if parallelism is not None:
                    self._parallelism[span.job] = parallelism
                step = self._steps.setdefault(key, _Step())
                if not step.seen or span.end > step.end:  # a retried step keeps its last attempt
                    step.number, step.trace_id, step.start, step.end = (span.attributes.get(semconv.TRAINING_STEP, 0),
                                                                        span.trace_id, span.start, span.end)
                    step.cpu_wait = span.attributes.get(semconv.TRAINING_STEP_THREAD_CPU_WAIT)
                    step.native_wait = span.attributes.get(semconv.TRAINING_STEP_NATIVE_THREADS_CPU_WAIT)
                    step.between_comm = span.attributes.get(semconv.TRAINING_STEP_BETWEEN_COMM, 0.0)
                    step.seen = True
                self._inputs.add(span)  # the input layer
            elif span.name in PHASES:
                waited = span.attributes.get(semconv.TRAINING_PHASE_THREAD_CPU_WAIT)
                self._steps.setdefault(key, _Step()).phases.append((PHASES[span.name], span.start, span.end, waited))
            elif span.name.startswith(semconv.SPAN_COMM_PREFIX):
                self._add_comm(span, key)

    def _add_comm(self, span: Span, key: tuple) -> None:
        attributes = span.attributes
        if pipeline.is_transfer(span):
            # A pipeline stage's send or receive: its wait for the neighbouring stage (the bubble), a wait for another
            # rank as a collective's before the last rank arrives, not work of its own (a stage that waits for
            # another's stall every 5th step would read as its own host work).
            if not attributes.get(semconv.COMM_ASYNC):
                self._steps.setdefault(key, _Step()).comm.append((span.start, span.end, _NEIGHBOUR, None))
            return
        group, sequence = attributes.get(semconv.COMM_GROUP_NAME, "0"), attributes.get(semconv.COMM_SEQUENCE)
        # Joined by sequence across the group's ranks; a send or recv is numbered per peer (semconv.P2P_OPS).
        if span.name.removeprefix(semconv.SPAN_COMM_PREFIX) in semconv.P2P_OPS:
            sequence = None
        if not attributes.get(semconv.COMM_ASYNC):
            self._steps.setdefault(key, _Step()).comm.append((span.start, span.end, group, sequence))
        if sequence is not None:
            self._collectives[(span.job, group, sequence)][span.rank] = span.start
        if span.error is None:  # older files carry a failed one's bandwidth too
            size = attributes.get(semconv.COMM_BYTES)
            op = span.name.removeprefix(semconv.SPAN_COMM_PREFIX)
            sized = self._comm_sizes.setdefault((span.job, op, size if type(size) is int else None), [0, 0.0, [], 0.0])
            busbw = attributes.get(semconv.COMM_BUSBW)
            sized[0] += 1
            sized[1] += span.seconds
            if busbw:
                sized[2].append(float(busbw))
            if not attributes.get(semconv.COMM_ASYNC):  # an async one overlaps the compute: no exposed time of its own
                sized[3] += span.seconds

    # -- results ------------------------------------------------------------------------------------

    def result(self, job: str | None = None) -> dict:
        if not self.jobs:
            return {"job_id": None, "ranks": {}, "findings": [],
                    "verdict": findings_module.none(
                        "no training spans in the input: a rank writes its steps as they end, and a hang report past "
                        "its watchdog's threshold (ten times it before the first step): a live job stuck before "
                        "its first step has none yet")}
        job = job if job is not None else max(self.jobs, key=self.jobs.get)
        self._waits_where_they_happened(job)  # data waits fetched ahead (issue 19)
        by_rank: dict[int, list[dict]] = defaultdict(list)
        for (step_job, rank, _trace), step in self._steps.items():
            if step_job == job and step.seen:
                by_rank[rank].append(self._breakdown(step, job))
        for steps in by_rank.values():
            steps.sort(key=lambda s: (s["start"], s["step"]))  # in time: a rollback runs step numbers again
            _between_steps(steps)
        ranks = {rank: self._rank_summary(steps) for rank, steps in sorted(by_rank.items())}
        gpu = self._gpu(job, by_rank)
        # -- findings: follow the waits across ranks, then the patterns of each rank's own steps --
        comm = defaultdict(dict)
        for (step_job, rank, _trace), step in self._steps.items():
            if step_job == job and step.seen:
                comm[rank][step.number] = step.comm
        steps = findings_module.StepFindings({rank: _steady(s) for rank, s in by_rank.items()},
                                             _followed(comm, by_rank), stages=self.pipeline.ran(job),
                                             missing=bool(self.crashes.missing(job)))
        found = steps.all()
        straggler = steps.straggler(found)
        found += findings_module.hardware_findings(gpu, found)
        for rank, summary in ranks.items():
            summary["anomaly"] = _anomaly(steps.patterns.get(rank), by_rank[rank], found)
        job_summary = self._job_summary(ranks)
        pipelined = self.pipeline.ran(job)
        if job_summary and job_summary["anomaly"] is None:
            job_summary["anomaly"] = _job_anomaly(found, by_rank)
        found = findings_module.ranked(found)  # other layers join below, ranked with these
        result = {
            "job_id": job,
            "other_jobs": sorted(j for j in self.jobs if j != job),
            # Ranks the world size counts with no telemetry in the input: left out, or dead before they wrote any.
            "missing_ranks": self.crashes.missing(job),
            "ranks_read": len(self.crashes.ranks[job]),  # with telemetry in the input, whether or not a step closed
            "ranks": ranks,
            "job": job_summary,
            "straggler": straggler,
            "gpu": gpu,
            "bandwidth": self._bandwidth(job),
            "findings": found,
            "verdict": found[0] if found else findings_module.none(_quiet(job_summary, pipelined=pipelined)),
            "model_series": model_series(self.model, job),
        }
        result["pipeline"] = self.pipeline.result(job)  # pipeline parallelism (diagnose/pipeline.py)
        pipeline.reconcile(result, result["pipeline"], _without_cross_stage_stragglers)
        # Model and memory layers (diagnose/model.py), the input layer (diagnose/inputs.py: INPUT / COMPUTE
        # change points): ranked with the others by the time they cost.
        model = self.model.findings(job, job_summary.get("step_seconds_p50") if job_summary else None)
        changes, result["host_load"] = inputs.findings(self._inputs, job, by_rank)
        result["host_load"] += steps.host_load
        result["loop_work"] = steps.loop_work
        _explain_late_ranks(changes, result["findings"], steps.waits.held)
        result["findings"] = findings_module.ranked(result["findings"] + model + changes + self.hangs.stalls(job))
        result["verdict"] = (result["findings"][0] if result["findings"] else findings_module.none(
            _quiet(job_summary, result["host_load"], pipelined, steps.loop_work)))
        self._broken_or_crashed(result, model, job)
        # -- HANG and DESYNC (hangs.py): a stopped job, or ranks that disagree on a collective, come first
        found = self.hangs.findings(job, result["missing_ranks"])
        if found:
            # The signal that stopped the hung job is the hang's end, not a finding of its own.
            result["findings"] = found + [f for f in result.get("findings", [])
                                          if not (f["layer"] == "CRASH" and f["kind"] == "signalled")]
            result["verdict"] = found[0]
        # The schema's field on every finding, whichever layer made it; a stopped job's cost (the time it has been
        # stuck) is no share of its steps.
        for finding in result["findings"]:
            findings_module.remedies_for(finding, self._parallelism.get(job))
        self._say_which_collectives(result["findings"], job, sum(len(steps) for steps in by_rank.values()))
        for finding in result["findings"]:
            if "share_of_run" not in finding:
                cost = None if finding["layer"] in _STOPPED_LAYERS else finding.get("cost_seconds")
                finding["share_of_run"] = cost / steps.run_seconds if cost is not None and steps.run_seconds else None
        result["clocks"] = self.clocks.residuals(job)
        # -- end HANG and DESYNC, clocks
        result["step_series"] = {rank: [[s["step"], round(s["seconds"], 6)] for s in steps]
                                 for rank, steps in sorted(by_rank.items())}
        result["timelines"] = self._timelines(job, by_rank)
        return result

    def _broken_or_crashed(self, result: dict, model: list[dict], job: str) -> None:
        """A NaN or an OOM (a broken run, not a slow one), then a CRASH (crashes.py): the verdict before any slowness;
        a broken model's finding at an earlier step than the crash is its cause (a loop that asserts on a NaN loss).
        The verdict heads the findings, as the schema says."""
        crashed = self.crashes.findings(job)
        for found in model:
            if found["layer"] == "MEMORY":  # an OOM that ended the run: its error, and the other ranks' after it
                found["evidence"] = [*self.crashes.memory_evidence.get((job, found["rank"], found["step"]), ()),
                                     *found["evidence"]]
        broken = [f for f in model if f["confidence"] >= BROKEN_RUN]
        if broken:
            result["verdict"] = max(broken, key=lambda f: (f["cost_seconds"] or 0.0, f["confidence"]))
        if crashed:
            result["findings"] = crashed + result["findings"]
            if not broken or min(f["step"] for f in broken) >= crashed[0]["step"]:
                result["verdict"] = crashed[0]
        verdict = result["verdict"]
        if any(f is verdict for f in result["findings"]):
            result["findings"] = [verdict, *(f for f in result["findings"] if f is not verdict)]

    def _waits_where_they_happened(self, job: str) -> None:
        """A data wait fetched ahead (a loader's look-ahead) is the child of the step whose micro-batch
        it fetched, but the loop was blocked on it before that step started: its time counts in the
        step of the same rank that was running then."""
        by_rank: dict[int, list[_Step]] = defaultdict(list)
        for (step_job, rank, _trace), step in self._steps.items():
            if step_job == job and step.seen:
                by_rank[rank].append(step)
        for steps in by_rank.values():
            steps.sort(key=lambda s: s.start)
            starts = [s.start for s in steps]
            for step in steps:
                ahead = [p for p in step.phases if p[0] == "data_wait" and p[2] <= step.start]
                for phase in ahead:
                    index = bisect.bisect_right(starts, phase[1]) - 1
                    if index >= 0 and phase[1] < steps[index].end and steps[index] is not step:
                        step.phases.remove(phase)
                        steps[index].phases.append(phase)

    def _bandwidth(self, job: str) -> dict[str, dict]:
        """Per op, the bus bandwidth of its completed collectives, and by their size (bytes of a rank's data), the
        longest in total first."""
        by_op: dict[str, list] = defaultdict(list)
        for (of_job, op, size), entry in sorted(self._comm_sizes.items(), key=lambda item: -item[1][1]):
            if of_job == job:
                by_op[op].append((size, entry))
        table = {}
        for op, sizes in sorted(by_op.items()):
            values = [busbw for _size, entry in sizes for busbw in entry[2]]
            if values:
                table[op] = {"median_busbw": statistics.median(values), "best_busbw": max(values),
                             "calls": len(values), "by_size": {
                                 str(size): {"calls": calls, "seconds": seconds,
                                             "median_busbw": statistics.median(busbw) if busbw else None}
                                 for size, (calls, seconds, busbw, _sync) in sizes if size is not None}}
        return table

    def _say_which_collectives(self, found: list[dict], job: str, rank_steps: int) -> None:
        """A communication finding names the collectives its time went to, and the first remedy reads them."""
        where = self._comm_time(job, rank_steps)
        for finding in found:
            if finding["layer"] == "communication" and where:
                finding["evidence"].append(where)
                finding["remedies"] = [WHOSE_COLLECTIVE, *finding["remedies"]]

    def _comm_time(self, job: str, rank_steps: int) -> str | None:
        """Which synchronous collectives the time in them went to: op and size, calls per step, share (the first
        three)."""
        sizes = sorted(((op, size, entry) for (of_job, op, size), entry in self._comm_sizes.items()
                        if of_job == job and size is not None and entry[3]), key=lambda item: -item[2][3])
        total = sum(entry[3] for _op, _size, entry in sizes)
        if not total or not rank_steps:
            return None
        return "the time in synchronous collectives went to: " + "; ".join(
            f"{op} of {size_text(size)}, {calls / rank_steps:.3g} per step and rank, {sync / total:.0%}"
            for op, size, (calls, _seconds, _busbw, sync) in sizes[:3])

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
                               "phases": [[part, start, end] for part, start, end, _waited in sorted(
                                   step.phases, key=lambda p: p[1])],
                               "comm": [[start, end] for start, end, _group, _sequence in step.comm]}
            number = next((s["step"] for steps_ in by_rank.values() for s in steps_ if s["trace_id"] == trace_id), 0)
            timelines[label] = {"trace_id": trace_id, "step": number, "ranks": lanes}
        return timelines

    @staticmethod
    def _part_at(at: int, steps: _PartIndex) -> str:
        """The part of the rank's step running at ``at``; "between_steps" outside every step."""
        return steps.at(at)

    def _gpu(self, job: str, by_rank: dict) -> dict:
        """Per rank: utilization overall and by the part of the step it was sampled in; throttling; ECC."""
        found = {}
        samples_of, steps_of = defaultdict(list), defaultdict(list)  # grouped once: ranks x samples is large
        for sample in self._samples:
            samples_of[sample.rank].append(sample)
        for (j, r, _t), step in self._steps.items():
            if j == job and step.seen:
                steps_of[r].append(step)
        for rank in sorted(set(samples_of) & set(by_rank)):
            samples = samples_of[rank]
            steps = _PartIndex(steps_of[rank])
            utilization = [s for s in samples if s.metric == semconv.METRIC_HW_GPU_UTILIZATION]
            by_part = defaultdict(list)
            for sample in utilization:
                by_part[self._part_at(sample.time, steps)].append(sample.value)
            throttle = defaultdict(list)
            for sample in samples:
                if sample.metric == semconv.METRIC_NVIDIA_GPU_THROTTLE:
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
            if group is _NEIGHBOUR:
                waits.append((start, end))
                continue
            last = self._last_arrival(job, group, sequence)
            last = min(last, end) if last is not None else start
            if last > start:
                waits.append((start, last))
            transfers.append((max(last, start), end))
        comm = _Coverage((start, end) for start, end, _group, _sequence in step.comm)
        phase_waits: dict | None = {}
        for part, start, end, waited in step.phases:
            parts[part] += (end - start) - (comm.overlap(start, end) if part != "data_wait" else 0)
            if part == "data_wait" or phase_waits is None:
                continue
            if waited is None:
                phase_waits = None  # where the training thread waited for a CPU: in all of the step's phases, or none
            else:
                phase_waits[part] = phase_waits.get(part, 0.0) + min(waited, 1.0) * (end - start) / 1e9
        parts["exposed_comm"] = _union_overlap(transfers, step.start, step.end)
        parts["comm_wait"] = _union_overlap(waits, step.start, step.end)
        total = step.end - step.start
        parts["unaccounted"] = max(total - sum(parts.values()), 0)
        return {"step": step.number, "trace_id": step.trace_id, "seconds": total / 1e9, "start": step.start,
                "end": step.end,
                "parts": {name: value / 1e9 for name, value in parts.items()},
                "cpu_wait": None if step.cpu_wait is None else min(step.cpu_wait, 1.0) * total / 1e9,
                "native_wait": None if step.native_wait is None else step.native_wait * total / 1e9,
                "between_comm": step.between_comm,
                "phase_waits": phase_waits or None}

    def _last_arrival(self, job: str, group, sequence) -> int | None:
        """When the last rank arrived at a collective; computed once per collective, not once per rank."""
        if sequence is None:
            return None
        key = (job, group, sequence)
        last = self._arrivals.get(key)
        if last is None:
            starts = self._collectives.get(key)
            last = self._arrivals[key] = max(starts.values()) if starts else None
        return last

    @staticmethod
    def _rank_summary(steps: list[dict]) -> dict:
        durations = [s["seconds"] for s in steps]
        steady = _steady(steps)
        total = sum(s["seconds"] for s in steady) or 1.0
        shares = {part: sum(s["parts"][part] for s in steady) / total for part in PARTS}
        waited = [s["cpu_wait"] / s["seconds"] for s in steady if s.get("cpu_wait") is not None and s["seconds"] > 0]
        return {
            # the share of its steps its training thread was ready to run but had no CPU (median): a crowded host
            "cpu_wait_share": statistics.median(waited) if waited else None,
            "steps": len(steps),
            "step_seconds": {"p50": _quantile(durations, 0.5), "p95": _quantile(durations, 0.95),
                             "max": max(durations) if durations else 0.0},
            "shares": shares,
            "anomaly": None,
            "slowest": max(steady or steps, key=lambda s: s["seconds"]) if steps else None,  # the warm-up step aside
            "typical": sorted(steady, key=lambda s: s["seconds"])[len(steady) // 2] if steady else None,
        }

    @staticmethod
    def _job_summary(ranks: dict) -> dict:
        if not ranks:
            return {}
        count = len(ranks)
        shares = {part: sum(r["shares"][part] for r in ranks.values()) / count for part in PARTS}
        p50 = statistics.median(r["step_seconds"]["p50"] for r in ranks.values())
        waited = {rank: r["cpu_wait_share"] for rank, r in ranks.items() if r.get("cpu_wait_share") is not None}
        most = max(waited, key=waited.get) if waited else None
        anomalies = [r["anomaly"] for r in ranks.values() if r["anomaly"]]
        anomaly = None
        if anomalies and len(anomalies) * 2 > count:
            anomaly = max(anomalies, key=lambda a: a["extra_seconds"])
        return {"ranks": count, "step_seconds_p50": p50, "shares": shares, "anomaly": anomaly,
                "cpu_wait": None if most is None else {"rank": most, "share": waited[most]}}


def _explain_late_ranks(changes: list[dict], found: list[dict], held: dict[int, dict[int, float]]) -> None:
    """An INPUT or COMPUTE change on one rank takes over the late-rank finding on that rank where the others waited
    for it three times as long per step (medians) from the change on as before it: the change is why they wait.
    Ranked as the surer of the two, at the larger cost. A rank whose sequences alone grew from step 15 read
    "straggler" first."""
    for change in changes:
        rank, at = change.get("rank"), change.get("change_step")
        late = next((f for f in found if rank is not None and f.get("rank") == rank and f.get("test") == "signed-rank"),
                    None)
        if late is None or at is None:
            continue
        waited = held.get(rank, {})
        before = [seconds for step, seconds in waited.items() if step < at]
        after = [seconds for step, seconds in waited.items() if step >= at]
        if not before or not after or statistics.median(after) < 3 * statistics.median(before):
            continue
        found.remove(late)
        change["evidence"] = [*change["evidence"], f"rank {rank} is the one the others wait for: {late['summary']}",
                              *late["evidence"]]
        if late["cost_seconds"] > change["cost_seconds"]:
            change["cost_seconds"], change["share_of_run"] = late["cost_seconds"], late["share_of_run"]
        change["confidence"] = max(change["confidence"], late["confidence"])


def _followed(comm: dict, by_rank: dict[int, list[dict]]) -> waits.Waits:
    """Who waited for whom in the collectives of the steps, and in those before each step (a barrier after rank 0's
    checkpoint), which count as a wait for the others in the step after them."""
    followed = waits.follow(comm)
    for rank, steps in by_rank.items():
        for step in steps:
            if step["between_comm"]:
                followed.waited[step["step"]][rank] += step["between_comm"]
    return followed


def _between_steps(steps: list[dict]) -> None:
    """Each step's ``between_steps``: from the end of the rank's step before it (the step numbered one less) to its
    start, the loop's own code, less what its thread spent in collectives there (a wait for the other ranks); 0 after
    a step not seen (its number skipped, the first)."""
    previous = None
    for step in steps:
        gap = step["start"] - previous["end"] if previous is not None and previous["step"] == step["step"] - 1 else 0
        step["parts"]["between_steps"] = max(gap / 1e9 - step["between_comm"], 0.0) if gap > 0 else 0.0
        previous = step


def size_text(size: int) -> str:
    """Bytes as a reader takes them in: "55.6 MB", "540 KB", "4 B"."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size} B"


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _without_cross_stage_stragglers(result: dict) -> dict:
    """pipeline.reconcile's second decision: in a pipeline job stages differ by design, so a late rank
    whose stage peers are not slower than it is no straggler; its late-rank findings go."""
    result["findings"] = [f for f in result["findings"]
                          if not (f.get("test") == "signed-rank"
                                  and f.get("phase") in (*findings_module.COMPUTE, "compute"))]
    return result["findings"][0] if result["findings"] else findings_module.none(_quiet(result["job"], pipelined=True))


def _steady(steps: list[dict]) -> list[dict]:
    """The first step pays for warm-up (allocation, first collectives): not part of the patterns."""
    return steps[1:] if len(steps) > 3 else steps


def _anomaly(pattern, steps: list[dict], found: list[dict]) -> dict | None:
    """A rank's periodic pattern in the report's former shape, if a finding reported it."""
    if pattern is None or not any(f.get("period") == pattern.period and f.get("offset") == pattern.offset
                                  for f in found):
        return None
    finding = next(f for f in found if f.get("period") == pattern.period and f.get("offset") == pattern.offset)
    return _anomaly_shape(pattern.period, pattern.offset, finding["phase"], pattern.steps, steps)


def _job_anomaly(found: list[dict], by_rank: dict[int, list[dict]]) -> dict | None:
    """The first periodic finding in the report's former shape, where no rank's own pattern matched
    it (a stall every rank shares can pass its test on the ranks together and on none alone)."""
    periodic = next((f for f in found if f.get("period") and f.get("steps")), None)
    if periodic is None:
        return None
    rank = periodic.get("rank") if periodic.get("rank") in by_rank else min(by_rank)
    return _anomaly_shape(periodic["period"], periodic.get("offset"), periodic.get("phase"), periodic["steps"],
                          by_rank[rank])


def _anomaly_shape(period: int, offset, phase, numbers: list[int], steps: list[dict]) -> dict:
    slow = set(numbers)
    inside = [s for s in steps if s["step"] in slow]
    outside = [s for s in _steady(steps) if s["step"] not in slow]
    # Medians, as the finding's own effect: one of the slow steps that also paid for something else (a
    # profiled step, a neighbour's burst) moved a mean of four by half the stall.
    return {"period": period, "offset": offset, "phase": phase,
            "extra_seconds": statistics.median(s["seconds"] for s in inside) -
            statistics.median(s["seconds"] for s in outside) if inside and outside else 0.0,
            "steps": list(numbers),
            "trace_ids": [s["trace_id"] for s in sorted(inside, key=lambda s: s["seconds"], reverse=True)[:5]]}


def _quiet(job: dict, host_load: list | None = None, pipelined: bool = False, loop_work: dict | None = None) -> str:
    if not job:
        return "no complete steps in the input"
    shares = job["shares"]
    compute = shares["forward"] + shares["backward"] + shares["optimizer"]
    quiet = [f"no finding costs {findings_module.MIN_COST_SHARE:.0%} of the run beyond chance: median step "
             f"{job['step_seconds_p50'] * 1e3:.1f} ms, {compute:.0%} of it in forward, backward and optimizer step"]
    # What the shares show that no test held: said, so that "none" is not read as "nothing there".
    if shares["data_wait"] >= UNEXPLAINED_DATA_WAIT:
        held = ("its share did not hold above it beyond chance" if shares["data_wait"] > findings_module.DATA_WAIT_SHARE
                else "below it")
        quiet.append(f"data wait is {shares['data_wait']:.0%} of step time, in no pattern, and the steady test's "
                     f"{findings_module.DATA_WAIT_SHARE:.0%} share: {held}")
    if shares["comm_wait"] >= UNEXPLAINED_COMM_WAIT:
        quiet.append(f"the stages wait for each other {shares['comm_wait']:.0%} of step time, in their transfers and "
                     "collectives: the pipeline's bubble (per stage below)" if pipelined  # by design: fill and drain
                     else f"the ranks wait for each other {shares['comm_wait']:.0%} of step time in collectives, and "
                     "no rank's own part explains it beyond chance")
    waited = job.get("cpu_wait")
    if waited and waited["share"] >= UNEXPLAINED_CPU_WAIT:
        # A review of a healthy run on a crowded host: the report said nothing of what the files showed.
        quiet.append(f"rank {waited['rank']}'s training thread waited for a CPU {waited['share']:.0%} of its step "
                     "time (median of its steps): the host had fewer free CPUs than the job's threads, evenly enough "
                     "that no step, phase or rank stands out")
    notes = [load["summary"] for load in host_load or ()] + ([loop_work["summary"]] if loop_work else [])
    return "; ".join(quiet + notes)
