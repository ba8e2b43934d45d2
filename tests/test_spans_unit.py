"""The emitter's span writer decides and records as the SDK's tracer would."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, Decision, ParentBased, Sampler, SamplingResult
from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags, TraceState

from opentelemetry_instrumentation_deepspeed.export import sdk
from opentelemetry_instrumentation_deepspeed.export.spans import SpanWriter


class CountingSampler(Sampler):
    """Samples every span and counts the questions: a sampler that is not parent-based."""

    def __init__(self):
        self.asked = 0

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,  # noqa: PLR0917
                      trace_state=None):
        self.asked += 1
        return SamplingResult(Decision.RECORD_AND_SAMPLE, {"sampled.by": "counting"})

    def get_description(self):
        return "CountingSampler"


def writer_with(sampler):
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return SpanWriter(provider), exporter


def remote_parent(sampled: bool) -> SpanContext:
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    return SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=flags, trace_state=TraceState([("vendor", "value")]))


def test_under_a_parent_based_sampler_children_take_the_parents_decision():
    root_sampler = CountingSampler()
    writer, exporter = writer_with(ParentBased(root_sampler))
    step = writer.child("step", remote_parent(sampled=True), {"a": 1}, 10)
    phase = writer.child("phase", step.context, None, 20)
    assert root_sampler.asked == 0, "a valid parent decides: the root sampler is not asked"
    assert phase.context.trace_id == 0xABC
    assert phase.context.trace_state.get("vendor") == "value"
    writer.end(phase, 20, 30)
    writer.end(step, 10, 40, {"b": 2}, Status(StatusCode.ERROR, "E: x"))
    assert exporter.get_finished_spans() == (), "written spans wait for flush()"
    writer.flush()
    exported = {span.name: span for span in exporter.get_finished_spans()}
    assert exported["phase"].parent.span_id == step.context.span_id
    assert exported["step"].parent.span_id == 0xDEF and exported["step"].parent.is_remote
    assert dict(exported["step"].attributes) == {"a": 1, "b": 2}
    assert exported["step"].status.status_code == StatusCode.ERROR
    assert (exported["phase"].start_time, exported["phase"].end_time) == (20, 30)

    dropped = writer.child("step", remote_parent(sampled=False), {"a": 1}, 10)
    assert not dropped.recording and not dropped.context.trace_flags.sampled
    assert root_sampler.asked == 0


def test_any_other_sampler_is_asked_for_every_span():
    sampler = CountingSampler()
    writer, exporter = writer_with(sampler)
    step = writer.child("step", remote_parent(sampled=False), None, 10)
    phase = writer.child("phase", step.context, {"b": 2}, 20)
    assert sampler.asked == 2
    writer.end(phase, 20, 30)
    writer.end(step, 10, 40)
    writer.flush()
    exported = {span.name: span for span in exporter.get_finished_spans()}
    assert dict(exported["phase"].attributes) == {"sampled.by": "counting", "b": 2}


def test_a_root_gets_the_chosen_ids_and_the_samplers_decision():
    writer, exporter = writer_with(ParentBased(ALWAYS_ON))
    root = writer.root("root", 0x1234, 0x5678, {"step": 3}, 5)
    assert (root.context.trace_id, root.context.span_id) == (0x1234, 0x5678)
    writer.end(root, 5, 6)
    writer.flush()
    (exported,) = exporter.get_finished_spans()
    assert exported.parent is None and exported.context.trace_flags.sampled


def test_without_the_sdks_internals_spans_go_through_the_public_api():
    sdk.use_internals(False)
    try:
        writer, exporter = writer_with(ParentBased(ALWAYS_ON))
    finally:
        sdk.use_internals(True)
    assert not writer.fast
    assert writer.root("root", 0x1234, 0x5678, {}, 5) is None, "the public API cannot choose ids"
    step = writer.child("step", remote_parent(sampled=True), {"a": 1}, 10)
    phase = writer.child("phase", step.context, None, 20)
    writer.end(phase, 20, 30, {"c": 3}, Status(StatusCode.ERROR, "E: x"), {"exception.type": "E"})
    writer.end(step, 10, 40)
    writer.flush()
    exported = {span.name: span for span in exporter.get_finished_spans()}
    assert exported["phase"].parent.span_id == step.context.span_id
    assert exported["step"].parent.span_id == 0xDEF
    assert (exported["phase"].start_time, exported["phase"].end_time) == (20, 30)
    assert exported["phase"].attributes["c"] == 3 and exported["phase"].events[0].name == "exception"
