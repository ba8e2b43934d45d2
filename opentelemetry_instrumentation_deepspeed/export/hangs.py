"""A hang report as a ``training.hang`` span, on the emitter's thread.

The span sits in the stuck step's trace (under the root every rank derives for it) and runs from
the step's start to the report; it is always sampled under a parent-based sampler, whatever the
step's decision was: a hang is rare and is what the telemetry is for. Its attributes say where the
rank is (phase, micro-step, the collective in flight); one ``training.hang.stack`` event per thread
carries the Python stack.
"""

from __future__ import annotations

from opentelemetry.trace import Status, StatusCode

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.export.spans import remote_parent
from opentelemetry_instrumentation_deepspeed.recording.record import HangReport


def attributes(report: HangReport) -> dict:
    since = report.phase_start if report.phase_start is not None else report.step_start
    found = {semconv.TRAINING_STEP: report.number, semconv.HANG_REASON: report.reason,
             semconv.HANG_DURATION: (report.at - since) / 1e9, semconv.HANG_THRESHOLD: report.threshold,
             semconv.HANG_COMM_SEQUENCES: [f"{group}:{sequence}" for group, sequence in
                                           sorted(report.sequences.items())]}
    if report.phase is not None:
        found[semconv.TRAINING_PHASE] = report.phase
    if report.between_steps:
        found[semconv.HANG_BETWEEN_STEPS] = True
    if report.micro_step is not None:
        found[semconv.TRAINING_MICRO_STEP] = report.micro_step
    collective = report.collective
    if collective is not None:
        route = collective.route
        found.update({semconv.COMM_OP: route.metric_attributes[semconv.COMM_OP],
                      semconv.COMM_GROUP_NAME: route.span_attributes.get(semconv.COMM_GROUP_NAME, "0"),
                      semconv.COMM_SEQUENCE: collective.sequence, semconv.COMM_BYTES: collective.bytes,
                      semconv.COMM_DTYPE: collective.dtype,
                      semconv.HANG_COMM_DURATION: (report.at - collective.start) / 1e9})
        if collective.peer is not None:
            found[semconv.COMM_PEER_RANK] = collective.peer
    return found


def where_text(report: HangReport) -> str:
    if report.between_steps:
        where = f"{report.phase}" if report.phase else "no step"
        return f"{where}, before step {report.number}"
    return f"{report.phase} of step {report.number}" if report.phase else f"step {report.number}"


def emit(report: HangReport, writers: set) -> None:
    facts = report.facts
    writer = facts.writer
    writers.add(writer)
    if not report.between_steps:  # an open step's: the first news of a rollback may be its hang, not its record
        facts.numbered(report.number, False)
    trace_id, root_span_id, _sampled = facts.step_ids(report.number)
    started = writer.child(semconv.SPAN_HANG, remote_parent(trace_id, root_span_id, True), attributes(report),
                           report.step_start)
    events = tuple((semconv.EVENT_HANG_STACK, {semconv.THREAD_ID: thread, semconv.THREAD_NAME: name,
                                               semconv.CODE_STACKTRACE: stack}, report.at)
                   for thread, name, stack in report.stacks)
    where = where_text(report)
    # A resumed report closes an earlier one: the thread moved on, which is no error.
    status = None if report.reason == semconv.HANG_REASON_RESUMED else Status(
        StatusCode.ERROR, f"{report.reason}: {report.error}" if report.error else
        f"{report.reason}: in {where} for {(report.at - report.step_start) / 1e9:.0f} s")
    writer.end(started, report.step_start, report.at, None, status, None, events)
