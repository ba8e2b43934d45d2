"""The cost per step of the instrumentation with no SDK configured.

With nothing behind the OpenTelemetry API, each instrumentor that was given no providers of its
own removes its wrappers when training starts (``session.leave_if_silent``). This checks that
inside real steps: every wrapper the three instrumentors install is itself wrapped by a timer
that counts its calls and adds up its own time (not the time of the call it passes on). Steps
alternate between the real wrappers and a wrapper that only passes the call on, behind the same
timer, so that where wrappers do run (``--keep-wrappers``: the pass-through path a forked child
takes) the difference is their own code's cost in situ and the identity arm the timer's cost.
wrapt's dispatch (C code, the same for any wrapper) is added from an isolated figure per call.

    python benchmarks/passthrough.py --zero-stage 2 --steps 2000
    python benchmarks/passthrough.py --keep-wrappers
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import timeit
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


def _identity(wrapped, _instance, args, kwargs):
    return wrapped(*args, **kwargs)


class WrapperTimer:
    """Wraps each installed wrapper; ``real`` chooses the real one or ``_identity`` for the next calls."""

    def __init__(self):
        self.real = True
        self.own_ns = {True: 0, False: 0}
        self.calls = {True: 0, False: 0}
        self.counting = False

    def around(self, wrapper):
        perf_counter_ns = time.perf_counter_ns

        def timed(wrapped, instance, args, kwargs):
            real = self.real
            inner = 0

            def call(*call_args, **call_kwargs):
                nonlocal inner
                started = perf_counter_ns()
                try:
                    return wrapped(*call_args, **call_kwargs)
                finally:
                    inner += perf_counter_ns() - started

            started = perf_counter_ns()
            try:
                return (wrapper if real else _identity)(call, instance, args, kwargs)
            finally:
                if self.counting:
                    self.own_ns[real] += perf_counter_ns() - started - inner
                    self.calls[real] += 1

        return timed


def wrapt_dispatch_us() -> float:
    """What wrapt adds to a call of a wrapped method, isolated: the same for any wrapper."""
    import wrapt

    class Plain:
        def method(self, value):
            return value

    class Wrapped(Plain):
        pass

    wrapt.wrap_function_wrapper(Wrapped, "method", _identity)
    plain, wrapped = Plain(), Wrapped()
    number = 200_000
    bare = min(timeit.repeat(lambda: plain.method(1), number=number, repeat=5))
    through = min(timeit.repeat(lambda: wrapped.method(1), number=number, repeat=5))
    return (through - bare) / number * 1e6


def main():
    args = parse_args()
    import wrapt
    from overhead import example_batches, example_engine, example_step, prepare_process

    from opentelemetry_instrumentation_deepspeed import (
        CommInstrumentor,
        DataLoaderInstrumentor,
        DeepSpeedInstrumentor,
    )
    from opentelemetry_instrumentation_deepspeed.runtime import session

    if args.keep_wrappers:
        session.leave_if_silent = lambda _instrumentor, _kwargs: None

    prepare_process()
    timer = WrapperTimer()
    install = wrapt.wrap_function_wrapper
    wrapt.wrap_function_wrapper = lambda owner, name, wrapper: install(owner, name, timer.around(wrapper))
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
    dispatch = wrapt_dispatch_us()
    print(f"ZeRO-{args.zero_stage}, world size {world}, no SDK configured, {args.steps} steps "
          f"(median {statistics.median(step_times[args.warmup:]) * 1e3:.2f} ms)")
    print(f"  wrapper calls per step: {calls:.1f}")
    print(f"  wrappers' own time per step, in situ: {own[True]:.1f} us; an identity wrapper behind the same "
          f"timer: {own[False]:.1f} us; the wrappers' logic: {own[True] - own[False]:+.1f} us")
    print(f"  wrapt's dispatch, isolated: {dispatch:.2f} us per call, {dispatch * calls:.1f} us per step")
    print(f"  added per step without an SDK: at most {own[True] + dispatch * calls:.1f} us "
          f"(timer included), about {own[True] - own[False] + dispatch * calls:.1f} us without it")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
