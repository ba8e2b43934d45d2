"""Is `diagnose` right about the input layer on runs it was never tuned on?

Runs examples/train.py on 2 ranks (torchrun, ZeRO-2, under opentelemetry-instrument) with randomly
drawn faults, and checks each verdict:

- shift: the sequence length changes at a random step by x2, x4 or /2 (with or without padding, one
  or two micro-batches per step): right when an INPUT finding names that step (whether it is also
  the verdict, which other layers' findings may outrank, is reported apart);
- slowdown: from a random step every rank's forward computes 5x slower with the same tokens: right
  when no INPUT finding is made (and a COMPUTE finding names the step, +-1: reported apart);
- healthy: varied sizes: right when no INPUT or COMPUTE finding is made.

    python benchmarks/input_shift.py --runs 12 --seed 7 --out /tmp/input-shift

Prints one line per run and a table; each run's telemetry and report stay under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def draw(rng: random.Random, kind: str) -> tuple[list[str], dict]:
    steps = rng.choice((18, 20, 24))
    args = ["--steps", str(steps), "--zero-stage", "2", "--grad-accum", str(rng.choice((1, 2)))]
    if rng.random() < 0.5:
        args.append("--padding")
    if kind == "shift":
        start, factor = rng.choice(((64, 2), (64, 4), (32, 4), (128, 0.5), (256, 0.5)))
        at = rng.randint(5, steps - 4)
        args += ["--seq-len", str(start), "--shift-seq-len", str(int(start * factor)), "--shift-at", str(at)]
        return args, {"kind": kind, "factor": factor, "at": at, "from": start}
    length = rng.choice((32, 64, 128))
    args += ["--seq-len", str(length), "--micro-batch-size", str(rng.choice((8, 16)))]
    if kind == "slowdown":
        at = rng.randint(5, steps - 4)
        args += ["--slowdown-at", str(at), "--slowdown-factor", "5"]
        return args, {"kind": kind, "at": at, "length": length}
    return args, {"kind": kind, "length": length}


def judge(fault: dict, report: dict) -> tuple[bool, str]:
    findings = report.get("findings", [])
    inputs = [f for f in findings if f["layer"] == "INPUT"]
    compute = [f for f in findings if f["layer"] == "COMPUTE"]
    if fault["kind"] == "shift":
        right = any(f["change_step"] == fault["at"] for f in inputs)
        if not right:
            return False, "missed"
        return True, "verdict INPUT" if report["verdict"]["layer"] == "INPUT" else "INPUT outranked"
    if fault["kind"] == "slowdown":
        if inputs:
            return False, "false INPUT"
        named = any(abs(f["change_step"] - fault["at"]) <= 1 for f in compute)
        return True, "COMPUTE at the step" if named else "no COMPUTE finding"
    if inputs or compute:
        return False, "false alarm"
    return True, ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default="input-shift-runs")
    parser.add_argument("--kinds", default="shift,shift,healthy,slowdown",
                        help="the kinds of run, in turn (shift, healthy, slowdown)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kinds = args.kinds.split(",")  # by default shifts in several factors, and two kinds to stay quiet on
    tally: dict[str, list[int]] = {}
    for index in range(args.runs):
        kind = kinds[index % len(kinds)]
        train_args, fault = draw(rng, kind)
        directory = out / f"run{index:02d}"
        directory.mkdir(exist_ok=True)
        port = str(20000 + rng.randint(0, 20000))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        started = time.monotonic()
        completed = subprocess.run([str(BIN / "opentelemetry-instrument"), str(BIN / "torchrun"), "--nproc_per_node",
                                    "2", "--master_port", port, str(REPO / "examples" / "train.py"), *train_args],
                                   cwd=directory, env=env, capture_output=True, text=True, timeout=900, check=False)
        seconds = time.monotonic() - started
        if completed.returncode:
            print(json.dumps({"run": index, "fault": fault, "error": completed.stderr[-500:]}), flush=True)
            continue
        report = json.loads(subprocess.run([str(BIN / "opentelemetry-deepspeed"), "diagnose", "--json"],
                                           cwd=directory, capture_output=True, text=True, check=False).stdout)
        (directory / "report.json").write_text(json.dumps(report, default=str))
        right, note = judge(fault, report)
        tally.setdefault(kind, [0, 0])[0] += right
        tally[kind][1] += 1
        print(json.dumps({"run": index, "fault": fault, "args": " ".join(train_args), "right": right, "note": note,
                          "findings": [f"{f['layer']}: {f['summary']}" for f in report.get("findings", [])],
                          "verdict": f"{report['verdict']['layer']}: {report['verdict']['summary']}",
                          "seconds": round(seconds, 1)}), flush=True)
    for kind, (right, total) in tally.items():
        print(f"{kind:9s} {right}/{total} right")
    return 0


if __name__ == "__main__":
    sys.exit(main())
