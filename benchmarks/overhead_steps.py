"""Added time per optimizer step, alternating every step within one engine, with an A/A control.

``overhead.py`` alternates blocks, each with a fresh engine: on the 2-core benchmark machine two
engines of the same model differ by more than the instrumentation costs (a bare block's median
step ranges from 15 to 25 ms), so its intervals are wide. Here one instrumented engine runs
triples of steps in rotating order: active (B), inert (A) and inert again (A', the control).
Inert is each component's off switch (the one a failure throws): the wrappers stay and only pass
calls through. Spans and metrics are exported as the embedded default exports them.

``--baseline bare`` makes A and A' bare instead: every attribute the instrumentors replaced with a
wrapper gets its original back for those steps (and the wrapper for B's), so B - A is the whole
added time, the wrappers' own dispatch included, which an inert wrapper still costs and B - A
with the default baseline leaves out.

What B - A measures is the training thread's own added time. Work on other threads (the emitter
making spans and metric points from step records, the span exporter encoding) lands on whichever step runs beside it, as
does the garbage collector's, so it is spread over all arms; their CPU time per active step is
measured and reported beside it. The mean is the figure; the 10%-trimmed mean (steps that a
stall elsewhere on the machine hit left out) narrows the interval where the machine is noisy.

    python benchmarks/overhead_steps.py --zero-stage 2 --triples 400
    torchrun --nproc_per_node 2 benchmarks/overhead_steps.py --block 40 --triples 30

``--block N`` alternates blocks of N steps instead of single steps, each block's figure the median
of its steps after the first fifth: the work other threads do for a block's records then lands in
the block itself, not in the next one. On 2 ranks sharing 2 cores that work competes with the
training threads, so the block ratio B / A is the whole instrumentation's cost, inside one
engine pair (run-to-run differences between whole runs, several percent here, are left out).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "benchmarks"))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--triples", type=int, default=400)
    parser.add_argument("--block", type=int, default=1, help="steps per arm in a row (see above)")
    parser.add_argument("--block-mean", action="store_true",
                        help="a block's figure is the mean of its steps, not the median: the other threads' work "
                             "that delays a few of its steps counts")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--mode", choices=("full", "sampled-out"), default="full")
    parser.add_argument("--dump", type=Path, help="write every step's time per arm to this JSON file")
    parser.add_argument("--baseline", choices=("inert", "bare"), default="inert",
                        help="what A and A' run: the wrappers switched off, or no wrappers at all (see above)")
    parser.add_argument("--drop-records", action="store_true",
                        help="the emitter drops each record unread: the steps with no span or metric work beside them")
    parser.add_argument("--feed-companion", action="store_true",
                        help="the emitter packs each record into a shared-memory ring that another process makes "
                             "the spans and metric points of (companion_feed.py)")
    parser.add_argument("--endpoint-down", action="store_true",
                        help="traces over OTLP/HTTP to a loopback port nobody listens on")
    return parser.parse_args()


def main():  # noqa: PLR0915 - one benchmark, read top to bottom
    args = parse_args()
    # Kernel sampling has its own figure (a profiled step): here every step is an ordinary one.
    os.environ.setdefault("OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY", "0")
    os.environ.setdefault("OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR", "0")
    from companion_feed import pack
    from overhead import example_batches, example_engine, prepare_process, setup_sdk

    from opentelemetry_instrumentation_deepspeed import (
        CommInstrumentor,
        DataLoaderInstrumentor,
        DeepSpeedInstrumentor,
    )
    from opentelemetry_instrumentation_deepspeed.export.emitter import Emitter
    from opentelemetry_instrumentation_deepspeed.recording import registry
    from opentelemetry_instrumentation_deepspeed.recording.record import StepRecord
    from opentelemetry_instrumentation_deepspeed.recording.recorder import StepRecorder

    recorder_cpu = [0.0]  # the CPU time of the emitter's drains, on whichever thread they ran
    drain = Emitter._drain  # inside the shipped drain(), which holds the emitter's lock: one drain at a time
    companion = Companion() if args.feed_companion else None

    def timed_drain(self, final, read_waits):
        started = time.thread_time()
        try:
            if not args.drop_records and companion is None:
                return drain(self, final, read_waits)
            # Nothing made of the records here: dropped, or packed for the companion (the ring has one producer
            # at a time: the lock).
            queue = self._queue
            while queue:
                record = queue.popleft()
                if type(record) is StepRecorder:  # its log is built into records, queued here
                    record.replay()
                elif type(record) is StepRecord:
                    # As shipped: each step's wait for a CPU decides whether its phases are read.
                    if record.schedstat is not None:
                        record.facts.host_cpu.waited(record.schedstat, record.end)
                    if companion is not None:
                        companion.ring.put(pack(record))
            return None
        finally:
            recorder_cpu[0] += time.thread_time() - started

    Emitter._drain = timed_drain

    prepare_process()
    tracer_provider, meter_provider, counted = setup_sdk(Path(tempfile.mkdtemp(prefix="otel-ds-steps-")),
                                                         args.mode == "sampled-out")
    if args.endpoint_down:
        from soak import provider_with_endpoint_down

        tracer_provider = provider_with_endpoint_down(meter_provider)
    comm = CommInstrumentor()
    for instrumentor in (DeepSpeedInstrumentor(), DataLoaderInstrumentor(), comm):
        instrumentor.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)

    engine = example_engine(args.zero_stage, args.grad_accum)
    world = engine.world_size
    batches = example_batches(engine, (args.warmup + 3 * args.triples * args.block) * args.grad_accum)
    recorder = registry.recorder_for(engine)
    observer = comm._observer

    collections = CollectorPauses()
    on_cuda = getattr(engine.device, "type", None) == "cuda"
    swaps = wrapped_attributes() if args.baseline == "bare" else []

    def step(active: bool) -> tuple[float, float]:
        recorder.broken = observer.broken = not active
        for owner, name, wrapper, original in swaps:  # outside the timed step; every step sets them alike
            setattr(owner, name, wrapper if active else original)
        collections.arm = "B" if active else "A"
        started, cpu_started = time.perf_counter(), time.thread_time()
        for _ in range(args.grad_accum):
            batch = next(batches)
            if on_cuda:
                batch = {key: value.to(engine.device, non_blocking=True) for key, value in batch.items()}
            loss = engine(**batch)
            engine.backward(loss)
            engine.step()
        return time.perf_counter() - started, time.thread_time() - cpu_started

    for _ in range(args.warmup):
        step(True)
    gc.callbacks.append(collections.callback)
    tracer_provider.force_flush()
    spans_before, export_cpu_before, recorder_cpu_before = counted.spans, counted.cpu_seconds, recorder_cpu[0]
    arms: dict[str, list[float]] = {"A": [], "B": [], "A'": []}
    cpu_arms: dict[str, list[float]] = {"A": [], "B": [], "A'": []}
    order = ["A", "B", "A'"]
    for index in range(args.triples):
        for arm in order[index % 3:] + order[:index % 3]:
            if args.block == 1:
                wall, cpu = step(arm == "B")
            else:
                block = [step(arm == "B") for _ in range(args.block)][args.block // 5:]
                statistic = statistics.fmean if args.block_mean else statistics.median
                wall, cpu = (statistic(times) for times in zip(*block, strict=True))
            arms[arm].append(wall)
            cpu_arms[arm].append(cpu)
    tracer_provider.force_flush()
    meter_provider.force_flush()
    spans, background = counted.spans - spans_before, {
        "span exporter": counted.cpu_seconds - export_cpu_before,
        "emitter (spans and metric points)": recorder_cpu[0] - recorder_cpu_before,
    }
    if companion is not None:
        background["companion process"] = companion.stop()
    gc.callbacks.remove(collections.callback)
    if engine.global_rank == 0:
        report(args, world, arms, cpu_arms, spans=spans, background=background)
        steps = {"B": args.triples * args.block, "A": 2 * args.triples * args.block}  # "A": both A arms
        print("  garbage collector pauses per step: " + ", ".join(
            f"{'active' if arm == 'B' else args.baseline} {seconds / steps[arm] * 1e6:.1f} us "
            f"({collections.count[arm]} collections, {collections.full[arm]} of them full, "
            f"the longest {collections.longest[arm] * 1e3:.1f} ms)"
            for arm, seconds in collections.seconds.items()))
        if args.dump:
            args.dump.write_text(json.dumps({"wall": arms, "training thread cpu": cpu_arms}))
    tracer_provider.shutdown()
    meter_provider.shutdown()


def wrapped_attributes() -> list[tuple]:
    """(owner, name, replacement, original) of every replacement in torch's and DeepSpeed's modules and classes:
    what the instrumentors installed (the methods of classes, the functions of modules and their copies bound
    elsewhere)."""
    import warnings

    from opentelemetry_instrumentation_deepspeed.instrumentors.patching import original_of

    found = []
    with warnings.catch_warnings():  # isinstance() reads __class__, which deprecated module attributes warn about
        warnings.simplefilter("ignore")
        for module_name, module in list(sys.modules.items()):
            if module is None or not module_name.startswith(("torch", "deepspeed")):
                continue
            owners = [module, *(value for value in list(vars(module).values())
                                if isinstance(value, type) and value.__module__ == module_name)]
            for owner in owners:
                for name, value in list(vars(owner).items()):
                    original = original_of(value)
                    if original is not None:
                        found.append((owner, name, value, original))
    return found


class Companion:
    """``--feed-companion``: the other end of the ring is a process of its own (companion_feed.py)."""

    def __init__(self):
        import subprocess

        from companion_feed import RingWriter

        self.ring = RingWriter()
        self.directory = Path(tempfile.mkdtemp(prefix="otel-ds-companion-"))
        self.process = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "companion_feed.py"),
                                         self.ring.memory.name, str(self.directory)])

    def stop(self) -> float:
        """The companion's CPU seconds from its set-up on (its exporter's included), once it has read everything."""
        (self.directory / "stop").touch()
        try:
            self.process.wait(timeout=120)
        finally:
            self.process.kill()  # nothing, if it has exited
            self.ring.close()
        steps, seconds = (self.directory / "companion.txt").read_text().split()
        print(f"  companion: {steps} steps read, {self.ring.dropped} dropped (ring full)")
        return float(seconds)


class CollectorPauses:
    """Time the garbage collector stops the training thread, by the arm of the step it stops."""

    def __init__(self):
        self.arm = "A"
        self.seconds = {"B": 0.0, "A": 0.0}  # "A": both A arms
        self.count = {"B": 0, "A": 0}
        self.longest = {"B": 0.0, "A": 0.0}
        self.full = {"B": 0, "A": 0}  # collections of the oldest generation: every object of the process
        self._started = 0.0

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        self.seconds[self.arm] += pause
        self.count[self.arm] += 1
        self.full[self.arm] += info.get("generation") == 2
        self.longest[self.arm] = max(self.longest[self.arm], pause)


def report(args, world: int, arms: dict[str, list[float]], cpu_arms: dict[str, list[float]], *, spans: int,
           background: dict[str, float]) -> None:
    print(f"ZeRO-{args.zero_stage}, grad accumulation {args.grad_accum}, world size {world}, mode {args.mode}"
          f"{', OTLP endpoint down' if args.endpoint_down else ''}, {args.triples} triples of "
          f"{'steps' if args.block == 1 else f'blocks of {args.block} steps'}, alternating within one engine")
    for arm, times in arms.items():
        print(f"  {arm:2}: median step {statistics.median(times) * 1e3:8.3f} ms"
              f"  ({statistics.median(times) / statistics.median(arms['A']):.4f} x A)")
    print(" wall time of the step:")
    differences(arms, args.baseline)
    # The training thread's CPU time leaves out the time other processes take the core from it, so
    # on a loaded machine it bounds the added work far more tightly than the wall time does.
    print(" CPU time of the training thread during the step:")
    differences(cpu_arms, args.baseline)
    active_steps = args.triples * args.block
    print(f"  spans per active step on this rank: {spans / active_steps:.1f}")
    print("  CPU time of other threads per active step: " + ", ".join(
        f"{name} {seconds / active_steps * 1e6:.1f} us" for name, seconds in background.items()))


def differences(arms: dict[str, list[float]], baseline: str = "inert") -> None:
    from overhead import bootstrap, trimmed_mean

    base = statistics.median(arms["A"])
    for label, arm in ((f"active - {baseline} (B - A)", "B"), ("control      (A' - A)", "A'")):
        differences = [(b - a) * 1e6 for a, b in zip(arms["A"], arms[arm], strict=True)]
        mean = statistics.fmean(differences)
        low, high = bootstrap(differences)
        trimmed = trimmed_mean(differences)
        trimmed_low, trimmed_high = bootstrap(differences, draws=2000, estimator=trimmed_mean)
        print(f"  {label}: {mean:+8.1f} us/step  95% CI [{low:+.1f}, {high:+.1f}]  = "
              f"{mean / (base * 1e6) * 100:+.2f}% of this {base * 1e3:.1f} ms step, "
              f"{mean / 1e3:+.3f}% of a 100 ms step, {mean / 1e4:+.4f}% of a 1 s step; "
              f"trimmed mean {trimmed:+.1f} [{trimmed_low:+.1f}, {trimmed_high:+.1f}]")


if __name__ == "__main__":
    main()
