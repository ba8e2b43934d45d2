"""Accuracy and false alarms of diagnose's MODEL and MEMORY findings on real DeepSpeed runs (CPU).

Each case runs examples/train.py under opentelemetry-instrument with one injected fault (or none),
then `opentelemetry-deepspeed diagnose --json`, and compares the verdict, and the findings, with
the injection: layer, kind, rank and step must all match (a MODEL finding is the verdict only when
no time-based layer stands out, so "named in findings" is the accuracy of the model layer itself).
Healthy runs must give no MODEL or MEMORY finding.
Findings other than the verdict are listed: those at the injected step (another rank's global
gradient norm, a NaN that spreads to the other rank's weights a step later) are consequences; any
other is a false alarm.

    python benchmarks/numerics_accuracy.py [--only NAME ...] > results.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

# name: (ranks, train.py arguments, expected (layer, kind, rank, step) or None for healthy)
CASES = {
    "healthy-2r-z2": (2, ["--steps", "30", "--zero-stage", "2", "--grad-accum", "2"], None),
    "healthy-1r-ga4": (1, ["--steps", "30", "--grad-accum", "4", "--micro-batch-size", "4"], None),
    "healthy-2r-seed7-z3": (2, ["--steps", "30", "--zero-stage", "3", "--seed", "7"], None),
    "healthy-1r-stall": (1, ["--steps", "30", "--stall-every", "3", "--stall-ms", "100"], None),
    "loss-x3-s14-r0": (2, ["--steps", "24", "--inject-loss-spike", "14:0:3"], ("MODEL", "loss_spike", 0, 14)),
    "loss-x5-s25-r1": (2, ["--steps", "30", "--zero-stage", "2", "--inject-loss-spike", "25:1:5"],
                       ("MODEL", "loss_spike", 1, 25)),
    "loss-x20-s10-1r": (1, ["--steps", "16", "--grad-accum", "2", "--inject-loss-spike", "10:0:20"],
                        ("MODEL", "loss_spike", 0, 10)),
    "loss-x1.5-s15-1r": (1, ["--steps", "20", "--inject-loss-spike", "15:0:1.5"], ("MODEL", "loss_spike", 0, 15)),
    # DeepSpeed's gradient norm is the job's: a spike on one rank is every rank's (rank None).
    "grad-x10-s18-r1": (2, ["--steps", "24", "--inject-grad-spike", "18:1:10"],
                        ("MODEL", "grad_norm_spike", None, 18)),
    "grad-nan-s11-r0-z2": (2, ["--steps", "16", "--zero-stage", "2", "--inject-grad-nan", "11:0"],
                           ("MODEL", "nonfinite_grad_norm", None, 11)),
    "grad-x30-s12-1r": (1, ["--steps", "16", "--inject-grad-spike", "12:0:30"], ("MODEL", "grad_norm_spike", 0, 12)),
    "nan-s9-r1": (2, ["--steps", "14", "--zero-stage", "1", "--inject-nan", "9:1"], ("MODEL", "nonfinite_loss", 1, 9)),
    "nan-s20-1r": (1, ["--steps", "24", "--grad-accum", "2", "--inject-nan", "20:0"],
                   ("MODEL", "nonfinite_loss", 0, 20)),
    "oom-fwd-s7-r0": (2, ["--steps", "10", "--inject-oom", "7:0:forward"], ("MEMORY", None, 0, 7)),
    "oom-bwd-s4-1r": (1, ["--steps", "8", "--zero-stage", "2", "--inject-oom", "4:0:backward"],
                      ("MEMORY", None, 0, 4)),
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_case(name: str, ranks: int, arguments: list[str], expected) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"numerics-{name}-") as directory:
        port = str(free_port())
        env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
        env.update(OMP_NUM_THREADS="1", MASTER_PORT=port)
        if ranks == 1:
            command = [str(BIN / "opentelemetry-instrument"), sys.executable, str(REPO / "examples" / "train.py")]
        else:
            command = [str(BIN / "opentelemetry-instrument"), str(BIN / "torchrun"), "--nproc_per_node", str(ranks),
                       "--master_port", port, str(REPO / "examples" / "train.py")]
        started = time.time()
        trained = subprocess.run([*command, *arguments], cwd=directory, env=env, capture_output=True, text=True,
                                 timeout=600, check=False)
        diagnosed = subprocess.run(
            [sys.executable, "-m", "opentelemetry_instrumentation_deepspeed.diagnose.cli", "diagnose", "--json",
             str(Path(directory) / "telemetry")], capture_output=True, text=True, check=False)
    if diagnosed.returncode != 0:
        return {"case": name, "correct": False, "named": False, "expected": expected, "error": diagnosed.stderr[-500:],
                "train_stderr": trained.stderr[-1500:], "returncode": trained.returncode, "findings": [],
                "false_alarms": []}
    report = json.loads(diagnosed.stdout)
    verdict = report["verdict"]
    found = (verdict["layer"], verdict.get("kind"), verdict.get("rank"), verdict.get("step"))
    findings = [(f["layer"], f.get("kind"), f["rank"], f["step"]) for f in report.get("findings", [])]
    named = expected is not None and tuple(expected) in findings
    if expected is None:
        correct = not findings
        false_alarms = findings
    else:
        correct = found == tuple(expected)
        false_alarms = [f for f in findings if not _consequence(f, expected)]
    return {"case": name, "ranks": ranks, "arguments": arguments, "expected": expected, "verdict": found,
            "correct": correct, "named": named, "findings": findings, "false_alarms": false_alarms,
            "returncode": trained.returncode, "seconds": round(time.time() - started, 1)}


def _consequence(finding, expected) -> bool:
    """At the injected step on any rank, or a NaN spreading to later steps (the weights are NaN)."""
    _layer, kind, _rank, step = finding
    if step == expected[3]:
        return True
    return expected[1] == "nonfinite_loss" and step > expected[3] and (kind or "").startswith("nonfinite")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="case names")
    args = parser.parse_args()
    results = []
    for name, (ranks, arguments, expected) in CASES.items():
        if args.only and name not in args.only:
            continue
        result = run_case(name, ranks, arguments, expected)
        results.append(result)
        print(json.dumps(result), file=sys.stderr, flush=True)
    faults = [r for r in results if r["expected"] is not None]
    healthy = [r for r in results if r["expected"] is None]
    print(json.dumps({"faults": len(faults), "verdict_exact": sum(r["correct"] for r in faults),
                      "named_in_findings": sum(r["named"] for r in faults),
                      "healthy_runs": len(healthy), "healthy_with_findings": sum(not r["correct"] for r in healthy),
                      "false_alarms_in_fault_runs": sum(len(r["false_alarms"]) for r in faults),
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
