"""Accuracy of `opentelemetry-deepspeed diagnose` on faults it was not tuned on: every class, one script.

Each fault class is an entry of CLASSES: how to draw a run with random parameters (which rank,
how long, how often, which phase or step, how many steps, ZeRO stage, size) and what a right
diagnosis says (layer, rank, period/offset, phase or step). Every repetition runs examples/train.py
for real under `opentelemetry-instrument` (torchrun, 2 ranks, or 1 process), then `diagnose` on
its telemetry, and scores the verdict. A hang is diagnosed live: `diagnose` reads the hung job's
directory every second while the job is still blocked, and its time to verdict counts from the
hang threshold's crossing (the stuck phase's start plus the watchdog's threshold, from the
reports); the job is killed once the verdict is complete. Prints one line per run and a table per
class: right layer, right rank, right period/offset, phase or step, all three, and the time to
verdict (after a run: the seconds `diagnose` took; a hang: seconds from the threshold).

    python benchmarks/accuracy.py --repeat 5 --healthy 20            # every class, round robin
    python benchmarks/accuracy.py --classes hang desync --repeat 3 --seed 7
    python benchmarks/accuracy.py --keep runs/ ...; python benchmarks/accuracy.py --rescore runs/
                                                       # diagnose kept runs again (after a change)

A rescored hang is diagnosed after the fact (the job was killed), so only its verdict, not its
time, is scored again. A new class is one more entry: a ``draw(rng)`` returning the example's
arguments, the launcher and the expected diagnosis, and optionally its own ``judge``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TRAIN = REPO / "examples" / "train.py"
BIN = Path(sys.executable).parent
HANG_FLOOR = "2"  # OTEL_PYTHON_DEEPSPEED_HANG_TIMEOUT of the hang runs: the watchdog's floor, seconds
LIVE_TIMEOUT = 240.0  # a live hang run gives up after this many seconds

from tests.conftest import free_port  # noqa: E402 - below the ephemeral range: no clash with other jobs' sockets


@dataclass
class Expected:
    layer: str  # "none" for a healthy run
    rank: int | None = None  # None: the finding must name no single rank (job-wide)
    period: int | None = None
    offset: int | None = None
    phase: str | None = None  # the part of the late rank's step that made it late
    step: int | None = None  # the step of a change point, a hang or a desync
    stall: tuple | None = None  # a second fault, found too: (rank, period) of a loader stall at offset 0
    until: int | None = None  # a stretch's last step (its first: ``step``)


@dataclass
class Draw:
    args: list[str]
    expected: Expected
    ranks: int = 2
    env: dict = field(default_factory=dict)
    live: bool = False  # diagnosed while the job runs (a hang)
    # Other processes that take the host's CPUs for part of the run: (kind, count, start[, leave]): "job", another
    # 2-rank training job; "spin", ``count`` processes that spin; from ``start`` seconds after the run's first
    # telemetry file (None: from the launch) to ``leave`` seconds after it (absent or None: to the run's end).
    neighbour: tuple | None = None


def _zero(rng):
    return ["--zero-stage", str(rng.choice((1, 2)))]


def draw_healthy(rng: random.Random) -> Draw:
    ranks = rng.choice((1, 2))
    args = ["--steps", str(rng.randint(12, 30)), "--grad-accum", str(rng.choice((1, 2))),
            "--zero-stage", str(rng.choice((0, 1, 2, 3))), "--micro-batch-size", str(rng.choice((8, 16, 32, 64))),
            "--seq-len", str(rng.choice((32, 64)))]
    return Draw(args, Expected("none"), ranks)


def draw_healthy_barrier(rng: random.Random) -> Draw:
    """The healthy draw on 2 ranks, every rank in a barrier after each step: the loop's own collective between them."""
    draw = draw_healthy(rng)
    return Draw([*draw.args, "--barrier"], draw.expected, 2)


def draw_healthy_small(rng: random.Random) -> Draw:
    # The healthy case: a tiny model whose gloo all-reduce is a real, variable share of the step.
    return Draw(["--steps", "20", "--zero-stage", "2", "--micro-batch-size", "8", "--seed", str(rng.randint(1, 9999))],
                Expected("none"), 2)


def draw_healthy_neighbour(rng: random.Random) -> Draw:
    # A healthy job whose host gets busier partway through: what a neighbour's job (the test suite's, beside
    # a sitting) did to three healthy runs, which read as a device that got slower.
    args = ["--steps", str(rng.randint(300, 600)), "--zero-stage", str(rng.choice((1, 2))),
            "--micro-batch-size", str(rng.choice((8, 16))), "--seq-len", str(rng.choice((32, 64)))]
    return Draw(args, Expected("none"), 2, neighbour=(rng.choice(("job", "spin")), rng.randint(1, 3),
                                                      round(rng.uniform(1.0, 4.0), 1)))


