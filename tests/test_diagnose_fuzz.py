"""Property-based: whatever OTLP-shaped document a line holds, `diagnose` reads the rest and reports.

Hypothesis builds documents shaped like OTLP JSON traces and metrics, with any field replaced by
something hostile (another type, nesting, NaN, 1e999, a 400-digit number, control characters). For
each: no exception from the reader, the backends' normalizer, the analysis or any of the three
outputs; the JSON is strict and the text has no control character.
"""

from __future__ import annotations

import copy
import io
import json
import statistics
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opentelemetry_instrumentation_deepspeed.diagnose import analysis, cli, waits
from opentelemetry_instrumentation_deepspeed.diagnose.analysis import Analysis
from opentelemetry_instrumentation_deepspeed.diagnose.backends import _spans
from opentelemetry_instrumentation_deepspeed.diagnose.html import render_html
from opentelemetry_instrumentation_deepspeed.diagnose.reader import ReadStats
from tests.test_diagnose_hostile import GOOD

scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-(10**400), 10**400),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
hostile = st.recursive(scalar, lambda inner: st.lists(inner, max_size=3) |
                       st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)
numberish = st.sampled_from(["1e999", "Infinity", "-Infinity", "NaN", "9" * 400, "-1", "0", "1.5", "", " 7",
                             "0x10", "\u0661\u0662", "18446744073709551616", "9223372036854775808"])
extreme = st.sampled_from([float("inf"), float("-inf"), float("nan"), 10**400, -(10**400), 1e308, 2**64, -1, True,
                           0.5, "x\nVerdict: FAKE\x1b[2J\u202e"]) | numberish

# Valid documents first, as the package writes them; then a few of their values are replaced.
text = st.text(max_size=12) | st.sampled_from(["job", "0", "all_reduce"])
nanos = st.integers(1, 2**63).map(str)
TYPED = {"training.step": st.integers(0, 50).map(str), "training.micro_step": st.integers(0, 3).map(str),
         "comm.op": text, "comm.bytes": st.integers(0, 2**40).map(str), "comm.async": st.booleans(),
         "comm.sequence": st.integers(0, 50).map(str), "comm.group.name": st.sampled_from(["0", "1"]),
         "comm.busbw": st.floats(0, 1e12), "training.step.skipped": st.booleans()}
KINDS = {str: "intValue", bool: "boolValue", float: "doubleValue"}


def attribute(key: str, values) -> st.SearchStrategy:
    def wrapped(value):
        kind = "stringValue" if key in ("comm.op", "comm.group.name") else KINDS[type(value)]
        return {"key": key, "value": {kind: value}}
    return values.map(wrapped)


span_attributes = st.lists(st.sampled_from(sorted(TYPED)), max_size=4, unique=True).flatmap(
    lambda keys: st.tuples(*(attribute(key, TYPED[key]) for key in keys)).map(list))
span = st.fixed_dictionaries(
    {"name": st.sampled_from(["training.step", "training.forward", "training.backward", "training.data.wait",
                              "training.optimizer.step", "comm.all_reduce", "comm.all_gather"]),
     "traceId": st.sampled_from(["11" * 16, "22" * 16, "ESIzRFVmd4iZqrvM3e7/AA=="]), "spanId": st.just("aa" * 8),
     "parentSpanId": st.just("bb" * 8), "startTimeUnixNano": st.integers(1, 2**62), "attributes": span_attributes},
).flatmap(lambda span: st.integers(0, 10**10).map(lambda duration: {
    **span, "startTimeUnixNano": str(span["startTimeUnixNano"]),
    "endTimeUnixNano": str(span["startTimeUnixNano"] + duration)}))
resource = st.tuples(text, st.integers(0, 3)).map(lambda job_rank: {"attributes": [
    {"key": "training.job.id", "value": {"stringValue": job_rank[0]}},
    {"key": "training.rank", "value": {"intValue": str(job_rank[1])}}]})
traces = st.lists(st.fixed_dictionaries(
    {"resource": resource, "scopeSpans": st.lists(st.fixed_dictionaries(
        {"spans": st.lists(span, min_size=1, max_size=4)}), min_size=1, max_size=2)}), min_size=1, max_size=2)
point = st.fixed_dictionaries(
    {"timeUnixNano": nanos, "asDouble": st.floats(0, 1),
     "attributes": st.just([{"key": "hw.gpu.throttle.reason", "value": {"stringValue": "hw_slowdown"}}])})
metrics = st.lists(st.fixed_dictionaries(
    {"resource": resource, "scopeMetrics": st.lists(st.fixed_dictionaries({"metrics": st.lists(
        st.fixed_dictionaries({"name": st.sampled_from(["hw.gpu.utilization", "hw.gpu.throttle", "hw.errors"]),
                               "gauge": st.fixed_dictionaries({"dataPoints": st.lists(point, min_size=1,
                                                                                      max_size=3)})}),
        min_size=1, max_size=2)}), min_size=1, max_size=2)}), min_size=1, max_size=2)
