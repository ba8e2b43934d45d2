"""The embedded default's span encoder writes exactly what the official OTLP JSON encoder writes."""

from __future__ import annotations

import json
import math

import pytest
from opentelemetry.exporter.otlp.json.file.trace_exporter import _encode_spans_to_dict
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from opentelemetry_instrumentation_deepspeed.export.emitter import _exception
from opentelemetry_instrumentation_deepspeed.export.otlp_json import SpanEncoder, finite_json
from opentelemetry_instrumentation_deepspeed.export.spans import SpanWriter
from opentelemetry_instrumentation_deepspeed.recording.record import Failure


def _spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"training.rank": 1, "a.list": [1, 2], "f": 0.5}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("scope", "1.0")
    with tracer.start_as_current_span("root", attributes={"b": True, "i": -3, "f": 1.5, "s": "x\"\n\u00e9",
                                                          "l": ["a", "b"], "fl": [1.0], "big": 2**62}) as root:
        child = tracer.start_span("child", links=[Link(root.get_span_context(), {"k": 1})], kind=SpanKind.CLIENT)
        try:
            raise ValueError("boom")
        except ValueError as error:
            child.record_exception(error)
            child.set_status(Status(StatusCode.ERROR, "boom"))
        child.end()
        provider.get_tracer("other").start_span("other", attributes={"comm.op": "all_reduce"}).end()
        ok = tracer.start_span("ok")
        ok.set_status(Status(StatusCode.OK))
        ok.end()
    # This project's spans, written after the fact by the emitter, with the same provider.
    writer = SpanWriter(provider)
    root = writer.root("training.global_step", 0xABC, 0xDEF, {"training.step": 7}, 1, True)
    step = writer.child("training.step", root.context, {"training.step": 7, "comm.busbw": 1.2345e9, "tiny": 1e-07,
                                                        "training.grad_norm": math.inf, "training.loss": math.nan}, 2)
    try:
        raise RuntimeError("in a step")
    except RuntimeError as error:
        failure = Failure.of(error)
    writer.end(step, 2, 3, {"comm.count": 3}, Status(StatusCode.ERROR, failure.description), _exception(failure))
    writer.end(root, 1, 4)
    writer.flush()
    assert "training.step" in [span.name for span in exporter.get_finished_spans()]
    return exporter.get_finished_spans()


def test_same_json_as_the_official_encoder():
    spans = _spans()
    ours = json.loads(SpanEncoder().encode(spans))
    official = json.loads(json.dumps(_encode_spans_to_dict(spans)))
    assert ours == official
    # Several batches through one encoder (its resource and scope caches) stay identical.
    encoder = SpanEncoder()
    for batch in (spans[:2], spans[2:], spans):
        assert json.loads(encoder.encode(batch)) == json.loads(json.dumps(_encode_spans_to_dict(batch)))


def test_non_finite_numbers_are_strings_as_protobufs_json_mapping_writes_them():
    """A review: a NaN loss or an infinite gradient norm (every fp16 overflow) wrote bare NaN and Infinity, which strict
    JSON parsers refuse, the whole line (a batch of spans) with them."""
    strict = {"parse_constant": lambda name: pytest.fail(f"{name} in the JSON")}
    line = SpanEncoder().encode(_spans())
    assert '"doubleValue":"Infinity"' in line and '"doubleValue":"NaN"' in line
    json.loads(line, **strict)
    # Metric points too, where an SDK passes a non-finite one on (1.45 drops them with a warning).
    request = {"gauge": {"dataPoints": [{"asDouble": -math.inf}, {"asDouble": 0.5}]}}
    json.loads(json.dumps(finite_json(request), allow_nan=False), **strict)
    assert finite_json(request)["gauge"]["dataPoints"][0]["asDouble"] == "-Infinity"
