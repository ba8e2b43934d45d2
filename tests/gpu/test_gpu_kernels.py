"""GPU check (scripts/gpu-check.sh): kernel spans of a profiled step, and phases' GPU intervals."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import BIN, REPO, clean_env, free_port
from tests.otlp_json import read_spans

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_profiled_step_has_kernels_under_their_operators_on_the_epoch_clock(tmp_path):
    command = [str(BIN / "opentelemetry-instrument"), sys.executable, str(REPO / "examples" / "train.py"),
               "--steps", "4", "--d-model", "256", "--micro-batch-size", "16"]
    env = clean_env(MASTER_PORT=str(free_port()), OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY="2")
    completed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
                               check=False)
    assert completed.returncode == 0, completed.stderr[-4000:]
    (trace_file,) = tmp_path.glob("telemetry/*/traces-rank0.jsonl")
    spans = read_spans(trace_file)
    by_id = {s.span_id: s for s in spans}
    kernels = [s for s in spans if s.attributes.get("profile.kind") in ("kernel", "memcpy", "memset")]
    print(f"{len(kernels)} kernel spans; e.g. {sorted({k.name for k in kernels})[:5]}")
    assert kernels, "profiled steps carry GPU kernels"
    launched = [k for k in kernels if by_id[k.parent_id].attributes.get("profile.kind") == "cpu_op"]
    assert len(launched) >= len(kernels) // 2, "most kernels hang under the operator that launched them"
    for kernel in launched:
        launcher = by_id[kernel.parent_id]
        assert kernel.start >= launcher.start - 1_000_000, (kernel.name, launcher.name)
    gpu_phases = {s.name for s in spans if s.name.endswith(".gpu")}
    assert {"training.forward.gpu", "training.backward.gpu", "training.optimizer.step.gpu"} <= gpu_phases
