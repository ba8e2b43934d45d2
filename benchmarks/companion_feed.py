"""A companion process fed through a shared-memory ring: what it would leave on the training process.

Issue "Record, then emit" asks for OpenTelemetry's work to move out of the training process if an
in-process emitter cannot meet the budgets. This is the measurement that decides it, not the
feature: ``overhead_steps.py --feed-companion`` replaces the emitter's work with packing each
closed step record (plain numbers and strings, ``marshal``) into a single-producer ring in shared
memory; this module's ``main`` is the other end, a process with its own SDK that makes the step,
phase and collective spans and the duration histograms from what it reads, and exports them as
the embedded default does (batch processor, OTLP JSON lines files).

What stays in the training process, and is timed beside the steps: rebuilding the records from the
recorder's log (as the emitter does) and packing them. What moves out: span and metric work, the
exporter's encoding. The companion is a prototype of that work (no exemplars, no GPU events, no
kernel spans), enough to put its CPU on the machine's other core as the real one would.

    python benchmarks/companion_feed.py SHM_NAME OUTPUT_DIR   # started by overhead_steps.py
"""

from __future__ import annotations

import marshal
import os
import struct
import sys
import time
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

from opentelemetry import trace

_HEADER = struct.Struct("<QQ")  # bytes written, bytes read: each side writes only its own counter
_LENGTH = struct.Struct("<I")
SIZE = 8 << 20


class RingWriter:
    """The training process's end: whole messages or none (a full ring drops the message and counts it)."""

    def __init__(self, size: int = SIZE):
        self.memory = shared_memory.SharedMemory(create=True, size=size + _HEADER.size)
        self.buffer = self.memory.buf
        self.capacity = size
        self.written = 0
        self.dropped = 0
        _HEADER.pack_into(self.buffer, 0, 0, 0)

    def put(self, message: bytes) -> None:
        framed = _LENGTH.pack(len(message)) + message
        read = _HEADER.unpack_from(self.buffer, 0)[1]
        if self.written + len(framed) - read > self.capacity:
            self.dropped += 1
            return
        offset = self.written % self.capacity
        first = min(len(framed), self.capacity - offset)
        start = _HEADER.size + offset
        self.buffer[start:start + first] = framed[:first]
        if first < len(framed):
            self.buffer[_HEADER.size:_HEADER.size + len(framed) - first] = framed[first:]
        self.written += len(framed)
        struct.pack_into("<Q", self.buffer, 0, self.written)  # published after the bytes it covers

    def close(self) -> None:
        self.buffer = None
        self.memory.close()
        self.memory.unlink()


def pack(record) -> bytes:
    """A closed StepRecord as plain values: what the companion needs to make its spans and points."""
    phases = [(phase.name, phase.micro_step, phase.start, phase.end or record.end) for phase in record.phases]
    index = {id(phase): number for number, phase in enumerate(record.phases)}
    collectives = [(call.route.span_name, call.route.span_attributes, call.sequence, call.bytes, call.dtype,
                    call.start, call.end or record.end, index.get(id(call.parent), -1))
                   for call in record.collectives]
    losses = [loss for loss in record.losses if type(loss) is float]
    grad_norm = record.grad_norm if type(record.grad_norm) is float else None
    return marshal.dumps((record.number, record.start, record.end, record.skipped, record.samples, phases,
                          collectives, list(record.waits), losses, grad_norm))


def _read(buffer, capacity: int, read: int, length: int) -> bytes:
    offset = read % capacity
    first = min(length, capacity - offset)
    data = bytes(buffer[_HEADER.size + offset:_HEADER.size + offset + first])
    if first < length:
        data += bytes(buffer[_HEADER.size:_HEADER.size + length - first])
    return data


def main(name: str, directory: str) -> None:
    os.environ["OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR"] = directory
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from opentelemetry_instrumentation_deepspeed.export import output
    from opentelemetry_instrumentation_deepspeed.runtime.job import identify

    output.use_identity(identify())
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(output.JsonLinesSpanExporter()))
    meter_provider = MeterProvider(metric_readers=[
        PeriodicExportingMetricReader(output.JsonLinesMetricExporter(), 5000)])
    tracer = tracer_provider.get_tracer("companion")
    meter = meter_provider.get_meter("companion")
    step_duration = meter.create_histogram("training.step.duration", unit="s")
    phase_duration = meter.create_histogram("training.phase.duration", unit="s")
    comm_duration = meter.create_histogram("comm.duration", unit="s")

    memory = shared_memory.SharedMemory(name=name)
    # Python 3.11 registers an attached segment as this process's own, to unlink at its exit: it is the writer's.
    resource_tracker.unregister(memory._name, "shared_memory")
    buffer, capacity = memory.buf, SIZE  # the mapping may be rounded up to whole pages
    read, steps = 0, 0
    setup = time.process_time()  # its imports and set-up are left out of the figure
    stop, parent = Path(directory) / "stop", os.getppid()
    while True:
        written = _HEADER.unpack_from(buffer, 0)[0]
        if written == read:
            # Asked to stop, or orphaned (a benchmark that failed never asks): what was written before is read first.
            if stop.exists() or os.getppid() != parent:
                if _HEADER.unpack_from(buffer, 0)[0] == read:
                    break
                continue
            time.sleep(0.5)  # the emitter's drain period
            continue
        while read < written:
            (length,) = _LENGTH.unpack(_read(buffer, capacity, read, _LENGTH.size))
            message = _read(buffer, capacity, read + _LENGTH.size, length)
            read += _LENGTH.size + length
            struct.pack_into("<Q", buffer, 8, read)
            _emit(tracer, marshal.loads(message), step_duration, phase_duration, comm_duration)
            steps += 1
    tracer_provider.shutdown()
    meter_provider.shutdown()
    (Path(directory) / "companion.txt").write_text(f"{steps} {time.process_time() - setup}")
    buffer = None
    memory.close()


def _emit(tracer, record, step_duration, phase_duration, comm_duration) -> None:
    number, start, end, skipped, samples, phases, collectives, _waits, losses, grad_norm = record
    root = tracer.start_span("training.step", start_time=start, attributes={
        "training.step": number, "training.step.skipped": skipped, "training.samples": samples})
    context = trace.set_span_in_context(root)
    spans = []
    for name, micro_step, phase_start, phase_end in phases:
        attributes = {"training.phase": name}
        if micro_step is not None:
            attributes["training.micro_step"] = micro_step
        span = tracer.start_span("training." + name, context=context, start_time=phase_start,
                                 attributes=attributes)
        spans.append(span)
        span.end(phase_end)
        phase_duration.record((phase_end - phase_start) / 1e9, {"training.phase": name})
    for span_name, attributes, sequence, data_bytes, dtype, call_start, call_end, parent in collectives:
        parent_context = trace.set_span_in_context(spans[parent]) if parent >= 0 else context
        span = tracer.start_span(span_name, context=parent_context, start_time=call_start, attributes={
            **attributes, "comm.sequence": sequence, "comm.bytes": data_bytes, "comm.dtype": dtype})
        span.end(call_end)
        comm_duration.record((call_end - call_start) / 1e9, attributes)
    if losses:
        root.set_attribute("training.loss", sum(losses) / len(losses))
    if grad_norm is not None:
        root.set_attribute("training.grad_norm", grad_norm)
    root.end(end)
    step_duration.record((end - start) / 1e9)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
