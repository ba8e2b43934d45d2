"""The model and memory layers: numerics that went wrong, and out-of-memory errors.

``NumericsWatch`` judges one rank's steps in order, from their loss, gradient norm and skipped
flag: a non-finite loss or gradient norm, a loss or gradient-norm spike (``factor`` times the
median of the recent finite values, and far outside their spread, so a noisy but healthy loss
never counts), a run of skipped (fp16 overflow) steps after training got going. Without fp16 loss
scaling (bf16, fp32) nothing calibrates by skipping: DeepSpeed's ZeRO optimizers skip a step whose
gradients hold an inf or a NaN, and that is a non-finite gradient norm at once. The emitter runs
it live (the ``training.numerics.anomalies`` metric and the step's attribute); ``ModelFindings``
runs it again over a whole run's spans for ``diagnose`` (MODEL), and names each out-of-memory
error with its rank, step, phase and memory figures (MEMORY).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict, deque

from opentelemetry_instrumentation_deepspeed import semconv

WINDOW = 32  # recent finite values of the baseline
MIN_BASELINE = 8  # values needed before a spike can be judged
SETTLED = 16  # values from which the step-to-step noise alone is the spread (_noise)
LOSS_SPIKE_FACTOR = 2.0
GRAD_NORM_SPIKE_FACTOR = 5.0
SPREAD_FACTOR = 6.0  # ... and this many robust standard deviations (1.4826 MAD) above the median
SKIPPED_RUN = 3  # consecutive skipped steps, once a step was applied, that make a run


# Precisions no loss scaler runs with (``training.precision``): a skipped step there is no calibration.
UNSCALED = ("bf16", "fp32")


class _Baseline:
    def __init__(self, factor: float):
        self.factor = factor
        self.values: deque = deque(maxlen=WINDOW)

    def spike(self, value: float) -> float | None:
        """``value`` over the median when it is a spike, else None; ``value`` then joins the baseline.

        The spread is judged on the logarithms where every value is positive: a loss or a norm is noisy by
        factors, and its spread is skewed (a small batch's mean squared error is a scaled chi-square), so a
        median and MAD of the values themselves put healthy tails 6 robust deviations out (a review: a healthy
        regression at 4 samples per step raised a spike in 1 run of 4; simulated, 26% of 60-step runs, 0.5% on
        the logarithms). A spike is a factor too, so a steady loss loses nothing: x3 still stands out. The
        spread is the step-to-step noise's (``_noise``), not the values': a falling loss's trend is no noise."""
        found = None
        if len(self.values) >= MIN_BASELINE:
            ordered = sorted(self.values)
            median = _median(ordered)
            # The spread (more sorting) only for a candidate: this runs on the emitter's thread every step.
            if median > 0 and value > self.factor * median:
                if ordered[0] > 0:
                    series, this = [math.log(v) for v in self.values], math.log(value)
                else:  # a loss that may be negative (a log-likelihood, a reward): the values themselves
                    series, this = list(self.values), value
                noise, trend = _noise(series)
                # Above the median, and a jump from the step before beyond its usual change: a loss that climbs
                # step after step (a divergence) is one spike where it starts, not one at every step (a code review:
                # 15-17 per run of a loss tripling over 20 steps).
                if (this - _median(sorted(series)) > SPREAD_FACTOR * noise
                        and this - series[-1] - trend > SPREAD_FACTOR * noise):
                    found = value / median
        self.values.append(value)
        return found


def _noise(series: list[float]) -> tuple[float, float]:
    """The robust standard deviation of a series' step-to-step noise, and its usual change per step: 1.4826 MAD of
    its successive differences (around their median, the change), over sqrt 2. A falling loss's trend is no noise:
    the MAD of the values themselves grew with it, and a loss that jumped x4.5 from 1.92 to 8.61 at step 30 of a
    run falling from 5.6 needed x20-50 (a review), where x2.2 sufficed on a flat loss. Under SETTLED values the
    differences' MAD is too unsteady (a healthy run's noisy loss read x4.6 at its 9th step as a spike): the larger
    of the two spreads until then."""
    differences = sorted(later - earlier for earlier, later in itertools.pairwise(series))
    trend = _median(differences)
    noise = 1.4826 * _median(sorted(abs(d - trend) for d in differences)) / math.sqrt(2)
    if len(series) < SETTLED:
        center = _median(sorted(series))
        noise = max(noise, 1.4826 * _median(sorted(abs(v - center) for v in series)))
    return noise, trend


def _median(ordered: list) -> float:
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


class NumericsWatch:
    """One rank's steps, judged in order: ``step`` returns [(kind, detail)] for each anomaly. ``scaled``: a loss
    scaler may skip steps (fp16; or the precision is not known)."""

    def __init__(self, scaled: bool = True):
        self.scaled = scaled
        self._loss = _Baseline(LOSS_SPIKE_FACTOR)
        self._grad_norm = _Baseline(GRAD_NORM_SPIKE_FACTOR)
        self._applied = False  # a step was applied: skipped steps before it calibrate the loss scale
        self._skipped_run = 0

    def step(self, loss: float | None, grad_norm: float | None, skipped: bool) -> list[tuple[str, str]]:
        found = []
        if loss is not None:
            if not math.isfinite(loss):
                found.append((semconv.NUMERICS_NONFINITE_LOSS, f"loss {loss}"))
            else:
                ratio = self._loss.spike(loss)
                if ratio:
                    found.append((semconv.NUMERICS_LOSS_SPIKE, f"loss {loss:.4g}, {ratio:.1f}x the recent median"))
        if skipped and not self.scaled:
            # No loss scale to calibrate: the optimizer skipped the step for an inf or a NaN in the gradients.
            norm = "" if grad_norm is None else f"gradient norm {grad_norm}, "
            found.append((semconv.NUMERICS_NONFINITE_GRAD_NORM,
                          f"{norm}the optimizer skipped the step (no fp16 loss scale: not an overflow)"))
        # A skipped step's norm is the overflow itself (inf or NaN by design): the run of skips tells.
        elif grad_norm is not None and not skipped:
            if not math.isfinite(grad_norm):
                found.append((semconv.NUMERICS_NONFINITE_GRAD_NORM, f"gradient norm {grad_norm}"))
            else:
                ratio = self._grad_norm.spike(grad_norm)
                if ratio:
                    found.append((semconv.NUMERICS_GRAD_NORM_SPIKE,
                                  f"gradient norm {grad_norm:.4g}, {ratio:.1f}x the recent median"))
        if skipped:
            self._skipped_run += 1
            if self.scaled and self._applied and self._skipped_run == SKIPPED_RUN:
                found.append((semconv.NUMERICS_SKIPPED_RUN, f"{SKIPPED_RUN} consecutive steps skipped (overflow)"))
        else:
            self._applied, self._skipped_run = True, 0
        return found


REMEDIES = {
    semconv.NUMERICS_NONFINITE_LOSS: [
        "look at the batch of that step on that rank (bad input, a division by zero, log of 0)",
        "lower the learning rate or add warm-up; check for an fp16 overflow in the forward (try bf16)"],
    semconv.NUMERICS_NONFINITE_GRAD_NORM: [
        "gradient clipping (gradient_clipping in the DeepSpeed config) and a lower learning rate",
        "check the loss function's backward for NaN (masked means, sqrt/log near 0)"],
    semconv.NUMERICS_LOSS_SPIKE: [
        "inspect the data of that step (a corrupt or out-of-distribution batch)",
        "lower the learning rate or lengthen warm-up; skip or roll back past the batch"],
    semconv.NUMERICS_GRAD_NORM_SPIKE: [
        "gradient clipping, a lower learning rate, or a longer warm-up",
        "look for a rare input that produces large activations (long sequences, outliers)"],
    semconv.NUMERICS_SKIPPED_RUN: [
        "fp16 overflows step after step: switch to bf16, or lower the learning rate",
        "raise the minimum loss scale only if the gradients are known to be finite (min_loss_scale)"],
    "memory": ["a smaller micro-batch (with more gradient accumulation), activation checkpointing",
               "a higher ZeRO stage or CPU offload of optimizer states / parameters",
               "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True when reserved memory far exceeds allocated"],
}
_TITLES = {semconv.NUMERICS_NONFINITE_LOSS: "non-finite loss", semconv.NUMERICS_NONFINITE_GRAD_NORM:
           "non-finite gradient norm", semconv.NUMERICS_LOSS_SPIKE: "loss spike",
           semconv.NUMERICS_GRAD_NORM_SPIKE: "gradient-norm spike", semconv.NUMERICS_SKIPPED_RUN:
           "run of skipped steps"}
# Findings this sure (non-finite numerics, an out-of-memory error) mean a broken run, not a slow one: they
# are the verdict even where a time-based layer stands out.
BROKEN_RUN = 0.95
_CONFIDENCE = {semconv.NUMERICS_NONFINITE_LOSS: 0.95, semconv.NUMERICS_NONFINITE_GRAD_NORM: 0.95,
               semconv.NUMERICS_LOSS_SPIKE: 0.8, semconv.NUMERICS_GRAD_NORM_SPIKE: 0.7,
               semconv.NUMERICS_SKIPPED_RUN: 0.8}
_MIB = 2**20


class ModelFindings:
    """Collects the step spans' model and memory attributes; ``findings`` judges them per rank."""

    def __init__(self):
        self._steps: dict = defaultdict(dict)  # (job, rank) -> step -> (trace id, end, attributes)

    def add(self, span) -> None:
        if span.name != semconv.SPAN_STEP:
            return
        attributes = span.attributes
        number = attributes.get(semconv.TRAINING_STEP)
        if number is None:
            return
        steps = self._steps[span.job, span.rank]
        known = steps.get(number)
        if known is None or span.end > known[1]:  # a retried step keeps its last attempt; an OOM its own
            steps[number] = (span.trace_id, span.end, attributes, known)

    def findings(self, job: str, step_seconds: float | None = None) -> list[dict]:
        ranks = {rank: steps for (step_job, rank), steps in sorted(self._steps.items()) if step_job == job}
        anomalies = {rank: _anomalies(steps) for rank, steps in ranks.items()}
        found = []
        for kind in _TITLES:
            entries = {rank: by_kind[kind] for rank, by_kind in anomalies.items() if kind in by_kind}
            if len(ranks) > 1 and len(entries) == len(ranks) and len({e["step"] for e in entries.values()}) == 1:
                # The same step on every rank: a global gradient norm (DeepSpeed's is the job's), or weights gone
                # non-finite everywhere in one update. Naming one rank (the first) would be a guess.
                found.append(_numerics_finding(kind, None, next(iter(entries.values())), step_seconds))
            else:
                found += [_numerics_finding(kind, rank, entry, step_seconds) for rank, entry in entries.items()]
        for rank, steps in ranks.items():
            found += self._memory(rank, steps)
        return found

    @staticmethod
    def _memory(rank: int, steps: dict) -> list[dict]:
        findings = []
        for number in sorted(steps):
            record = steps[number]
            while record is not None:  # every attempt of the step: a retry after an OOM is a step of its own
                trace_id, _end, attributes, earlier = record
                phase = attributes.get(semconv.TRAINING_MEMORY_OOM)
                if phase:
                    findings.append(_oom_finding(rank, number, phase, trace_id, attributes))
                record = earlier
        return findings


def _anomalies(steps: dict) -> dict:
    """One rank's steps judged in order: kind -> its first step, detail, and every step and trace it was seen in."""
    first_step = steps[min(steps)][2] if steps else {}
    watch = NumericsWatch(scaled=first_step.get(semconv.TRAINING_PRECISION) not in UNSCALED)
    found: dict = {}
    run: list = []  # the skipped steps in a row up to this one: (number, trace id)
    reported: list = []  # the run of the latest skipped-run finding: its later steps join the finding as they come
    first: list = []  # the first run found, as long as it went on
    for number in sorted(steps):
        trace_id, _end, attributes, _earlier = steps[number]
        loss, grad_norm = attributes.get(semconv.TRAINING_LOSS), attributes.get(semconv.TRAINING_GRAD_NORM)
        skipped = bool(attributes.get(semconv.TRAINING_STEP_SKIPPED))
        if skipped:
            run.append((number, trace_id))
        else:
            run = []
        entry = found.get(semconv.NUMERICS_SKIPPED_RUN)
        if skipped and reported is run:
            entry["steps"].append(number)
            entry["trace_ids"].append(trace_id)
        for kind, detail in watch.step(loss, grad_norm, skipped):
            # A run of skipped steps is found at its SKIPPED_RUN-th: the finding starts at its first (a review: "at
            # step 14: 3 consecutive" for steps 12-15, costed as one step).
            taken = run if kind == semconv.NUMERICS_SKIPPED_RUN else [(number, trace_id)]
            entry = found.setdefault(kind, {"step": taken[0][0], "detail": detail, "steps": [], "trace_ids": []})
            entry["steps"] += [step for step, _trace in taken]
            entry["trace_ids"] += [trace for _step, trace in taken]
            if kind == semconv.NUMERICS_SKIPPED_RUN:
                reported, first = run, first or run
    if first:
        found[semconv.NUMERICS_SKIPPED_RUN]["detail"] = f"{len(first)} consecutive steps skipped (overflow)"
    for entry in found.values():
        entry["precision"] = first_step.get(semconv.TRAINING_PRECISION)
    return found


def _numerics_finding(kind: str, rank: int | None, entry: dict, step_seconds: float | None) -> dict:
    """``rank`` None: the same anomaly at the same step on every rank."""
    count = len(entry["steps"])
    later = f" (and {count - 1} later step{'s' if count > 2 else ''}: {entry['steps'][1:6]})" if count > 1 else ""
    where = "every rank" if rank is None else f"rank {rank}"
    remedies = REMEDIES[kind]
    if kind == semconv.NUMERICS_NONFINITE_LOSS and entry.get("precision") in UNSCALED:
        remedies = [remedies[0], "lower the learning rate or add warm-up (no fp16 here: not a loss-scale overflow)"]
    if rank is None and kind == semconv.NUMERICS_NONFINITE_LOSS:
        remedies = [f"every rank at once: the same bad input on every rank, or weights that went non-finite in the "
                    f"update before step {entry['step']} (an inf or a NaN in one rank's gradients is all-reduced into "
                    "every rank's): look at the gradients of the step before, on each rank", *remedies[1:]]
    return {
        "layer": "MODEL", "kind": kind, "rank": rank, "step": entry["step"],
        "summary": f"{_TITLES[kind]} on {where} at step {entry['step']}: {entry['detail']}{later}",
        "evidence": [f"training.step {n} of {where}" for n in entry["steps"][:5]],
        "remedies": remedies,
        # A diverging run loses what follows it: counted as the step time of each affected step.
        "cost_seconds": step_seconds * count if step_seconds else None,
        "confidence": _CONFIDENCE[kind], "trace_ids": entry["trace_ids"][:5],
    }


def _oom_finding(rank: int, number: int, phase: str, trace_id: str, attributes: dict) -> dict:
    figures = []
    for key, label in ((semconv.TRAINING_MEMORY_ALLOCATED, "allocated"),
                       (semconv.TRAINING_MEMORY_RESERVED, "reserved")):
        if attributes.get(key) is not None:
            figures.append(f"{label} {attributes[key] / _MIB:.0f} MiB")
    peaks = []
    for name in semconv.PHASES[1:]:
        value = attributes.get(semconv.TRAINING_MEMORY_PHASE_PEAK.format(phase=name))
        if value is not None:
            peaks.append(f"{name} {value / _MIB:.0f} MiB")
    evidence = [f"at the failure: {', '.join(figures)}" if figures else "no allocator figures (not on CUDA?)"]
    if peaks:
        evidence.append(f"the step's peak by phase: {', '.join(peaks)}")
    reserved, allocated = attributes.get(semconv.TRAINING_MEMORY_RESERVED), attributes.get(
        semconv.TRAINING_MEMORY_ALLOCATED)
    if reserved and allocated is not None and reserved - allocated > 0.2 * reserved:
        evidence.append(f"{(reserved - allocated) / _MIB:.0f} MiB reserved but not allocated: fragmentation")
    return {"layer": "MEMORY", "rank": rank, "step": number, "phase": phase,
            "summary": f"out of GPU memory on rank {rank} at step {number}, in {phase.replace('.', ' ')}",
            "evidence": evidence, "remedies": REMEDIES["memory"], "cost_seconds": None, "confidence": 0.95,
            "trace_ids": [trace_id]}


def series(model: ModelFindings, job: str) -> dict:
    """Per rank, [step, value] of the loss and the gradient norm (None where not finite), for the report."""
    found: dict = {"loss": {}, "grad_norm": {}}
    for (step_job, rank), steps in sorted(model._steps.items()):
        if step_job != job:
            continue
        for name, key in (("loss", semconv.TRAINING_LOSS), ("grad_norm", semconv.TRAINING_GRAD_NORM)):
            values = [[number, _finite(steps[number][2].get(key))] for number in sorted(steps)
                      if steps[number][2].get(key) is not None]
            if values:
                found[name][rank] = values
    return found


def _finite(value):
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


# The ranks' colours in every chart of the HTML report (html.py draws their legend): rank r's is r modulo their number,
# the same in every chart, whichever ranks it has.
RANK_COLORS = ("#2e5aac", "#e4572e", "#17a398", "#8e6bbf", "#f3a712", "#555")


def chart_html(values: dict, title: str, marks: set) -> str:
    """One small SVG line chart of ``values`` ({rank: [[step, value]]}); ``marks``: (rank, step) to circle."""
    points = [(step, value) for rank_values in values.values() for step, value in rank_values if value is not None]
    if not points:
        return ""
    width, height = 440, 180
    first, last = min(s for s, _ in points), max(s for s, _ in points)
    low, high = min(v for _, v in points), max(v for _, v in points)
    high = high if high > low else low + 1.0

    def x(step):
        return 40 + (step - first) / max(last - first, 1) * (width - 50)

    def y(value):
        return height - 20 - (value - low) / (high - low) * (height - 35)

    shapes = [f'<text x="4" y="12" class="axis">{title}: {high:.4g}</text>',
              f'<text x="4" y="{height - 22}" class="axis">{low:.4g}</text>',
              f'<text x="40" y="{height - 4}" class="axis">step {first}</text>',
              f'<text x="{width - 70}" y="{height - 4}" class="axis">step {last}</text>']
    for rank, rank_values in sorted(values.items()):
        path = " ".join(f"{x(step):.1f},{y(value):.1f}" for step, value in rank_values if value is not None)
        shapes.append(f'<polyline points="{path}" fill="none" stroke="{RANK_COLORS[int(rank) % len(RANK_COLORS)]}" '
                      f'stroke-width="1.5"><title>rank {rank}</title></polyline>')
        for step, value in rank_values:
            if (rank, step) in marks:
                at = y(value) if value is not None else 14
                shapes.append(f'<circle cx="{x(step):.1f}" cy="{at:.1f}" r="4" fill="#e4572e"><title>rank {rank} '
                              f"step {step}: {'not finite' if value is None else f'{value:.4g}'}</title></circle>")
    return f'<svg width="{width}" height="{height}" role="img">{"".join(shapes)}</svg>'


def charts_html(report: dict) -> str:
    """The report's loss and gradient-norm charts, the steps of MODEL findings circled."""
    model = report.get("model_series") or {}
    marks = {(f["rank"], f["step"]) for f in report.get("findings", []) if f.get("layer") == "MODEL"}
    charts = [chart_html({int(r): v for r, v in (model.get(name) or {}).items()}, label, marks)
              for name, label in (("loss", "loss"), ("grad_norm", "gradient norm"))]
    return "".join(charts)
