"""CI's guard on the overhead: the instrumentation's work per step, counted (not timed).

benchmarks/recorded.json holds the recorded figures and the command that produced them; a change
that doubles them fails here, whatever the machine's speed. The timed figures come from
benchmarks/overhead.py, never from a test.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, clean_env, free_port

RECORDED = json.loads((REPO / "benchmarks" / "recorded.json").read_text())


def test_recorded_figures_name_the_command_that_measures_them():
    program, script, *args = RECORDED["command"].split()
    assert (program, script) == ("python", "benchmarks/sensitivity.py") and (REPO / script).is_file()
    assert args == ["--zero-stage", "2"]
    for key in ("calls_per_step", "recording_calls_per_step", "recording_opcodes_per_step", "spans_per_step",
                "records_per_step"):
        assert RECORDED[key] > 0, key


@pytest.mark.slow
def test_work_per_step_stays_within_twice_the_recorded_figures():
    _, script, *args = RECORDED["command"].split()
    completed = subprocess.run([sys.executable, str(REPO / script), *args],
                               env=clean_env(MASTER_PORT=str(free_port())), capture_output=True, text=True,
                               timeout=600, check=False)
    assert completed.returncode == 0, completed.stderr[-3000:]
    figures = json.loads(completed.stdout.strip().splitlines()[-1])
    assert figures["spans_per_step"] == RECORDED["spans_per_step"], figures
    assert figures["records_per_step"] <= 2 * RECORDED["records_per_step"], figures
    assert figures["calls_per_step"] <= 2 * RECORDED["calls_per_step"], figures
    assert figures["recording_calls_per_step"] <= 2 * RECORDED["recording_calls_per_step"], figures
    assert figures["recording_opcodes_per_step"] <= 2 * RECORDED["recording_opcodes_per_step"], figures
    # A guard that cannot fail is no guard: the count must be of the instrumentation's real work.
    assert figures["calls_per_step"] >= RECORDED["calls_per_step"] / 2, figures
    assert figures["recording_opcodes_per_step"] >= RECORDED["recording_opcodes_per_step"] / 2, figures
