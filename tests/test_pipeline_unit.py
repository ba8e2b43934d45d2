"""Pipeline parallelism without DeepSpeed: the recorder's pipeline steps, and the diagnosis of pipeline
timelines (a GPipe schedule simulated with noise) whose slow stage is known."""

from __future__ import annotations

import dataclasses
import random

import pytest

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.diagnose.analysis import Analysis
from opentelemetry_instrumentation_deepspeed.diagnose.reader import Span
from opentelemetry_instrumentation_deepspeed.recording.recorder import StepRecorder
from opentelemetry_instrumentation_deepspeed.recording.state import State
from tests.test_state_machine import Records
from tests.test_steps_unit import Engine

# -- the recorder ---------------------------------------------------------------------------------


def pipelined_recorder(micro_batches):
    records = Records()
    engine = Engine(micro_batches)
    recorder = StepRecorder(engine, "facts", records.submit)
    recorder.pipelined = True
    return recorder, engine, records


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[str]:
    """The order of forwards (F) and backwards (B) on one stage under 1F1B."""
    warm = min(stages - stage - 1, micro_batches)
    order = ["F"] * warm
    forwards, backwards = warm, 0
    while backwards < micro_batches:
        if forwards < micro_batches:
            order.append("F")
            forwards += 1
        order.append("B")
        backwards += 1
    return order


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_train_batch_is_one_step_with_its_backwards_numbered_in_order(stage):
    recorder, engine, records = pipelined_recorder(4)
    for done in range(2):
        recorder.batch_started(engine)
        for kind in one_f_one_b(stage, 3, 4):
            if kind == "F":
                recorder.data_waited(1, 2)
                recorder.phase_ended(recorder.forward_started(engine))
            else:
                recorder.phase_ended(recorder.backward_started(engine))
        phase = recorder.pipeline_optimizer_started(engine)
        engine.global_steps += 1
        recorder.phase_ended(phase)
        # The step stays open after its optimizer step: the loss is reduced before train_batch() returns.
        assert recorder.state == State.OPEN and len(records) == done
        recorder.batch_ended(engine)
        assert recorder.state == State.IDLE
    assert [record.number for record in records] == [1, 2]
    for record in records:
        forwards = [p.micro_step for p in record.phases if p.name == semconv.PHASE_FORWARD]
        backwards = [p.micro_step for p in record.phases if p.name == semconv.PHASE_BACKWARD]
        assert forwards == backwards == [0, 1, 2, 3]
        assert [p.name for p in record.phases][-1] == semconv.PHASE_OPTIMIZER_STEP
        assert [w[2] for w in record.waits] == [0, 1, 2, 3]
        assert record.micro_batches == 4 and record.closed and record.failure is None


def test_outside_train_batch_nothing_opens_and_a_failure_ends_the_step():
    recorder, engine, records = pipelined_recorder(2)
    recorder.batch_ended(engine)  # a stale end: nothing to close
    assert recorder.state == State.IDLE and not records
    recorder.batch_started(engine)
    phase = recorder.forward_started(engine)
    recorder.phase_failed(phase, RuntimeError("stage 1 died"))
    recorder.phase_failed(None, RuntimeError("stage 1 died"))  # train_batch()'s own wrapper: already ended
    assert recorder.state == State.IDLE and len(records) == 1
    assert records[0].failure.description == "RuntimeError: stage 1 died"


# -- the diagnosis ----------------------------------------------------------------------------------

MS = 1_000_000


