"""Where telemetry goes: OTLP when an endpoint is configured, the local files otherwise."""

from __future__ import annotations

import json

import pytest

from tests.conftest import launch
from tests.otlp_receiver import OtlpReceiver
from tests.test_step_spans import check_step_tree

pytestmark = pytest.mark.slow  # real DeepSpeed jobs


def test_otlp_endpoint_gets_everything_and_no_files_are_written(workdir):
    with OtlpReceiver() as receiver:
        run = launch(workdir, "torchrun", "--steps", "3", "--grad-accum", "2", "--micro-batch-size", "4", env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        }).check()
    run.spans = receiver.spans()
    check_step_tree(run, steps=3, grad_accum=2, world_size=2, zero_stage=1)
    assert not (workdir / "telemetry").exists()
    assert "OTLP JSON lines" not in run.output


def test_embedded_default_is_announced_once_on_rank_0(workdir):
    run = launch(workdir, "deepspeed", "--steps", "2").check()
    assert run.output.count("opentelemetry-instrumentation-deepspeed: writing traces and metrics") == 1
    (job_dir,) = (workdir / "telemetry").iterdir()
    assert sorted(path.name for path in job_dir.iterdir()) == [
        "metrics-rank0.jsonl", "metrics-rank1.jsonl", "traces-rank0.jsonl", "traces-rank1.jsonl"]
    assert job_dir.name == run.spans[0].resource["training.job.id"]
    for path in job_dir.iterdir():
        for line in path.read_text().splitlines():
            top = "resourceSpans" if path.name.startswith("traces") else "resourceMetrics"
            assert set(json.loads(line)) == {top}, "the official OTLP JSON file format"


def test_output_dir_variable(workdir):
    target = workdir / "elsewhere"
    run = launch(workdir, "python", "--steps", "2", env={"OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR": str(target)}).check()
    assert not (workdir / "telemetry").exists()
    assert list(target.glob("*/traces-rank0.jsonl")), run.output


def test_instrumented_losses_equal_uninstrumented_bit_for_bit(workdir):
    args = ("--steps", "6", "--zero-stage", "2", "--grad-accum", "2")
    bare = launch(workdir, "torchrun", *args, "--loss-file", str(workdir / "bare.json"), instrument=False).check()
    traced = launch(workdir, "torchrun", *args, "--loss-file", str(workdir / "traced.json")).check()
    assert not bare.spans and traced.spans
    bare_losses = json.loads((workdir / "bare.json").read_text())
    traced_losses = json.loads((workdir / "traced.json").read_text())
    assert len(bare_losses) == 6
    # JSON floats round-trip exactly: equal text means equal bits.
    assert traced_losses == bare_losses
