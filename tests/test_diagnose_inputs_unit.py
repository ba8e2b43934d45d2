"""`diagnose` on the input layer, from synthetic step spans: noisy like this machine's, with faults drawn at random.

Step times are drawn as a loaded host makes them (log-normal jitter, and now and then a step three
times slower); the tokens per step are exact, as the instrumentation counts them.
"""

from __future__ import annotations

import random

import pytest

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.diagnose.analysis import Analysis
from opentelemetry_instrumentation_deepspeed.diagnose.html import render_html
from opentelemetry_instrumentation_deepspeed.diagnose.inputs import FOLLOWS, change_points
from opentelemetry_instrumentation_deepspeed.diagnose.reader import Span

SEEDS = range(12)


def run_spans(rng: random.Random, steps: int, lengths, per_token=lambda step: 1.0, *, ranks=2, samples=8,
              padding=1.0, attributes=True, jitter=0.15, spikes=0.05, rank_lengths=None, cpus=None):
    """The ``training.step`` spans of a job: ``lengths(step)`` padded tokens per sample on every rank (or
    ``rank_lengths(rank, step)``), step time proportional to the tokens of the step's longest rank;
    ``cpus(step)``: (host busy, host idle, each rank's process) CPUs, as each rank measured them on one host, and
    optionally the share of the step its training thread waited for a CPU."""
    spans, clock = [], 1_700_000_000_000_000_000
    for step in range(1, steps + 1):
        by_rank = {rank: (rank_lengths(rank, step) if rank_lengths else lengths(step)) for rank in range(ranks)}
        work = max(by_rank.values()) * samples * 40e-6 * per_token(step)  # 40 us per token
        seconds = work * rng.lognormvariate(0, jitter) * (3 if rng.random() < spikes else 1)
        if step == 1:
            seconds *= 4  # warm-up
        trace = f"{step:032x}"
        for rank, length in by_rank.items():
            extra = {}
            if attributes:
                extra = {semconv.TRAINING_STEP_PADDED_TOKENS: samples * length,
                         semconv.TRAINING_STEP_TOKENS: int(samples * length * padding),
                         semconv.TRAINING_STEP_SEQUENCE_LENGTH: length}
            if cpus is not None:
                busy, idle, process, *waiting = cpus(step)
                jittered = rng.uniform(0.95, 1.05)  # each rank's samples cover slightly different intervals
                extra.update({semconv.TRAINING_STEP_HOST_CPU_BUSY: busy * jittered,
                              semconv.TRAINING_STEP_HOST_CPU_IDLE: idle * jittered,
                              semconv.TRAINING_STEP_PROCESS_CPU: process * rng.uniform(0.9, 1.1),
                              semconv.HOST_NAME: "node-1"})
                if waiting:  # its own jitter, so that the steps' draws are those of the same seed without it
                    measured = waiting[0] * random.Random(step * 31 + rank).uniform(0.8, 1.2)
                    extra[semconv.TRAINING_STEP_THREAD_CPU_WAIT] = min(measured, 1.0)
            end = clock + int(seconds * 1e9 * rng.uniform(0.98, 1.0))
            spans.append(Span(semconv.SPAN_STEP, trace, f"{rank:016x}", "", clock, end, "job", rank,
                              {semconv.TRAINING_STEP: step, **extra}))
        clock += int(seconds * 1e9) + 1_000_000
    return spans


def diagnose(spans) -> dict:
    analysis = Analysis()
    analysis.add(spans)
    return analysis.result()


def layers(report) -> list[str]:
    return [finding["layer"] for finding in report["findings"]]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_sequence_length_shift_is_input_from_its_step(seed):
    rng = random.Random(seed)
    steps = rng.randint(16, 60)
    at = rng.randint(5, steps - 2)  # three steps on each side, the warm-up step apart
    before, factor = rng.choice(((64, 4), (64, 2), (128, 0.5), (32, 8)))
    after = int(before * factor)
    report = diagnose(run_spans(rng, steps, lambda step: after if step >= at else before, padding=rng.uniform(0.5, 1)))
    verdict = report["verdict"]
    assert verdict["layer"] == "INPUT" and verdict["change_step"] == at, verdict
    assert f"from step {at}, tokens per step {'x' if factor > 1 else '/'}" in verdict["summary"]
    assert f"(sequence length {before} -> {after})" in verdict["summary"]
    if min(at - 2, steps - at + 1) >= 8:  # a few steps on a side, one of them slow, read as a change per token
        assert "time per token unchanged" in verdict["summary"]
    assert verdict["rank"] is None and verdict["cost_seconds"] > 0 and FOLLOWS <= verdict["confidence"] <= 1
    assert set(verdict) >= {"layer", "summary", "evidence", "remedies", "rank", "step", "cost_seconds",
                            "confidence", "trace_ids"}
    assert layers(report) == ["INPUT"]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_healthy_noisy_run_raises_nothing(seed):
    rng = random.Random(1000 + seed)
    length = rng.choice((32, 64, 512))
    report = diagnose(run_spans(rng, rng.randint(8, 200), lambda step: length, jitter=rng.uniform(0.05, 0.3),
                                spikes=rng.uniform(0, 0.15)))
    assert report["findings"] == [] and report["verdict"]["layer"] == "none", report["verdict"]


