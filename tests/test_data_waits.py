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


def _ids(length):
    return lambda samples: {"input_ids": torch.ones(len(samples), length, dtype=torch.long)}


def _forward_lengths(record) -> list:
    return [phase.inputs[1] for phase in record.phases if phase.name == "forward"]  # (samples, length, tokens)


@pytest.mark.parametrize("fetch_first", [True, False], ids=["trainer", "interleaved"])
def test_an_evaluation_loop_through_the_bare_module_feeds_no_step(recorded, fetch_first):
    """The Trainer evaluates the unwrapped module (a DDP loop its ``model.module``): no wrapper sees those forwards.
    Their fetches were taken as the next step's: its start moved back over the whole evaluation, and each forward
    took the batch fetched before its own, for the rest of the run."""
    engine, records = recorded
    train = torch.utils.data.DataLoader(list(range(8)), batch_size=2, collate_fn=_ids(4))
    evaluation = torch.utils.data.DataLoader(list(range(9)), batch_size=3, collate_fn=_ids(7))
    batches = iter(train)
    for step in range(2):
        if step == 1:
            evaluated = time.time_ns()
            for _batch in evaluation:  # three batches, forwards unseen, to the loader's end
                pass
        if fetch_first:  # the Trainer fetches the step's micro-batches, then runs them
            fetched = [next(batches) for _ in range(2)]
            for _batch in fetched:
                train_micro_batch(registry.active(), engine)
        else:
            for _ in range(2):
                next(batches)
                train_micro_batch(registry.active(), engine)
    assert [len(record.waits) for record in records] == [2, 2]
    assert records[1].start > evaluated
    assert [_forward_lengths(record) for record in records] == [[4, 4], [4, 4]]


def test_an_epoch_s_last_partial_step_keeps_the_fetch_made_before_its_loader_ended(recorded):
    """The Trainer fetches a step's micro-batches first: at an epoch's end the loader runs out after the last one,
    before its forward."""
    engine, records = recorded
    train = torch.utils.data.DataLoader(list(range(6)), batch_size=2, collate_fn=_ids(4))
    for _epoch in range(2):
        batches = iter(train)
        while True:
            fetched = []
            for _ in range(2):
                try:
                    fetched.append(next(batches))
                except StopIteration:
                    break
            if not fetched:
                break
            if len(fetched) == 1:
                engine.micro_steps = 1  # a partial step's one micro-batch is its boundary
            for _batch in fetched:
                train_micro_batch(registry.active(), engine)
    assert [len(record.waits) for record in records] == [2, 1, 2, 1]
    assert all(_forward_lengths(record) == [4] * len(record.waits) for record in records)


class _ModuleEngine(torch.nn.Module, Engine):
    """An engine as DeepSpeed's is: an nn.Module wrapping the model as ``module``, whose eval() and train() set the
    wrapped module's mode only."""

    def __init__(self):
        torch.nn.Module.__init__(self)
        Engine.__init__(self)
        self.module = torch.nn.Linear(2, 2)

    def eval(self):
        self.module.train(False)

    def train(self, mode=True):
        self.module.train(mode)


@pytest.mark.parametrize(("mode", "grad", "state"), [("train", True, "forward"), ("train", False, "idle"),
                                                     ("eval", False, "idle"), ("eval", True, "forward")])
def test_deepspeed_s_eval_mode_is_an_evaluation_without_gradients_and_training_with_them(mode, grad, state):
    """engine.eval() under no_grad is an evaluation (its batch feeds no step); with gradients the wrapped module's
    eval mode is training without dropout (a code review: every such forward read as an evaluation)."""
    from opentelemetry_instrumentation_deepspeed.instrumentors import engine as engine_wrappers

    engine = _ModuleEngine()
    recorder = StepRecorder(engine, "facts", Records().submit)
    registry.track(engine, recorder)
    try:
        getattr(engine, mode)()
        seen = []
        with torch.set_grad_enabled(grad):
            engine_wrappers._forward(lambda self, x: seen.append(recorder.state) or self.module(x))(engine,
                                                                                                  torch.ones(1, 2))
        assert seen == [state]
    finally:
        registry.forget_all()
