"""What a span id costs: the SDK's RandomIdGenerator against export/id_generator.py's, interleaved.

Rounds alternate the arms (A B A' B' ...), where A and A' are two instances of the SDK's generator:
their ratio is the noise floor (an A/A control). Each round times a batch of generate_span_id()
calls (what the emitter calls per span) and, separately, generate_trace_id(). Prints the median
nanoseconds per call of each arm and the ratios of the medians.

    python benchmarks/id_generator.py --rounds 301 --calls 2000
"""

from __future__ import annotations

import argparse
import statistics
import time

from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

from opentelemetry_instrumentation_deepspeed.export.id_generator import IsolatedRandomIdGenerator


def per_call(method, calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        method()
    return (time.perf_counter_ns() - start) / calls


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=301)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    arms = {"sdk": RandomIdGenerator(), "sdk (A/A)": RandomIdGenerator(), "isolated": IsolatedRandomIdGenerator()}
    for kind in ("generate_span_id", "generate_trace_id"):
        times: dict[str, list[float]] = {name: [] for name in arms}
        for round_ in range(args.rounds):
            order = list(arms) if round_ % 2 == 0 else list(reversed(arms))
            for name in order:
                times[name].append(per_call(getattr(arms[name], kind), args.calls))
        medians = {name: statistics.median(values) for name, values in times.items()}
        print(f"{kind}: " + ", ".join(f"{name} {value:.1f} ns" for name, value in medians.items())
              + f"; isolated/sdk {medians['isolated'] / medians['sdk']:.3f}, "
                f"A/A {medians['sdk (A/A)'] / medians['sdk']:.3f}")


if __name__ == "__main__":
    main()