@pytest.mark.parametrize("seed", SEEDS)
def test_compute_slower_per_token_is_not_input(seed):
    rng = random.Random(2000 + seed)
    steps = rng.randint(16, 60)
    at = rng.randint(5, steps - 2)  # three steps on each side, the warm-up step apart
    factor = rng.uniform(2, 4)
    report = diagnose(run_spans(rng, steps, lambda step: 64, per_token=lambda step: factor if step >= at else 1.0))
    assert "INPUT" not in layers(report)
    finding = report["verdict"]
    # Noise can move a noisy series' change point by one step (a slow step just before it reads as the
    # change); the exact counts of the input's never do.
    assert finding["layer"] == "COMPUTE" and abs(finding["change_step"] - at) <= 1, finding
    assert "time per token x" in finding["summary"] and "not the input" in finding["summary"]


# The host's CPUs as this machine's 2-core runs measured them (docs/diagnose.md, "Accuracy"): two ranks alone
# use 0.8 CPU each and leave 0.3 idle; with a neighbour's 2-rank job they get 0.45 each and none is idle.
ALONE, NEIGHBOUR = (1.65, 0.35, 0.8), (2.0, 0.0, 0.45)


def neighbour_from(at: int, waiting: tuple[float, float], *, cpus=(ALONE, NEIGHBOUR)):
    """The host's CPUs before and from step ``at`` (``cpus``), and the share of each step the training threads
    waited for a CPU (``waiting``: before, from ``at``)."""
    return lambda step: (*cpus[1], waiting[1]) if step >= at else (*cpus[0], waiting[0])


@pytest.mark.parametrize("seed", SEEDS)
def test_steps_slowed_by_a_neighbour_taking_the_cpus_are_no_finding_of_the_job(seed):
    rng = random.Random(3000 + seed)
    steps = rng.randint(16, 60)
    at = rng.randint(5, steps - 2)
    factor = rng.uniform(2, 4)  # what, without the host's figures, is a compute slowdown (the test above)
    rest = random.Random(seed).uniform(1.0, 1.3)  # the step less its wait for a CPU, after / before
    report = diagnose(run_spans(rng, steps, lambda step: 64, per_token=lambda step: factor if step >= at else 1.0,
                                cpus=neighbour_from(at, (0.03, 1 - 0.97 * rest / factor))))
    assert report["verdict"]["layer"] == "none", report["verdict"]
    [load] = report["host_load"]
    assert abs(load["change_step"] - at) <= 1 and load["host"] == "node-1"
    assert load["other_cpus"][1] - load["other_cpus"][0] > 0.8 and load["idle_cpus"][1] < 0.1
    assert load["waited_seconds"][1] > 0.4 * load["step_seconds"][1] > 10 * load["waited_seconds"][0]
    assert f"from step {load['change_step']} the steps took x" in report["verdict"]["summary"]
    assert "ms per step for a CPU of host node-1 (other processes used 0." in report["verdict"]["summary"]
    assert ("-> 1.1 CPUs, 0.0 idle); without the waits for a CPU and for each other, the time per token "
            in report["verdict"]["summary"])


# A neighbour that takes the CPUs the job leaves idle while it waits for its slower device: the host is as busy,
# but the training threads hardly wait for a CPU (the compute slowdowns of a sitting beside the test suite).
# A host loaded throughout, the threads waiting half of every step: the waits grow with the compute, but their
# share does not, and the step less its waits keeps the change.
SLOWER_DEVICE = {
    "as a neighbour starts": lambda at, seed: neighbour_from(at, (0.03, random.Random(seed).uniform(0, 0.2))),
    "on a host loaded throughout": lambda at, _seed: neighbour_from(at, (0.5, 0.5), cpus=(NEIGHBOUR, NEIGHBOUR)),
}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("host", SLOWER_DEVICE)
def test_a_slower_device_is_compute_whoever_else_is_busy(host, seed):
    # Seven steps or more each side (one spike among five fails the 85% separation): where a change point can
    # be found at all is the compute test's matter.
    rng = random.Random(2000 + seed)
    steps = rng.randint(20, 60)
    at = rng.randint(9, steps - 6)
    factor = rng.uniform(2, 4)
    report = diagnose(run_spans(rng, steps, lambda step: 64, per_token=lambda step: factor if step >= at else 1.0,
                                cpus=SLOWER_DEVICE[host](at, seed)))
    # (Two noise spikes just before the change can draw it two steps early: the change point is not the matter here.)
    assert report["verdict"]["layer"] == "COMPUTE" and abs(report["verdict"]["change_step"] - at) <= 2
    assert report["host_load"] == []