def simulate(stages: int, micro_batches: int, compute_ms: list[float], steps: int, rng: random.Random, *,
             data_parallel: int = 1, job: str = "job", stall=None) -> list[Span]:
    """Spans of a GPipe schedule: stage s's forward of micro-batch i waits for stage s-1's, its backward
    for stage s+1's; time blocked waiting is a comm.recv from the neighbour waited for. The step ends in an all-reduce
    of every stage (DeepSpeed's gradient-norm and overflow checks), where the stages that finished first wait for the
    last. ``stall(step, stage, phase, micro-batch)``: ms added to that phase."""
    stall = stall or (lambda *_: 0.0)
    spans: list[Span] = []
    ids = iter(range(1, 10**9))
    clock = 1_000 * MS
    for number in range(1, steps + 1):
        trace = f"{number:032x}"
        for replica in range(data_parallel):
            def noisy(ms):
                return int(ms * rng.uniform(0.7, 1.3) * MS)

            forward = [[0] * micro_batches for _ in range(stages)]
            backward = [[0] * micro_batches for _ in range(stages)]
            lanes: list[list] = [[] for _ in range(stages)]
            ready = [clock] * stages
            for i in range(micro_batches):
                for s in range(stages):
                    arrive = forward[s - 1][i] if s else ready[s]
                    if arrive > ready[s]:
                        lanes[s].append(("comm.recv", ready[s], arrive, s - 1))
                    start = max(arrive, ready[s])
                    forward[s][i] = ready[s] = start + noisy(compute_ms[s]) + int(stall(number, s, "forward", i) * MS)
                    lanes[s].append((semconv.SPAN_FORWARD, start, ready[s], i))
            for i in range(micro_batches):
                for s in reversed(range(stages)):
                    arrive = backward[s + 1][i] if s < stages - 1 else ready[s]
                    if arrive > ready[s]:
                        lanes[s].append(("comm.recv", ready[s], arrive, s + 1))
                    start = max(arrive, ready[s])
                    backward[s][i] = ready[s] = (start + noisy(2 * compute_ms[s])
                                                 + int(stall(number, s, "backward", i) * MS))
                    lanes[s].append((semconv.SPAN_BACKWARD, start, ready[s], i))
            end = max(ready) + MS
            for s in range(stages):
                rank = replica * stages + s
                step_id = f"{next(ids):016x}"
                spans.append(Span(semconv.SPAN_STEP, trace, step_id, "", clock, end + MS, job, rank, {
                    semconv.TRAINING_STEP: number, semconv.TRAINING_PIPELINE_STAGE: s,
                    semconv.TRAINING_PIPELINE_STAGES: stages, semconv.TRAINING_STEP_MICRO_BATCHES: micro_batches}))
                spans.append(Span(semconv.SPAN_OPTIMIZER_STEP, trace, f"{next(ids):016x}", step_id, end, end + MS,
                                  job, rank, {}))
                spans.append(Span("comm.all_reduce", trace, f"{next(ids):016x}", step_id, ready[s], end, job, rank,
                                  {semconv.COMM_OP: "all_reduce", semconv.COMM_GROUP_NAME: f"replica{replica}",
                                   semconv.COMM_SEQUENCE: number}))
                for name, start, stop, detail in lanes[s]:
                    attributes = ({semconv.COMM_PEER_STAGE: detail, semconv.COMM_OP: "recv"} if name == "comm.recv"
                                  else {semconv.TRAINING_MICRO_STEP: detail})
                    spans.append(Span(name, trace, f"{next(ids):016x}", step_id, start, stop, job, rank, attributes))
        clock = end + 3 * MS
    return spans


def diagnose(spans):
    analysis = Analysis()
    analysis.add(spans)
    return analysis.result()


def test_injected_slow_stages_are_named_and_balanced_pipelines_raise_no_alarm():
    rng = random.Random(19)
    named, missed, false_alarms, cases = 0, [], [], 0
    for case in range(24):
        stages, micro_batches = rng.choice([2, 3, 4]), rng.choice([4, 6, 8])
        base = rng.uniform(2, 8)
        compute = [base * rng.uniform(0.95, 1.1) for _ in range(stages)]  # balanced: within 15%
        slow = case % 2 == 0
        slow_stage = rng.randrange(stages)
        if slow:
            compute[slow_stage] = base * rng.uniform(1.6, 3.0)
        report = diagnose(simulate(stages, micro_batches, compute, rng.choice([6, 10]), rng,
                                   data_parallel=rng.choice([1, 2])))
        findings = report["pipeline"]["findings"]
        assert set(report["pipeline"]["stages"]) == set(range(stages))
        cases += 1
        if slow:
            if findings and findings[0]["stage"] == slow_stage and report["verdict"]["layer"] == "PIPELINE":
                named += 1
            else:
                missed.append((case, stages, micro_batches, compute, slow_stage, report["verdict"]))
        elif findings or report["verdict"]["layer"] != "none":
            false_alarms.append((case, stages, compute, report["verdict"]))
    assert not missed and not false_alarms, (missed, false_alarms)
    assert named == cases // 2


def test_a_stages_periodic_stall_is_its_own_and_the_others_wait_for_it_in_their_receives():
    """A stage stalls every k-th step: the other stages wait for it in their receives (the bubble), which is no work of
    theirs. Their receives once counted as their host work, and a stall of 100 ms every 5th step on stage 1 read as
    rank 0's HOST WORK pattern beside it, or instead of it."""
    rng = random.Random(23)
    wrong = []
    for case in range(16):
        stages, micro_batches = rng.choice([2, 3]), rng.choice([2, 4])
        stalling, phase = rng.randrange(stages), rng.choice(["forward", "backward"])
        period, offset, ms = rng.choice([3, 4, 5]), rng.randrange(3), rng.uniform(40, 120)

        where = (stalling, phase, 0, offset)
        report = diagnose(simulate(stages, micro_batches, [4.0] * stages, 24, rng, stall=lambda number, stage, which,
                                   micro_batch, where=where, period=period, ms=ms:
                                   ms if (stage, which, micro_batch, number % period) == where else 0.0))
        named = [(f["layer"], f.get("rank")) for f in report["findings"]]
        # Its compute, a straggler's where the others wait for it in the step's closing all-reduce.
        if (not named or named[0] not in {("compute", stalling), ("straggler", stalling)}
                or any(rank != stalling for _layer, rank in named)):
            wrong.append((case, stages, micro_batches, stalling, phase, period, round(ms), named))
    assert not wrong, "\n".join(map(str, wrong))


