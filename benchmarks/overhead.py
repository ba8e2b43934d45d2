"""Added time per optimizer step: instrumented blocks interleaved with bare ones, plus an A/A control.

Runs the example model in this process (or on every rank, under torchrun). Each round runs
three blocks in rotating order: bare (A), instrumented (B) and bare again (A'). A block builds
a fresh engine, warms up, then times its steps; instrumenting toggles ``instrument()`` /
``uninstrument()``. Telemetry is really encoded: spans and metrics go through the SDK's batch
processor and periodic reader into the official OTLP JSON file exporters.

    python benchmarks/overhead.py --zero-stage 2
    torchrun --nproc_per_node 2 benchmarks/overhead.py --zero-stage 3

Reports, on rank 0: median step time per arm, B - A and A' - A (the control) in microseconds
per step with a 95% bootstrap interval over rounds, and spans per step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--mode", choices=("full", "sampled-out"), default="full",
                        help="full: every step recorded (the default settings); sampled-out: the sampler "
                             "drops every step (metrics still recorded). No SDK: benchmarks/passthrough.py")
    parser.add_argument("--sync-check", action="store_true",
                        help="on CUDA: count synchronizing operations per step in each arm")
    parser.add_argument("--profile-every", type=int, default=None,
                        help="OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY for the instrumented blocks (default: its default)")
    return parser.parse_args()


def setup_sdk(directory: Path, sampled_out: bool = False, export_interval_millis: int = 5000):
    """The SDK as the embedded default sets it up: batch processor and periodic reader into this
    project's OTLP JSON lines exporters. ``sampled_out``: every step's root is dropped by a
    parent-based sampler, as ``parentbased_traceidratio`` drops most of them."""
    os.environ["OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR"] = str(directory)
    from opentelemetry_instrumentation_deepspeed.runtime.environment_variables import DEFAULT_BSP_SCHEDULE_DELAY

    os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", DEFAULT_BSP_SCHEDULE_DELAY)  # as the distro sets it
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

    from opentelemetry_instrumentation_deepspeed.export import output
    from opentelemetry_instrumentation_deepspeed.runtime.job import identify

    output.use_identity(identify())
    counted = _CountingExporter(output.JsonLinesSpanExporter())
    tracer_provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF) if sampled_out else None)
    tracer_provider.add_span_processor(BatchSpanProcessor(counted))
    reader = PeriodicExportingMetricReader(output.JsonLinesMetricExporter(), export_interval_millis)
    meter_provider = MeterProvider(metric_readers=[reader])
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(meter_provider)
    return tracer_provider, meter_provider, counted


class _CountingExporter:
    """Counts the spans exported, and the exporter thread's CPU time spent encoding and writing them."""

    def __init__(self, inner):
        self.inner, self.spans, self.cpu_seconds = inner, 0, 0.0

    def export(self, spans):
        self.spans += len(spans)
        started = time.thread_time()
        try:
            return self.inner.export(spans)
        finally:
            self.cpu_seconds += time.thread_time() - started

    def shutdown(self):
        self.inner.shutdown()

    def force_flush(self, timeout_millis=30_000):
        return True


class SyncCounter:
    """On CUDA: synchronizing operations inside the timed steps, from torch's sync debug mode
    (warn) and from calls to the synchronize functions; the harness's own sync is outside."""

    def __init__(self, torch):
        self.torch = torch
        self.count = 0
        self._inside = False
        for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
                            (torch.cuda.Stream, "synchronize")):
            original = getattr(owner, name)

            def counting(*args, _original=original, **kwargs):
                self.count += self._inside
                return _original(*args, **kwargs)

            setattr(owner, name, counting)

    def __enter__(self):
        import warnings

        self._warnings = warnings.catch_warnings(record=True)
        self._caught = self._warnings.__enter__()
        warnings.simplefilter("always")
        self.torch.cuda.set_sync_debug_mode("warn")
        self._inside = True
        return self

    def __exit__(self, *exc):
        self._inside = False
        self.torch.cuda.set_sync_debug_mode(0)
        self.count += sum("synchroniz" in str(warning.message) for warning in self._caught)
        self._warnings.__exit__(*exc)


