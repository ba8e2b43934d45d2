"""Span and trace ids that no user seed reaches, in this process, in other processes and in forked children."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

from opentelemetry.sdk.trace import TracerProvider

from opentelemetry_instrumentation_deepspeed.export import sdk
from opentelemetry_instrumentation_deepspeed.export.id_generator import IsolatedRandomIdGenerator
from opentelemetry_instrumentation_deepspeed.export.spans import SpanWriter
from opentelemetry_instrumentation_deepspeed.runtime.distro import DeepSpeedDistro

# A training script's seeding, then span ids: what each process prints.
_SEEDED = """
import json, os, random, sys
import numpy
from opentelemetry_instrumentation_deepspeed.export.id_generator import IsolatedRandomIdGenerator
random.seed(42); numpy.random.seed(42)
ids = IsolatedRandomIdGenerator()
pid = os.fork() if "fork" in sys.argv else None
if pid:
    os.waitpid(pid, 0)  # the child prints first
spans = [ids.generate_span_id() for _ in range(500)]
traces = [ids.generate_trace_id() for _ in range(50)]
print(json.dumps({"pid": os.getpid(), "spans": spans, "traces": traces}), flush=True)
if pid == 0:
    os._exit(0)
"""


def _drawn(*args: str) -> list[dict]:
    result = subprocess.run([sys.executable, "-c", _SEEDED, *args], capture_output=True, text=True, timeout=120,
                            check=True)
    return [json.loads(line) for line in result.stdout.splitlines()]


def _no_repeats(drawn: list[dict]) -> None:
    for kind in ("spans", "traces"):
        ids = [value for one in drawn for value in one[kind]]
        assert all(ids) and len(set(ids)) == len(ids), f"{kind} ids repeat"


def test_ids_differ_between_processes_that_seeded_everything_alike():
    _no_repeats(_drawn() + _drawn())


def test_a_forked_child_does_not_repeat_its_parent_s_ids():
    drawn = _drawn("fork")
    assert len({one["pid"] for one in drawn}) == 2
    _no_repeats(drawn)


def test_no_seed_reaches_the_ids():
    import numpy
    import torch

    ids = IsolatedRandomIdGenerator()
    drawn = []
    for _ in range(2):
        random.seed(7)
        numpy.random.seed(7)
        torch.manual_seed(7)
        drawn.append({ids.generate_span_id() for _ in range(100)})
    assert not drawn[0] & drawn[1]
    assert ids.is_trace_id_random() and 0 < ids.generate_trace_id() < 2**128


def test_the_sdk_s_seedable_default_is_replaced_for_the_spans_made_here():
    assert type(SpanWriter(TracerProvider())._ids) is IsolatedRandomIdGenerator

    class Chosen(IsolatedRandomIdGenerator):
        """A generator the user chose (OTEL_PYTHON_ID_GENERATOR, or given to the provider) is kept."""

    chosen = Chosen()
    assert SpanWriter(TracerProvider(id_generator=chosen))._ids is chosen


def test_opentelemetry_instrument_defaults_to_it(monkeypatch):
    monkeypatch.delenv("OTEL_PYTHON_ID_GENERATOR", raising=False)
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_LOGS_EXPORTER", "OTEL_BSP_SCHEDULE_DELAY"):
        monkeypatch.setenv(name, os.environ.get(name, "none"))
    DeepSpeedDistro()._configure()
    assert os.environ["OTEL_PYTHON_ID_GENERATOR"] == "deepspeed_random"
    provider, _ = sdk.build_providers({}, {})
    assert type(provider.id_generator) is IsolatedRandomIdGenerator
    monkeypatch.setenv("OTEL_PYTHON_ID_GENERATOR", "random")
    provider, _ = sdk.build_providers({}, {})
    assert type(provider.id_generator) is not IsolatedRandomIdGenerator, "the user's choice stands"
    DeepSpeedDistro()._configure()
    assert os.environ["OTEL_PYTHON_ID_GENERATOR"] == "random"


def test_the_sdk_configurator_finds_it_by_name():
    from opentelemetry.sdk._configuration import _import_id_generator

    assert type(_import_id_generator("deepspeed_random")) is IsolatedRandomIdGenerator