valid = st.one_of(traces.map(lambda batch: {"resourceSpans": batch}),
                  metrics.map(lambda batch: {"resourceMetrics": batch}),
                  traces.map(lambda batch: {"batches": batch}))  # as Tempo answers


def _places(node, path=()):
    yield path
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield from _places(child, (*path, key))


@st.composite
def document(draw):
    """A valid document with up to three of its values (a leaf or a whole subtree) made hostile."""
    doc = copy.deepcopy(draw(valid))  # st.just values are shared between examples
    for _ in range(draw(st.integers(1, 3))):
        place = draw(st.sampled_from(list(_places(doc))[::-1]))  # leaves first: drawn more often
        replacement = draw(extreme | hostile)
        if not place:
            return replacement
        parent = doc
        for key in place[:-1]:
            parent = parent[key]
        parent[place[-1]] = replacement
    return doc


def check_outputs(report: dict) -> None:
    out = io.StringIO()
    cli.write_json(report, out)
    json.loads(out.getvalue(), parse_constant=lambda constant: (_ for _ in ()).throw(ValueError(constant)))
    for line in cli.render_text(report).split("\n"):
        assert cli.printable(line) == line, repr(line)
    render_html(report)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents=st.lists(document(), min_size=1, max_size=3))
def test_any_otlp_shaped_line_is_read_or_skipped(documents):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "spans.jsonl"
        path.write_text(GOOD + "".join(json.dumps(doc) + "\n" for doc in documents))  # NaN, Infinity as Python writes
        report = cli.diagnose([str(path)], None)
    assert report["input"]["lines"] == GOOD.count("\n") + len(documents)
    assert report["input"]["bad_lines"] <= len(documents)
    assert report["input"]["spans"] >= 24, "the good lines are read"
    check_outputs(report)
    # The same documents as a trace backend's answers (base64 ids, Tempo's "batches").
    stats, analysis = ReadStats(), Analysis()
    for index, doc in enumerate(documents):
        analysis.add(_spans(doc, stats, f"answer {index}"))
    analysis.add_samples(stats.samples)
    result = analysis.result(None)
    check_outputs({"schema_version": 1, **result, "input": {
        "files": 0, "lines": 0, "spans": stats.spans, "gpu_samples": len(stats.samples),
        "bad_lines": stats.bad_lines, "problems": stats.problems}})


# -- the near-linear algorithms against the quadratic ones they replaced -------------------------------

def _reference_overlap(intervals, start, end):
    covered, cursor = 0, start
    for first, last in sorted(intervals):
        low, high = max(first, cursor), min(last, end)
        if high > low:
            covered += high - low
            cursor = high
    return covered


interval = st.tuples(st.integers(0, 100), st.integers(0, 30)).map(lambda pair: (pair[0], pair[0] + pair[1]))


@settings(max_examples=200, deadline=None)
@given(intervals=st.lists(interval, max_size=12), query=interval, at=st.integers(-5, 140))
def test_coverage_is_the_union_overlap(intervals, query, at):
    coverage = analysis._Coverage(intervals)
    assert coverage.overlap(*query) == _reference_overlap(intervals, *query)
    assert coverage.holds(at) == any(a <= at <= b and b > a for a, b in intervals)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.floats(-1e6, 1e6), min_size=2, max_size=9), pick=st.integers(0, 8))
def test_median_of_the_others(values, pick):
    value = values[pick % len(values)]
    others = list(values)
    others.remove(value)
    assert waits._median_without(sorted(values), value) == statistics.median(others)


@settings(max_examples=200, deadline=None)
@given(layout=st.lists(st.tuples(st.integers(1, 20), st.lists(st.tuples(st.sampled_from(analysis.PARTS[:4]),
                                                                          st.integers(1, 5), st.booleans()),
                                                                max_size=4)), max_size=5),
       times=st.lists(st.integers(0, 200), max_size=10))
def test_part_index_finds_the_part_a_scan_finds(layout, times):
    # Steps one after another, phases one after another inside them (as a rank records them),
    # some phases holding a synchronous collective in their second half.
    steps, cursor = [], 0
    for gap, phases in layout:
        step = analysis._Step(start=cursor + gap, seen=True)
        at = step.start
        for part, length, comm in phases:
            step.phases.append((part, at, at + length))
            if comm:
                step.comm.append((at + length // 2, at + length, "0", None))
            at += length + 1
        step.end = at
        cursor = at
        steps.append(step)
    index = analysis._PartIndex(steps)
    for at in times:
        expected = "between_steps"
        for step in steps:
            if step.start <= at <= step.end:
                in_comm = any(a <= at <= b for a, b, _g, _s in step.comm)
                expected = next(("exposed_comm" if part != "data_wait" and in_comm else part
                                 for part, start, end in step.phases if start <= at <= end), "unaccounted")
                break
        assert index.at(at) == expected
