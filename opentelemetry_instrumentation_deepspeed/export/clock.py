"""A refreshed clock offset (``runtime/clock.py``) as a ``training.clock.sync`` span, on the emitter's thread.

The span runs from the first ping's sending to the best answer's reading, on this rank's clock, and
says the offset and its error then; ``diagnose`` moves the rank's later spans by it. It lies in the
trace of the step under way (under the root every rank derives for it), sampled as a hang report is:
a parent-based sampler keeps it whatever the step's decision, since every later span depends on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.export.spans import remote_parent


@dataclass(slots=True)
class ClockReading:
    facts: object  # an engine's facts: where the span goes
    offset: int  # this clock minus rank 0's, nanoseconds
    error: int
    sent: int
    received: int


def attach(facts) -> None:
    """Send the refresher's readings (if it runs) to the emitter, as spans of ``facts``' writer."""
    from opentelemetry_instrumentation_deepspeed.export.emitter import emitter
    from opentelemetry_instrumentation_deepspeed.runtime import clock

    refresher = clock.refresher()
    if refresher is not None and refresher.send is None:
        refresher.send = lambda found: emitter().submit(ClockReading(facts, *found))


def emit(reading: ClockReading, writers: set) -> None:
    facts = reading.facts
    writer = facts.writer
    writers.add(writer)
    trace_id, root_span_id, _sampled = facts.step_ids(facts.last_written + 1)
    attributes = {semconv.TRAINING_CLOCK_OFFSET: reading.offset, semconv.TRAINING_CLOCK_OFFSET_ERROR: reading.error}
    started = writer.child(semconv.SPAN_CLOCK_SYNC, remote_parent(trace_id, root_span_id, True), attributes,
                           reading.sent)
    writer.end(started, reading.sent, reading.received)
