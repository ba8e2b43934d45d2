"""Operator and kernel spans of a profiled step, from its stopped ``torch.profiler`` (Kineto), made by
the emitter once the step's record is closed (``recording.profiler`` decides which steps).

Each operator becomes a span under the phase (or ``comm.*`` span) it ran in, nested under its
calling operator when that one is emitted too; GPU kernels and memory copies become spans under
the operator that launched them (Kineto's correlation ids). Only the ``top`` operators with the
most self time, and as many kernels with the most time, become spans; the step span counts the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.trace import SpanContext

from opentelemetry_instrumentation_deepspeed import semconv


@dataclass
class Interval:
    """A span of the profiled step that operators can run in: a phase or a host-timed collective."""

    start: int
    end: int
    context: SpanContext


@dataclass
class _Op:
    event: object
    start: int
    end: int
    self_ns: int
    parent: _Op | None = None
    span_context: SpanContext | None = None

    @property
    def start_thread(self) -> int:
        return self.event.start_thread_id()


def emit(writer, profile, intervals: list[Interval], step_context: SpanContext, top: int) -> dict:
    """Spans of ``profile``'s operators and kernels; the step span's ``profile.*`` attributes."""
    cpu_ops, device_events = [], []
    for event in profile.profiler.kineto_results.events():
        kind = str(event.activity_type())
        if kind.endswith("cpu_op"):
            cpu_ops.append(event)
        elif kind.endswith(("kernel", "memcpy", "memset")):
            device_events.append(event)
    # Operators outside every phase (loss code, zero_grad) sit directly under the step.
    ops, emitted = _emit_ops(writer, cpu_ops, intervals, step_context, top)
    emitted_kernels = _emit_device_events(writer, device_events, ops, intervals, step_context, top)
    return {semconv.PROFILE_OPS: len(cpu_ops), semconv.PROFILE_OPS_EMITTED: emitted,
            semconv.PROFILE_KERNELS: len(device_events), semconv.PROFILE_KERNELS_EMITTED: emitted_kernels}


def _span(writer, name: str, parent: SpanContext, attributes: dict, start: int,  # noqa: PLR0917
          end: int) -> SpanContext:
    started = writer.child(name, parent, attributes, start)
    writer.end(started, start, end)
    return started.context


def _emit_ops(writer, events, intervals: list[Interval], step_context, top: int) -> tuple[dict[int, _Op], int]:
    """Operators by correlation id (all of them, for kernels to find their launcher), and how many became spans."""
    ops = sorted((_Op(e, e.start_ns(), e.end_ns(), e.duration_ns()) for e in events),
                 key=lambda op: (op.start_thread, op.start, -op.end))
    stack: list[_Op] = []
    for op in ops:  # each operator's caller: the innermost earlier one on its thread that contains it
        while stack and (stack[-1].start_thread != op.start_thread or stack[-1].end < op.end):
            stack.pop()
        if stack:
            op.parent = stack[-1]
            op.parent.self_ns -= op.end - op.start
        stack.append(op)
    chosen = sorted(ops, key=lambda op: op.self_ns, reverse=True)[:top]
    for op in sorted(chosen, key=lambda op: (op.start, -op.end)):  # callers before callees
        caller = _emitted_ancestor(op.parent)
        parent = caller.span_context if caller is not None else _innermost(intervals, op.start) or step_context
        event = op.event
        attributes = {semconv.PROFILE_KIND: "cpu_op", semconv.PROFILE_DEVICE: "cpu"}
        shapes = [list(shape) for shape in (event.shapes() or []) if shape]
        if shapes:
            attributes[semconv.PROFILE_SHAPES] = str(shapes)
        if event.flops():
            attributes[semconv.PROFILE_FLOPS] = int(event.flops())
        op.span_context = _span(writer, event.name(), parent, attributes, op.start, op.end)
    return {op.event.correlation_id(): op for op in ops}, len(chosen)


def _emit_device_events(writer, events, ops: dict[int, _Op], intervals: list[Interval],  # noqa: PLR0917
                        step_context, top: int) -> int:
    chosen = sorted(events, key=lambda e: e.duration_ns(), reverse=True)[:top]
    for event in chosen:
        # Kineto links a kernel to the operator that launched it; the nearest one that became a span
        # is its parent, else the phase around the launch (on the host clock, not the kernel's).
        launcher = ops.get(event.linked_correlation_id())
        emitted = _emitted_ancestor(launcher)
        if emitted is not None:
            parent = emitted.span_context
        else:
            parent = (_innermost(intervals, launcher.start) if launcher is not None else None) or step_context
        name = event.name()
        kind = "memcpy" if "memcpy" in name.lower() else "memset" if "memset" in name.lower() else "kernel"
        _span(writer, name, parent, {
            semconv.PROFILE_KIND: kind,
            semconv.PROFILE_DEVICE: f"cuda:{event.device_index()}",
            semconv.PROFILE_STREAM: int(event.device_resource_id()),
        }, event.start_ns(), event.end_ns())
    return len(chosen)


def _emitted_ancestor(op: _Op | None) -> _Op | None:
    while op is not None and op.span_context is None:
        op = op.parent
    return op


def _innermost(intervals: list[Interval], at: int) -> SpanContext | None:
    """The shortest interval containing ``at``: a collective inside its phase wins."""
    best = None
    for interval in intervals:
        if interval.start <= at <= interval.end and (best is None or interval.end - interval.start <
                                                     best.end - best.start):
            best = interval
    return None if best is None else best.context