def draw_healthy_busy(rng: random.Random) -> Draw:
    # A short healthy run whose host's load changes during its steps (the host rule's case, which the long runs
    # above reach in few of their draws).
    args = ["--steps", str(rng.randint(20, 40)), *_zero(rng), "--micro-batch-size", str(rng.choice((8, 16))),
            "--seq-len", str(rng.choice((32, 64)))]
    return Draw(args, Expected("none"), 2, neighbour=_arriving_or_leaving(rng))


def _arriving_or_leaving(rng: random.Random) -> tuple:
    """1-3 spinning processes that arrive 0-1.5 s after the first telemetry file, or run from the launch and leave
    then: the steps begin about 1 s before that file, and a short run's last 1-3 s."""
    moment = round(rng.uniform(0.0, 1.5), 1)
    return "spin", rng.randint(1, 3), *((moment, None) if rng.random() < 0.5 else (None, moment))


# The periodicity test's bound (docs/diagnose.md, "Findings and the verdict"): four stalls every 3rd step in
# the 11-13 steps counted of a 12-14 step run are at alpha even when each is the slowest step (p = 0.010,
# 0.008, 0.006 from the arrangements alone, estimated by 499 shuffles +- 0.004), so the stall classes run 16
# steps or more, and runs at the bound are a class of their own.
MIN_STALL_STEPS = 16


def _stall_steps(rng: random.Random, every: int) -> int:
    return max(every * rng.randint(4, 5) + rng.randint(0, every - 1), MIN_STALL_STEPS)  # four or five stalls


def draw_loader_stall_rank(rng: random.Random) -> Draw:
    rank, every, stall = rng.randint(0, 1), rng.randint(3, 6), rng.randint(80, 300)
    return Draw(["--steps", str(_stall_steps(rng, every)), "--stall-every", str(every), "--stall-ms", str(stall),
                 "--stall-rank", str(rank), *_zero(rng)], Expected("data loading", rank, every, 0, "data_wait"))


def draw_loader_stall_all(rng: random.Random) -> Draw:
    every, stall = rng.randint(3, 6), rng.randint(80, 300)
    return Draw(["--steps", str(_stall_steps(rng, every)), "--stall-every", str(every), "--stall-ms", str(stall),
                 *_zero(rng)], Expected("data loading", None, every, 0, "data_wait"))


def draw_loader_stall_short(rng: random.Random) -> Draw:
    """At the test's bound: four stalls every 3rd step in a 12-14 step run, on one rank or on every rank."""
    rank, stall = rng.choice((0, 1, None)), rng.randint(80, 300)
    where = [] if rank is None else ["--stall-rank", str(rank)]
    return Draw(["--steps", str(rng.randint(12, 14)), "--stall-every", "3", "--stall-ms", str(stall), *where,
                 *_zero(rng)], Expected("data loading", rank, 3, 0, "data_wait"))


def draw_loader_stall_late(rng: random.Random) -> Draw:
    """One rank's loader starts stalling mid-run: every 3rd-6th step from step 20-40 on, six to eight times (a quarter
    to two thirds into the run)."""
    rank, every, stall = rng.randint(0, 1), rng.randint(3, 6), rng.randint(80, 300)
    start = rng.randint(20, 40)
    first = start + (-start) % every
    steps = first + every * rng.randint(5, 7) + rng.randint(0, every - 1)
    return Draw(["--steps", str(steps), "--stall-every", str(every), "--stall-ms", str(stall), "--stall-rank",
                 str(rank), "--stall-from", str(start), *_zero(rng)],
                Expected("data loading", rank, every, 0, "data_wait", step=first))


def draw_host_work_rank(rng: random.Random) -> Draw:
    """One rank's loop works on the host after every k-th step (a checkpoint, logging): the gap before the next step,
    which the other rank waits through in that step's first collective. Four or five gaps after warm-up, in a run as
    long as the stall classes' (the periodicity test's bound), one step more: a gap comes before the step after."""
    rank, every, work = rng.randint(0, 1), rng.randint(3, 6), rng.randint(80, 300)
    steps = max(every * rng.randint(4, 5) + rng.randint(1, every), MIN_STALL_STEPS + 1)
    return Draw(["--steps", str(steps), "--host-work",
                 f"{every}:{work}:{rank}", *_zero(rng)],
                Expected("HOST WORK", rank, every, 1 % every, "between_steps"))


def draw_host_work_barrier(rng: random.Random) -> Draw:
    """As host-work-rank, and every rank then meets in a barrier (the usual ``if rank == 0: save(); barrier()``):
    every rank's gap before the next step is the same; the others' is their wait in the barrier."""
    draw = draw_host_work_rank(rng)
    return Draw([*draw.args, "--barrier"], draw.expected)


