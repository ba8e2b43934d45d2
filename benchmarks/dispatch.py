"""What a wrapper's dispatch costs inside real steps: no wrapper, a wrapt proxy, a plain function.

No instrumentation runs here. The functions a step calls through the instrumentors' wrappers (the
engine's ``forward``, ``backward``, ``_backward_prologue``, ``_backward_epilogue`` and ``step``, and
every collective of ``deepspeed.comm`` and ``torch.distributed``) are replaced, step by step in
rotating order, by one of four things that only pass the call on:

- bare: the original;
- wrapt: a ``wrapt.FunctionWrapper`` around it, the proxy ``wrap_function_wrapper`` installs;
- plain: a plain function that calls the original itself (what ``instrumentors/patching.py`` installs);
- plain + wrapper: a plain function that calls a wrapt-style ``wrapper(wrapped, instance, args,
  kwargs)``, which calls the original (the wrappers' signature kept, one frame more).

Each arm's training-thread CPU time per step is compared with the bare step just before or after it.
The same code in a warm loop says much less: there a wrapt call costs ~0.6 us more than a plain
one, and inside a step the caches it needs have gone cold.

    OMP_NUM_THREADS=1 python benchmarks/dispatch.py --steps 1500
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
sys.path.insert(0, str(REPO / "benchmarks"))

ARMS = ("bare", "wrapt", "plain", "plain + wrapper")
ENGINE_METHODS = ("forward", "backward", "_backward_prologue", "_backward_epilogue", "step")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1500, help="steps per arm")
    parser.add_argument("--warmup", type=int, default=30)
    return parser.parse_args()


def _pass_on(wrapped, _instance, args, kwargs):
    return wrapped(*args, **kwargs)


def _method_variants(original) -> tuple:
    import wrapt

    def plain(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    def plain_and_wrapper(self, *args, **kwargs):
        return _pass_on(original.__get__(self), self, args, kwargs)

    return original, wrapt.FunctionWrapper(original, _pass_on), plain, plain_and_wrapper


def _function_variants(original) -> tuple:
    import wrapt

    def plain(*args, **kwargs):
        return original(*args, **kwargs)

    def plain_and_wrapper(*args, **kwargs):
        return _pass_on(original, None, args, kwargs)

    return original, wrapt.FunctionWrapper(original, _pass_on), plain, plain_and_wrapper


def replaceable() -> list[tuple]:
    """(owner, name, variants by arm) of every attribute the instrumentors would replace on a step's path."""
    import deepspeed.comm
    import deepspeed.comm.comm
    import torch.distributed
    from deepspeed.runtime.engine import DeepSpeedEngine
    from torch.distributed import distributed_c10d

    from opentelemetry_instrumentation_deepspeed.instrumentors.collectives import DEEPSPEED_OPS, TORCH_OPS

    found = [(DeepSpeedEngine, name, _method_variants(vars(DeepSpeedEngine)[name])) for name in ENGINE_METHODS]
    for modules, ops in (((torch.distributed, distributed_c10d), TORCH_OPS),
                         ((deepspeed.comm, deepspeed.comm.comm), DEEPSPEED_OPS)):
        for name in ops:
            original = getattr(modules[1], name, None)
            if original is None:
                continue
            variants = _function_variants(original)
            found += [(module, name, variants) for module in modules if getattr(module, name, None) is original]
    return found


def main():
    args = parse_args()
    from overhead import example_batches, example_engine, prepare_process

    prepare_process()
    engine = example_engine(args.zero_stage, 1)
    batches = example_batches(engine, args.warmup + len(ARMS) * args.steps)
    attributes = replaceable()

    def step(arm: int) -> float:
        for owner, name, variants in attributes:  # outside the timed step; every step sets them alike
            setattr(owner, name, variants[arm])
        started = time.thread_time()
        loss = engine(**next(batches))
        engine.backward(loss)
        engine.step()
        return time.thread_time() - started

    for _ in range(args.warmup):
        step(0)
    times: list[list[float]] = [[] for _ in ARMS]
    order = list(range(len(ARMS)))
    for index in range(args.steps):
        shift = index % len(ARMS)
        for arm in order[shift:] + order[:shift]:
            times[arm].append(step(arm))
    for owner, name, variants in attributes:
        setattr(owner, name, variants[0])
    if engine.global_rank != 0:
        return
    print(f"ZeRO-{args.zero_stage}, {len(attributes)} attributes replaced, {args.steps} steps per arm, "
          f"bare step {statistics.median(times[0]) * 1e3:.2f} ms of training-thread CPU")
    for arm in range(1, len(ARMS)):
        differences = sorted(b - a for a, b in zip(times[0], times[arm], strict=True))
        cut = len(differences) // 10
        trimmed = differences[cut:len(differences) - cut]
        mean, median = statistics.mean(differences) * 1e6, statistics.median(differences) * 1e6
        print(f"  {ARMS[arm]:>15} - bare: mean {mean:+6.1f} us per step, "
              f"10%-trimmed mean {statistics.mean(trimmed) * 1e6:+6.1f}, median {median:+6.1f}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
