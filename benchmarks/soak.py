"""Memory and disk over a long run: RSS and file sizes every K steps of an instrumented tiny model.

Runs the example's model (1 layer, d_model 16, micro-batch 2) in this process with the three
instrumentors on and the SDK set up as the embedded default sets it up (batch processor and
periodic reader into this project's OTLP JSON lines files), or with traces going to an OTLP
endpoint that refuses connections (``--endpoint-down``).

    python benchmarks/soak.py --steps 20000
    python benchmarks/soak.py --steps 10000 --endpoint-down

Prints RSS and the size of the trace and metric files every ``--every`` steps, then the RSS
growth after warm-up and the bytes written per step.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "benchmarks"))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--endpoint-down", action="store_true",
                        help="traces over OTLP/HTTP to a loopback port nobody listens on")
    return parser.parse_args()


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def provider_with_endpoint_down(meter_provider):
    """Traces to a port nobody listens on, counted as the embedded session counts them."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from opentelemetry_instrumentation_deepspeed.export import delivery

    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(
        OTLPSpanExporter(endpoint=f"http://127.0.0.1:{closed_port()}/v1/traces", timeout=2)))
    delivery.quiet_repeated_warnings()
    delivery.watch(tracer_provider, meter_provider)
    return tracer_provider


def main():
    args = parse_args()
    import torch
    import train as train_module
    from overhead import example_engine, prepare_process, setup_sdk

    from opentelemetry_instrumentation_deepspeed import CommInstrumentor, DataLoaderInstrumentor, DeepSpeedInstrumentor

    prepare_process()
    directory = Path(tempfile.mkdtemp(prefix="otel-ds-soak-"))
    tracer_provider, meter_provider, _ = setup_sdk(directory)
    if args.endpoint_down:
        tracer_provider = provider_with_endpoint_down(meter_provider)
    for instrumentor in (DeepSpeedInstrumentor(), DataLoaderInstrumentor(), CommInstrumentor()):
        instrumentor.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)

    engine = example_engine(args.zero_stage, d_model=16, layers=1, micro_batch=2)
    dataset = train_module.SyntheticTokens(4096, 32, 256, seed=1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, shuffle=False)

    def files() -> tuple[int, int]:
        sizes = {"traces": 0, "metrics": 0}
        for path in directory.rglob("*.jsonl"):
            sizes["traces" if path.name.startswith("traces") else "metrics"] += path.stat().st_size
        return sizes["traces"], sizes["metrics"]

    print(f"{'step':>7} {'RSS MiB':>8} {'traces MB':>10} {'metrics MB':>11} {'s':>7}")
    started = time.monotonic()
    samples = []
    step = 0
    while step < args.steps:
        for batch in loader:
            loss = engine(**batch)
            engine.backward(loss)
            engine.step()
            step += 1
            if step % args.every == 0:
                traces, metrics = files()
                samples.append((step, rss_mib(), traces, metrics))
                print(f"{step:7d} {samples[-1][1]:8.1f} {traces / 1e6:10.2f} {metrics / 1e6:11.2f} "
                      f"{time.monotonic() - started:7.0f}", flush=True)
            if step >= args.steps:
                break
    tracer_provider.force_flush()
    warm = samples[min(1, len(samples) - 1)]
    last = samples[-1]
    print(f"RSS growth from step {warm[0]} to {last[0]}: {last[1] - warm[1]:+.1f} MiB")
    if last[0] > warm[0]:
        per_step = (last[2] - warm[2]) / (last[0] - warm[0])
        print(f"traces written: {per_step:.0f} bytes per step ({per_step * 1e4 / 1e6:.1f} MB per 10,000 steps)")


if __name__ == "__main__":
    main()