def draw_slow_rank(rng: random.Random) -> Draw:
    rank, slow, phase = rng.randint(0, 1), rng.randint(20, 60), rng.choice(("forward", "backward", "optimizer"))
    return Draw(["--steps", str(rng.randint(12, 20)), "--slow-rank", str(rank), "--slow-ms", str(slow),
                 "--slow-phase", phase, *_zero(rng)], Expected("straggler", rank, phase=phase))


def draw_slow_and_stall(rng: random.Random) -> Draw:
    """Two faults at once: a rank late at every step (its loader or a phase), and a loader stall every k-th step on it
    or on the other rank; both must be found."""
    rank, slow, phase = rng.randint(0, 1), rng.randint(30, 60), rng.choice(("data", "forward", "backward"))
    stalling, every, stall = rng.randint(0, 1), rng.randint(3, 5), rng.randint(80, 250)
    expected = Expected("data loading" if phase == "data" else "straggler", rank,
                        phase="data_wait" if phase == "data" else phase, stall=(stalling, every))
    return Draw(["--steps", str(_stall_steps(rng, every)), "--slow-rank", str(rank), "--slow-ms", str(slow),
                 "--slow-phase", phase, "--stall-every", str(every), "--stall-ms", str(stall),
                 "--stall-rank", str(stalling), *_zero(rng)], expected)


def draw_slow_rank_long(rng: random.Random) -> Draw:
    # Long enough that a quiet host stops the phases' reads of the CPU wait (50 steps under 5%: recording/host_cpu.py),
    # and, in half the draws, a neighbour then makes the ranks wait for CPUs again.
    rank, slow, phase = rng.randint(0, 1), rng.randint(20, 60), rng.choice(("forward", "backward", "optimizer"))
    neighbour = ("spin", rng.randint(1, 3), round(rng.uniform(4.0, 8.0), 1)) if rng.random() < 0.5 else None
    return Draw(["--steps", str(rng.randint(150, 250)), "--slow-rank", str(rank), "--slow-ms", str(slow),
                 "--slow-phase", phase, *_zero(rng)], Expected("straggler", rank, phase=phase), neighbour=neighbour)


def draw_comm_heavy(rng: random.Random) -> Draw:
    # --comm-heavy: each backward all-reduces a preallocated 32-64 MiB buffer on top of the model's
    # own gradients (any ZeRO stage): exposed communication 59-80% of the step on this machine.
    return Draw(["--steps", str(rng.randint(8, 14)), "--comm-heavy", "--comm-heavy-mib", str(rng.randint(32, 64)),
                 "--micro-batch-size", str(rng.choice((8, 16))), "--zero-stage", str(rng.choice((0, 1, 2)))],
                Expected("communication"))


def draw_input_shift(rng: random.Random) -> Draw:
    steps = rng.choice((18, 20, 24))
    start, factor = rng.choice(((64, 2), (64, 4), (32, 4), (128, 0.5), (256, 0.5)))
    at = rng.randint(5, steps - 4)
    args = ["--steps", str(steps), "--zero-stage", "2", "--grad-accum", str(rng.choice((1, 2))),
            "--seq-len", str(start), "--shift-seq-len", str(int(start * factor)), "--shift-at", str(at)]
    if rng.random() < 0.5:
        args.append("--padding")
    return Draw(args, Expected("INPUT", step=at))


def draw_input_spell(rng: random.Random) -> Draw:
    # Longer sequences for 3-8 steps, then back (a review's "steps 10-15 of 30": NONE), on every rank or on one.
    steps = rng.choice((20, 24, 30))
    start = rng.randint(5, steps - 12)
    until = start + rng.randint(2, 7)
    base, factor = rng.choice(((64, 2), (64, 4), (32, 4), (32, 8)))
    rank = rng.choice((None, 0, 1))
    args = ["--steps", str(steps), "--zero-stage", "2", "--grad-accum", str(rng.choice((1, 2))), "--seq-len",
            str(base), "--shift-seq-len", str(base * factor), "--shift-at", str(start), "--shift-until", str(until)]
    if rank is not None:
        args += ["--shift-rank", str(rank)]
    if rng.random() < 0.5:
        args.append("--padding")
    return Draw(args, Expected("INPUT", rank=rank, step=start, until=until))


def draw_input_shift_busy(rng: random.Random) -> Draw:
    # The input shift on a host whose load changes during the steps (sitting 12's miss: a neighbour's load that
    # fell two steps before the sequences doubled hid the change from the step time).
    draw = draw_input_shift(rng)
    draw.neighbour = _arriving_or_leaving(rng)
    return draw


