"""Operator and kernel spans for sampled steps, from ``torch.profiler`` (Kineto).

A step is profiled when its number is a multiple of ``OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY``, when
someone touches the trigger file (``OTEL_PYTHON_DEEPSPEED_PROFILE_TRIGGER``: each rank profiles
the next step it starts after seeing the file's modification time change), or when the previous
step took more than ``OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR`` times the median of the recent
unprofiled ones (the next step is profiled, to catch a recurring cause). The profiler runs from
the step's first event to its end, and is stopped whatever happens: step end, step failure,
process exit.

Each profiled step's operators become spans under the phase (or ``comm.*`` span) they ran in,
nested under their calling operator when that one is emitted too; GPU kernels and memory
copies become spans under the operator that launched them (Kineto's correlation ids). Only
the ``OTEL_PYTHON_DEEPSPEED_PROFILE_TOP`` operators with the most self time, and as many
kernels with the most time, become spans; the step span counts the rest.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
from collections import deque
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env
from opentelemetry_instrumentation_deepspeed.runtime import lifecycle
from opentelemetry_instrumentation_deepspeed.runtime.safety import Component, fail_open

_logger = logging.getLogger(__name__)
_EMPTY = Context()

_RECENT_STEPS = 20
_BASELINE_EVERY = 5  # unprofiled steps between two medians of the recent ones
# Steps between two looks at the trigger file: a system call inside a step costs ~25 us. Multiples
# of the step number, so that every rank looks at the same steps and profiles the same one.
TRIGGER_EVERY = 8


@dataclass
class Interval:
    """A span of the profiled step that operators can run in: a phase or a collective."""

    start: int
    end: int
    context: Context


@dataclass
class _Op:
    event: object
    start: int
    end: int
    self_ns: int
    parent: _Op | None = None
    span_context: Context | None = None

    @property
    def start_thread(self) -> int:
        return self.event.start_thread_id()


class StepProfiler(Component):
    def __init__(self, every: int, trigger: str | None, top: int, slow_factor: float):
        super().__init__("kernel profiling")
        self._every, self._trigger, self._top, self._slow_factor = every, trigger, top, slow_factor
        self._trigger_seen = self._trigger_mtime()
        self._requested = False
        self._recent: deque[float] = deque(maxlen=_RECENT_STEPS)
        self._slow_above: float | None = None  # seconds: the factor times the recent median
        self._unprofiled = 0
        self._profile = None
        # Kineto logs every start and stop on stderr; a user's own setting wins.
        os.environ.setdefault("KINETO_LOG_LEVEL", "99")
        lifecycle.at_exit(lifecycle.STOP_PROFILER, lambda _reason: self.abandon())

    def _trigger_mtime(self) -> float | None:
        # A stat of a missing file raises: an exception on top of the system call.
        if not self._trigger or not os.access(self._trigger, os.F_OK):
            return None
        try:
            return os.stat(self._trigger).st_mtime_ns
        except OSError:
            return None

    def _triggered(self) -> bool:
        if not self._trigger:
            return False
        mtime = self._trigger_mtime()
        if mtime is not None and mtime != self._trigger_seen:
            self._trigger_seen = mtime
            return True
        return False

    @fail_open
    def step_opened(self, number: int) -> bool:
        """Start the profiler if step ``number`` is to be profiled."""
        wanted = ((self._every and number % self._every == 0) or self._requested
                  or (number % TRIGGER_EVERY == 0 and self._triggered()))
        if not wanted or self._profile is not None:
            return False
        self._requested = False
        torch = sys.modules["torch"]
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities, record_shapes=True, with_flops=True)
        profile.start()
        self._profile = profile
        return True

    def _stop(self):
        profile, self._profile = self._profile, None
        if profile is not None:
            profile.stop()
        return profile

    @fail_open
    def abandon(self) -> None:
        """The step failed, or the process exits: stop the profiler, emit nothing."""
        self._stop()

    @fail_open
    def step_closed(self, tracer, step_span, intervals: list[Interval], seconds: float | None) -> None:
        if self._profile is None:
            # A profiled step is slow by construction: only unprofiled ones make the baseline.
            if self._slow_factor and seconds is not None:
                if self._slow_above is not None and seconds > self._slow_above:
                    self._requested = True
                self._recent.append(seconds)
                self._unprofiled += 1
                # A median per step costs more inside a step than it is worth: one every few steps.
                if self._unprofiled % _BASELINE_EVERY == 0:
                    self._slow_above = self._slow_factor * statistics.median(self._recent)
            return
        events = list(self._stop().profiler.kineto_results.events())
        cpu_ops, device_events = [], []
        for event in events:
            kind = str(event.activity_type())
            if kind.endswith("cpu_op"):
                cpu_ops.append(event)
            elif kind.endswith(("kernel", "memcpy", "memset")):
                device_events.append(event)
        # Operators outside every phase (loss code, zero_grad) sit directly under the step.
        step_context = trace.set_span_in_context(step_span, _EMPTY)
        ops, emitted = self._emit_ops(tracer, cpu_ops, intervals, step_context)
        emitted_kernels = self._emit_device_events(tracer, device_events, ops, intervals, step_context)
        step_span.set_attributes({
            semconv.PROFILE_OPS: len(cpu_ops), semconv.PROFILE_OPS_EMITTED: emitted,
            semconv.PROFILE_KERNELS: len(device_events), semconv.PROFILE_KERNELS_EMITTED: emitted_kernels,
        })

    # -- emission ---------------------------------------------------------------------------------

    def _emit_ops(self, tracer, events, intervals: list[Interval], step_context) -> tuple[dict[int, _Op], int]:
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
        chosen = sorted(ops, key=lambda op: op.self_ns, reverse=True)[: self._top]
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
            span = tracer.start_span(event.name(), context=parent, start_time=op.start, attributes=attributes)
            span.end(end_time=op.end)
            op.span_context = trace.set_span_in_context(span, _EMPTY)
        return {op.event.correlation_id(): op for op in ops}, len(chosen)

    def _emit_device_events(self, tracer, events, ops: dict[int, _Op], intervals: list[Interval],
                            step_context) -> int:
        chosen = sorted(events, key=lambda e: e.duration_ns(), reverse=True)[: self._top]
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
            span = tracer.start_span(name, context=parent, start_time=event.start_ns(), attributes={
                semconv.PROFILE_KIND: kind,
                semconv.PROFILE_DEVICE: f"cuda:{event.device_index()}",
                semconv.PROFILE_STREAM: int(event.device_resource_id()),
            })
            span.end(end_time=event.end_ns())
        return len(chosen)


def _emitted_ancestor(op: _Op | None) -> _Op | None:
    while op is not None and op.span_context is None:
        op = op.parent
    return op


def _innermost(intervals: list[Interval], at: int) -> Context | None:
    """The shortest interval containing ``at``: a collective inside its phase wins."""
    best = None
    for interval in intervals:
        if interval.start <= at <= interval.end and (best is None or interval.end - interval.start <
                                                     best.end - best.start):
            best = interval
    return None if best is None else best.context


def from_environment() -> StepProfiler | None:
    every, trigger, slow_factor = env.profile_every(), env.profile_trigger(), env.profile_slow_factor()
    if not every and not trigger and not slow_factor:
        return None
    return StepProfiler(every, trigger, env.profile_top(), slow_factor)

