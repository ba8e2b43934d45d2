"""The span spine on real DeepSpeed runs: the exact tree per step per rank, and one trace per step."""

from __future__ import annotations

from collections import Counter, defaultdict

import deepspeed
import pytest

from tests.conftest import launch
from tests.otlp_json import Span

pytestmark = pytest.mark.slow  # real DeepSpeed jobs

PHASES = ("training.data.wait", "training.forward", "training.backward", "training.optimizer.step")

# (launcher, zero stage, gradient accumulation, backward, loader): every stage, both accumulations,
# both launchers and the single process, the direct loss.backward() path and DeepSpeed's own loader.
CASES = [
    ("deepspeed", 0, 1, "engine", "torch"),
    ("deepspeed", 1, 4, "direct", "torch"),
    ("torchrun", 2, 4, "engine", "deepspeed"),
    ("torchrun", 3, 1, "direct", "torch"),
    ("python", 3, 4, "engine", "torch"),
    ("python", 2, 1, "direct", "deepspeed"),
]
STEPS = 4
MICRO_BATCH = 4


def step_spans_of(spans: list[Span]) -> list[Span]:
    return sorted((s for s in spans if s.name == "training.step"), key=lambda s: s.attributes["training.step"])


def check_step_tree(run, steps: int, grad_accum: int, world_size: int, zero_stage: int) -> None:
    """What a user looks for in a trace viewer, asserted exactly."""
    by_rank = run.by_rank()
    assert sorted(by_rank) == list(range(world_size))
    roots = [span for span in by_rank[0] if span.name == "training.global_step"]
    assert sorted(root.attributes["training.step"] for root in roots) == list(range(1, steps + 1))
    root_of = {root.attributes["training.step"]: root for root in roots}
    for root in roots:
        assert root.parent_id == "", "the step's root is a real root span"
        assert root.attributes["training.step.samples"] == MICRO_BATCH * grad_accum * world_size
        assert root.attributes["training.world_size"] == world_size
    assert all(span.name != "training.global_step" for rank in range(1, world_size) for span in by_rank[rank])

    for rank, all_spans in by_rank.items():
        spans = [span for span in all_spans if not span.name.startswith("comm.")]
        by_id = {span.span_id: span for span in spans}
        step_spans = step_spans_of(spans)
        assert [s.attributes["training.step"] for s in step_spans] == list(range(1, steps + 1)), f"rank {rank}"
        children: dict[str, list[Span]] = defaultdict(list)
        for span in spans:
            children[span.parent_id].append(span)
        for step in step_spans:
            number = step.attributes["training.step"]
            root = root_of[number]
            assert step.trace_id == root.trace_id, f"rank {rank} step {number} is not in the step's trace"
            assert step.parent_id == root.span_id, f"rank {rank} step {number} is not under the root"
            assert step.attributes["training.gradient_accumulation_steps"] == grad_accum
            assert step.attributes["training.zero_stage"] == zero_stage
            assert step.attributes["training.step.samples"] == MICRO_BATCH * grad_accum
            assert step.attributes["training.step.micro_batches"] == grad_accum
            assert step.attributes["training.step.skipped"] is False
            kids = children[step.span_id]
            assert Counter(kid.name for kid in kids) == {
                "training.data.wait": grad_accum, "training.forward": grad_accum,
                "training.backward": grad_accum, "training.optimizer.step": 1,
            }, f"rank {rank} step {number}"
            for name in ("training.data.wait", "training.forward", "training.backward"):
                micro = sorted(kid.attributes["training.micro_step"] for kid in kids if kid.name == name)
                assert micro == list(range(grad_accum)), f"{name} micro steps on rank {rank} step {number}"
            for kid in kids:
                assert kid.trace_id == step.trace_id
                assert step.start <= kid.start <= kid.end <= step.end, f"{kid.name} outside its step"
                assert all(child.name.startswith("comm.") for child in children[kid.span_id])
            if rank == 0:
                assert root.start <= step.start <= step.end <= root.end
        # Every span of this rank is in this tree: nothing orphaned, nothing extra.
        # step + optimizer step + three spans per micro-batch, and the root on rank 0
        expected = steps * (2 + 3 * grad_accum + (rank == 0))
        assert len(spans) == expected
        assert all(span.parent_id in by_id or span.name in {"training.global_step", "training.step"}
                   for span in spans)

    # One trace per global step for the whole job.
    traces = defaultdict(set)
    for span in run.spans:
        traces[span.trace_id].add(span.resource["training.rank"])
    assert len(traces) == steps
    assert all(ranks == set(range(world_size)) for ranks in traces.values())


