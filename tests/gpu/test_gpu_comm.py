"""GPU checks (scripts/gpu-check.sh): collectives timed by CUDA events on a real GPU, never synchronizing."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import BIN, REPO, clean_env, free_port
from tests.otlp_json import read_spans

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROBE = r"""
import os, sys, time, torch, torch.distributed as dist
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry_instrumentation_deepspeed import CommInstrumentor
from opentelemetry_instrumentation_deepspeed.recording import registry
sys.path.insert(0, os.environ["REPO"])
from tests.test_steps_unit import recorder_on

syncs = []
for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize")):
    original = getattr(owner, name)
    setattr(owner, name, lambda *a, _o=original, _n=name, **k: (syncs.append(_n), _o(*a, **k))[1])

recorder, engine, exporter = recorder_on(1)
CommInstrumentor().instrument(tracer_provider=recorder.facts.writer.provider)
registry._active = recorder
dist.init_process_group("nccl", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{os.environ['PORT']}")
x = torch.randn(8192, 8192, device="cuda")
data = torch.ones(64 * 1024 * 1024 // 4, device="cuda")
dist.all_reduce(data)  # warm-up, outside any step
torch.cuda.set_sync_debug_mode("error")  # a synchronizing call below, even one made in C++, raises
forward = recorder.forward_started(engine)
issued = time.time_ns()
for _ in range(4):
    x = x @ x  # keeps the GPU busy, so host and GPU times differ
dist.all_reduce(data)
work = dist.all_reduce(data, async_op=True)
work.wait()
host_done = time.time_ns()
recorder.phase_ended(forward)
recorder.phase_ended(recorder.backward_started(engine))
engine.step(recorder)  # the step closes: its record goes to the emitter
torch.cuda.set_sync_debug_mode("default")
torch.cuda.synchronize()  # the test's own, after the fact: let every event complete
syncs.remove("synchronize")
spans = [s for s in exporter.get_finished_spans() if s.name == "comm.all_reduce"]  # a drain reads the events
for s in spans:
    print("SPAN", s.attributes.get("comm.timing", "host"), s.attributes["comm.async"], s.start_time - issued,
          s.end_time - s.start_time, s.attributes["comm.busbw"])
print("HOST", host_done - issued)
print("SYNCS", len(syncs))
dist.destroy_process_group()
"""


def test_collectives_get_gpu_times_without_synchronizing(tmp_path):
    env = clean_env(REPO=str(REPO), PORT=str(free_port()))
    completed = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                               timeout=300, check=False)
    print(completed.stdout)
    assert completed.returncode == 0, completed.stderr[-4000:]
    lines = completed.stdout.splitlines()
    assert "SYNCS 0" in lines, "the instrumentation called synchronize"
    spans = [line.split() for line in lines if line.startswith("SPAN")]
    assert len(spans) == 2 and all(span[1] == "gpu" for span in spans), spans
    for _, _, _, offset, duration, _ in spans:
        assert int(duration) > 0
        # The GPU ran the all-reduce after the matmuls queued before it: later than its host issue.
        assert int(offset) > 0


def test_instrumented_single_gpu_deepspeed_run(tmp_path):
    port = str(free_port())
    command = [str(BIN / "opentelemetry-instrument"), sys.executable, str(REPO / "examples" / "train.py"),
               "--steps", "5", "--zero-stage", "3"]
    completed = subprocess.run(command, cwd=tmp_path, env=clean_env(MASTER_PORT=port), capture_output=True,
                               text=True, timeout=600, check=False)
    assert completed.returncode == 0, completed.stderr[-4000:]
    (trace_file,) = tmp_path.glob("telemetry/*/traces-rank0.jsonl")
    spans = read_spans(trace_file)
    steps = {s.trace_id: s for s in spans if s.name == "training.step"}
    comms = [s for s in spans if s.name.startswith("comm.")]
    timings = sorted({s.attributes.get("comm.timing", "host") for s in comms})
    print(f"{len(steps)} steps, {len(comms)} comm spans, timings {timings}")
    assert len(steps) == 5 and comms
    assert timings == ["gpu"]
    for span in comms:
        step = steps[span.trace_id]
        # GPU times on the epoch clock: within the step, give or take a millisecond.
        assert step.start - 1_000_000 <= span.start <= span.end <= step.end + 1_000_000, span
