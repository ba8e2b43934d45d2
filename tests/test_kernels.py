"""Operator spans of sampled steps, on real DeepSpeed runs (CPU: operators; kernels in scripts/gpu-check.sh)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import defaultdict

import pytest
import torch

from opentelemetry_instrumentation_deepspeed.recording import profiler
from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env
from tests.conftest import BIN, TRAIN, clean_env, free_port, launch
from tests.otlp_json import read_spans
from tests.test_steps_unit import recorder_on

MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"}


def operators(spans):
    return [span for span in spans if "profile.kind" in span.attributes]


def phase_of(span, by_id) -> str:
    """The phase an operator ran in, through its calling operators and collectives."""
    while "profile.kind" in span.attributes or span.name.startswith("comm."):
        span = by_id[span.parent_id]
    return span.name


def self_times(ops, by_parent):
    return {op.span_id: (op.end - op.start) - sum(c.end - c.start for c in by_parent[op.span_id]) for op in ops}


@pytest.mark.slow
def test_every_nth_step_is_profiled_and_its_operators_sit_in_their_phase(workdir):
    run = launch(workdir, "torchrun", "--steps", "7", "--zero-stage", "2",
                 # Enough operators that every phase has some among them, whatever the machine's load does
                 # to their self times (with 40, the optimizer step's were sometimes all left out).
                 env={"OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY": "3", "OTEL_PYTHON_DEEPSPEED_PROFILE_TOP": "400",
                      "OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR": "0"}).check()
    for rank, spans in run.by_rank().items():
        by_id = {span.span_id: span for span in spans}
        by_parent = defaultdict(list)
        for span in spans:
            by_parent[span.parent_id].append(span)
        steps = {s.attributes["training.step"]: s for s in spans if s.name == "training.step"}
        ops_by_trace = defaultdict(list)
        for op in operators(spans):
            ops_by_trace[op.trace_id].append(op)
        profiled = sorted(n for n, step in steps.items() if ops_by_trace[step.trace_id])
        assert profiled == [3, 6], f"rank {rank}: only sampled steps carry operator spans"
        for number in profiled:
            step, ops = steps[number], ops_by_trace[steps[number].trace_id]
            assert len(ops) == step.attributes["profile.ops.emitted"] <= 400 < step.attributes["profile.ops"]
            for op in ops:
                parent = by_id[op.parent_id]
                assert parent.name.startswith(("training.", "comm.")) or "profile.kind" in parent.attributes
                assert parent.start <= op.start <= op.end <= parent.end, f"{op.name} outside {parent.name}"
                assert op.attributes["profile.kind"] == "cpu_op" and op.attributes["profile.device"] == "cpu"
            # The model's own work: what the forward phase spends its operator time on.
            times, by_name = self_times(ops, by_parent), defaultdict(int)
            for op in ops:
                if phase_of(op, by_id) == "training.forward":
                    by_name[op.name] += times[op.span_id]
            top = sorted(by_name, key=by_name.get, reverse=True)[:3]
            assert MATMULS & set(top), top
            assert any("profile.shapes" in op.attributes and "profile.flops" in op.attributes
                       for op in ops if op.name in MATMULS)
            phases = {phase_of(op, by_id) for op in ops}
            assert {"training.forward", "training.backward", "training.optimizer.step"} <= phases, phases
        assert not any(s.attributes.get("profile.kind") for s in spans if s.trace_id not in
                       {steps[n].trace_id for n in profiled})


@pytest.mark.slow
def test_the_trigger_file_profiles_one_coming_step_of_a_running_job_the_same_on_every_rank(workdir):
    trigger = workdir / "profile-now"
    env_vars = clean_env(OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY="0", OTEL_PYTHON_DEEPSPEED_PROFILE_TRIGGER=str(trigger),
                         OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR="0", OTEL_BSP_SCHEDULE_DELAY="100")
    command = [str(BIN / "opentelemetry-instrument"), str(BIN / "torchrun"), "--nproc_per_node", "2",
               "--master_port", str(free_port()), str(TRAIN), "--steps", "1500", "--micro-batch-size", "2"]
    job = subprocess.Popen(command, cwd=workdir, env=env_vars, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        seen = 0
        deadline = time.monotonic() + 120
        while seen < 20 and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.05)
            for path in workdir.glob("telemetry/*/traces-rank0.jsonl"):
                for line in path.read_text().splitlines()[-3:]:
                    if line.endswith("}"):
                        seen = max([seen] + [s.attributes["training.step"] for s in _spans_of(line)
                                             if s.name == "training.step"])
        assert seen >= 20 and job.poll() is None, "the job should be running and traced"
        trigger.touch()
        asked_at = seen
    finally:
        _, stderr = job.communicate(timeout=300)
    assert job.returncode == 0, stderr.decode()[-3000:]
    profiled = {}
    for path in workdir.glob("telemetry/*/traces-rank*.jsonl"):
        spans = read_spans(path)
        traces = {s.trace_id for s in operators(spans)}
        profiled[path.name] = sorted(s.attributes["training.step"] for s in spans
                                     if s.name == "training.step" and s.trace_id in traces)
    assert sorted(profiled) == ["traces-rank0.jsonl", "traces-rank1.jsonl"]
    (first,), (second,) = profiled.values()
    assert first > asked_at and second > asked_at
    assert first % profiler.TRIGGER_EVERY == 0 and second % profiler.TRIGGER_EVERY == 0, "steps where ranks look"
    assert abs(first - second) in (0, profiler.TRIGGER_EVERY), "the same step, unless the touch fell between ranks"


def _spans_of(line: str):
    from tests.otlp_json import spans_from_request

    return spans_from_request(json.loads(line))


@pytest.fixture
def profiling(monkeypatch):
    monkeypatch.setenv("OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY", "2")
    monkeypatch.setenv("OTEL_PYTHON_DEEPSPEED_PROFILE_TRIGGER", "")
    monkeypatch.setenv("OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR", "0")
    env.reset_cache()
    yield
    env.reset_cache()


def profiler_running() -> bool:
    return torch.autograd.profiler._is_profiler_enabled


def test_only_sampled_steps_run_the_profiler_and_a_failing_one_leaves_none(profiling):
    recorder, engine, exporter = recorder_on(1)
    span = recorder.forward_started(engine)  # step 1: not sampled
    assert not profiler_running()
    recorder.phase_ended(span)
    recorder.phase_ended(recorder.backward_started(engine))
    engine.step(recorder)
    span = recorder.forward_started(engine)  # step 2: sampled
    assert profiler_running()
    recorder.phase_failed(span, RuntimeError("boom"))
    assert not profiler_running(), "the profiler stops with the step that raised"
    assert not operators_in(exporter), "a failed step's operators are not emitted"


def test_a_slow_step_gets_the_next_one_profiled(monkeypatch):
    monkeypatch.setenv("OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY", "0")
    monkeypatch.setenv("OTEL_PYTHON_DEEPSPEED_PROFILE_TRIGGER", "")
    env.reset_cache()
    try:
        recorder, engine, exporter = recorder_on(1)
        for _ in range(8):
            # Steps of 20 ms: a scheduling hiccup of a loaded machine is not a slow step.
            span = recorder.forward_started(engine)
            time.sleep(0.02)
            recorder.phase_ended(span)
            recorder.phase_ended(recorder.backward_started(engine))
            engine.step(recorder)
        assert not operators_in(exporter)
        span = recorder.forward_started(engine)
        time.sleep(0.3)  # a stall, far beyond 3 x the recent median
        recorder.phase_ended(span)
        recorder.phase_ended(recorder.backward_started(engine))
        engine.step(recorder)
        assert not operators_in(exporter), "the slow step itself has already run"
        span = recorder.forward_started(engine)
        assert profiler_running(), "the next one is profiled"
        torch.ones(8, 8) @ torch.ones(8, 8)
        recorder.phase_ended(span)
        recorder.phase_ended(recorder.backward_started(engine))
        engine.step(recorder)
        assert "aten::mm" in {span.name for span in operators_in(exporter)}
        assert not profiler_running()
        assert recorder.profiler._emitted > 0, "what its spans cost the emitter counts in the profiler's budget"
    finally:
        env.reset_cache()


def operators_in(exporter):
    return [span for span in exporter.get_finished_spans() if "profile.kind" in span.attributes]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
