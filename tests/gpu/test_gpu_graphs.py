"""GPU check (scripts/gpu-check.sh): a CUDA graph captured in torch's default ("global") mode while the emitter
keeps asking the step's events about their progress, which that mode refuses from any thread, graph and all."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, clean_env

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROBE = r"""
import os, sys, time, torch
sys.path.insert(0, os.environ["REPO"])
from opentelemetry_instrumentation_deepspeed.export import emitter as emitter_module
emitter_module.DRAIN_SECONDS = 0.0005  # the emitter's thread asks about the events all the time
from tests.test_steps_unit import recorder_on

recorder, engine, exporter = recorder_on(0, cuda=torch.cuda)
x = torch.randn(4096, 4096, device="cuda")
static = torch.randn(1024, 1024, device="cuda")
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):  # warm-up on a side stream, as torch's docs ask before a capture
    static @ static
torch.cuda.current_stream().wait_stream(side)
captured = 0
for step in range(30):
    forward = recorder.forward_started(engine)
    for _ in range(4):
        x = x @ x / 64  # the GPU stays busy: the step's events complete while the emitter polls
    recorder.phase_ended(forward)
    recorder.phase_ended(recorder.backward_started(engine))
    engine.step(recorder)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = static @ static
    graph.replay()
    captured += 1
torch.cuda.synchronize()
time.sleep(0.2)
gpu = [s for s in exporter.get_finished_spans() if s.name == "training.forward.gpu"]
print("CAPTURED", captured, "GPU_FORWARDS", len(gpu))
"""


def test_cuda_graphs_are_captured_while_the_emitter_reads_events():
    completed = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=clean_env(REPO=str(REPO)),
                               capture_output=True, text=True, timeout=240, check=False)
    print(completed.stdout)
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "CAPTURED 30 GPU_FORWARDS 30" in completed.stdout
