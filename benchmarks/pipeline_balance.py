"""False alarms and accuracy of the PIPELINE finding on real 2-stage DeepSpeed pipelines.

Runs ``tests/scripts/train_pipeline.py`` (a ``PipelineModule`` of identical layers, 2 stages, the
``deepspeed`` launcher under ``opentelemetry-instrument``) at several widths, micro-batch counts and
step counts: first balanced (no stage should be named), then with one stage made ``factor`` times
slower. The slowdown is a sleep in that stage's first layer, sized from the stage's own work in the
balanced run of the same shape: ``(factor - 1) x work / micro-batches`` per forward. Prints one JSON
line per run (the stages' compute, work and step, the time an even split would save as a share of
the step, the findings) and keeps each run's telemetry under ``--keep`` for ``--rescore``.

    python benchmarks/pipeline_balance.py --keep /tmp/pipe-runs
    python benchmarks/pipeline_balance.py --rescore /tmp/pipe-runs      # diagnose kept runs again
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "train_pipeline.py"
BIN = Path(sys.executable).parent

# name: (width, micro-batch size, micro-batches, steps)
SHAPES = {"A": (64, 4, 4, 6), "B": (256, 8, 4, 5), "C": (512, 16, 4, 5), "D": (512, 16, 8, 4), "E": (1024, 16, 4, 5)}
# (shape, slowed stage, factor): each stage, factors 1.3-3
INJECTED = [("A", 1, 1.3), ("A", 0, 3.0), ("B", 0, 2.0), ("B", 1, 1.6), ("C", 1, 1.3), ("C", 0, 1.6),
            ("D", 0, 2.5), ("D", 1, 2.0), ("E", 1, 3.0), ("E", 0, 1.3), ("C", 0, 3.0), ("E", 0, 2.0)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def environment() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("OTEL_", "TORCHELASTIC_")) and key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    return env


def diagnose(workdir: Path) -> dict:
    out = subprocess.run([str(BIN / "opentelemetry-deepspeed"), "diagnose", "--json"], cwd=workdir,
                         capture_output=True, text=True, check=True, timeout=120).stdout
    return json.loads(out)


def score(workdir: Path, meta: dict) -> dict:
    pipeline = diagnose(workdir)["pipeline"]
    stages = pipeline["stages"]
    work = {stage: summary["work_seconds"] for stage, summary in stages.items()}
    step = sorted(summary["step_seconds"] for summary in stages.values())[len(stages) // 2]
    micro_batches = SHAPES[meta["shape"]][2]
    lost = (max(work.values()) - sum(work.values()) / len(work)) * (micro_batches + len(work) - 1) / micro_batches
    named = [finding["stage"] for finding in pipeline["findings"]]
    return {**meta, "compute_ms": {s: round(v["compute_seconds"] * 1e3, 2) for s, v in stages.items()},
            "work_ms": {s: round(v * 1e3, 2) for s, v in work.items()}, "step_ms": round(step * 1e3, 1),
            "lost_share": round(lost / step, 3), "named": named}


def run(keep: Path, shape: str, tag: str, extra: tuple[str, ...] = (), **meta) -> dict:
    width, size, micro_batches, steps = SHAPES[shape]
    workdir = keep / f"{shape}-{tag}"
    workdir.mkdir(parents=True, exist_ok=True)
    command = [str(BIN / "opentelemetry-instrument"), str(BIN / "deepspeed"), "--num_gpus", "2",
               "--master_port", str(free_port()), str(SCRIPT), "--width", str(width), "--micro-batch-size",
               str(size), "--micro-batches", str(micro_batches), "--steps", str(steps), *extra]
    load, started = os.getloadavg()[0], time.monotonic()
    completed = subprocess.run(command, cwd=workdir, env=environment(), capture_output=True, text=True, timeout=600,
                               check=False)
    meta = {"shape": shape, "tag": tag, "load": round(load, 1), **meta}
    (workdir / "meta.json").write_text(json.dumps(meta))
    if completed.returncode:
        return {**meta, "error": completed.stderr[-800:]}
    return {**score(workdir, meta), "seconds": round(time.monotonic() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keep", type=Path, default=Path("/tmp/pipeline-balance"))
    parser.add_argument("--balanced-repeat", type=int, default=2)
    parser.add_argument("--rescore", type=Path)
    parser.add_argument("--round", default="", help="a suffix for the injected runs' names: another round, same --keep")
    args = parser.parse_args()
    if args.rescore:
        for workdir in sorted(args.rescore.iterdir()):
            if (workdir / "meta.json").exists():
                print(json.dumps(score(workdir, json.loads((workdir / "meta.json").read_text()))), flush=True)
        return
    for repeat in range(args.balanced_repeat):
        for shape in SHAPES:
            print(json.dumps(run(args.keep, shape, f"bal{repeat}", slow_stage=None)), flush=True)
    for shape, stage, factor in INJECTED:
        own = diagnose(args.keep / f"{shape}-bal0")["pipeline"]["stages"][str(stage)]["work_seconds"]
        sleep_ms = (factor - 1) * own * 1e3 / SHAPES[shape][2]
        slow = ("--slow-stage", str(stage), "--slow-ms", f"{sleep_ms:.3f}")
        print(json.dumps(run(args.keep, shape, f"s{stage}x{factor}{args.round}", slow, slow_stage=stage, factor=factor,
                             sleep_ms=round(sleep_ms, 3))), flush=True)


if __name__ == "__main__":
    main()