def test_a_balanced_pipelines_waits_are_its_bubble_not_an_unexplained_wait():
    """The stages' transfers are their waits for each other (comm_wait): by design in a pipeline, not a wait "no rank's
    own part explains"."""
    rng = random.Random(3)
    for stages, micro_batches in ((2, 2), (3, 4), (4, 8)):
        report = diagnose(simulate(stages, micro_batches, [4.0] * stages, 12, rng))
        verdict = report["verdict"]
        assert verdict["layer"] == "none" and report["job"]["shares"]["comm_wait"] >= 0.25, verdict
        assert "the pipeline's bubble" in verdict["summary"] and "explains it" not in verdict["summary"]


@pytest.mark.parametrize(("stage", "phase"), [(0, "forward"), (1, "backward"), (2, "backward"), (1, "forward")])
def test_an_imbalanced_stage_is_named_with_the_phase_that_makes_it_slow(stage, phase):
    rng = random.Random(stage)
    spans = simulate(3, 4, [3.0, 3.0, 3.0], 10, rng,
                     stall=lambda _number, s, which, _i: 12.0 if (s, which) == (stage, phase) else 0.0)
    (found,) = diagnose(spans)["pipeline"]["findings"]
    assert (found["stage"], found["phase"]) == (stage, phase)
    assert f"of the difference in its {phase}" in found["summary"]


def stretched(spans: list[Span], stage: int, rng: random.Random) -> list[Span]:
    """``spans`` with half of ``stage``'s forwards and backwards made 2-5x longer: a host that runs
    something else in the middle of them (as a loaded machine does), not more work."""
    out = []
    for span in spans:
        if (span.rank == stage and span.name in (semconv.SPAN_FORWARD, semconv.SPAN_BACKWARD)
                and rng.random() < 0.5):
            out.append(dataclasses.replace(span, end=span.start + int((span.end - span.start) * rng.uniform(2, 5))))
        else:
            out.append(span)
    return out


def test_time_the_host_adds_to_one_stage_is_not_an_imbalance_and_work_still_is():
    rng = random.Random(5)
    # Balanced work, stage 1's spans stretched by the host: 2-3x its compute in wall time, no finding.
    report = diagnose(stretched(simulate(2, 4, [4.0, 4.2], 8, rng), 1, rng))
    stages = report["pipeline"]["stages"]
    assert stages[1]["compute_seconds"] > 1.6 * stages[0]["compute_seconds"]
    assert stages[1]["work_seconds"] < 1.2 * stages[0]["work_seconds"]
    assert report["pipeline"]["findings"] == [] and report["verdict"]["layer"] == "none"
    # Stage 0 with 4x the work (more than the host adds to stage 1): stage 0 is named.
    report = diagnose(stretched(simulate(2, 4, [16.0, 4.0], 8, rng), 1, rng))
    assert [finding["stage"] for finding in report["pipeline"]["findings"]] == [0]


def test_the_finding_has_the_shared_shape_and_bubbles_per_stage():
    rng = random.Random(7)
    report = diagnose(simulate(2, 4, [4.0, 10.0], 8, rng))
    finding = report["verdict"]
    assert finding["layer"] == "PIPELINE" and finding["stage"] == 1 and finding["rank"] == 1
    assert {"layer", "summary", "evidence", "remedies", "rank", "step", "cost_seconds", "confidence",
            "trace_ids"} <= set(finding)
    assert 0 < finding["confidence"] <= 1 and finding["trace_ids"] and finding["cost_seconds"] > 0
    # The faster stage waits for the slower one: its bubble is most of its step, spent receiving from stage 1.
    stages = report["pipeline"]["stages"]
    assert stages[0]["bubble_share"] > 0.5 > stages[1]["bubble_share"]
    assert stages[0]["recv_seconds_by_peer_stage"][1] > stages[1]["recv_seconds_by_peer_stage"][0]
    # Ranks of different stages are not stragglers of each other.
    assert report["straggler"] is None


def test_a_job_without_stages_has_no_pipeline_section():
    spans = [Span(semconv.SPAN_STEP, f"{n:032x}", f"{n:016x}", "", n * MS, (n + 5) * MS, "job", 0,
                  {semconv.TRAINING_STEP: n}) for n in range(1, 6)]
    assert diagnose(spans)["pipeline"] == {}


def test_the_html_report_shows_the_stages_the_input_and_the_verdicts_traces():
    """What the text report says and the page left out: the stages its NONE verdict points to, the lines and spans
    skipped, the ranks with no telemetry, the verdict's traces."""
    from opentelemetry_instrumentation_deepspeed.diagnose.html import render_html

    report = diagnose(simulate(2, 4, [4.0, 10.0], 8, random.Random(7)))
    report["input"] = {"spans": 10, "files": 1, "bad_lines": 1, "bad_spans": 2,
                       "problems": ["x.jsonl:3: span 'y' has impossible times (5, 1), skipped"]}
    report["missing_ranks"] = [3]
    page = render_html(report)
    assert "Pipeline stages, per step" in page and "<td>stage 1</td>" in page
    assert "1 malformed line(s) skipped; 2 malformed span(s) skipped" in page and "impossible times (5, 1)" in page
    assert "no telemetry of rank 3 in the input" in page
    assert report["verdict"]["trace_ids"] and all(trace in page for trace in report["verdict"]["trace_ids"])
