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


def _terminated_mid_run(workdir, **env) -> tuple[int, str]:
    """A long 1-process run, sent SIGTERM once its first spans are on disk: (return code, output).

    Each forward sleeps 100 ms (the example's straggler option), so the signal lands inside a step,
    not in the fraction of a millisecond between two, whatever the machine's load."""
    process = subprocess.Popen([str(BIN / "opentelemetry-instrument"), str(BIN / "python"), str(TRAIN),
                                "--steps", "100000", "--slow-rank", "0", "--slow-ms", "100"],
                               cwd=workdir, env=clean_env(MASTER_PORT=str(free_port()), **env),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # Training is under way once the first spans are written (after the batch delay, 5 s).
        deadline = time.monotonic() + 240
        while not list(workdir.glob("telemetry/*/traces-rank0.jsonl")):
            assert process.poll() is None, process.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no spans written"
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    return process.returncode, output


def test_sigterm_flushes_completed_steps_and_marks_the_interrupted_one(workdir):
    returncode, output = _terminated_mid_run(workdir)
    # It died as an unhandled SIGTERM kills a process: the launcher sees the same thing.
    assert returncode == -signal.SIGTERM, output[-3000:]
    _whole_lines(workdir)
    (traces,) = workdir.glob("telemetry/*/traces-rank0.jsonl")
    steps = _steps(read_spans(traces))
    last = max(steps)
    # Every step before the interrupted one arrived, complete; the interrupted one says why it ended.
    assert sorted(steps) == list(range(1, last + 1))
    assert last > 5, "the steps since the last periodic export were flushed at the signal"
    assert all(span.status != 2 for number in range(1, last) for span in steps[number])
    (interrupted,) = steps[last]
    assert (interrupted.status, interrupted.status_message) == (2, "terminated by SIGTERM")
    assert list(workdir.glob("telemetry/*/metrics-rank0.jsonl")), "the metrics were flushed too"


def test_sigterm_is_left_alone_when_asked(workdir):
    returncode, output = _terminated_mid_run(workdir, OTEL_PYTHON_DEEPSPEED_SIGTERM_FLUSH="false")
    assert returncode == -signal.SIGTERM, output[-3000:]
    (traces,) = workdir.glob("telemetry/*/traces-rank0.jsonl")
    assert not any(span.status_message == "terminated by SIGTERM" for span in read_spans(traces))


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