def prepare_process() -> None:
    """As every benchmark runs: one process unless a launcher set RANK and the rest, torch on one
    thread, DeepSpeed's shared-memory collective (a compiled op) off."""
    import deepspeed
    import torch
    import train as train_module

    train_module.default_single_process_env()
    torch.set_num_threads(1)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def example_engine(zero_stage: int, grad_accum: int = 1, d_model: int = 64, layers: int = 2,
                   micro_batch: int = 8):
    """A DeepSpeed engine on the example model (vocabulary 256, sequence 32) with AdamW."""
    import deepspeed
    import torch
    import train as train_module

    model = train_module.TinyLM(256, d_model, layers, 32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": grad_accum,
              "zero_optimization": {"stage": zero_stage}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def example_batches(engine, micro_batches: int, micro_batch: int = 8):
    """An iterator over ``micro_batches`` batches of synthetic tokens: this rank's share of them."""
    import torch
    import train as train_module

    world = engine.world_size
    dataset = train_module.SyntheticTokens(micro_batches * micro_batch * world, 32, 256, seed=1)
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world, rank=engine.global_rank,
                                                  shuffle=False)
    return iter(torch.utils.data.DataLoader(dataset, batch_size=micro_batch, sampler=sampler))


def example_step(engine, batches) -> None:
    """One optimizer step (one micro-batch) of the example."""
    loss = engine(**next(batches))
    engine.backward(loss)
    engine.step()


def run_block(args, torch, syncs: SyncCounter | None = None) -> list[tuple[float, float]]:
    engine = example_engine(args.zero_stage, args.grad_accum, args.d_model, args.layers)
    steps = args.warmup + args.steps
    batches = example_batches(engine, steps * args.grad_accum)
    cuda = engine.device.type == "cuda" if hasattr(engine.device, "type") else False
    timings = []
    for index in range(steps):
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(args.grad_accum):
            with syncs if syncs is not None and index >= args.warmup else contextlib.nullcontext():
                batch = {key: value.to(engine.device, non_blocking=True) for key, value in next(batches).items()}
                loss = engine(**batch)
                engine.backward(loss)
                engine.step()
        if cuda:
            torch.cuda.synchronize()  # the harness's: a step's time is its GPU work, in both arms
        if index >= args.warmup:
            timings.append((time.perf_counter() - wall, time.process_time() - cpu))
    engine.destroy()
    return timings


def trimmed_mean(values: list[float], cut: float = 0.1) -> float:
    """The mean of the middle values: steps that a stall elsewhere on the machine hit are left out."""
    ordered = sorted(values)
    drop = int(len(ordered) * cut)
    return statistics.fmean(ordered[drop:len(ordered) - drop])


def bootstrap(differences: list[float], draws: int = 5000, estimator=statistics.fmean) -> tuple[float, float]:
    rng = random.Random(0)
    estimates = sorted(estimator(rng.choices(differences, k=len(differences))) for _ in range(draws))
    return estimates[int(0.025 * draws)], estimates[int(0.975 * draws)]


