"""The input layer on a real 2-rank run: the batches' counts in spans and metrics, and `diagnose`'s INPUT verdict."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import BIN, launch
from tests.otlp_json import read_last_points

pytestmark = pytest.mark.slow  # a real DeepSpeed job

STEPS, SHIFT_AT, GRAD_ACCUM, MICRO_BATCH = 16, 9, 2, 8
HOST_CPUS = Path("/proc/stat").read_text().count("\ncpu")  # its lines cpu0, cpu1, ...


def test_a_sequence_length_shift_is_counted_and_diagnosed_as_input(workdir):
    run = launch(workdir, "torchrun", "--steps", str(STEPS), "--zero-stage", "2", "--grad-accum", str(GRAD_ACCUM),
                 "--seq-len", "32", "--shift-seq-len", "128", "--shift-at", str(SHIFT_AT), "--padding").check()
    for rank, spans in run.by_rank().items():
        steps = {s.trace_id: s for s in spans if s.name == "training.step"}
        assert len(steps) == STEPS
        forwards = [s for s in spans if s.name == "training.forward"]
        backwards = {(s.trace_id, s.attributes["training.micro_step"]): s for s in spans
                     if s.name == "training.backward"}
        assert len(forwards) == STEPS * GRAD_ACCUM
        for forward in forwards:
            step = steps[forward.trace_id].attributes["training.step"]
            length = 128 if step >= SHIFT_AT else 32
            batch = forward.attributes
            assert (batch["training.batch.samples"], batch["training.batch.sequence_length"]) == (MICRO_BATCH, length)
            # The example pads each sequence after at least half its length: the mask says which tokens are real.
            assert MICRO_BATCH * length // 2 <= batch["training.batch.tokens"] < MICRO_BATCH * length
            backward = backwards[forward.trace_id, batch["training.micro_step"]].attributes
            assert all(backward[key] == value for key, value in batch.items() if key.startswith("training.batch."))
            # The share of each phase its training thread waited for a CPU (read, whatever the host, for 50 steps)
            assert 0 <= batch["training.phase.thread.cpu.wait"] <= 1
            assert 0 <= backward["training.phase.thread.cpu.wait"] <= 1
        for trace_id, step in steps.items():
            mine = [f.attributes for f in forwards if f.trace_id == trace_id]
            assert step.attributes["training.step.tokens"] == sum(b["training.batch.tokens"] for b in mine)
            assert step.attributes["training.step.padded_tokens"] == sum(
                b["training.batch.samples"] * b["training.batch.sequence_length"] for b in mine)
            assert step.attributes["training.step.sequence_length"] == max(
                b["training.batch.sequence_length"] for b in mine)
            # The host's CPUs in the step: busy and idle add up to all of them; this rank used some.
            cpus = step.attributes
            assert 0.8 * HOST_CPUS <= cpus["training.step.host.cpu.busy"] + cpus["training.step.host.cpu.idle"] \
                <= 1.2 * HOST_CPUS
            assert 0 < cpus["training.step.process.cpu"] <= HOST_CPUS
            # ... and the share of the step its training thread waited, ready, for one of them
            assert 0 <= cpus["training.step.thread.cpu.wait"] <= 1
            # ... and its native threads (gloo's) waited, summed over them
            assert cpus["training.step.native_threads.cpu.wait"] >= 0
        (metrics_file,) = workdir.glob(f"telemetry/*/metrics-rank{rank}.jsonl")
        points = {p.metric: p for p in read_last_points(metrics_file)}
        lengths = points["training.batch.sequence_length"]
        batches, shifted = STEPS * GRAD_ACCUM, (STEPS - SHIFT_AT + 1) * GRAD_ACCUM
        assert (lengths.value, lengths.total) == (batches, shifted * 128 + (batches - shifted) * 32)
        real = sum(s.attributes["training.step.tokens"] for s in steps.values())
        assert points["training.batch.tokens"].value == real
        assert points["training.batch.tokens"].value < points["training.tokens"].value  # padding excluded

    completed = subprocess.run([str(BIN / "opentelemetry-deepspeed"), "diagnose", "--json"], cwd=workdir,
                               capture_output=True, text=True, timeout=120, check=True)
    verdict = json.loads(completed.stdout)["verdict"]
    assert verdict["layer"] == "INPUT" and verdict["change_step"] == SHIFT_AT, verdict
    assert verdict["summary"].startswith(f"from step {SHIFT_AT}, tokens per step x4.0 (sequence length 32 -> 128)")
    assert verdict["rank"] is None and verdict["cost_seconds"] > 0


def test_compute_that_got_slower_with_the_same_input_is_compute_not_input(workdir):
    # Every rank's forward and backward 5 times slower from step 11, the same tokens every step.
    launch(workdir, "torchrun", "--steps", "18", "--zero-stage", "2", "--seq-len", "256", "--micro-batch-size", "16",
           "--slowdown-at", "11", "--slowdown-factor", "5").check()
    completed = subprocess.run([str(BIN / "opentelemetry-deepspeed"), "diagnose", "--json"], cwd=workdir,
                               capture_output=True, text=True, timeout=120, check=True)
    verdict = json.loads(completed.stdout)["verdict"]
    assert verdict["layer"] == "COMPUTE" and abs(verdict["change_step"] - 11) <= 1, verdict
    assert "with the same tokens per step" in verdict["summary"] and verdict["rank"] is None, verdict["summary"]
