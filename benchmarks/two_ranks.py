"""Side by side on 2 ranks: whole runs of the example, bare, instrumented and with DeepSpeed's own tools.

Each arm launches ``examples/train.py`` on 2 ranks (``deepspeed --num_gpus 2``, or ``torchrun
--nproc_per_node 2``), ZeRO-2, warm-up steps plus the timed steps, as a user would run it:

- ``bare``: no OpenTelemetry;
- ``instrumented``: under ``opentelemetry-instrument`` with the defaults (the embedded file
  exporter, into a temporary directory);
- ``deepspeed-builtins``: no OpenTelemetry; DeepSpeed's ``wall_clock_breakdown``, ``comms_logger``
  and CSV monitor on (the example's ``--deepspeed-builtins``): the built-in tool to compare with;
- ``bare-again``: bare once more, the A/A control.

Arms run interleaved, one run of each per round, the order rotated every round (ABCD, BCDA,
...), so a machine that slows down or speeds up during the sitting weighs on every arm alike.
Every arm's step times come from the same place: the example's ``--step-times``, the host clock
around each optimizer step of its loop (data fetch to ``engine.step()`` and the loss read), on
each rank.

    OMP_NUM_THREADS=1 python benchmarks/two_ranks.py --rounds 6 --steps 40
    OMP_NUM_THREADS=1 python benchmarks/two_ranks.py --arms bare instrumented bare-again --json out.json

Reading it: per arm and rank, the median step over all its timed steps; then the ratio to
``bare``: in each round, the arm's median step divided by bare's median step of that round, and
the median of those ratios over rounds, with a 95% bootstrap interval over rounds. ``both`` takes
each step's mean over the two ranks. ``bare-again`` / ``bare`` is the A/A control: how far apart
two identical arms land in this sitting; an effect inside it is not shown. On a shared or small
machine runs differ by more than a few percent: read the ratios beside the control, never the
absolute milliseconds of one run. Each run's 1-minute load average (at its start and end) is
printed and kept in the JSON: a sitting where it is well above the number of CPUs measures the
other load as much as the arms.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "examples" / "train.py"
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO / "benchmarks"))

ARMS = ("bare", "instrumented", "deepspeed-builtins", "bare-again")
RANKS = 2
# Variables of the caller's environment that would change what an arm runs.
_INHERITED_PREFIXES = ("OTEL_", "TORCHELASTIC_", "SLURM_")
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="runs of each arm, interleaved")
    parser.add_argument("--steps", type=int, default=40, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="optimizer steps run first and not timed")
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--launcher", choices=("deepspeed", "torchrun"), default="deepspeed")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS),
                        help="arms to run (bare is always run: the ratios are to it)")
    parser.add_argument("--train-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for examples/train.py (repeat it), e.g. --train-arg=--grad-accum=2")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    parser.add_argument("--json", type=Path, help="write every run's step times and the summary here")
    parser.add_argument("--keep", action="store_true", help="keep the runs' directories (printed)")
    args = parser.parse_args(argv)
    if "bare" not in args.arms:
        args.arms.insert(0, "bare")
    return args


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def arm_env(directory: Path) -> dict[str, str]:
    """The caller's environment without OpenTelemetry's or a launcher's variables, one thread per rank,
    and the embedded default writing into ``directory``."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(_INHERITED_PREFIXES) and key not in _RANK_VARIABLES}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
               OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR=str(directory / "telemetry"))
    # DeepSpeed's CPU build caches JIT extensions here; the example needs none, but keep it stable.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    return env


def command(args, arm: str, step_times: Path) -> list[str]:
    port = str(free_port())
    if args.launcher == "deepspeed":
        launch = [str(BIN / "deepspeed"), "--num_gpus", str(RANKS), "--master_port", port]
    else:
        launch = [str(BIN / "torchrun"), "--nproc_per_node", str(RANKS), "--master_port", port]
    train = [str(TRAIN), "--steps", str(args.warmup + args.steps), "--zero-stage", str(args.zero_stage),
             "--step-times", str(step_times), *args.train_arg]
    if arm == "deepspeed-builtins":
        train.append("--deepspeed-builtins")
    prefix = [str(BIN / "opentelemetry-instrument")] if arm == "instrumented" else []
    return [*prefix, *launch, *train]


