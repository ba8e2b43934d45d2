"""Reliability with DataLoader worker processes (issue #9): fork and spawn, persistent or not.

tests/scripts/train_workers.py trains through a DataLoader with 2 workers; each worker writes what
it inherited from its rank (threads, the global providers, the SIGTERM handler), and one sample
takes SLOW_MS to load, as a slow storage read would.
"""

from __future__ import annotations

import itertools
import json
import statistics

import pytest

from tests.scripts.launching import launch_script

pytestmark = pytest.mark.slow  # real DeepSpeed jobs

STEPS, GRAD_ACCUM, MICRO_BATCH, WORKERS, EPOCHS = 8, 2, 4, 2, 2
SLOW_MS = 600
SLOW_BATCH = 5  # rank 0's 6th micro-batch of each epoch: step 3, micro-batch 1, and step 7 in the second epoch
STEPS_PER_EPOCH = STEPS // EPOCHS
SLOW = {(SLOW_BATCH // GRAD_ACCUM + 1 + epoch * STEPS_PER_EPOCH, SLOW_BATCH % GRAD_ACCUM) for epoch in range(EPOCHS)}
# The first step of an epoch waits for its workers to start, each in its own time (spawn: seconds).
EPOCH_STARTS = {(1 + epoch * STEPS_PER_EPOCH, micro) for epoch in range(EPOCHS) for micro in range(GRAD_ACCUM)}

def _run(tmp_path_factory, name: str, launcher: str, *args: str):
    workdir = tmp_path_factory.mktemp(name)
    probes = workdir / "probes"
    probes.mkdir()
    world_size = 2 if launcher == "torchrun" else 1
    slow_sample = SLOW_BATCH * MICRO_BATCH * world_size  # DistributedSampler gives rank 0 every world_size-th
    # One batch prefetched per worker: the slow read overlaps at most two micro-batches of training,
    # so most of it shows as waiting. Collections every 100 ms: a worker that exports does so while
    # it lives (~1 s), not only at exit.
    # The timeout is the deadlock check: a hang at fork fails the run instead of the suite. A deadlock
    # lasts for ever, so the bound only has to stay clear of a slow run: the spawn run (workers that
    # import torch anew) took 72 s with the suite and a 2-process CPU burner beside it on 2 cores
    # (load 6 to 13); 480 s is more than 6 times that.
    run = launch_script(workdir, "train_workers.py", launcher, "--steps", str(STEPS), "--grad-accum", str(GRAD_ACCUM),
                        "--micro-batch-size", str(MICRO_BATCH), "--workers", str(WORKERS), "--epochs", str(EPOCHS),
                        "--slow-sample", str(slow_sample), "--slow-ms", str(SLOW_MS), "--prefetch-factor", "1",
                        "--probe-dir", str(probes),
                        *args, env={"OTEL_METRIC_EXPORT_INTERVAL": "100"}, timeout=480)
    run.world_size = world_size
    run.probes = [json.loads(path.read_text()) for path in sorted(probes.glob("worker-*.json"))]
    return run


@pytest.fixture(scope="module")
def fork_run(tmp_path_factory):
    """2 ranks, workers forked anew for each epoch (the second time mid-job, with the SDK running)."""
    return _run(tmp_path_factory, "fork", "torchrun", "--context", "fork")


@pytest.fixture(scope="module")
def spawn_run(tmp_path_factory):
    """1 process, persistent workers started once by spawn."""
    return _run(tmp_path_factory, "spawn", "python", "--context", "spawn", "--persistent")


@pytest.fixture(params=["fork", "spawn"])
def run(request):
    return request.getfixturevalue(f"{request.param}_run")


def test_training_completes_with_the_workers_started_as_configured(run):
    run.check()
    assert run.trained() == (STEPS, 0)
    persistent = "--persistent" in run.command
    expected = run.world_size * WORKERS * (1 if persistent else EPOCHS)
    assert len(run.probes) == expected, run.probes
    assert {probe["parent"] for probe in run.probes} == {span.resource["process.pid"] for span in run.spans}


def test_only_the_ranks_write_telemetry_files(run):
    run.check()
    (job,) = (run.cwd / "telemetry").iterdir()
    expected = {f"{signal}-rank{rank}.jsonl" for signal in ("traces", "metrics") for rank in range(run.world_size)}
    assert {path.name for path in job.iterdir()} == expected
    assert not list(run.cwd.glob("*.jsonl")) and not list(run.cwd.glob("otel-*"))


def test_one_data_wait_per_micro_batch_and_the_slow_sample_shows_on_its_step(run):
    run.check()
    for rank, spans in run.by_rank().items():
        step_of = {s.span_id: s.attributes["training.step"] for s in spans if s.name == "training.step"}
        assert sorted(step_of.values()) == list(range(1, STEPS + 1))
        waits = {}
        for span in spans:
            if span.name == "training.data.wait":
                key = (step_of[span.parent_id], span.attributes["training.micro_step"])
                assert key not in waits, f"rank {rank}: two waits for {key}"
                waits[key] = (span.end - span.start) / 1e6
        assert set(waits) == {(step, micro) for step in range(1, STEPS + 1) for micro in range(GRAD_ACCUM)}
        steady = {key: ms for key, ms in waits.items() if key not in EPOCH_STARTS}
        others = [ms for key, ms in steady.items() if key not in SLOW]
        if rank == 0:
            slow = {key: ms for key, ms in steady.items() if key in SLOW}
            assert all(ms > SLOW_MS * 0.6 for ms in slow.values()), slow
            assert min(slow.values()) > max(others), (slow, sorted(others)[-3:])
        assert statistics.median(others) < SLOW_MS * 0.1, (rank, sorted(others))
        if rank != 0:
            assert max(others + [waits[key] for key in SLOW]) < SLOW_MS * 0.5, "rank 0's slow worker is not ours"


def _check_workers_hold_no_telemetry(run):
    run.check()
    assert run.probes
    for probe in run.probes:
        assert [name for name in probe["threads"] if name.startswith("Otel")] == [], probe
        assert not probe["tracer_provider"].startswith("opentelemetry.sdk."), probe
        assert not probe["meter_provider"].startswith("opentelemetry.sdk."), probe
        assert not str(probe["sigterm"]).startswith("opentelemetry_instrumentation_deepspeed"), probe


def _check_cumulative_metrics_never_go_back(run):
    run.check()
    for path in sorted(run.cwd.glob("telemetry/*/metrics-rank*.jsonl")):
        series = []
        for line in path.read_text().splitlines():
            for resource in json.loads(line)["resourceMetrics"]:
                for scope in resource["scopeMetrics"]:
                    for metric in scope["metrics"]:
                        if metric["name"] == "training.samples":
                            series += [int(point["asInt"]) for point in metric["sum"]["dataPoints"]]
        assert len(series) > 3, path
        backwards = [(a, b) for a, b in itertools.pairwise(series) if b < a]
        assert backwards == [], f"{path.name}: cumulative training.samples went back {len(backwards)} times: {series}"


def test_spawned_workers_hold_no_telemetry(spawn_run):
    _check_workers_hold_no_telemetry(spawn_run)


def test_forked_workers_hold_no_telemetry(fork_run):
    _check_workers_hold_no_telemetry(fork_run)


def test_spawned_workers_export_nothing(spawn_run):
    _check_cumulative_metrics_never_go_back(spawn_run)


def test_forked_workers_export_nothing(fork_run):
    _check_cumulative_metrics_never_go_back(fork_run)



def test_workers_forked_inside_a_profiled_step_record_nothing(tmp_path):
    """A loop that restarts its iterator where an epoch runs out, inside a step (3 micro-batches an epoch, 2 a step):
    the new epoch's workers are forked from the training thread while a profile runs. They inherited the session
    and recorded every operator they ran for as long as they lived."""
    probes = tmp_path / "probes"
    probes.mkdir()
    run = launch_script(tmp_path, "train_workers.py", "python", "--steps", "4", "--grad-accum", "2",
                        "--epoch-micro-batches", "3", "--workers", "2", "--probe-dir", str(probes),
                        env={"OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY": "1",
                             "OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR": "0"}, timeout=480).check()
    records = [json.loads(path.read_text()) for path in probes.glob("worker-*.json")]
    assert len(records) == 2 * 3, records  # epochs start at micro-batches 0, 3 (step 2's second) and 6 (step 4's)
    assert [record["profiling"] for record in records] == [False] * 6
    steps = {span.attributes["training.step"]: span for span in run.spans if span.name == "training.step"}
    profiled = {span.trace_id for span in run.spans if "profile.kind" in span.attributes}
    assert steps[2].trace_id in profiled, "the step keeps the operators profiled before the fork"