def draw_compute_slowdown(rng: random.Random) -> Draw:
    # Every rank's forward and backward 4-6x slower from a step on, same input: COMPUTE, not INPUT. The
    # model's compute must be a fair share of the step for that to slow the step by the rule's x1.5 per
    # token: sequences of 128-256 tokens, micro-batch 16 (at 32 tokens and micro-batch 8, x4 of a 3 ms
    # forward is noise). The forward alone slowed was not enough on a loaded host, where the optimizer
    # and the collectives grow: x1.2 per token in 2 of 7 runs.
    steps = rng.choice((18, 20, 24))
    at = rng.randint(5, steps - 4)
    return Draw(["--steps", str(steps), "--zero-stage", "2", "--seq-len", str(rng.choice((128, 256))),
                 "--micro-batch-size", "16", "--slowdown-at", str(at), "--slowdown-factor", str(rng.choice((4, 5, 6)))],
                Expected("COMPUTE", step=at))


def draw_hang(rng: random.Random) -> Draw:
    rank, step, phase = rng.randint(0, 1), rng.randint(2, 10), rng.choice(("forward", "backward"))
    return Draw(["--steps", "14", "--hang-rank", str(rank), "--hang-step", str(step), "--hang-phase", phase,
                 *_zero(rng), "--grad-accum", str(rng.choice((1, 2)))],
                Expected("HANG", rank, phase=phase, step=step), env={"OTEL_PYTHON_DEEPSPEED_HANG_TIMEOUT": HANG_FLOOR},
                live=True)


def draw_hang_between_steps(rng: random.Random) -> Draw:
    # No step open: in the data loader before step N, or in the loop's own code after step N's engine.step().
    rank, step, phase = rng.randint(0, 1), rng.randint(2, 10), rng.choice(("data", "after-step"))
    return Draw(["--steps", "14", "--hang-rank", str(rank), "--hang-step", str(step), "--hang-phase", phase,
                 *_zero(rng), "--grad-accum", str(rng.choice((1, 2)))],
                Expected("HANG", rank, phase=phase, step=step + (phase == "after-step")),
                env={"OTEL_PYTHON_DEEPSPEED_HANG_TIMEOUT": HANG_FLOOR}, live=True)


def draw_stall(rng: random.Random) -> Draw:
    # A hang that ends: rank R pauses 4-8 s (past the watchdog's 2 s floor) in one step, then the run goes on.
    rank, step = rng.randint(0, 1), rng.randint(3, 10)
    phase = rng.choice(("forward", "backward", "data", "after-step"))
    return Draw(["--steps", "14", "--hang-rank", str(rank), "--hang-step", str(step), "--hang-phase", phase,
                 "--hang-seconds", f"{rng.uniform(4, 8):.1f}", *_zero(rng), "--grad-accum", str(rng.choice((1, 2)))],
                Expected("STALL", rank, phase=phase, step=step + (phase == "after-step")),
                env={"OTEL_PYTHON_DEEPSPEED_HANG_TIMEOUT": HANG_FLOOR})


def draw_desync(rng: random.Random) -> Draw:
    rank, steps = rng.randint(0, 1), rng.randint(10, 16)
    step = rng.randint(2, steps - 1)
    return Draw(["--steps", str(steps), "--desync-rank", str(rank), "--desync-step", str(step), *_zero(rng)],
                Expected("DESYNC", rank, step=step))


_CRASH_PHASES = {"forward": "forward", "data": "data.wait"}  # where a raise leaves a failed phase; elsewhere none


def draw_crash(rng: random.Random) -> Draw:
    """One rank fails at step N: its exception in its forward, its data loader, the loop's code between forward and
    backward or after its step; or it dies there without a word (SIGKILL, os._exit), or of a segmentation fault."""
    rank, steps = rng.randint(0, 1), rng.randint(10, 20)
    after, where = rng.randint(2, steps - 2), rng.choice(("forward", "data", "loop", "after-step"))
    how = rng.choice(("raise", "raise", "kill", "exit", "segv"))
    phase = _CRASH_PHASES.get(where) if how == "raise" else None
    return Draw(["--steps", str(steps), "--crash-after", str(after), "--crash-in", where, "--crash-rank", str(rank),
                 "--crash-how", how, *_zero(rng), "--grad-accum", str(rng.choice((1, 2)))],
                Expected("CRASH", rank, phase=phase, step=after + 1))


def judge_crash(report: dict, expected: Expected) -> dict[str, bool]:
    """The rank that failed first, the step the others lost it in, and the phase it failed in where one was open."""
    verdict = report["verdict"]
    layer = verdict["layer"] == "CRASH"
    return {"layer": layer, "rank": layer and verdict.get("rank") == expected.rank,
            "pattern": layer and verdict.get("step") == expected.step and verdict.get("phase") == expected.phase}


