"""The instrumentation's work per optimizer step, counted rather than timed, for CI.

Timings on a shared CI machine swing by more than the whole budget, so CI counts what the
overhead is made of instead: Python function calls executed inside this package and the
OpenTelemetry API/SDK per step (the instrumentation's own code, its spans, measurements and
export), plus spans and histogram records per step. Counts are the same on every machine; a
change that doubles them (a span per operator, an attribute loop, a lost cache) doubles the cost.

    python benchmarks/sensitivity.py --zero-stage 2

Prints one JSON object: calls, spans and records per step, and the bytecode instructions the training
thread executes in this package and OpenTelemetry per step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "benchmarks"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    # Profiled steps are counted by their own benchmark; here every step is an ordinary one.
    os.environ["OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY"] = "0"
    os.environ["OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR"] = "0"
    import opentelemetry
    from overhead import example_batches, example_engine, example_step, histogram_records, prepare_process, setup_sdk

    import opentelemetry_instrumentation_deepspeed as package
    from opentelemetry_instrumentation_deepspeed import CommInstrumentor, DataLoaderInstrumentor, DeepSpeedInstrumentor
    from opentelemetry_instrumentation_deepspeed.export import emitter

    # The emitter's thread must not drain during the counted steps: force_flush drains them all on
    # this thread, where their spans and metric points are counted with the rest.
    emitter.DRAIN_SECONDS = 3600.0

    prepare_process()
    directory = Path(tempfile.mkdtemp(prefix="otel-ds-sensitivity-"))
    # No metric collection on a timer: it drains the emitter on the reader's thread, uncounted, when it
    # falls within the counted steps, as it can on a loaded machine (395 calls per step instead of 864
    # in one run of the suite under load; 568 with a collection every 200 ms).
    tracer_provider, meter_provider, counted = setup_sdk(directory, export_interval_millis=3_600_000)
    for instrumentor in (DeepSpeedInstrumentor(), DataLoaderInstrumentor(), CommInstrumentor()):
        instrumentor.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)

    engine = example_engine(args.zero_stage)
    batches = example_batches(engine, args.warmup + 2 * args.steps)

    roots = tuple(str(Path(module.__path__[0])) for module in (package, opentelemetry))
    calls = 0

    def count(frame, event, _arg):
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.startswith(roots):
            calls += 1

    for _ in range(args.warmup):
        example_step(engine, batches)
    tracer_provider.force_flush()
    spans_before = counted.spans
    # The emitter makes the steps' spans when drained, so the batch processor gets them only from
    # force_flush, which drains and encodes them on this thread, where they are counted with the rest.
    sys.setprofile(count)
    for _ in range(args.steps):
        example_step(engine, batches)
    recording = calls  # the training thread's own: the wrappers and the recorders
    tracer_provider.force_flush()
    sys.setprofile(None)
    spans = counted.spans - spans_before
    opcodes = training_thread_opcodes(engine, batches, example_step, args.steps, roots)
    meter_provider.shutdown()
    records = histogram_records(directory)
    print(json.dumps({"calls_per_step": round(calls / args.steps, 1),
                      "recording_calls_per_step": round(recording / args.steps, 1),
                      "recording_opcodes_per_step": round(opcodes / args.steps, 1),
                      "spans_per_step": spans / args.steps,
                      "records_per_step": records / (args.warmup + 2 * args.steps)}))


def training_thread_opcodes(engine, batches, example_step, steps: int, roots: tuple) -> int:
    """Bytecode instructions this package and OpenTelemetry execute on the training thread over ``steps`` steps.

    Calls count frames, each about as costly as a short body; instructions also count the bodies, so a change
    that moves work from one frame into another, or lengthens a frame, shows here, exactly, where timings on
    this machine cannot resolve it (a step's added time swings by +-40 us between sittings).
    """
    executed = 0

    def count(frame, _event, _arg):
        nonlocal executed
        executed += 1
        return count

    def enter(frame, _event, _arg):
        if not frame.f_code.co_filename.startswith(roots):
            return None
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return count

    sys.settrace(enter)
    try:
        for _ in range(steps):
            example_step(engine, batches)
    finally:
        sys.settrace(None)
    return executed


if __name__ == "__main__":
    main()
