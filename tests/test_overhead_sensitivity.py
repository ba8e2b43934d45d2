"""CI's guard on the overhead: the instrumentation's work per step, counted (not timed).

benchmarks/README.md records the figures; a change that doubles them fails here, whatever
the machine's speed. The timed figures come from benchmarks/overhead.py, never from a test.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, clean_env, free_port

pytestmark = pytest.mark.slow  # runs benchmarks/sensitivity.py: real DeepSpeed steps

# Recorded with benchmarks/sensitivity.py (ZeRO-2, one process): see benchmarks/README.md.
RECORDED_CALLS_PER_STEP = 542
SPANS_PER_STEP = 8  # training.global_step, training.step, data wait, forward, backward, optimizer step, 2 comm
RECORDED_RECORDS_PER_STEP = 8.1


def test_work_per_step_stays_within_twice_the_recorded_figures():
    completed = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sensitivity.py"), "--zero-stage", "2"],
                               env=clean_env(MASTER_PORT=str(free_port())), capture_output=True, text=True,
                               timeout=600, check=False)
    assert completed.returncode == 0, completed.stderr[-3000:]
    figures = json.loads(completed.stdout.strip().splitlines()[-1])
    assert figures["spans_per_step"] == SPANS_PER_STEP, figures
    assert figures["records_per_step"] <= 2 * RECORDED_RECORDS_PER_STEP, figures
    assert figures["calls_per_step"] <= 2 * RECORDED_CALLS_PER_STEP, figures
    # A guard that cannot fail is no guard: the count must be of the instrumentation's real work.
    assert figures["calls_per_step"] >= RECORDED_CALLS_PER_STEP / 2, figures