def judge(report: dict, expected: Expected) -> dict[str, bool]:
    verdict = report["verdict"]
    layer = verdict["layer"] == expected.layer
    if expected.layer == "none":
        return {"layer": layer, "rank": layer, "pattern": layer}
    rank = verdict.get("rank") == expected.rank
    if expected.period is not None:
        pattern = verdict.get("period") == expected.period and verdict.get("offset") == expected.offset
        if expected.step is not None:  # a stall that starts mid-run: from its first step
            pattern = pattern and verdict.get("step") == expected.step
    elif expected.phase is not None:
        pattern = verdict.get("phase") == expected.phase
    else:
        pattern = True
    return {"layer": layer, "rank": rank, "pattern": pattern}


def judge_change(report: dict, expected: Expected) -> dict[str, bool]:
    """An INPUT change point is exact; a COMPUTE one found in noise may be one step off (docs/diagnose.md)."""
    verdict = report["verdict"]
    slack = 0 if expected.layer == "INPUT" else 1
    layer = verdict["layer"] == expected.layer
    return {"layer": layer, "rank": layer and verdict.get("rank") is None,
            "pattern": layer and abs((verdict.get("change_step") or -99) - expected.step) <= slack}


def judge_spell(report: dict, expected: Expected) -> dict[str, bool]:
    """A stretch of longer sequences: its first step and its last exact, and the rank it is on."""
    verdict = report["verdict"]
    layer = verdict["layer"] == "INPUT"
    return {"layer": layer, "rank": layer and verdict.get("rank") == expected.rank,
            "pattern": layer and (verdict.get("change_step"), verdict.get("until_step")) == (expected.step,
                                                                                                expected.until)}


def judge_hang(report: dict, expected: Expected) -> dict[str, bool]:
    """The stopped rank, and where: "rank R stopped in PHASE of step N" (the phase needs its own report);
    with no step open, in the data loader before step N, or between steps before step N (after-step:
    blocked after step N - 1's engine.step())."""
    verdict = report["verdict"]
    layer = verdict["layer"] == "HANG"
    where = {"data": f"rank {expected.rank} stopped in the data loader (data wait) before step {expected.step}",
             "after-step": f"rank {expected.rank} stopped between steps (no step open, before step {expected.step})"
             }.get(expected.phase, f"rank {expected.rank} stopped in {expected.phase} of step {expected.step}")
    return {"layer": layer, "rank": layer and verdict.get("rank") == expected.rank,
            "pattern": layer and verdict.get("step") == expected.step and verdict["summary"].startswith(where)}


def judge_stall(report: dict, expected: Expected) -> dict[str, bool]:
    """As a hang, after the run: "step N stalled S s, past the watchdog's threshold, then went on: rank R stopped
    ..." (the step of a pause after step N's engine.step() is N + 1's, which it delayed)."""
    verdict = report["verdict"]
    if verdict["layer"] != "STALL":
        return {"layer": False, "rank": False, "pattern": False}
    stopped = verdict["summary"].partition("then went on: ")[2]
    return judge_hang({"verdict": {**verdict, "layer": "HANG", "summary": stopped}}, expected)


def judge_desync(report: dict, expected: Expected) -> dict[str, bool]:
    """With 2 ranks a mismatch cannot say which rank is the odd one out: the rank is right when the
    finding gives the injected rank's side of it ("rank R all_reduce of 16 bytes int32")."""
    verdict = report["verdict"]
    layer = verdict["layer"] == "DESYNC"
    side = re.search(rf"rank {expected.rank} all_reduce of \d+ bytes int32\b", verdict["summary"])
    return {"layer": layer, "rank": layer and side is not None,
            "pattern": layer and verdict.get("step") == expected.step}


def judge_both(report: dict, expected: Expected) -> dict[str, bool]:
    """A late rank and a periodic stall: each must be among the findings (the verdict is the costlier)."""
    stalling, every = expected.stall
    found = report["findings"]
    late = [f for f in found if f.get("test") == "signed-rank"]
    stalls = [f for f in found if f.get("period")]
    layer = (any(f["layer"] == expected.layer for f in late) and any(f["layer"] == "data loading" for f in stalls))
    rank = (any(f["layer"] == expected.layer and f.get("rank") == expected.rank for f in late)
            and any(f.get("rank") == stalling for f in stalls if f["layer"] == "data loading"))
    pattern = (any(f.get("rank") == expected.rank and f.get("phase") == expected.phase for f in late)
               and any(f.get("rank") == stalling and (f.get("period"), f.get("offset")) == (every, 0) for f in stalls))
    return {"layer": layer, "rank": rank, "pattern": pattern}


@dataclass
class FaultClass:
    name: str
    draw: object
    judge: object = judge
    notes: str = ""