def run_arm(args, arm: str, directory: Path) -> dict:
    """One run of ``arm`` in its own working directory: each rank's timed step times, in seconds."""
    directory.mkdir(parents=True)
    step_times = directory / "step-times"
    argv = command(args, arm, step_times)
    load = os.getloadavg()[0]
    started = time.monotonic()
    completed = subprocess.run(argv, cwd=directory, env=arm_env(directory), capture_output=True, text=True,
                               timeout=args.timeout, check=False)
    elapsed = time.monotonic() - started
    (directory / "output.txt").write_text(completed.stdout + completed.stderr)
    ranks = []
    for rank in range(RANKS):
        written = Path(f"{step_times}.rank{rank}")
        seconds = [float(line) for line in written.read_text().split()] if written.exists() else []
        if len(seconds) != args.warmup + args.steps:
            raise SystemExit(f"{arm} failed ({completed.returncode}): rank {rank} wrote {len(seconds)} step times, "
                             f"not {args.warmup + args.steps}: {' '.join(argv)}\n"
                             f"{(completed.stdout + completed.stderr)[-4000:]}")
        ranks.append(seconds[args.warmup:])
    if completed.returncode != 0:
        # Every step was timed; what failed is the teardown (gloo's threads abort now and then at
        # exit, bare runs included), which the step times do not contain.
        print(f"  ({arm}: exit status {completed.returncode} after all steps; its output is in output.txt with --keep)")
    return {"arm": arm, "seconds": elapsed, "load": [load, os.getloadavg()[0]], "steps": ranks,
            "returncode": completed.returncode}


def series(run: dict, which: str) -> list[float]:
    """A run's step times for one rank ("0", "1") or for ``both`` (each step's mean over the ranks)."""
    if which == "both":
        return [statistics.fmean(step) for step in zip(*run["steps"], strict=True)]
    return run["steps"][int(which)]


def summarize(args, rounds: list[dict[str, dict]]) -> dict:
    from overhead import bootstrap

    views = [*(str(rank) for rank in range(RANKS)), "both"]
    summary: dict = {}
    for arm in args.arms:
        summary[arm] = {}
        for view in views:
            pooled = [seconds for runs in rounds for seconds in series(runs[arm], view)]
            ratios = [statistics.median(series(runs[arm], view)) / statistics.median(series(runs["bare"], view))
                      for runs in rounds]
            low, high = bootstrap(ratios, estimator=statistics.median)
            summary[arm][view] = {"median_ms": statistics.median(pooled) * 1e3,
                                  "ratio": statistics.median(ratios), "ratio_ci": [low, high],
                                  "ratios": ratios}
    return summary


def report(args, summary: dict, rounds: list[dict[str, dict]], minutes: float) -> None:
    print(f"{RANKS} ranks ({args.launcher}), ZeRO-{args.zero_stage}, {args.rounds} rounds x {args.steps} timed steps "
          f"(after {args.warmup} warm-up), arms interleaved and rotated; {minutes:.1f} min")
    print(f"  {'arm':20} {'rank':>4}  {'median step':>11}  {'/ bare (median of rounds)':>26}  95% CI over rounds")
    for arm, views in summary.items():
        for view, figures in views.items():
            low, high = figures["ratio_ci"]
            print(f"  {arm:20} {view:>4}  {figures['median_ms']:8.2f} ms  {figures['ratio']:26.3f}  "
                  f"[{low:.3f}, {high:.3f}]")
    if "bare-again" in summary:
        print(f"  A/A control (bare-again / bare, both ranks): {summary['bare-again']['both']['ratio']:.3f}")
    seconds = {arm: statistics.fmean(runs[arm]["seconds"] for runs in rounds) for arm in args.arms}
    print("  mean run (start-up, steps, exit): " + ", ".join(f"{arm} {s:.1f} s" for arm, s in seconds.items()))
    loads = [value for runs in rounds for run in runs.values() for value in run["load"]]
    print(f"  1-minute load average during the sitting: {min(loads):.1f} to {max(loads):.1f} "
          f"(on {os.cpu_count()} CPUs; each run uses about 2)")


def main(argv=None):
    args = parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="otel-ds-two-ranks-"))
    started = time.monotonic()
    rounds: list[dict[str, dict]] = []
    for index in range(args.rounds):
        shift = index % len(args.arms)
        runs = {}
        for arm in args.arms[shift:] + args.arms[:shift]:
            runs[arm] = run_arm(args, arm, root / f"round{index}" / arm)
            print(f"round {index + 1}/{args.rounds} {arm:20} median step "
                  + ", ".join(f"rank {rank} {statistics.median(steps) * 1e3:.2f} ms"
                              for rank, steps in enumerate(runs[arm]["steps"]))
                  + f" ({runs[arm]['seconds']:.0f} s, load average {runs[arm]['load'][0]:.1f} -> "
                  f"{runs[arm]['load'][1]:.1f})", flush=True)
        rounds.append(runs)
    minutes = (time.monotonic() - started) / 60
    summary = summarize(args, rounds)
    report(args, summary, rounds, minutes)
    if args.json:
        args.json.write_text(json.dumps({
            "arguments": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
            "summary": summary,
            "rounds": [{arm: {key: run[key] for key in ("seconds", "load", "steps")} for arm, run in runs.items()}
                       for runs in rounds],
        }, indent=1))
    if args.keep:
        print(f"runs kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
