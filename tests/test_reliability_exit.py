"""A rank that is told to stop, or dies of an exception: the telemetry of what it did survives it."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from tests.conftest import BIN, TRAIN, clean_env, free_port, launch
from tests.otlp_json import read_spans

pytestmark = pytest.mark.slow  # real DeepSpeed jobs


def _whole_lines(directory, files: str = "*.jsonl") -> None:
    for path in directory.glob(f"telemetry/*/{files}"):
        text = path.read_text()
        assert text.endswith("\n"), f"{path.name} ends inside a line"
        for line in text.splitlines():
            json.loads(line)


def _steps(spans) -> dict[int, list]:
    steps: dict[int, list] = {}
    for span in spans:
        if span.name == "training.step":
            steps.setdefault(span.attributes["training.step"], []).append(span)
    return steps


BLOCKED_STEP = 8


def _terminated_mid_run(workdir, *, after_export: bool = False, **env) -> tuple[int, str]:
    """A 1-process run sent SIGTERM inside step 8: (return code, output).

    The forward of step 8 blocks until a signal arrives (the example's ``--block-in-step``) after
    saying so: the signal lands inside that step, whatever the machine's load. ``after_export``:
    once the batch processor has written the earlier steps' spans (it runs while the step blocks)."""
    process = subprocess.Popen([str(BIN / "opentelemetry-instrument"), str(BIN / "python"), str(TRAIN),
                                "--steps", "100", "--block-in-step", str(BLOCKED_STEP)],
                               cwd=workdir, env=clean_env(MASTER_PORT=str(free_port()), **env),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        for line in process.stdout:
            lines.append(line)
            if line.startswith(f"blocked in step {BLOCKED_STEP}"):
                deadline = time.monotonic() + 60
                while after_export and not list(workdir.glob("telemetry/*/traces-rank0.jsonl")):
                    assert time.monotonic() < deadline, "no spans exported while the step blocked"
                    time.sleep(0.1)
                sent = time.monotonic()
                process.send_signal(signal.SIGTERM)
                break
        else:
            pytest.fail("the run ended before blocking: " + "".join(lines)[-3000:])
        output, _ = process.communicate(timeout=120)
        # Dead within the exit budget (5 s) of the signal, with room for a loaded machine.
        assert time.monotonic() - sent < 30, "".join(lines) + output
    finally:
        process.kill()
    return process.returncode, "".join(lines) + output


def test_sigterm_flushes_completed_steps_and_marks_the_interrupted_one(workdir):
    returncode, output = _terminated_mid_run(workdir)
    # It died as an unhandled SIGTERM kills a process: the launcher sees the same thing.
    assert returncode == -signal.SIGTERM, output[-3000:]
    _whole_lines(workdir)
    (traces,) = workdir.glob("telemetry/*/traces-rank0.jsonl")
    steps = _steps(read_spans(traces))
    # Every step before the interrupted one arrived, complete (most were still queued at the signal);
    # the interrupted one says why it ended.
    assert sorted(steps) == list(range(1, BLOCKED_STEP + 1))
    assert all(span.status != 2 for number in range(1, BLOCKED_STEP) for span in steps[number])
    (interrupted,) = steps[BLOCKED_STEP]
    assert (interrupted.status, interrupted.status_message) == (2, "terminated by SIGTERM")
    assert list(workdir.glob("telemetry/*/metrics-rank0.jsonl")), "the metrics were flushed too"


def test_sigterm_is_left_alone_when_asked(workdir):
    returncode, output = _terminated_mid_run(workdir, after_export=True, OTEL_PYTHON_DEEPSPEED_SIGTERM_FLUSH="false")
    assert returncode == -signal.SIGTERM, output[-3000:]
    (traces,) = workdir.glob("telemetry/*/traces-rank0.jsonl")
    spans = read_spans(traces)
    assert spans and not any(span.status_message == "terminated by SIGTERM" for span in spans)
    assert BLOCKED_STEP not in _steps(spans), "nothing ran at the signal: the step in progress was never written"


def test_a_rank_that_dies_of_an_exception_leaves_the_error_on_its_step(workdir):
    run = launch(workdir, "torchrun", "--steps", "20", "--crash-after", "6", timeout=400)
    assert run.returncode != 0
    # Rank 1, blocked in a collective with its dead peer, is stopped by torchrun (in the end SIGKILL).
    _whole_lines(workdir, "*-rank0.jsonl")
    (traces,) = workdir.glob("telemetry/*/traces-rank0.jsonl")
    spans = read_spans(traces)
    steps = _steps(spans)
    assert sorted(steps) == list(range(1, 8)), "six completed steps and the failing seventh"
    (failed,) = steps[7]
    assert (failed.status, failed.status_message) == (2, "RuntimeError: injected crash in forward")
    forward = [span for span in spans if span.name == "training.forward" and span.parent_id == failed.span_id]
    assert len(forward) == 1
    (event,) = [event for event in forward[0].events if event["name"] == "exception"]
    attributes = event["attributes"]
    assert attributes["exception.type"] == "RuntimeError"
    assert "injected crash in forward" in attributes["exception.stacktrace"]


def test_files_rotate_at_the_size_limit(workdir):
    # 1 MB per file: rotation at 0.5 MB, after about 130 steps of spans (3.9 KB each).
    run = launch(workdir, "python", "--steps", "200", env={"OTEL_PYTHON_DEEPSPEED_OUTPUT_MAX_MB": "1",
                                                           "OTEL_BSP_SCHEDULE_DELAY": "100"}).check()
    (job,) = (workdir / "telemetry").iterdir()
    current, previous = job / "traces-rank0.jsonl", job / "traces-rank0.previous.jsonl"
    assert previous.exists()
    assert current.stat().st_size + previous.stat().st_size <= 1_000_000
    _whole_lines(workdir)
    # The newest steps are kept: the last step is in the current file.
    assert max(_steps(read_spans(current))) == 200, run.output[-2000:]