def main():
    args = parse_args()
    import torch

    from opentelemetry_instrumentation_deepspeed import CommInstrumentor, DataLoaderInstrumentor, DeepSpeedInstrumentor

    prepare_process()
    if args.profile_every is not None:
        os.environ["OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY"] = str(args.profile_every)
    directory = Path(tempfile.mkdtemp(prefix="otel-ds-bench-"))
    tracer_provider, meter_provider, counted = setup_sdk(directory, args.mode == "sampled-out")
    providers = {"tracer_provider": tracer_provider, "meter_provider": meter_provider}
    instrumentors = (DeepSpeedInstrumentor(), DataLoaderInstrumentor(), CommInstrumentor())

    arms: dict[str, list[float]] = {"A": [], "B": [], "A'": []}
    cpu: dict[str, list[float]] = {"A": [], "B": [], "A'": []}
    per_round: dict[str, list[float]] = {"A": [], "B": [], "A'": []}
    cpu_per_round: dict[str, list[float]] = {"A": [], "B": [], "A'": []}
    instrumented_steps = 0
    syncs = {arm: SyncCounter(torch) for arm in arms} if args.sync_check else {}
    order = ["A", "B", "A'"]
    for round_index in range(args.rounds):
        for arm in order[round_index % 3:] + order[: round_index % 3]:
            if arm == "B":
                for instrumentor in instrumentors:
                    instrumentor.instrument(**providers)
            timings = run_block(args, torch, syncs.get(arm))
            if arm == "B":
                for instrumentor in instrumentors:
                    instrumentor.uninstrument()
                instrumented_steps += args.warmup + args.steps
            arms[arm] += [wall for wall, _ in timings]
            cpu[arm] += [cpu_s for _, cpu_s in timings]
            per_round[arm].append(statistics.median(wall for wall, _ in timings))
            cpu_per_round[arm].append(statistics.median(cpu_s for _, cpu_s in timings))
    tracer_provider.force_flush()
    spans = counted.spans
    tracer_provider.shutdown()
    meter_provider.shutdown()
    records = histogram_records(directory)

    if int(os.environ["RANK"]) == 0:
        report(args, arms, cpu, per_round, cpu_per_round, spans_per_step=spans / instrumented_steps,
               records_per_step=records / instrumented_steps)
        if syncs:
            timed = args.rounds * args.steps
            print("  synchronizing operations per step: "
                  + ", ".join(f"{arm} {counter.count / timed:.2f}" for arm, counter in syncs.items()))


def histogram_records(directory: Path) -> int:
    """Measurements recorded on this rank: the counts of its histograms in the last (cumulative) export."""
    import json

    (path,) = directory.rglob("metrics-rank*.jsonl")
    last = json.loads(path.read_text().splitlines()[-1])
    return sum(int(point["count"])
               for resource in last["resourceMetrics"] for scope in resource["scopeMetrics"]
               for metric in scope["metrics"] if "histogram" in metric
               for point in metric["histogram"]["dataPoints"])


# Costs of the pieces on this machine (benchmarks/README.md, "Where it goes"): a span on the
# training thread and its encoding on the exporter thread; a histogram measurement.
SPAN_US, ENCODE_US, RECORD_US = 7.0, 15.0, 15.0


def report(args, arms, cpu, per_round, cpu_per_round, *, spans_per_step: float, records_per_step: float) -> None:
    base = statistics.median(arms["A"])
    print(f"ZeRO-{args.zero_stage}, grad accumulation {args.grad_accum}, world size {os.environ['WORLD_SIZE']}, "
          f"mode {args.mode}, {args.rounds} rounds x {args.steps} steps per arm")
    for arm, walls in arms.items():
        print(f"  {arm:2}: median step {statistics.median(walls) * 1e3:8.3f} ms wall, "
              f"{statistics.median(cpu[arm]) * 1e3:8.3f} ms CPU")
    for label, arm in (("instrumented - bare (B - A)", "B"), ("control     (A' - A)", "A'")):
        for kind, series in (("wall", per_round), ("CPU ", cpu_per_round)):
            differences = [(b - a) * 1e6 for a, b in zip(series["A"], series[arm], strict=True)]
            mean = statistics.fmean(differences)
            low, high = bootstrap(differences)
            print(f"  {label} {kind}: {mean:+8.1f} us/step  95% CI [{low:+.1f}, {high:+.1f}]  "
                  f"= {mean / (base * 1e6) * 100:+.2f}% of this {base * 1e3:.1f} ms step, "
                  f"{mean / 1e3:+.3f}% of a 100 ms step, {mean / 1e4:+.4f}% of a 1 s step")
    predicted = spans_per_step * (SPAN_US + ENCODE_US) + records_per_step * RECORD_US
    print(f"  per instrumented step on this rank: {spans_per_step:.1f} spans, {records_per_step:.1f} histogram "
          f"records; predicted from the micro-costs: {predicted:.0f} us")


if __name__ == "__main__":
    main()
