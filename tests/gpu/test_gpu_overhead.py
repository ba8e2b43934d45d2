"""GPU checks (scripts/gpu-check.sh): the overhead on a real GPU step, and no synchronization added."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, clean_env, free_port

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_instrumented_steps_add_no_synchronization_and_report_the_ratio():
    # Kernel sampling off: stopping torch.profiler synchronizes, once per profiled step (documented).
    command = [sys.executable, str(REPO / "benchmarks" / "overhead.py"), "--zero-stage", "2", "--rounds", "6",
               "--steps", "20", "--sync-check", "--profile-every", "0"]
    completed = subprocess.run(command, cwd=REPO, env=clean_env(MASTER_PORT=str(free_port()),
                                                                OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR="0"),
                               capture_output=True, text=True, timeout=240, check=False)
    print(completed.stdout)
    assert completed.returncode == 0, completed.stderr[-4000:]
    match = re.search(r"synchronizing operations per step: A ([\d.]+), B ([\d.]+), A' ([\d.]+)", completed.stdout)
    assert match, completed.stdout
    bare, instrumented, control = map(float, match.groups())
    assert instrumented == bare == control, "the instrumentation added synchronizing operations"
    assert "instrumented - bare (B - A) wall" in completed.stdout


def test_the_added_time_per_step_on_a_gpu():
    """The figure of record (active vs inert steps in one engine), on a real GPU step: printed for the note."""
    command = [sys.executable, str(REPO / "benchmarks" / "overhead_steps.py"), "--zero-stage", "2",
               "--triples", "300", "--warmup", "20"]
    completed = subprocess.run(command, cwd=REPO, env=clean_env(MASTER_PORT=str(free_port())),
                               capture_output=True, text=True, timeout=180, check=False)
    print(completed.stdout)
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert re.search(r"active - inert \(B - A\): +[-+][\d.]+ us/step", completed.stdout), completed.stdout
    assert "spans per active step on this rank: 8.0" in completed.stdout
