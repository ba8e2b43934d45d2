"""Accuracy of `opentelemetry-deepspeed diagnose` on faults it was not tuned on.

Each fault class is an entry of CLASSES: how to draw a run with random parameters (which rank,
how long, how often, which phase, how many steps, ZeRO stage) and what a right diagnosis says
(layer, rank, period or phase). Every repetition runs examples/train.py for real under
`opentelemetry-instrument` (torchrun, 2 ranks, or 1 process), then `diagnose` on its telemetry,
and scores the top finding. Prints one line per run and a table per class: right layer, right
rank, right period/step (or phase), all three, and the seconds `diagnose` took.

    python benchmarks/accuracy.py --repeat 6 --healthy 20            # every class
    python benchmarks/accuracy.py --classes loader-stall-rank --repeat 3 --seed 7
    python benchmarks/accuracy.py --keep runs/ ...; python benchmarks/accuracy.py --rescore runs/
                                                       # diagnose kept runs again (after a change)

A new class (a hang, an input shift, a desync) is one more entry: a ``draw(rng)`` returning the
example's arguments, the launcher and the expected diagnosis, and optionally its own ``judge``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "examples" / "train.py"
BIN = Path(sys.executable).parent


@dataclass
class Expected:
    layer: str  # "none" for a healthy run
    rank: int | None = None  # None: the finding must name no single rank (job-wide)
    period: int | None = None
    offset: int | None = None
    phase: str | None = None  # the part of the late rank's step that made it late


@dataclass
class Draw:
    args: list[str]
    expected: Expected
    ranks: int = 2


def _zero(rng):
    return ["--zero-stage", str(rng.choice((1, 2)))]


def draw_healthy(rng: random.Random) -> Draw:
    ranks = rng.choice((1, 2))
    args = ["--steps", str(rng.randint(12, 30)), "--grad-accum", str(rng.choice((1, 2))),
            "--zero-stage", str(rng.choice((0, 1, 2, 3))), "--micro-batch-size", str(rng.choice((8, 32, 64)))]
    return Draw(args, Expected("none"), ranks)


def draw_loader_stall_rank(rng: random.Random) -> Draw:
    rank, every, stall = rng.randint(0, 1), rng.randint(3, 6), rng.randint(80, 300)
    steps = every * rng.randint(4, 5) + rng.randint(0, every - 1)  # four or five stalls
    return Draw(["--steps", str(steps), "--stall-every", str(every), "--stall-ms", str(stall), "--stall-rank",
                 str(rank), *_zero(rng)], Expected("data loading", rank, every, 0, "data_wait"))


def draw_loader_stall_all(rng: random.Random) -> Draw:
    every, stall = rng.randint(3, 6), rng.randint(80, 300)
    steps = every * rng.randint(4, 5) + rng.randint(0, every - 1)
    return Draw(["--steps", str(steps), "--stall-every", str(every), "--stall-ms", str(stall), *_zero(rng)],
                Expected("data loading", None, every, 0, "data_wait"))


def draw_slow_rank(rng: random.Random) -> Draw:
    rank, slow, phase = rng.randint(0, 1), rng.randint(20, 60), rng.choice(("forward", "backward", "optimizer"))
    return Draw(["--steps", str(rng.randint(12, 20)), "--slow-rank", str(rank), "--slow-ms", str(slow),
                 "--slow-phase", phase, *_zero(rng)], Expected("straggler", rank, phase=phase))


def draw_comm_heavy(rng: random.Random) -> Draw:
    # ZeRO 0-1: under ZeRO-2 the ballast's gradient bucketing in the backward costs as much as its
    # collectives (measured: backward 43-47%, exposed communication 26-32%), so the class is not clear-cut.
    return Draw(["--steps", str(rng.randint(8, 12)), "--comm-heavy", "--zero-stage", str(rng.choice((0, 1)))],
                Expected("communication"))


def judge(report: dict, expected: Expected) -> dict[str, bool]:
    verdict = report["verdict"]
    layer = verdict["layer"] == expected.layer
    if expected.layer == "none":
        return {"layer": layer, "rank": layer, "pattern": layer}
    rank = verdict.get("rank") == expected.rank
    if expected.period is not None:
        pattern = verdict.get("period") == expected.period and verdict.get("offset") == expected.offset
    elif expected.phase is not None:
        pattern = verdict.get("phase") == expected.phase
    else:
        pattern = True
    return {"layer": layer, "rank": rank, "pattern": pattern}


@dataclass
class FaultClass:
    name: str
    draw: object
    judge: object = judge
    notes: str = ""


CLASSES = [
    FaultClass("healthy", draw_healthy, notes="1-2 ranks, 12-30 steps, grad accum 1-2, ZeRO 0-3, micro-batch 8/32/64"),
    FaultClass("loader-stall-rank", draw_loader_stall_rank,
               notes="one rank's loader stalls 80-300 ms every 3rd-6th step, 4-5 times"),
    FaultClass("loader-stall-all", draw_loader_stall_all,
               notes="every rank's loader stalls 80-300 ms every 3rd-6th step"),
    FaultClass("slow-rank", draw_slow_rank, notes="one rank 20-60 ms slower in forward, backward or optimizer step"),
    FaultClass("comm-heavy", draw_comm_heavy, notes="8M parameters of no compute: the all-reduce dominates"),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def diagnose(workdir: Path) -> tuple[dict, float, str]:
    started = time.perf_counter()
    diagnosed = subprocess.run([str(BIN / "opentelemetry-deepspeed"), "diagnose", "--json"], cwd=workdir,
                               capture_output=True, text=True, timeout=600, check=False)
    return json.loads(diagnosed.stdout), time.perf_counter() - started, diagnosed.stderr[-500:]


def run_once(draw: Draw, workdir: Path) -> tuple[dict | None, float, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OTEL_", "TORCHELASTIC_"))
           and key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    port = str(free_port())
    if draw.ranks == 1:
        env["MASTER_PORT"] = port
        command = [str(BIN / "opentelemetry-instrument"), sys.executable, str(TRAIN), *draw.args]
    else:
        command = [str(BIN / "opentelemetry-instrument"), str(BIN / "torchrun"), "--nproc_per_node", "2",
                   "--master_port", port, str(TRAIN), *draw.args]
    completed = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=600,
                               check=False)
    if completed.returncode:
        return None, 0.0, completed.stderr[-1500:]
    return diagnose(workdir)


def record(fault: FaultClass, draw: Draw, report: dict | None, seconds: float, args) -> tuple[dict, float]:
    if report is None:
        score = {"layer": False, "rank": False, "pattern": False}
        verdict = {"layer": "run failed", "summary": ""}
    else:
        score = fault.judge(report, draw.expected)
        verdict = report["verdict"]
    line = {"class": fault.name, "args": draw.args, "ranks": draw.ranks, "expected": draw.expected.__dict__,
            "verdict": {k: verdict.get(k) for k in ("layer", "rank", "period", "offset", "phase", "share_of_run",
                                                    "confidence")},
            "score": score, "diagnose_seconds": round(seconds, 2)}
    print(json.dumps(line), flush=True)
    if args.results:
        with open(args.results, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(line) + "\n")
    return score, seconds


def print_table(table: dict) -> None:
    print("\n| class | runs | right layer | right rank | right period / phase | all right | diagnose s (max) |")
    print("|---|---|---|---|---|---|---|")
    for name, rows in table.items():
        count = len(rows)
        right = {key: sum(score[key] for score, _s in rows) for key in ("layer", "rank", "pattern")}
        every = sum(all(score.values()) for score, _s in rows)
        print(f"| {name} | {count} | {right['layer']}/{count} | {right['rank']}/{count} | {right['pattern']}/{count} "
              f"| {every}/{count} | {max((s for _x, s in rows), default=0):.1f} |")


def rescore(directories: list[Path], args) -> None:
    table = {}
    classes = {fault.name: fault for fault in CLASSES}
    kept_runs = sorted((kept for directory in directories for kept in directory.iterdir()),
                       key=lambda p: (p.name.rsplit("-", 1)[0], int(p.name.rsplit("-", 1)[1])))
    for kept in kept_runs:
        saved = json.loads((kept / "draw.json").read_text())
        fault = classes[saved["class"]]
        draw = Draw(saved["args"], Expected(**saved["expected"]), saved["ranks"])
        report, seconds, _problem = diagnose(kept)
        table.setdefault(fault.name, []).append(record(fault, draw, report, seconds, args))
    print_table(table)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", nargs="*", default=[c.name for c in CLASSES], choices=[c.name for c in CLASSES])
    parser.add_argument("--repeat", type=int, default=5, help="repetitions of each fault class")
    parser.add_argument("--healthy", type=int, default=20, help="repetitions of the healthy class")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--keep", help="keep each run's telemetry under this directory")
    parser.add_argument("--results", help="append one JSON line per run to this file")
    parser.add_argument("--rescore", metavar="DIR", nargs="+", help="diagnose the runs kept under DIR again")
    args = parser.parse_args()
    if args.rescore:
        rescore([Path(directory) for directory in args.rescore], args)
        return
    rng = random.Random(args.seed)
    chosen = [c for c in CLASSES if c.name in args.classes]
    table = {fault.name: [] for fault in chosen}
    # Round robin over the classes, so that a load on the machine falls on all of them alike.
    counts = {fault.name: args.healthy if fault.name == "healthy" else args.repeat for fault in chosen}
    schedule = [(fault, repetition) for repetition in range(max(counts.values(), default=0))
                for fault in chosen if repetition < counts[fault.name]]
    for fault, repetition in schedule:
        draw = fault.draw(rng)
        workdir = Path(tempfile.mkdtemp(prefix=f"accuracy-{fault.name}-"))
        report, seconds, problem = run_once(draw, workdir)
        if report is None:
            print(f"{fault.name} #{repetition}: the run failed: {problem}", flush=True)
        table[fault.name].append(record(fault, draw, report, seconds, args))
        if args.keep and (workdir / "telemetry").is_dir():
            kept = Path(args.keep) / f"{fault.name}-{repetition}"
            shutil.copytree(workdir / "telemetry", kept / "telemetry", dirs_exist_ok=True)
            (kept / "draw.json").write_text(json.dumps({"class": fault.name, "args": draw.args, "ranks": draw.ranks,
                                                        "expected": draw.expected.__dict__}))
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(table)


if __name__ == "__main__":
    main()
