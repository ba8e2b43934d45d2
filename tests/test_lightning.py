"""PyTorch Lightning (``strategy="ddp"``, its own launcher) on 2 CPU ranks under ``opentelemetry-instrument``: the
steps of a plain PyTorch loop, through the real package."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.conftest import BIN, REPO, launch
from tests.otlp_json import read_last_points

pytestmark = pytest.mark.slow  # real 2-rank jobs

SCRIPT = REPO / "tests" / "scripts" / "lightning_loop.py"


def printed_losses(run) -> dict[int, dict[int, float]]:
    losses: dict[int, dict[int, float]] = {0: {}, 1: {}}
    for rank, step, loss in re.findall(r"^rank (\d) step (\d+) loss (\S+)$", run.output, re.MULTILINE):
        losses[int(rank)][int(step)] = float(loss)
    return losses


def diagnose(workdir) -> dict:
    completed = subprocess.run([str(BIN / "opentelemetry-deepspeed"), "diagnose", "--json"], cwd=workdir,
                               capture_output=True, text=True, timeout=120, check=True)
    return json.loads(completed.stdout)


def test_accumulated_steps_with_validations_are_whole_with_their_loss_and_samples(workdir):
    """The Lightning review: after its first validation every forward was dropped as an evaluation's (the DDP wrapper
    stayed in eval mode); with accumulation the last micro-batch's forward and backward went into the optimizer phase
    and its loss was lost; training.samples stayed 0 (the batch reaches the model whole, as a list)."""
    steps = 8
    run = launch(workdir, "python", "--steps", str(steps), "--accumulate", "2", "--validate-every", "4",
                 script=SCRIPT, timeout=300).check()
    printed = printed_losses(run)
    for rank, spans in run.by_rank().items():
        by_id = {span.span_id: span for span in spans}
        training_steps = {span.attributes["training.step"]: span for span in spans if span.name == "training.step"}
        assert sorted(training_steps) == list(range(1, steps + 1))
        assert {number: step.attributes["training.loss"] for number, step in training_steps.items()} == printed[rank]
        for step in training_steps.values():
            assert step.attributes["training.parallelism"] == "ddp"
            assert (step.attributes["training.step.micro_batches"], step.attributes["training.step.samples"]) == (2, 16)
            for name in ("training.data.wait", "training.forward", "training.backward"):
                micro = sorted(s.attributes["training.micro_step"] for s in spans
                               if s.name == name and s.parent_id == step.span_id)
                assert micro == [0, 1], (name, step.attributes["training.step"], micro)
            (optimizer,) = [s for s in spans if s.name == "training.optimizer.step" and s.parent_id == step.span_id]
            assert not [s for s in spans if s.name == "training.forward" and by_id.get(s.parent_id) is optimizer]
        (metrics,) = run.cwd.glob(f"telemetry/*/metrics-rank{rank}.jsonl")
        assert [p.value for p in read_last_points(metrics) if p.metric == "training.samples"] == [16 * steps]
    assert diagnose(workdir)["verdict"]["layer"] == "none"


def test_a_rank_s_stalling_loader_is_named_after_validations(workdir):
    """The Lightning review: a loader stall on rank 1 read as HOST WORK once a validation had run, the waits dropped
    with the forwards."""
    launch(workdir, "python", "--steps", "24", "--validate-every", "6", "--stall-rank", "1", "--stall-every", "6",
           "--stall-ms", "250", script=SCRIPT, timeout=300).check()
    verdict = diagnose(workdir)["verdict"]
    assert (verdict["layer"], verdict["rank"], verdict.get("period")) == ("data loading", 1, 6), verdict
