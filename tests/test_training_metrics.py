"""Training metrics of real 2-rank runs, as exported (OTLP JSON lines), with exemplars that lead to traces."""

from __future__ import annotations

import pytest

from tests.conftest import launch
from tests.otlp_json import read_all_points, read_last_points

pytestmark = pytest.mark.slow  # real DeepSpeed jobs

STEPS, GRAD_ACCUM, MICRO_BATCH, SEQ_LEN = 5, 2, 4, 32


def points_by_rank(workdir):
    return {int(path.name.removeprefix("metrics-rank").removesuffix(".jsonl")): read_last_points(path)
            for path in workdir.glob("telemetry/*/metrics-rank*.jsonl")}


def value(points, metric, **attributes):
    (point,) = [p for p in points
                if p.metric == metric and all(p.attributes.get(k) == v for k, v in attributes.items())]
    return point


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("metrics")
    result = launch(workdir, "torchrun", "--steps", str(STEPS), "--grad-accum", str(GRAD_ACCUM),
                    "--micro-batch-size", str(MICRO_BATCH), "--zero-stage", "2",
                    env={"OTEL_PYTHON_DEEPSPEED_PEAK_FLOPS": "1e12"}).check()
    return result, points_by_rank(workdir)


def test_durations_count_every_step_and_phase(run):
    _, by_rank = run
    assert sorted(by_rank) == [0, 1]
    for points in by_rank.values():
        assert value(points, "training.step.duration").value == STEPS
        for phase, count in (("data.wait", STEPS * GRAD_ACCUM), ("forward", STEPS * GRAD_ACCUM),
                             ("backward", STEPS * GRAD_ACCUM), ("optimizer.step", STEPS)):
            assert value(points, "training.phase.duration", **{"training.phase": phase}).value == count


def test_durations_match_the_spans(run):
    result, by_rank = run
    for rank, spans in result.by_rank().items():
        steps = [s for s in spans if s.name == "training.step"]
        total = sum(s.end - s.start for s in steps) / 1e9
        assert value(by_rank[rank], "training.step.duration").total == pytest.approx(total, rel=1e-6)


def test_samples_and_tokens_are_the_slice_each_rank_consumed(run):
    _, by_rank = run
    for points in by_rank.values():
        samples = STEPS * GRAD_ACCUM * MICRO_BATCH
        assert value(points, "training.samples").value == samples
        assert value(points, "training.tokens").value == samples * SEQ_LEN
        assert value(points, "training.steps.skipped").value == 0


def test_exemplars_point_to_the_step_traces(run):
    result, by_rank = run
    for rank, spans in result.by_rank().items():
        step_traces = {s.trace_id for s in spans if s.name == "training.step"}
        histograms = [p for p in by_rank[rank] if p.metric in ("training.step.duration", "training.phase.duration")]
        exemplars = [trace_id for point in histograms for trace_id in point.exemplar_trace_ids]
        assert exemplars, "histogram points carry exemplars"
        assert set(exemplars) <= step_traces
        # A collective's duration too, from its span (a review: they never carried one).
        comm = [trace_id for point in by_rank[rank] if point.metric == "training.comm.duration"
                for trace_id in point.exemplar_trace_ids]
        assert comm and set(comm) <= step_traces


def test_mfu_grad_norm_and_bounded_attributes(run):
    result, by_rank = run
    for rank, points in by_rank.items():
        last_step = max((s for s in result.by_rank()[rank] if s.name == "training.step"), key=lambda s: s.start)
        mfu = value(points, "training.mfu").value
        # 6 x parameters x tokens of the last step / (its duration x the configured peak)
        assert 0 < mfu < 1
        assert mfu * (last_step.end - last_step.start) / 1e9 * 1e12 > 0
        assert value(points, "training.grad_norm").value > 0, "a CPU tensor: read without a device sync"
        assert not [p for p in points if p.metric == "training.loss_scale"], "fp32 has no loss scale"
        for point in points:
            if point.metric.startswith("training."):
                assert set(point.attributes) <= {"training.phase", "comm.op", "comm.backend", "comm.group.size",
                                                 "training.numerics.kind"}


def test_dataloader_workers_are_measured(workdir):
    launch(workdir, "python", "--steps", "30", "--workers", "2",
           env={"OTEL_METRIC_EXPORT_INTERVAL": "200"}).check()
    (metrics_file,) = workdir.glob("telemetry/*/metrics-rank0.jsonl")
    points = read_all_points(metrics_file)
    workers = [p.value for p in points if p.metric == "training.data.workers"]
    memory = [p.value for p in points if p.metric == "training.data.workers.memory.usage"]
    cpu = [p.value for p in points if p.metric == "training.data.workers.cpu.utilization"]
    assert 2 in workers, workers
    assert max(memory) > 10 * 2**20, "two Python processes hold more than 10 MiB"
    assert all(0 <= value <= 4 for value in cpu)
