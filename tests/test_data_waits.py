"""Data waits under Accelerate's real loaders, which fetch a batch ahead: one wait per batch the loop gets."""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider

from opentelemetry_instrumentation_deepspeed import DataLoaderInstrumentor
from opentelemetry_instrumentation_deepspeed.recording import registry
from opentelemetry_instrumentation_deepspeed.recording.recorder import StepRecorder
from tests.test_state_machine import Records, train_micro_batch
from tests.test_steps_unit import Engine

SLOW_BATCH = 3  # its collation sleeps


def collate(samples):
    if samples[0] == 2 * SLOW_BATCH:
        time.sleep(0.3)
    return torch.tensor(samples)


@pytest.fixture
def recorded():
    instrumentor = DataLoaderInstrumentor()
    instrumentor.instrument(tracer_provider=TracerProvider())
    engine, records = Engine(grad_accum=2), Records()
    registry.track(engine, StepRecorder(engine, "facts", records.submit))
    try:
        yield engine, records
    finally:
        registry.forget_all()
        instrumentor.uninstrument()


def test_uninstrument_restores_accelerate_s_loaders():
    from accelerate import data_loader

    classes = (data_loader.DataLoaderShard, data_loader.DataLoaderDispatcher, data_loader.SkipDataLoader)
    original = [vars(cls)["__iter__"] for cls in classes]
    instrumentor = DataLoaderInstrumentor()
    instrumentor.instrument(tracer_provider=TracerProvider())
    try:
        assert [vars(cls)["__iter__"].__wrapped__ for cls in classes] == original
    finally:
        instrumentor.uninstrument()
    assert [vars(cls)["__iter__"] for cls in classes] == original


@pytest.mark.parametrize("loader", ["DataLoaderShard", "SkipDataLoader"])
def test_an_accelerate_loader_is_one_wait_per_batch_it_hands_over(recorded, loader):
    from accelerate import data_loader

    engine, records = recorded
    batches = getattr(data_loader, loader)(list(range(10)), batch_size=2, collate_fn=collate)
    for _epoch in range(2):
        for index, _batch in enumerate(batches):
            if index == 4:
                engine.micro_steps = 1  # the epoch's last, partial step is a boundary (Accelerate syncs there)
            rec = registry.active()
            train_micro_batch(rec, engine)
    assert [[wait[2] for wait in record.waits] for record in records] == [[0, 1], [0, 1], [0]] * 2
    waits = [(wait[1] - wait[0], step, wait[2]) for step, record in enumerate(records[:3]) for wait in record.waits]
    # DataLoaderShard fetches batch 3 while the loop waits for batch 2 (step 2's first): that wait is batch 2's.
    assert max(waits)[1:] == (1, 0 if loader == "DataLoaderShard" else 1)
    assert isinstance(iter(batches), type(iter(batches).__wrapped__)), "still the loader's generator to its users"


def test_a_background_thread_s_fetches_are_no_waits_of_the_loop(recorded):
    """A prefetcher thread fills a queue from the loader (the BackgroundGenerator pattern): the loop never waited in
    those fetches; counted, they made the steps start at the prefetcher's first fetch."""
    engine, records = recorded
    loader = torch.utils.data.DataLoader(list(range(10, 18)), batch_size=2, collate_fn=collate)  # none slow
    fetched = queue.Queue()
    prefetcher = threading.Thread(target=lambda: [fetched.put(batch) for batch in loader])
    prefetcher.start()
    prefetcher.join()
    for _ in range(4):
        fetched.get()
        train_micro_batch(registry.active(), engine)
    assert len(records) == 2 and [record.waits for record in records] == [[], []]


def test_an_engine_built_on_one_thread_and_trained_on_another_keeps_its_waits(recorded):
    """A harness builds the engine on its main thread and trains on a worker's: the thread that opens the steps is the
    training thread from then on (the first step's fetches before it opened were the builder's thread's to make)."""
    engine, records = recorded
    loader = torch.utils.data.DataLoader(list(range(10, 18)), batch_size=2, collate_fn=collate)  # none slow

    def train():
        for _batch in loader:
            train_micro_batch(registry.active(), engine)

    worker = threading.Thread(target=train)
    worker.start()
    worker.join()
    assert [len(record.waits) for record in records] == [1, 2]
    assert registry.active().thread == worker.ident


def test_diagnose_counts_a_wait_fetched_ahead_in_the_step_it_blocked():
    """Step 2's first micro-batch was fetched during step 1: its wait is step 2's child, step 1's time."""
    from opentelemetry_instrumentation_deepspeed.diagnose.analysis import Analysis
    from opentelemetry_instrumentation_deepspeed.diagnose.reader import Span

    def span(name, trace, start, end, parent="", **attributes):
        return Span(name, trace, f"{name}-{trace}-{start}", parent, start, end, "job", 0, attributes)

    spans = [span("training.step", "t1", 0, 100, **{"training.step": 1}),
             span("training.forward", "t1", 10, 50, "training.step-t1-0"),
             span("training.data.wait", "t2", 60, 90, "training.step-t2-100"),  # fetched ahead, inside step 1
             span("training.step", "t2", 100, 260, **{"training.step": 2}),
             span("training.data.wait", "t2", 100, 110, "training.step-t2-100"),
             span("training.forward", "t2", 110, 250, "training.step-t2-100"),
             span("training.step", "t3", 260, 310, **{"training.step": 3}),
             span("training.forward", "t3", 260, 300, "training.step-t3-260")]
    analysis = Analysis()
    analysis.add(spans)
    rank = analysis.result()["ranks"][0]
    first, second = rank["typical"], rank["slowest"]  # the median step and the longest
    assert (first["step"], second["step"]) == (1, 2)
    assert first["parts"]["data_wait"] == pytest.approx(30e-9) and first["parts"]["unaccounted"] == pytest.approx(30e-9)
    assert second["parts"]["data_wait"] == pytest.approx(10e-9)


def test_instrumented_again_before_training_registers_the_worker_metrics_once(monkeypatch):
    """An instrument() undone before training started leaves its start listener behind: it must not register the
    workers' instruments a second time beside the new instrument()'s."""
    from opentelemetry.sdk.metrics import MeterProvider

    from opentelemetry_instrumentation_deepspeed.instrumentors import dataloader
    from opentelemetry_instrumentation_deepspeed.runtime import session

    registered = []
    monkeypatch.setattr(dataloader.WorkerProcesses, "register", lambda self, meter: registered.append(self))
    monkeypatch.setattr(session, "_listeners", [])
    instrumentor = DataLoaderInstrumentor()
    instrumentor.instrument(meter_provider=MeterProvider())
    instrumentor.uninstrument()
    instrumentor.instrument(meter_provider=MeterProvider())
    try:
        for listener in list(session._listeners):
            listener(None)
        assert len(registered) == 1
    finally:
        instrumentor.uninstrument()