def test_waits_for_a_cpu_on_both_ranks_in_turn_are_the_hosts_not_the_compute():
    # From step 20 a neighbour takes the CPUs: in each step one rank's thread waits 30 ms for one in its backward,
    # the other's in its optimizer step (which, at random), and each rank waits for the other's wait in the next
    # collective. Each rank's step less its own wait still holds the other's (x1.8 per token: what the rule
    # without the ranks' wait for each other read as COMPUTE); less both, nothing changed but the host.
    from tests.test_diagnose_findings import synthetic_job

    def waits(rank, step):
        first = random.Random(step).randrange(2)
        return {("backward", "optimizer")[rank ^ first]: 30} if step >= 20 else {}

    report = diagnose(synthetic_job(40, extra=waits, cpu_wait=lambda _rank, step: 0.33 if step >= 20 else 0.02,
                                    attributes=on_a_host_busy_from(20)))
    assert report["verdict"]["layer"] == "none", report["verdict"]
    [load] = report["host_load"]
    assert abs(load["change_step"] - 20) <= 1 and load["step_seconds"][1] > 2 * load["step_seconds"][0]


def on_a_host_busy_from(at: int):
    """A step's padded tokens (the same in every step) and its host's CPUs: alone before ``at``, a neighbour's from."""
    def attributes(_rank, step):
        busy, idle, process = NEIGHBOUR if step >= at else ALONE
        return {semconv.TRAINING_STEP_PADDED_TOKENS: 512, semconv.TRAINING_STEP_SEQUENCE_LENGTH: 64,
                semconv.TRAINING_STEP_HOST_CPU_BUSY: busy, semconv.TRAINING_STEP_HOST_CPU_IDLE: idle,
                semconv.TRAINING_STEP_PROCESS_CPU: process, semconv.HOST_NAME: "node-1"}

    return attributes


@pytest.mark.parametrize("seed", range(4))
def test_a_rank_slow_to_take_its_collectives_results_on_a_busy_host_is_the_hosts(seed):
    # From step 20 rank 1's threads wait for a CPU: its training thread 15 ms in the backward, and it takes each
    # collective's result 12 ms after rank 0 has (its communication threads' wait, which no figure measures).
    # The transfer is the same on both ranks, so rank 1's exposed communication beyond rank 0's is its delay;
    # counted as rank 1's own work, the change outlived the waits taken out: COMPUTE, time per token x1.8-1.9.
    from tests.test_diagnose_findings import synthetic_job

    def slower(rank, step):
        return {"backward": 15, "exposed_comm": 12} if rank == 1 and step >= 20 else {}

    report = diagnose(synthetic_job(40, seed=seed, extra=slower, attributes=on_a_host_busy_from(20),
                                    cpu_wait=lambda rank, step: 0.21 if rank == 1 and step >= 20 else 0.02))
    assert report["verdict"]["layer"] == "none", report["verdict"]
    [load] = report["host_load"]
    assert abs(load["change_step"] - 20) <= 1


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("native", [0.6, 0.02])
def test_transfers_slowed_on_every_rank_are_the_hosts_where_the_native_threads_waited(seed, native):
    # From step 20 a neighbour takes the CPUs: both training threads wait for one in their backward, and every
    # transfer takes x8 on both ranks alike. Where gloo's threads waited for a CPU meanwhile (the native threads'
    # summed wait, 60% of the step), that is the host's doing; where they did not, the transfers themselves got
    # slower (a network's doing), which stays a finding of the job however busy the host.
    from tests.test_diagnose_findings import synthetic_job

    def attributes(rank, step):
        return {**on_a_host_busy_from(20)(rank, step),
                semconv.TRAINING_STEP_NATIVE_THREADS_CPU_WAIT: native if step >= 20 else 0.02}

    report = diagnose(synthetic_job(40, seed=seed, extra=lambda _rank, step: {"backward": 10} if step >= 20 else {},
                                    transfer=lambda step: 8.0 if step >= 20 else 1.0, attributes=attributes,
                                    cpu_wait=lambda _rank, step: 0.15 if step >= 20 else 0.02))
    if native > 0.1:
        assert report["verdict"]["layer"] == "none", report["verdict"]
        [load] = report["host_load"]
        assert abs(load["change_step"] - 20) <= 1
    else:
        assert report["verdict"]["layer"] == "COMPUTE" and report["host_load"] == [], report["verdict"]


