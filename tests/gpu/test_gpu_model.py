"""GPU checks (scripts/gpu-check.sh): loss and gradient norm copied off the device without a sync, the
caching allocator's figures by phase, and a real out-of-memory error ending its phase and step."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from tests.conftest import BIN, REPO, clean_env, free_port
from tests.otlp_json import read_spans

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROBE = r"""
import os, sys, torch
sys.path.insert(0, os.environ["REPO"])
from tests.test_steps_unit import recorder_on

recorder, engine, exporter = recorder_on(0, grad_accum=2, cuda=torch.cuda)
assert recorder._device_scalars is not None and recorder._memory is not None
norm = torch.tensor(0.625, device="cuda")
engine.get_global_grad_norm = lambda: norm
x = torch.randn(4096, 4096, device="cuda")
printed = 0.0
losses = []
torch.cuda.set_sync_debug_mode("error")  # any synchronizing call below raises
for micro in range(2):
    forward = recorder.forward_started(engine)
    for _ in range(8):
        x = x @ x / 64  # keeps the GPU busy: the copies complete well after the host moves on
    loss = x.mean() * 0 + (1.5 + micro)
    recorder.forward_ended(forward, loss)
    recorder.phase_ended(recorder.backward_started(engine, loss=loss))
    losses.append(loss)
    engine.step(recorder)
torch.cuda.set_sync_debug_mode("default")
for each in losses:
    printed += each.item() / 2
torch.cuda.synchronize()  # the test's own, after the fact
(step,) = [s for s in exporter.get_finished_spans() if s.name == "training.step"]
print("LOSS", step.attributes["training.loss"] == printed, step.attributes["training.grad_norm"])
print("MEMORY", step.attributes["training.memory.allocated"], step.attributes["training.memory.reserved"],
      step.attributes["training.memory.forward.peak"], step.attributes["training.memory.backward.peak"])

# A real out-of-memory error inside a forward: the phase and the step end in ERROR with the figures.
recorder, engine, exporter = recorder_on(0, cuda=torch.cuda)
forward = recorder.forward_started(engine)
try:
    torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
except torch.OutOfMemoryError as error:
    recorder.phase_failed(forward, error)
step = [s for s in exporter.get_finished_spans() if s.name == "training.step"][-1]
print("OOM", step.status.status_code.name, step.attributes["training.memory.oom"],
      step.attributes["training.memory.allocated"] > 0, recorder.facts.metrics.memory.ooms >= 1)
"""


def test_device_loss_memory_and_oom_without_synchronizing():
    completed = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=clean_env(REPO=str(REPO)),
                               capture_output=True, text=True, timeout=300, check=False)
    print(completed.stdout)
    assert completed.returncode == 0, completed.stderr[-4000:]
    lines = {line.split()[0]: line.split()[1:] for line in completed.stdout.splitlines() if line[:1].isupper()}
    assert lines["LOSS"] == ["True", "0.625"], "the loss equals the values .item() reads, bit for bit"
    allocated, reserved, forward_peak, backward_peak = map(int, lines["MEMORY"])
    assert 0 < allocated <= reserved and forward_peak >= 64 * 2**20 and backward_peak > 0
    assert lines["OOM"] == ["ERROR", "forward", "True", "True"]


def test_a_real_gpu_run_reports_what_the_script_prints(tmp_path):
    command = [str(BIN / "opentelemetry-instrument"), sys.executable, str(REPO / "examples" / "train.py"),
               "--steps", "6", "--zero-stage", "2", "--grad-accum", "2", "--print-steps"]
    completed = subprocess.run(command, cwd=tmp_path, env=clean_env(MASTER_PORT=str(free_port())),
                               capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 0, completed.stderr[-4000:]
    printed = {int(step): (float(loss), float(norm)) for step, _rank, loss, norm in
               re.findall(r"^step (\d+) rank (\d+) loss (\S+) grad_norm (\S+)$", completed.stdout, re.MULTILINE)}
    spans = [s for path in tmp_path.glob("telemetry/*/traces-rank*.jsonl") for s in read_spans(path)]
    steps = {s.attributes["training.step"]: s.attributes for s in spans if s.name == "training.step"}
    assert sorted(steps) == sorted(printed) == list(range(1, 7))
    for number, attributes in steps.items():
        assert (attributes["training.loss"], attributes["training.grad_norm"]) == printed[number], number
        assert attributes["training.memory.allocated"] > 0
        assert attributes["training.memory.forward.peak"] >= attributes["training.memory.allocated"] // 2
    phases = [s for s in spans if s.name in ("training.forward", "training.backward", "training.optimizer.step")]
    assert phases and all(s.attributes["training.memory.peak"] > 0 for s in phases)