CLASSES = [
    FaultClass("healthy", draw_healthy, notes="1-2 ranks, 12-30 steps, grad accum 1-2, ZeRO 0-3, micro-batch 8-64, "
               "sequence 32/64"),
    FaultClass("healthy-barrier", draw_healthy_barrier, notes="the healthy draw on 2 ranks, a barrier after each step"),
    FaultClass("healthy-small", draw_healthy_small, notes="the issue's case: 2 ranks, ZeRO-2, micro-batch 8, 20 steps"),
    FaultClass("healthy-neighbour", draw_healthy_neighbour,
               notes="2 ranks, 300-600 steps; from 1-4 s into the run another 2-rank job or 1-3 spinning processes "
               "take the host's CPUs"),
    FaultClass("healthy-busy", draw_healthy_busy,
               notes="2 ranks, 20-40 steps; 1-3 spinning processes arrive, or leave, during the steps"),
    FaultClass("loader-stall-rank", draw_loader_stall_rank,
               notes="one rank's loader stalls 80-300 ms every 3rd-6th step, 4-5 times, 16 steps or more"),
    FaultClass("loader-stall-all", draw_loader_stall_all,
               notes="every rank's loader stalls 80-300 ms every 3rd-6th step, 16 steps or more"),
    FaultClass("loader-stall-short", draw_loader_stall_short,
               notes="at the test's bound: 4 stalls every 3rd step in 12-14 steps, one rank or every rank"),
    FaultClass("loader-stall-late", draw_loader_stall_late,
               notes="one rank's loader stalls 80-300 ms every 3rd-6th step from step 20-40 on, 6-8 times"),
    FaultClass("host-work-rank", draw_host_work_rank,
               notes="one rank's loop works 80-300 ms on the host after every 3rd-6th step, before the next one"),
    FaultClass("host-work-barrier", draw_host_work_barrier,
               notes="as host-work-rank, then a barrier on every rank after each step"),
    FaultClass("slow-rank", draw_slow_rank, notes="one rank 20-60 ms slower in forward, backward or optimizer step"),
    FaultClass("slow-and-stall", draw_slow_and_stall, judge_both,
               notes="one rank 30-60 ms late in its loader, forward or backward at every step, and a loader stall of "
               "80-250 ms every 3rd-5th step on it or on the other rank: both found"),
    FaultClass("slow-rank-long", draw_slow_rank_long,
               notes="one rank 20-60 ms slower in a phase for 150-250 steps; in half the draws 1-3 spinning processes "
               "arrive 4-8 s after the first telemetry file"),
    FaultClass("comm-heavy", draw_comm_heavy, notes="each backward all-reduces a 32-64 MiB buffer too, ZeRO 0-2"),
    FaultClass("input-shift", draw_input_shift, judge_change, notes="sequence length x2, x4 or /2 at a random step"),
    FaultClass("input-spell", draw_input_spell, judge_spell,
               notes="sequence length x2-x8 for 3-8 steps, then back, on every rank or on one"),
    FaultClass("input-shift-busy", draw_input_shift_busy, judge_change,
               notes="the input shift while 1-3 spinning processes arrive, or leave, during the steps"),
    FaultClass("compute-slowdown", draw_compute_slowdown, judge_change,
               notes="every rank's forward and backward 4-6x slower from a random step, same input"),
    FaultClass("hang", draw_hang, judge_hang, notes="rank 0-1 blocks in forward/backward of step 2-10, diagnosed live"),
    FaultClass("hang-between-steps", draw_hang_between_steps, judge_hang,
               notes="rank 0-1 blocks in the data loader before step 2-10 or after its engine.step(), diagnosed live"),
    FaultClass("stall", draw_stall, judge_stall,
               notes="rank 0-1 pauses 4-8 s in forward/backward/data/after-step of step 3-10, then goes on"),
    FaultClass("desync", draw_desync, judge_desync, notes="one rank all-reduces int32 where the other float32"),
    FaultClass("crash", draw_crash, judge_crash,
               notes="rank 0-1 fails after step 2-18: raises in its forward, data loader, loop code or after its "
               "step (2/5), or is SIGKILLed, os._exit()s or segfaults there (1/5 each)"),
]




def diagnose(workdir: Path) -> tuple[dict | None, float, str]:
    started = time.perf_counter()
    diagnosed = subprocess.run([str(BIN / "opentelemetry-deepspeed"), "diagnose", "--json"], cwd=workdir,
                               capture_output=True, text=True, timeout=600, check=False)
    seconds = time.perf_counter() - started
    try:
        return json.loads(diagnosed.stdout), seconds, diagnosed.stderr[-500:]
    except json.JSONDecodeError:
        return None, seconds, diagnosed.stderr[-500:]


