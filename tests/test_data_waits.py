"""Data waits under Accelerate's real loaders, which fetch a batch ahead: one wait per batch the loop gets."""

from __future__ import annotations

import time

import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider

from opentelemetry_instrumentation_deepspeed import DataLoaderInstrumentor
from opentelemetry_instrumentation_deepspeed.recording import registry
from opentelemetry_instrumentation_deepspeed.recording.recorder import StepRecorder
from tests.test_state_machine import train_micro_batch
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
    engine, records = Engine(grad_accum=2), []
    registry.track(engine, StepRecorder(engine, "facts", records.append))
    try:
        yield engine, records
    finally:
        registry.forget_all()
        instrumentor.uninstrument()


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
