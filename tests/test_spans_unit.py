"""The light tracer of the training thread decides and records as the SDK's tracer would."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, Decision, ParentBased, Sampler, SamplingResult
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

from opentelemetry_instrumentation_deepspeed.export import spans


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


def tracer_with(sampler):
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return spans.Tracer(provider.get_tracer("test")), exporter


def remote_parent(sampled: bool) -> NonRecordingSpan:
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    return NonRecordingSpan(SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=flags,
                                        trace_state=TraceState([("vendor", "value")])))


def test_under_a_parent_based_sampler_children_take_the_parents_decision():
    root_sampler = CountingSampler()
    tracer, exporter = tracer_with(ParentBased(root_sampler))
    step = tracer.start_child("step", remote_parent(sampled=True), {"a": 1}, 10)
    phase = tracer.start_child("phase", step, None, 20)
    assert root_sampler.asked == 0, "a valid parent decides: the root sampler is not asked"
    assert phase.get_span_context().trace_id == 0xABC
    assert phase.get_span_context().trace_state.get("vendor") == "value"
    phase.end(end_time=30)
    step.end(end_time=40)
    assert exporter.get_finished_spans() == (), "ended spans wait for hand_over()"
    spans.hand_over()
    exported = {span.name: span for span in exporter.get_finished_spans()}
    assert exported["phase"].parent.span_id == step.get_span_context().span_id
    assert exported["step"].parent.span_id == 0xDEF and exported["step"].parent.is_remote
    assert dict(exported["step"].attributes) == {"a": 1}
    assert (exported["phase"].start_time, exported["phase"].end_time) == (20, 30)

    dropped = tracer.start_child("step", remote_parent(sampled=False), {"a": 1}, 10)
    assert not dropped.is_recording() and not dropped.get_span_context().trace_flags.sampled
    assert root_sampler.asked == 0


def test_any_other_sampler_is_asked_for_every_span():
    sampler = CountingSampler()
    tracer, exporter = tracer_with(sampler)
    step = tracer.start_child("step", remote_parent(sampled=False), None, 10)
    phase = tracer.start_child("phase", step, {"b": 2}, 20)
    assert sampler.asked == 2
    phase.end(end_time=30)
    step.end(end_time=40)
    spans.hand_over()
    exported = {span.name: span for span in exporter.get_finished_spans()}
    assert dict(exported["phase"].attributes) == {"sampled.by": "counting", "b": 2}


def test_a_root_gets_the_chosen_ids_and_the_samplers_decision():
    tracer, exporter = tracer_with(ParentBased(ALWAYS_ON))
    root = tracer.start_root("root", 0x1234, 0x5678, {"step": 3}, 5)
    assert (root.get_span_context().trace_id, root.get_span_context().span_id) == (0x1234, 0x5678)
    root.end(end_time=6)
    spans.hand_over()
    (exported,) = exporter.get_finished_spans()
    assert exported.parent is None and exported.context.trace_flags.sampled
