"""Pipeline parallelism: a real ``deepspeed.pipe.PipelineModule`` on 2 stages, through the ``deepspeed``
launcher under ``opentelemetry-instrument``."""

from __future__ import annotations

import json
import re
import subprocess
from collections import Counter, defaultdict

import pytest

from tests.conftest import BIN, REPO, launch

pytestmark = pytest.mark.slow  # real DeepSpeed jobs

PIPELINE = REPO / "tests" / "scripts" / "train_pipeline.py"
STEPS, MICRO_BATCHES = 5, 4


def losses(run) -> str:
    match = re.search(r"^losses (.*)$", run.output, re.MULTILINE)
    assert match, run.output[-2000:]
    return match.group(1)


def diagnose(workdir) -> dict:
    completed = subprocess.run([str(BIN / "opentelemetry-deepspeed"), "diagnose", "--json"], cwd=workdir,
                               capture_output=True, text=True, timeout=120, check=True)
    return json.loads(completed.stdout)


def test_each_stage_traces_its_steps_micro_batches_and_transfers(tmp_path):
    # Layers wide enough that their compute, not the last stage's loss, fills each stage: balanced.
    args = ("--steps", str(STEPS), "--micro-batches", str(MICRO_BATCHES), "--eval", "--width", "512",
            "--micro-batch-size", "16")
    run = launch(tmp_path, "deepspeed", *args, script=PIPELINE).check()
    assert run.trained() == (STEPS, 0)
    # Each step's loss, as train_batch() returned it, is the step's training.loss on the last stage.
    returned = [float(loss) for loss in losses(run).split()]
    last_stage = sorted((s for s in run.by_rank()[1] if s.name == "training.step"),
                        key=lambda s: s.attributes["training.step"])
    assert [s.attributes["training.loss"] for s in last_stage] == pytest.approx(returned, abs=2e-6)

    ranks = run.by_rank()
    assert set(ranks) == {0, 1}
    roots = {span.trace_id: span for span in ranks[0] if span.name == "training.global_step"}
    assert len(roots) == STEPS
    for rank, spans in ranks.items():
        peer = 1 - rank
        resource = spans[0].resource
        assert (resource["training.pipeline.stage"], resource["training.pipeline.stages"]) == (rank, 2)
        assert (resource["training.data_parallel.rank"], resource["training.data_parallel.size"]) == (0, 1)
        steps = [span for span in spans if span.name == "training.step"]
        # One step per train_batch(); eval_batch() adds none.
        assert sorted(span.attributes["training.step"] for span in steps) == list(range(1, STEPS + 1))
        by_id = {span.span_id: span for span in spans}
        for step in steps:
            assert step.trace_id in roots and step.parent_id == roots[step.trace_id].span_id
            assert step.attributes["training.pipeline.stage"] == rank
            assert step.attributes["training.step.micro_batches"] == MICRO_BATCHES
            children = defaultdict(list)
            for span in spans:
                if span.parent_id == step.span_id:
                    children[span.name].append(span)
            for name in ("training.forward", "training.backward", "training.data.wait"):
                assert sorted(s.attributes["training.micro_step"] for s in children[name]) == list(range(MICRO_BATCHES))
            assert len(children["training.optimizer.step"]) == 1
            # Stage 0 sends activations and receives gradients; stage 1 the other way round.
            transfers = children["comm.send"] + children["comm.recv"]
            assert len(children["comm.send"]) >= MICRO_BATCHES and len(children["comm.recv"]) >= MICRO_BATCHES
            assert {(s.attributes["training.pipeline.peer_stage"], s.attributes["comm.peer.rank"])
                    for s in transfers} == {(peer, peer)}
            assert all(step.start <= s.start and s.end <= step.end for s in transfers)
            # The first stage's forward of micro-batch i precedes the last stage's: stage 1 waits for stage 0.
            forwards = sorted(children["training.forward"], key=lambda s: s.attributes["training.micro_step"])
            backwards = sorted(children["training.backward"], key=lambda s: s.attributes["training.micro_step"])
            assert all(f.end <= b.start for f, b in zip(forwards, backwards, strict=True))
        assert not [s for s in spans if s.parent_id and s.parent_id not in by_id and s.name != "training.step"]
        counts = Counter(span.name for span in spans)
        assert counts["training.forward"] == counts["training.backward"] == STEPS * MICRO_BATCHES

    report = diagnose(run.cwd)
    stages = report["pipeline"]["stages"]
    assert set(stages) == {"0", "1"} and all(0 < stage["bubble_seconds"] < stage["step_seconds"]
                                             and 0 < stage["work_seconds"] <= stage["compute_seconds"]
                                             for stage in stages.values())
    # Equal layers on both stages: no stage is imbalanced, although the last one also computes the
    # loss (its work is 1.2-1.7x the first stage's, a few percent of the step).
    assert not report["pipeline"]["findings"], (report["pipeline"]["findings"], stages)
    assert report["verdict"]["layer"] == "none", report["verdict"]


def test_an_injected_slow_stage_is_named(workdir):
    launch(workdir, "deepspeed", "--steps", "6", "--slow-stage", "0", "--slow-ms", "15", script=PIPELINE).check()
    report = diagnose(workdir)
    verdict = report["verdict"]
    assert verdict["layer"] == "PIPELINE" and verdict["stage"] == 0 and verdict["rank"] == 0, verdict
    stages = report["pipeline"]["stages"]
    # Four 15 ms sleeps per step on stage 0, which stage 1 idles through; stage 0 is named despite
    # the last stage's own extra work (the loss).
    assert stages["0"]["work_seconds"] > 0.055 and stages["1"]["bubble_seconds"] > 0.045
    assert report["straggler"] is None
