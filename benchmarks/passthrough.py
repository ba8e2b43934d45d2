"""The cost per step of the instrumentation with no SDK configured.

With nothing behind the OpenTelemetry API, each instrumentor that was given no providers of its
own removes its wrappers when training starts (``session.leave_if_silent``). This checks that
inside real steps: every wrapper the three instrumentors install is itself wrapped by a timer
that counts its calls and adds up its own time (not the time of the call it passes on). Steps
alternate between the real wrappers and the original called straight from the same timer, so that
where wrappers do run (``--keep-wrappers``: the pass-through path a forked child takes) the
difference is their own code's cost in situ and the other arm the timer's cost.

    python benchmarks/passthrough.py --zero-stage 2 --steps 2000
    python benchmarks/passthrough.py --keep-wrappers
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--keep-wrappers", action="store_true",
                        help="measure the pass-through wrappers that no-SDK training removes")
    return parser.parse_args()


class WrapperTimer:
    """Wraps each replacement the instrumentors install; ``real`` chooses the replacement or the original behind
    the same timer for the next calls."""

    def __init__(self):
        self.real = True
        self.own_ns = {True: 0, False: 0}
        self.calls = {True: 0, False: 0}
        self.counting = False

    def around(self, factory):
        perf_counter_ns = time.perf_counter_ns

        def timed_factory(original):
            inner = []  # per call, innermost last: the time spent in the original, left out of the wrapper's own

            def call(*args, **kwargs):
                started = perf_counter_ns()
                try:
                    return original(*args, **kwargs)
                finally:
                    inner[-1] += perf_counter_ns() - started

            replaced = factory(call)

            def timed(*args, **kwargs):
                real = self.real
                inner.append(0)
                started = perf_counter_ns()
                try:
                    return (replaced if real else call)(*args, **kwargs)
                finally:
                    own = perf_counter_ns() - started - inner.pop()
                    if self.counting:
                        self.own_ns[real] += own
                        self.calls[real] += 1

            return timed

        return timed_factory


def main():
    args = parse_args()
    from overhead import example_batches, example_engine, example_step, prepare_process

    from opentelemetry_instrumentation_deepspeed import (
        CommInstrumentor,
        DataLoaderInstrumentor,
        DeepSpeedInstrumentor,
    )
    from opentelemetry_instrumentation_deepspeed.instrumentors import patching
    from opentelemetry_instrumentation_deepspeed.runtime import session

    if args.keep_wrappers:
        session.leave_if_silent = lambda _instrumentor, _kwargs: None

    prepare_process()
    timer = WrapperTimer()
    install = patching.replacement
    patching.replacement = lambda original, factory: install(original, timer.around(factory))
    for instrumentor in (DeepSpeedInstrumentor(), DataLoaderInstrumentor(), CommInstrumentor()):
        instrumentor.instrument()

    engine = example_engine(args.zero_stage)
    assert session.silent, "no SDK is configured: the instrumentation must be silent"
    world = engine.world_size
    batches = example_batches(engine, args.warmup + args.steps)
    step_times = []
    for index in range(args.warmup + args.steps):
        timer.counting = index >= args.warmup
        timer.real = index % 2 == 0
        started = time.perf_counter()
        example_step(engine, batches)
        step_times.append(time.perf_counter() - started)
    if engine.global_rank != 0:
        return
    steps = {True: (args.steps + 1) // 2, False: args.steps // 2}
    own = {arm: timer.own_ns[arm] / steps[arm] / 1e3 for arm in (True, False)}
    calls = timer.calls[True] / steps[True]
    print(f"ZeRO-{args.zero_stage}, world size {world}, no SDK configured, {args.steps} steps "
          f"(median {statistics.median(step_times[args.warmup:]) * 1e3:.2f} ms)")
    print(f"  wrapper calls per step: {calls:.1f}")
    print(f"  wrappers' own time per step, in situ: {own[True]:.1f} us; the original behind the same "
          f"timer: {own[False]:.1f} us; the wrappers' logic: {own[True] - own[False]:+.1f} us")
    print(f"  added per step without an SDK: at most {own[True]:.1f} us (timer included), about "
          f"{own[True] - own[False]:.1f} us without it")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
