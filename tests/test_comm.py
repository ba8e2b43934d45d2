"""Collectives on real 2-rank DeepSpeed runs over gloo, checked against DeepSpeed's own comms_logger."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import pytest

from tests.conftest import launch
from tests.otlp_json import read_last_points

pytestmark = pytest.mark.slow  # real DeepSpeed jobs

STEPS = 3

# Where each stage's collectives come from, as DeepSpeed 0.19 issues them.
EXPECTED_PARENTS = {
    0: {("all_reduce", "training.backward")},
    1: {("all_reduce", "training.backward"), ("all_gather_into_tensor", "training.optimizer.step")},
    2: {("all_reduce", "training.backward"), ("all_gather_into_tensor", "training.optimizer.step")},
    3: {("all_gather_into_tensor", "training.forward"), ("all_gather_into_tensor", "training.backward"),
        ("reduce_scatter_tensor", "training.backward")},
}


def comm_spans(spans):
    return [span for span in spans if span.name.startswith("comm.")]


def deepspeed_counts(workdir, rank) -> Counter:
    logged = json.loads((workdir / f"comms.rank{rank}.json").read_text())
    return Counter({(op, int(size)): calls for op, sizes in logged.items() for size, calls in sizes.items()})


@pytest.mark.parametrize(("zero_stage", "grad_accum"), [(0, 1), (1, 2), (2, 2), (3, 1), (3, 2)])
def test_every_collective_once_as_deepspeed_counts_it(workdir, zero_stage, grad_accum):
    # No span limit here: every call is compared; test_span_limit_keeps_counts_and_metrics_whole checks the limit.
    run = launch(workdir, "torchrun", "--steps", str(STEPS), "--zero-stage", str(zero_stage),
                 "--grad-accum", str(grad_accum), "--comms-log", str(workdir / "comms"),
                 env={"OTEL_PYTHON_DEEPSPEED_COMM_SPAN_LIMIT": "1000000"}).check()
    for rank, spans in run.by_rank().items():
        by_id = {span.span_id: span for span in spans}
        ours = Counter((span.attributes["comm.op"], span.attributes["comm.bytes"]) for span in comm_spans(spans))
        assert ours == deepspeed_counts(workdir, rank), f"rank {rank}"
        parents = {(span.attributes["comm.op"], by_id[span.parent_id].name) for span in comm_spans(spans)}
        assert EXPECTED_PARENTS[zero_stage] <= parents, parents
        for span in comm_spans(spans):
            parent = by_id[span.parent_id]
            assert parent.start <= span.start <= span.end <= parent.end or span.attributes["comm.async"]
            assert span.attributes["comm.backend"] == "gloo" and span.attributes["comm.group.size"] == 2
            seconds = (span.end - span.start) / 1e9
            size = span.attributes["comm.bytes"] * (2 if "all_gather" in span.name else 1)
            assert span.attributes["comm.algbw"] == pytest.approx(size / seconds, rel=1e-3)
        steps = [span for span in spans if span.name == "training.step"]
        assert sum(step.attributes.get("comm.count", 0) for step in steps) == len(comm_spans(spans))


def test_sequence_numbers_join_the_same_collective_across_ranks(workdir):
    run = launch(workdir, "deepspeed", "--steps", "2", "--zero-stage", "3").check()
    by_sequence = defaultdict(dict)
    for rank, spans in run.by_rank().items():
        for span in comm_spans(spans):
            key = (span.attributes.get("comm.group.name", "0"), span.attributes["comm.sequence"])
            assert rank not in by_sequence[key], "a sequence number names one collective per rank"
            by_sequence[key][rank] = span
    assert len(by_sequence) > 50
    for key, pair in by_sequence.items():
        assert set(pair) == {0, 1}, key
        assert pair[0].name == pair[1].name and pair[0].trace_id == pair[1].trace_id
        assert pair[0].attributes["comm.bytes"] == pair[1].attributes["comm.bytes"]


def test_plain_torch_distributed_calls_are_seen_and_async_ones_end_at_wait(workdir):
    run = launch(workdir, "torchrun", "--steps", str(STEPS), "--grad-accum", "2", "--average-loss", "async",
                 "--comms-log", str(workdir / "comms")).check()
    for rank, spans in run.by_rank().items():
        by_id = {span.span_id: span for span in spans}
        averages = [span for span in comm_spans(spans) if span.attributes["comm.async"]
                    and span.attributes["comm.op"] == "all_reduce"]
        assert len(averages) == STEPS * 2
        for span in averages:
            assert by_id[span.parent_id].name == "training.step"
            assert span.attributes["comm.bytes"] == 4 and span.attributes["comm.dtype"] == "float32"
            assert span.end - span.start >= 20_000_000, "issue to wait(), across the 20 ms of host work"
        # DeepSpeed's logger sees only its own calls; ours, those plus the plain ones.
        ours = Counter((s.attributes["comm.op"], s.attributes["comm.bytes"]) for s in comm_spans(spans))
        ours[("all_reduce", 4)] -= len(averages)
        assert +ours == deepspeed_counts(workdir, rank)


def test_span_limit_keeps_counts_and_metrics_whole(workdir):
    run = launch(workdir, "torchrun", "--steps", str(STEPS), "--zero-stage", "3",
                 "--comms-log", str(workdir / "comms"), env={"OTEL_PYTHON_DEEPSPEED_COMM_SPAN_LIMIT": "10"}).check()
    for rank, spans in run.by_rank().items():
        logged = sum(deepspeed_counts(workdir, rank).values())
        steps = [span for span in spans if span.name == "training.step"]
        assert all(len([s for s in comm_spans(spans) if s.trace_id == step.trace_id]) == 10 for step in steps)
        assert sum(step.attributes["comm.count"] for step in steps) == logged
        assert sum(step.attributes["comm.spans_dropped"] for step in steps) == logged - 10 * STEPS
        phases = [span for span in spans if span.name.startswith("training.") and span.name != "training.step"]
        assert sum(phase.attributes.get("comm.count", 0) for phase in phases) == logged
        (metrics_file,) = workdir.glob(f"telemetry/*/metrics-rank{rank}.jsonl")
        counted = sum(p.value for p in read_last_points(metrics_file) if p.metric == "training.comm.duration")
        assert counted >= logged, "every collective is measured, in steps and out"


def test_metrics_mode_records_no_spans(workdir):
    run = launch(workdir, "torchrun", "--steps", "2", "--zero-stage", "3",
                 env={"OTEL_PYTHON_DEEPSPEED_COMM": "metrics"}).check()
    assert not comm_spans(run.spans)
    assert all(s.attributes["comm.count"] > 0 for s in run.spans if s.name == "training.step")
    (metrics_file,) = workdir.glob("telemetry/*/metrics-rank0.jsonl")
    points = read_last_points(metrics_file)
    ops = {p.attributes["comm.op"] for p in points if p.metric == "training.comm.duration"}
    assert {"reduce_scatter_tensor", "all_gather_into_tensor"} <= ops
    for point in points:
        if point.metric.startswith("training.comm."):
            assert set(point.attributes) == {"comm.op", "comm.backend", "comm.group.size"}, "bounded cardinality"
    sizes = {p.attributes["comm.op"]: p.value for p in points if p.metric == "training.comm.size"}
    bus = {p.attributes["comm.op"]: p.value for p in points if p.metric == "training.comm.bus.size"}
    # Two ranks: reduce-scatter's bus factor is 1/2.
    assert bus["reduce_scatter_tensor"] == pytest.approx(sizes["reduce_scatter_tensor"] / 2, rel=0.01)


def test_off_mode_observes_nothing(workdir):
    run = launch(workdir, "torchrun", "--steps", "2", env={"OTEL_PYTHON_DEEPSPEED_COMM": "off"}).check()
    assert not comm_spans(run.spans)
    assert not any("comm.count" in s.attributes for s in run.spans)
    for path in workdir.glob("telemetry/*/metrics-rank*.jsonl"):
        assert not [p for p in read_last_points(path) if p.metric.startswith("training.comm.")]