def test_without_the_threads_wait_a_busier_host_is_not_claimed():
    # Files of a version (or a kernel) without training.step.thread.cpu.wait: the finding stands, as before.
    rng = random.Random(7)
    report = diagnose(run_spans(rng, 40, lambda step: 64, per_token=lambda step: 3.0 if step >= 20 else 1.0,
                                cpus=lambda step: NEIGHBOUR if step >= 20 else ALONE))
    assert report["verdict"]["layer"] == "COMPUTE" and report["host_load"] == []


@pytest.mark.parametrize("cpus", [None, lambda step: (*ALONE, 0.03)], ids=["without", "with the waits measured"])
def test_tokens_that_change_while_the_step_time_does_not_cost_nothing(cpus):
    rng = random.Random(5)
    # A data-bound step: its time does not follow its tokens, with the waits for a CPU taken out or not.
    report = diagnose(run_spans(rng, 30, lambda step: 256 if step >= 15 else 64,
                                per_token=lambda step: 0.25 if step >= 15 else 1.0, cpus=cpus))
    assert report["findings"] == []


@pytest.mark.parametrize("seed", SEEDS)
def test_a_shift_hidden_by_a_neighbour_leaving_is_input(seed):
    # A neighbour's job leaves the host a few steps before the sequences grow: the steps it slowed (the training
    # threads waiting for a CPU) take as long as the longer sequences' steps after it, so the step time does not
    # follow the tokens (sitting 12's miss: x2 at step 13, the host's load fell at step 11); the step without the
    # waits for a CPU does.
    rng = random.Random(4000 + seed)
    steps = rng.randint(18, 60)
    at = rng.randint(10, steps - 4)
    left = at - rng.randint(1, 3)
    factor = rng.choice((2, 3, 4))
    slowed = factor * rng.uniform(0.95, 1.1)  # the neighbour's steps, as long as the longer sequences' ones
    report = diagnose(run_spans(rng, steps, lambda step: 64 * factor if step >= at else 64,
                                per_token=lambda step: slowed if step < left else 1.0,
                                cpus=neighbour_from(left, (1 - 0.97 / slowed, 0.03), cpus=(NEIGHBOUR, ALONE))))
    verdict = report["verdict"]
    assert verdict["layer"] == "INPUT" and verdict["change_step"] == at, verdict
    assert (f"tokens per step x{factor}.0 (sequence length 64 -> {64 * factor}), step time without the waits for "
            "a CPU and for each other x") in verdict["summary"]
    assert any("hid the input's change" in line for line in verdict["evidence"])
    assert "COMPUTE" not in layers(report)


def test_a_shift_on_one_rank_names_it():
    rng = random.Random(9)
    report = diagnose(run_spans(rng, 30, None, rank_lengths=lambda rank, step: 256 if rank == 1 and step >= 12 else 64))
    verdict = report["verdict"]
    assert verdict["layer"] == "INPUT" and verdict["rank"] == 1 and verdict["change_step"] == 12, verdict
    assert verdict["summary"].startswith("rank 1: from step 12")


def test_attention_growing_with_the_sequence_shows_in_the_time_per_token():
    rng = random.Random(3)
    report = diagnose(run_spans(rng, 30, lambda step: 1024 if step >= 10 else 128,
                                per_token=lambda step: 2.0 if step >= 10 else 1.0, jitter=0.05))
    verdict = report["verdict"]
    assert verdict["layer"] == "INPUT" and verdict["change_step"] == 10
    assert "tokens per step x8.0" in verdict["summary"] and "time per token x2.0" in verdict["summary"]
    assert "COMPUTE" not in layers(report)  # the change of time per token is the input's own


def test_a_curriculum_of_several_lengths_gives_each_change():
    rng = random.Random(4)
    report = diagnose(run_spans(rng, 45, lambda step: 64 if step < 15 else (128 if step < 30 else 256)))
    assert sorted(f["change_step"] for f in report["findings"]) == [15, 30]
    assert layers(report) == ["INPUT", "INPUT"]