def check_resource(run, world_size: int) -> None:
    resources = {span.resource["training.rank"]: span.resource for span in run.spans}
    job_ids = {resource["training.job.id"] for resource in resources.values()}
    assert len(job_ids) == 1, "every rank reports the same job id"
    assert len({resource["service.instance.id"] for resource in resources.values()}) == world_size
    assert len({resource["process.pid"] for resource in resources.values()}) == world_size
    for rank, resource in resources.items():
        assert resource["service.name"] == "train"
        assert resource["training.world_size"] == world_size
        assert resource["training.local_rank"] == rank
        assert resource["training.framework"] == "deepspeed"
        assert resource["deepspeed.version"] == deepspeed.__version__
        assert resource["host.name"]
    assert len(run.trace_files) == world_size, "one file per rank; launchers and helpers write nothing"
    assert len(list(run.cwd.glob("telemetry/*/*"))) == 2 * world_size, "traces and metrics of each rank, no more"


@pytest.mark.parametrize("case", CASES, ids=lambda case: "-".join(map(str, case)))
def test_step_tree(workdir, case):
    launcher, zero_stage, grad_accum, backward, loader = case
    world_size = 1 if launcher == "python" else 2
    run = launch(workdir, launcher, "--steps", str(STEPS), "--zero-stage", str(zero_stage),
                 "--grad-accum", str(grad_accum), "--micro-batch-size", str(MICRO_BATCH),
                 "--backward", backward, "--loader", loader).check()
    assert run.trained() == (STEPS, 0)
    check_step_tree(run, STEPS, grad_accum, world_size, zero_stage)
    check_resource(run, world_size)
    if backward == "direct":
        assert all(span.attributes.get("training.backward.direct") for span in run.spans
                   if span.name == "training.backward")


def test_skipped_steps_match_deepspeed(workdir):
    """fp16 with a huge initial loss scale overflows; DeepSpeed skips those updates."""
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().is_fp16_supported():
        pytest.skip("DeepSpeed's CPU accelerator refuses fp16 on this CPU (oneDNN has no fp16 support here)")
    run = launch(workdir, "python", "--steps", "10", "--zero-stage", "2", "--fp16").check()
    steps, skipped = run.trained()
    assert 0 < skipped < steps
    step_spans = step_spans_of(run.spans)
    assert len(step_spans) == steps
    assert sum(span.attributes["training.step.skipped"] for span in step_spans) == skipped
    # Overflows come first, while the scale comes down.
    flags = [span.attributes["training.step.skipped"] for span in step_spans]
    assert flags == [True] * skipped + [False] * (steps - skipped)


def test_job_ids_differ_between_runs(workdir):
    job_ids = set()
    for name in ("first", "second"):
        (workdir / name).mkdir()
        run = launch(workdir / name, "deepspeed", "--steps", "1").check()
        job_ids |= {span.resource["training.job.id"] for span in run.spans}
    assert len(job_ids) == 2


def test_sampling_agrees_across_ranks(workdir):
    """A trace-id ratio sampler keeps or drops a step on every rank alike, with no communication."""
    steps = 12
    run = launch(workdir, "torchrun", "--steps", str(steps), env={
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.5",
        "OTEL_PYTHON_DEEPSPEED_JOB_ID": "sampling-agreement",
    }).check()
    kept = {rank: {s.attributes["training.step"] for s in spans if s.name == "training.step"}
            for rank, spans in run.by_rank().items()}
    roots = {s.attributes["training.step"] for s in run.spans if s.name == "training.global_step"}
    assert kept[0] == kept[1] == roots
    assert 0 < len(roots) < steps
    assert {s.resource["training.job.id"] for s in run.spans} == {"sampling-agreement"}
