"""Where the instrumentation's time goes inside real steps: each entry point, timed in place.

A profiler that traces every call costs more than what it measures, and the same code timed in a
loop runs warm, several times faster than between DeepSpeed's own Python, which evicts it from
the CPU caches. So the entry points that the wrappers call (the step recorder's and the collective
observer's) are each wrapped with two clock reads, and their time inside real ZeRO steps is added
up; ``--inner`` also times the functions they call (inclusive times, so nested ones overlap).
The clock reads add ~1 us per call; the sum is an upper bound of the training thread's share.

    python benchmarks/profile_steps.py --zero-stage 2 --steps 1000
    python benchmarks/profile_steps.py --mode sampled-out --inner
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "benchmarks"))

# The wrappers call most of these through module aliases of the methods' unguarded functions (their fail-open
# guard inline): those aliases are timed where the wrappers look them up, the methods for the other callers.
ENTRY_POINTS = {
    "recording.recorder.StepRecorder": ("data_waited", "forward_started", "backward_started", "phase_ended",
                                        "optimizer_step_started", "optimizer_step_ended"),
    "instrumentors.comm.CommObserver": ("issued", "completed"),
    "instrumentors.engine": ("_forward_started", "_forward_ended", "_backward_started", "_phase_ended",
                             "_optimizer_step_started", "_optimizer_step_ended"),
    "instrumentors.dataloader": ("_data_waited",),
    "instrumentors.comm": ("_issue", "_complete", "_finish"),
    "recording.inputs": ("left_loader",),
}
INNER = {
    "recording.recorder.StepRecorder": ("_start", "_end", "_fire", "_open", "_ended", "_close", "comm_issued",
                                        "_schedstat", "_hand_over"),
    "recording.scalars": ("take",),
    "recording.profiler.StepProfiler": ("step_opened", "step_closed"),
    "instrumentors.comm.CommObserver": ("_finish", "_group", "_route"),
}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--mode", choices=("full", "sampled-out"), default="full")
    parser.add_argument("--inner", action="store_true", help="also time the functions the entry points call")
    return parser.parse_args()


class Timers:
    def __init__(self):
        self.nanoseconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    def wrap(self, owner, name: str, label: str) -> None:
        function = getattr(owner, name)
        clock = time.perf_counter_ns

        def timed(*args, **kwargs):
            started = clock()
            try:
                return function(*args, **kwargs)
            finally:
                self.nanoseconds[label] += clock() - started
                self.calls[label] += 1

        setattr(owner, name, timed)

    def install(self, table: dict) -> None:
        import importlib

        for path, names in table.items():
            module_name, _, class_name = path.rpartition(".")
            if class_name[0].islower():  # a module's function, not a class's method
                module_name, class_name = path, ""
            owner = importlib.import_module(f"opentelemetry_instrumentation_deepspeed.{module_name}")
            if class_name:
                owner = getattr(owner, class_name)
            for name in names:
                self.wrap(owner, name, f"{path.split('.')[-1]}.{name}")


def main():
    args = parse_args()
    os.environ.setdefault("OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY", "0")
    os.environ.setdefault("OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR", "0")
    from overhead import example_batches, example_engine, example_step, prepare_process, setup_sdk

    from opentelemetry_instrumentation_deepspeed import CommInstrumentor, DataLoaderInstrumentor, DeepSpeedInstrumentor

    timers = Timers()
    timers.install(ENTRY_POINTS)
    if args.inner:
        timers.install(INNER)
    prepare_process()
    tracer_provider, meter_provider, _ = setup_sdk(Path(tempfile.mkdtemp(prefix="otel-ds-profile-")),
                                                   args.mode == "sampled-out")
    for instrumentor in (DeepSpeedInstrumentor(), DataLoaderInstrumentor(), CommInstrumentor()):
        instrumentor.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
    engine = example_engine(args.zero_stage)
    batches = example_batches(engine, args.warmup + args.steps)
    for _ in range(args.warmup):
        example_step(engine, batches)
    timers.nanoseconds.clear()
    timers.calls.clear()
    started = time.perf_counter()
    for _ in range(args.steps):
        example_step(engine, batches)
    step_ms = (time.perf_counter() - started) / args.steps * 1e3
    print(f"ZeRO-{args.zero_stage}, mode {args.mode}, {args.steps} steps of {step_ms:.2f} ms (timers included)")
    entry_labels = {f"{path.split('.')[-1]}.{name}" for path, names in ENTRY_POINTS.items() for name in names}
    total = 0
    for label, nanoseconds in timers.nanoseconds.most_common():
        calls = timers.calls[label]
        marker = "" if label in entry_labels else "   (inner)"
        print(f"  {label:40} {nanoseconds / args.steps / 1e3:7.1f} us/step  {calls / args.steps:4.1f} calls/step  "
              f"{nanoseconds / calls / 1e3:6.1f} us/call{marker}")
        if label in entry_labels:
            total += nanoseconds
    print(f"  entry points together: {total / args.steps / 1e3:.1f} us per step")
    tracer_provider.shutdown()
    meter_provider.shutdown()


if __name__ == "__main__":
    main()
