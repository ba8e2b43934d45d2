"""How often `diagnose` names a hung job's stopped rank, phase and step, and how soon, on live jobs.

Each case starts the example on 2 ranks under torchrun with one rank blocking forever at a random
step and phase (`--hang-rank R --hang-step N --hang-phase P`: forward or backward of an open step,
or with no step open: data, in the loader, and after-step, in the loop's own code; ZeRO stage and
gradient accumulation varied too), runs `opentelemetry-deepspeed diagnose --json` on the live
directory every second, and stops the job once the verdict is HANG with every rank's report in (or
a minute after the first HANG). Healthy runs of the same shapes check that the watchdog raises no
HANG. Times: from the hang threshold's crossing (the stuck phase's start plus the threshold, from
the reports) to the first HANG verdict (rank and step), and to the complete one (the phase and
frames of the stopped rank).

    python benchmarks/hang_accuracy.py --cases 6 --healthy 2 --seed 1 [--phases data,after-step] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TRAIN = REPO / "examples" / "train.py"


def _env(floor: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", OTEL_PYTHON_DEEPSPEED_HANG_TIMEOUT=floor,
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    return env


def _port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _diagnose(workdir: Path) -> dict:
    done = subprocess.run([str(BIN / "opentelemetry-deepspeed"), "diagnose", "--json"], cwd=workdir,
                          capture_output=True, text=True, timeout=120, check=False)
    return json.loads(done.stdout) if done.stdout.strip() else {}


def _threshold_crossing(workdir: Path) -> float | None:
    times = []
    for path in workdir.glob("telemetry/*/traces-rank*.jsonl"):
        for line in path.read_text().splitlines():
            for resource in json.loads(line).get("resourceSpans", ()):
                for scope in resource["scopeSpans"]:
                    for span in scope["spans"]:
                        if span["name"] == "training.hang":
                            values = {a["key"]: next(iter(a["value"].values())) for a in span["attributes"]}
                            times.append(int(span["endTimeUnixNano"]) / 1e9 - float(values["training.hang.duration"])
                                         + float(values["training.hang.threshold"]))
    return min(times) if times else None


def run_case(case: dict, floor: str, timeout: float) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="hang-accuracy-"))
    args = ["--steps", str(case["steps"]), "--zero-stage", str(case["zero"]), "--grad-accum", str(case["accum"])]
    if case["rank"] is not None:
        args += ["--hang-rank", str(case["rank"]), "--hang-step", str(case["step"]), "--hang-phase", case["phase"]]
    command = [str(BIN / "opentelemetry-instrument"), str(BIN / "torchrun"), "--nproc_per_node", "2",
               "--master_port", str(_port()), str(TRAIN), *args]
    with open(workdir / "job.log", "w") as log:
        job = subprocess.Popen(command, cwd=workdir, env=_env(floor), stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    verdict, first, found_at, complete_at, started = None, None, None, None, time.monotonic()
    try:
        while time.monotonic() - started < timeout:
            ended = job.poll() is not None
            if (workdir / "telemetry").is_dir():
                report = _diagnose(workdir)
                verdict = report.get("verdict")
                if verdict and verdict.get("layer") == "HANG":
                    if found_at is None:
                        first, found_at = verdict, time.time()
                    if verdict.get("confidence", 0) >= 0.9 or time.time() - found_at > 60:
                        complete_at = time.time()  # every rank reported (or a minute passed)
                        break
            if ended:
                break
            time.sleep(1)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGTERM)
        try:
            job.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    crossing = _threshold_crossing(workdir)
    result = {**case, "verdict": (verdict or {}).get("layer"), "summary": (verdict or {}).get("summary", "")}
    if case["rank"] is None:
        result["right"] = result["verdict"] != "HANG"
    else:
        # First HANG verdict: the right rank and step. Once every rank reported: the phase too.
        # after-step: blocked after step N's engine.step(), so no step is open and N + 1 is the one that did not start.
        step = case["step"] + (case["phase"] == "after-step")
        result["first_right"] = bool(first) and first.get("rank") == case["rank"] and first.get("step") == step
        expected = {"data": f"rank {case['rank']} stopped in the data loader (data wait) before step {step}",
                    "after-step": f"rank {case['rank']} stopped between steps (no step open, before step {step})"}.get(
            case["phase"], f"rank {case['rank']} stopped in {case['phase']} of step {step}")
        result["right"] = result["verdict"] == "HANG" and verdict.get("rank") == case["rank"] and \
            result["summary"].startswith(expected)
        result["seconds_to_verdict"] = round(found_at - crossing, 1) if found_at and crossing else None
        result["seconds_to_complete"] = round(complete_at - crossing, 1) if complete_at and crossing else None
    shutil.rmtree(workdir, ignore_errors=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=6)
    parser.add_argument("--healthy", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--floor", default="2", help="OTEL_PYTHON_DEEPSPEED_HANG_TIMEOUT of the runs")
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--phases", default="forward,backward,data,after-step",
                        help="where the hangs are drawn from: forward, backward (a step open), data, after-step (none)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    cases = [{"rank": rng.randint(0, 1), "step": rng.randint(2, 10), "phase": rng.choice(args.phases.split(",")),
              "zero": rng.choice((1, 2)), "accum": rng.choice((1, 2)), "steps": 14} for _ in range(args.cases)]
    cases += [{"rank": None, "step": None, "phase": None, "zero": rng.choice((1, 2)), "accum": 1, "steps": 14}
              for _ in range(args.healthy)]
    results = []
    for case in cases:
        result = run_case(case, args.floor, args.timeout)
        results.append(result)
        print(json.dumps(result), flush=True)
    hung = [r for r in results if r["rank"] is not None]
    healthy = [r for r in results if r["rank"] is None]
    delays = sorted(r["seconds_to_verdict"] for r in hung if r.get("seconds_to_verdict") is not None)
    complete = sorted(r["seconds_to_complete"] for r in hung if r.get("seconds_to_complete") is not None)
    summary = {"first_verdict_rank_and_step_right": f"{sum(r['first_right'] for r in hung)}/{len(hung)}",
               "hang_right": f"{sum(r['right'] for r in hung)}/{len(hung)}",
               "seconds_to_complete_verdict": {"min": complete[0], "median": complete[len(complete) // 2],
                                               "max": complete[-1]} if complete else None,
               "healthy_without_hang": f"{sum(r['right'] for r in healthy)}/{len(healthy)}",
               "seconds_to_verdict": {"min": delays[0], "median": delays[len(delays) // 2], "max": delays[-1]}
               if delays else None,
               "load_average": os.getloadavg()[0]}
    print(json.dumps(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