def _command(draw: Draw) -> tuple[list[str], dict]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OTEL_", "TORCHELASTIC_"))
           and key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", **draw.env)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    port = str(free_port())
    if draw.ranks == 1:
        env["MASTER_PORT"] = port
        return [str(BIN / "opentelemetry-instrument"), sys.executable, str(TRAIN), *draw.args], env
    return [str(BIN / "opentelemetry-instrument"), str(BIN / "torchrun"), "--nproc_per_node", str(draw.ranks),
            "--master_port", port, str(TRAIN), *draw.args], env


def run_once(draw: Draw, workdir: Path) -> tuple[dict | None, float, str]:
    command, env = _command(draw)
    if draw.live:
        return run_live(command, env, workdir)
    neighbour = Neighbour(draw.neighbour, env, workdir) if draw.neighbour is not None else None
    try:
        completed = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=600,
                                   check=False)
    finally:
        if neighbour is not None:
            neighbour.stop()
    if completed.returncode and not (workdir / "telemetry").is_dir():
        return None, 0.0, completed.stderr[-1500:]
    report, seconds, problem = diagnose(workdir)
    if completed.returncode:  # a job that died still left its telemetry, which a user would diagnose
        problem = f"exit code {completed.returncode}: {completed.stderr[-1500:]}"
    return report, seconds, problem


