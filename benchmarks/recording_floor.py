"""The training thread's floor: what a recorder that only appends events, and keeps no state, would add per step.

The step recorder (``recording/recorder.py``) keeps each step's state on the training thread, reads
what cannot be read elsewhere and appends one entry per event to a log, which ``recording/builder.py``
replays into records on another thread. The reads cannot leave the training thread: a forward's batch
shape, the loss and the gradient norm, DeepSpeed's boundary and skipped-step counters, the thread's
schedstat, a collective's arguments, the profiler's per-step check. This benchmark keeps exactly those
reads and replaces everything else with one ``deque.append`` of a tuple per event, then runs
``overhead_steps.py --drop-records`` on it. Run it alternately with ``overhead_steps.py --zero-stage 2
--drop-records`` (the shipped recorder, records also dropped) to compare them in one sitting.

    python benchmarks/recording_floor.py --triples 3000

What it leaves out, and the shipped recorder does: the state that tells a phase's start from a nested
one and a running phase's end from a stale one (the phase numbers the wrappers hand back), the
phases' schedstat reads on a busy host, the GPU events and allocator reads on CUDA, making the
``Collective`` a wrapper finishes, and handing the log to the emitter. No correct recorder gets down
to it: what separates the two is that bookkeeping, not where the records are built (``benchmarks/README.md``,
2026-12-06).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import types
import weakref


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--triples", type=int, default=3000)
    return parser.parse_args()


def install() -> collections.deque:
    """Replace the wrappers' recorder and observer entry points with the floor's; the events they append."""
    from opentelemetry_instrumentation_deepspeed.instrumentors import comm, dataloader, engine
    from opentelemetry_instrumentation_deepspeed.recording.batches import batch_shape
    from opentelemetry_instrumentation_deepspeed.recording.scalars import take

    events: collections.deque = collections.deque(maxlen=8192)  # another thread would take them from here
    append, now, pread = events.append, time.time_ns, os.pread

    def forward_started(recorder, _engine, args, kwargs):
        append((1, now(), batch_shape(args, kwargs or {})))
        return True

    def forward_ended(recorder, _phase, output):
        append((2, now()))
        recorder._forward_output = weakref.ref(output) if getattr(output, "ndim", None) == 0 else None

    def backward_started(_recorder, _engine, _direct, loss):
        append((3, now(), None if loss is None else take(loss, None)))
        return True

    def phase_ended(_recorder, _phase):
        append((4, now()))

    def optimizer_step_started(recorder, ds_engine):
        if not ds_engine.is_gradient_accumulation_boundary():
            return None
        append((5, now(), ds_engine.skipped_steps))
        if recorder.profiler is not None:
            recorder.profiler.step_opened(ds_engine.global_steps + 1)
        return True

    def optimizer_step_ended(recorder, ds_engine, _phase):
        append((6, now(), ds_engine.skipped_steps, take(ds_engine.get_global_grad_norm(), None),
                pread(recorder._thread_stat, 64, 0)))
        if recorder.profiler is not None:
            recorder.profiler.step_closed(0.0)

    def issue(_observer, spec, args, kwargs):
        group, data_bytes, tensor, is_async = spec.read(args, kwargs)
        call = types.SimpleNamespace(is_async=is_async, end=None)  # what the wrapper reads back
        append((7, now(), call, spec, group, data_bytes, None if tensor is None else tensor.dtype))
        return call

    def finish(_observer, call):
        call.end = now()

    def data_waited(_recorder, start, end):
        append((0, start, end))

    engine._forward_started, engine._forward_ended, engine._backward_started = (forward_started, forward_ended,
                                                                                backward_started)
    engine._phase_ended = phase_ended
    engine._optimizer_step_started, engine._optimizer_step_ended = optimizer_step_started, optimizer_step_ended
    comm._issue, comm._finish = issue, finish
    dataloader._data_waited = data_waited
    return events


def main():
    args = parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import overhead_steps

    events = install()
    sys.argv = [sys.argv[0], "--zero-stage", "2", "--triples", str(args.triples), "--drop-records"]
    overhead_steps.main()
    print(f"  events appended by the floor's recorder: the last {len(events)} kept")


if __name__ == "__main__":
    main()