def test_runs_without_input_attributes_are_diagnosed_as_before():
    rng = random.Random(6)
    report = diagnose(run_spans(rng, 30, lambda step: 256 if step >= 12 else 64, attributes=False))
    assert report["findings"] == [] and report["verdict"]["layer"] == "none"


def test_change_points_need_both_sides_to_hold_and_a_large_enough_factor():
    assert change_points([1.0] * 10 + [4.0] * 10, 1.2) == [10]
    assert change_points([1.0] * 10 + [1.1] * 10, 1.2) == []
    assert change_points([1.0] * 18 + [4.0] * 2, 1.2) == []  # two steps are no new regime
    assert change_points([1.0, 3.0] * 10, 1.2) == []  # alternating: no split holds


def test_a_step_the_change_reached_halfway_does_not_hide_the_change():
    # Step times (ms) of a run whose compute got 5x slower at its 4th counted step, on a loaded host:
    # least squares puts that step (620) before the split, where one of the 4 steps is then no
    # longer below the middle; the split one step earlier holds.
    steps = [215, 210, 188, 620, 819, 866, 2102, 1205, 1023, 1435, 1474, 2117, 2267, 1746, 4029, 3420, 2549]
    assert change_points(steps, 1.5)[0] == 3
    assert change_points([1.0] * 4 + [2.0] + [1.0] * 5, 1.5) == [], "one slow step is still no new regime"


@pytest.mark.parametrize("seed", SEEDS)
def test_longer_sequences_for_a_while_then_back_are_one_input_finding(seed):
    """A review: sequences of 256 in steps 10-15 of 30, 64 otherwise, read NONE (no single split holds), though the
    stretch took half the run. The stretch, its length, place, factor and the ranks it is on drawn."""
    rng = random.Random(3000 + seed)
    steps = rng.randint(24, 60)
    start = rng.randint(5, steps - 10)
    end = rng.randint(start + 3, min(start + steps // 2, steps - 4))  # its last step; 3 or more after it
    base, factor = rng.choice(((64, 4), (64, 2), (32, 8), (128, 3)))
    one_rank = rng.random() < 0.5

    def lengths(rank, step):
        return base * factor if start <= step <= end and (rank == 1 or not one_rank) else base

    report = diagnose(run_spans(rng, steps, None, rank_lengths=lengths))
    inputs = [f for f in report["findings"] if f["layer"] == "INPUT"]
    assert len(inputs) == 1 and report["verdict"] is inputs[0], report["findings"]
    (finding,) = inputs
    assert (finding["change_step"], finding["until_step"], finding["rank"]) == (start, end, 1 if one_rank else None)
    assert f"in steps {start}-{end} (then back), tokens per step x" in finding["summary"], finding["summary"]
    page = render_html(report)  # the step-time chart marks where the stretch starts and where it came back
    assert f"change at step {start}<" in page and page.count(f"back after step {end}<") == 2, "its title and its label"


def test_a_stretch_is_two_change_points_only_where_asked_and_where_it_holds():
    stretch = [1.0] * 10 + [4.0] * 5 + [1.0] * 10
    assert change_points(stretch, 1.2) == []
    assert change_points(stretch, 1.2, spells=True) == [10, 15]
    assert change_points([1.0] * 10 + [4.0] * 2 + [1.0] * 10, 1.2, spells=True) == [], "two steps are no stretch"
    assert change_points([1.0, 3.0] * 10, 1.2, spells=True) == []


def test_fewer_samples_of_the_same_length_are_named_so():
    """A review: a micro-batch of 8 samples instead of 16 read "(sequence length 128 -> 128)"."""
    rng = random.Random(5)
    spans = run_spans(rng, 12, lambda step: 128, samples=16) + [
        span for span in run_spans(rng, 24, lambda step: 128, samples=8) if span.attributes[semconv.TRAINING_STEP] > 12]
    report = diagnose(spans)
    assert "(samples per step 32 -> 16, sequence length 128)" in report["verdict"]["summary"], report["verdict"]


def test_the_steps_a_dead_rank_never_exported_are_no_change_of_the_input():
    """A review: rank 1 was killed at step 300 and its spans since step 257 went with it; steps 257-299, rank 0's
    alone, held half the job's tokens: "INPUT: from step 257, tokens per step /2.0". Rank 0's steps there were faster
    too (as here), which made the step time follow."""
    rng = random.Random(3)
    spans = [span for span in run_spans(rng, 40, lambda step: 64, lambda step: 0.5 if step > 28 else 1.0, spikes=0)
             if not (span.rank == 1 and span.attributes[semconv.TRAINING_STEP] > 28)]
    assert "INPUT" not in layers(diagnose(spans))