class Neighbour:
    """Other processes on the host (``Draw.neighbour``): started at the launch or a moment after the run has
    written its first telemetry (its steps have begun), killed a moment after that or when the run ends."""

    def __init__(self, neighbour: tuple, env: dict, workdir: Path):
        self.kind, self.count, self.start, *leave = neighbour
        self.leave = leave[0] if leave else None
        self.env = {key: value for key, value in env.items() if not key.startswith("OTEL_")}  # not instrumented
        self.workdir = workdir
        self.processes: list[subprocess.Popen] = []
        self.lock = threading.Lock()
        self.ended = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        if self.start is None:
            self._spawn()
        self._wait_for_telemetry()
        if self.start is not None:
            if self.ended.wait(self.start):
                return
            self._spawn()
        if self.leave is not None and not self.ended.wait(self.leave - (self.start or 0.0)):
            self._kill()  # it leaves while the run goes on

    def _wait_for_telemetry(self) -> None:
        while not self.ended.is_set() and not list(self.workdir.glob("telemetry/*/traces-rank*.jsonl")):
            time.sleep(0.1)

    def _spawn(self) -> None:
        home = self.workdir / "neighbour"
        home.mkdir(exist_ok=True)
        commands = ([[str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), str(TRAIN),
                      "--steps", "100000"]] if self.kind == "job"
                    else [[sys.executable, "-c", "while True: pass"]] * self.count)
        with self.lock:
            for command in commands:
                if self.ended.is_set():
                    return
                self.processes.append(subprocess.Popen(command, cwd=home, env=self.env, stdout=subprocess.DEVNULL,
                                                       stderr=subprocess.DEVNULL, start_new_session=True))

    def stop(self) -> None:
        self.ended.set()
        self._kill()

    def _kill(self) -> None:
        import psutil

        with self.lock:
            processes, self.processes = self.processes, []
            for process in processes:
                # torchrun starts its workers in sessions of their own: its process group alone leaves them running
                with contextlib.suppress(psutil.Error):
                    for child in psutil.Process(process.pid).children(recursive=True):
                        with contextlib.suppress(psutil.Error):
                            child.kill()
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def threshold_crossing(workdir: Path) -> float | None:
    """The earliest moment a rank's step went past its hang threshold, from its watchdog's reports."""
    times = []
    for path in workdir.glob("telemetry/*/traces-rank*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                document = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            for resource in document.get("resourceSpans", ()):
                for scope in resource["scopeSpans"]:
                    for span in scope["spans"]:
                        if span["name"] == "training.hang":
                            values = {a["key"]: next(iter(a["value"].values())) for a in span["attributes"]}
                            times.append(int(span["endTimeUnixNano"]) / 1e9 - float(values["training.hang.duration"])
                                         + float(values["training.hang.threshold"]))
    return min(times) if times else None


def run_live(command: list[str], env: dict, workdir: Path) -> tuple[dict | None, float, str]:
    """A job that hangs: `diagnose` on its directory every second while it runs, until the verdict is a
    HANG with every rank's report in (confidence 0.9) or a minute after the first HANG; then the job is
    killed. Returns the last report and the seconds from the threshold's crossing to the first HANG."""
    with open(workdir / "job.log", "w", encoding="utf-8") as log:
        job = subprocess.Popen(command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    report, found_at, started = None, None, time.monotonic()
    try:
        while time.monotonic() - started < LIVE_TIMEOUT:
            ended = job.poll() is not None
            if (workdir / "telemetry").is_dir():
                report = diagnose(workdir)[0] or report
                verdict = (report or {}).get("verdict") or {}
                if verdict.get("layer") == "HANG":
                    found_at = found_at or time.time()
                    if verdict.get("confidence", 0) >= 0.9 or time.time() - found_at > 60:
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
    crossing = threshold_crossing(workdir)
    seconds = found_at - crossing if found_at and crossing else float("nan")
    problem = "" if report else (workdir / "job.log").read_text()[-1500:]
    return report, seconds, problem


def record(fault: FaultClass, draw: Draw, report: dict | None, seconds: float, args,  # noqa: PLR0917
           problem: str = "") -> tuple[dict, float]:
    if report is None:
        score = {"layer": False, "rank": False, "pattern": False}
        verdict = {"layer": "run failed", "summary": ""}
    else:
        score = fault.judge(report, draw.expected)
        verdict = report["verdict"]
    line = {"class": fault.name, "args": draw.args, "ranks": draw.ranks, "expected": draw.expected.__dict__,
            "verdict": {k: verdict.get(k) for k in ("layer", "rank", "period", "offset", "phase", "step",
                                                    "change_step", "share_of_run", "confidence", "summary")},
            "score": score, "seconds_to_verdict" if draw.live else "diagnose_seconds": round(seconds, 2),
            "load_average": round(os.getloadavg()[0], 1)}
    if report is not None and fault.name.startswith("healthy"):
        line["exposed_comm_share"] = (report.get("job") or {}).get("shares", {}).get("exposed_comm")
        line["host_load"] = [load["summary"] for load in report.get("host_load", ())]
    if draw.neighbour is not None:
        line["neighbour"] = draw.neighbour
    if report is not None and problem.startswith("exit code"):
        line["job_exit"] = problem.split(":", 1)[0]  # diagnosed all the same
    if report is not None and fault.name == "comm-heavy":
        line["shares"] = {k: round(v, 3) for k, v in (report.get("job") or {}).get("shares", {}).items()}
    print(json.dumps(line), flush=True)
    if args.results:
        with open(args.results, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(line) + "\n")
    return score, seconds


def print_table(table: dict) -> None:
    print("\n| class | runs | right layer | right rank | right period / phase / step | all right "
          "| time to verdict s (median / max) |")
    print("|---|---|---|---|---|---|---|")
    for name, rows in table.items():
        count = len(rows)
        right = {key: sum(score[key] for score, _s in rows) for key in ("layer", "rank", "pattern")}
        every = sum(all(score.values()) for score, _s in rows)
        times = [s for _x, s in rows if math.isfinite(s)]
        timing = f"{statistics.median(times):.1f} / {max(times):.1f}" if times else "-"
        print(f"| {name} | {count} | {right['layer']}/{count} | {right['rank']}/{count} | {right['pattern']}/{count} "
              f"| {every}/{count} | {timing} |")


def rescore(directories: list[Path], args) -> None:
    table = {}
    classes = {fault.name: fault for fault in CLASSES}
    kept_runs = sorted((kept for directory in directories for kept in directory.iterdir() if kept.is_dir()),
                       key=lambda p: (p.name.rsplit("-", 1)[0], int(p.name.rsplit("-", 1)[1])))
    for kept in kept_runs:
        saved = json.loads((kept / "draw.json").read_text())
        fault = classes[saved["class"]]
        draw = Draw(saved["args"], Expected(**saved["expected"]), saved["ranks"])  # after the fact, hangs too
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
    # Round robin over the classes, each class's runs spread evenly over the sitting (the healthy class
    # has more), so that a load on the machine falls on all of them alike.
    counts = {fault.name: args.healthy if fault.name == "healthy" else args.repeat for fault in chosen}
    schedule = sorted(((fault, repetition) for fault in chosen for repetition in range(counts[fault.name])),
                      key=lambda item: (item[1] + 0.5) / counts[item[0].name])
    for fault, repetition in schedule:
        draw = fault.draw(rng)
        workdir = Path(tempfile.mkdtemp(prefix=f"accuracy-{fault.name}-"))
        report, seconds, problem = run_once(draw, workdir)
        if report is None or problem.startswith("exit code"):
            print(f"{fault.name} #{repetition}: the run failed: {problem}", flush=True)
        table[fault.name].append(record(fault, draw, report, seconds, args, problem))
        if args.keep and (workdir / "telemetry").is_dir():
            kept = Path(args.keep) / f"{fault.name}-{repetition}"
            shutil.copytree(workdir / "telemetry", kept / "telemetry", dirs_exist_ok=True)
            (kept / "draw.json").write_text(json.dumps({"class": fault.name, "args": draw.args, "ranks": draw.ranks,
                                                        "expected": draw.expected.__dict__}))
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(table)


if __name__ == "__main__":
    main()
