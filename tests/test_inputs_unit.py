"""The input layer: what a micro-batch holds, read as it leaves the DataLoader, and what the emitter makes of it."""

from __future__ import annotations

import logging
from collections import UserDict, deque, namedtuple
from types import SimpleNamespace

import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.export.emitter import emitter
from opentelemetry_instrumentation_deepspeed.instrumentors.engine import build_recorder
from opentelemetry_instrumentation_deepspeed.recording import inputs
from opentelemetry_instrumentation_deepspeed.runtime.job import JobIdentity
from tests.test_steps_unit import recorder_on


def counted(batch, pad_token_id=None):
    recorder = SimpleNamespace(inputs=deque(maxlen=4), pad_token_id=pad_token_id)
    inputs.left_loader(recorder, batch)
    assert len(recorder.inputs) == 1, "every fetch queues one entry, so forwards stay aligned with their batches"
    return recorder.inputs[0]


def padded_batch(real_lengths, length):
    ids = torch.randint(1, 100, (len(real_lengths), length))
    mask = (torch.arange(length).unsqueeze(0) < torch.tensor(real_lengths).unsqueeze(1)).long()
    return ids.masked_fill(mask == 0, 0), mask


def test_an_attention_mask_gives_the_real_tokens():
    ids, mask = padded_batch([3, 8, 5], 8)
    assert counted({"input_ids": ids, "attention_mask": mask, "labels": ids}) == (3, 8, 16)
    # Hugging Face's BatchEncoding is a UserDict: a mapping, not a dict.
    assert counted(UserDict({"input_ids": ids, "attention_mask": mask.bool()})) == (3, 8, 16)


def test_a_float_mask_gives_the_real_tokens_whether_it_multiplies_or_adds():
    ids, mask = padded_batch([3, 8, 5], 8)
    assert counted({"input_ids": ids, "attention_mask": mask.float()}) == (3, 8, 16)
    # Additive: 0 where attended, a large negative number (or -inf) at the padding.
    for masked in (torch.finfo(torch.float32).min, float("-inf"), -1e4):
        additive = torch.zeros(3, 8).masked_fill(mask == 0, masked)
        assert counted({"input_ids": ids, "attention_mask": additive}) == (3, 8, 16)
    assert counted({"input_ids": ids, "attention_mask": torch.zeros(3, 8)}) == (3, 8, 24), "additive, no padding"


def test_a_padding_id_gives_the_real_tokens_when_there_is_no_mask():
    ids, _mask = padded_batch([2, 4], 6)
    assert counted({"input_ids": ids}, pad_token_id=0) == (2, 6, 6)
    assert counted((ids, ids), pad_token_id=0) == (2, 6, 6)
    assert counted(ids, pad_token_id=0) == (2, 6, 6)


def test_without_mask_or_padding_id_every_token_is_real():
    ids = torch.ones(4, 32, dtype=torch.int32)
    assert counted([ids, torch.zeros(4)]) == (4, 32, 128)
    Pair = namedtuple("Pair", "input_ids labels")
    assert counted(Pair(ids, ids)) == (4, 32, 128)


def test_a_mask_that_is_not_a_torch_tensor_is_not_read():
    ids, mask = padded_batch([1, 2], 4)
    assert counted({"input_ids": ids, "attention_mask": mask.numpy()}) == (2, 4, 8)


def test_what_is_not_a_batch_of_token_ids_queues_a_placeholder():
    assert counted({"pixels": torch.zeros(2, 3, 8, 8)}) is None
    assert counted(torch.zeros(2, 16)) is None  # floating point: not token ids
    assert counted(torch.zeros(2, 16, dtype=torch.bool)) is None
    assert counted(torch.zeros(16, dtype=torch.long)) is None  # one dimension: no sequence length
    assert counted([]) is None
    assert counted("text") is None


@pytest.mark.slow  # the first jagged nested tensor of a process imports 2 s of torch
def test_a_jagged_nested_batch_queues_a_placeholder_and_its_step_is_emitted():
    """Its length is symbolic: summed on the emitter's thread, it broke the drain and turned all telemetry off."""
    ids = torch.nested.nested_tensor([torch.arange(1, 4), torch.arange(1, 7)], layout=torch.jagged)
    assert counted({"input_ids": ids}) is None
    recorder, engine, exporter = recorder_on(0)
    inputs.left_loader(recorder, {"input_ids": ids})
    recorder.phase_ended(recorder.forward_started(engine, (), {"input_ids": ids}))
    recorder.phase_ended(recorder.backward_started(engine))
    engine.step(recorder)
    (step,) = [span for span in exporter.get_finished_spans() if span.name == "training.step"]
    assert "training.step.padded_tokens" not in step.attributes and not emitter().broken


def test_a_strided_nested_batch_queues_a_placeholder_and_counting_stays_on(caplog):
    """A review: its shape raises a RuntimeError, which turned the counting off for the process, with a traceback."""
    strided = torch.nested.nested_tensor([torch.arange(1, 4), torch.arange(1, 7)])
    assert counted({"input_ids": strided}) is None
    assert counted(torch.ones(2, 5, dtype=torch.long)) == (2, 5, 10)
    assert "failed" not in caplog.text


def test_a_batch_already_on_a_device_keeps_its_shape_and_is_not_counted():
    # A meta tensor stands for device memory: any read of its values would fail here, as it would sync there.
    ids = torch.empty(4, 64, dtype=torch.long, device="meta")
    mask = torch.empty(4, 64, dtype=torch.long, device="meta")
    assert counted({"input_ids": ids, "attention_mask": mask}) == (4, 64, None)
    assert counted(ids, pad_token_id=0) == (4, 64, None)
    assert counted(ids) == (4, 64, 256)  # nothing to count: every token is real, known from the shape


def test_a_batch_that_breaks_the_reader_turns_counting_off_not_training(caplog, monkeypatch):
    class Hostile(dict):
        def get(self, key, default=None):
            raise RuntimeError("a batch type nobody foresaw")

    monkeypatch.setattr(inputs, "_reading", inputs.Component("input batch counting"))
    recorder = SimpleNamespace(inputs=deque(maxlen=4), pad_token_id=None)
    with caplog.at_level(logging.ERROR):
        inputs.left_loader(recorder, Hostile())
        inputs.left_loader(recorder, Hostile())
        inputs.left_loader(recorder, torch.ones(2, 2, dtype=torch.long))
    assert len([r for r in caplog.records if "input batch counting" in r.getMessage()]) == 1
    assert not recorder.inputs  # off for the rest of the process


def test_the_padding_id_comes_from_the_configuration_else_the_models_config():
    engine = SimpleNamespace(module=SimpleNamespace(config=SimpleNamespace(pad_token_id=3)))
    assert inputs.pad_token_id(engine, None) == 3
    assert inputs.pad_token_id(engine, 7) == 7
    assert inputs.pad_token_id(SimpleNamespace(module=torch.nn.Linear(1, 1)), None) is None
    engine.module.config.pad_token_id = [1, 2]  # not one id
    assert inputs.pad_token_id(engine, None) is None


def fetch(recorder, real_lengths, length):
    ids, mask = padded_batch(real_lengths, length)
    recorder.data_waited(1, 2)
    inputs.left_loader(recorder, {"input_ids": ids, "attention_mask": mask})


def micro_batch(recorder, engine):
    recorder.phase_ended(recorder.forward_started(engine))
    recorder.phase_ended(recorder.backward_started(engine))
    engine.step(recorder)


def test_each_forward_takes_its_own_batch_even_when_the_loader_fetches_ahead():
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    recorder, engine, exported = recorder_on(0, grad_accum=2)
    recorder = build_recorder(engine, JobIdentity("job-1", 0, 0, 2), recorder.facts.writer.provider,
                              meter_provider.get_meter("test"))
    # Step 1 as Hugging Face's Trainer runs it: both micro-batches fetched, then both forwards.
    fetch(recorder, [2, 4], 8)
    fetch(recorder, [8, 8], 8)
    micro_batch(recorder, engine)
    micro_batch(recorder, engine)
    # Step 2 fetches each micro-batch just before its forward, with longer sequences.
    for real in ([10, 16], [16, 1]):
        fetch(recorder, real, 16)
        micro_batch(recorder, engine)
    spans = exported.get_finished_spans()
    forwards = [dict(s.attributes) for s in spans if s.name == semconv.SPAN_FORWARD]
    backwards = [dict(s.attributes) for s in spans if s.name == semconv.SPAN_BACKWARD]
    assert [(f[semconv.TRAINING_BATCH_SAMPLES], f[semconv.TRAINING_BATCH_SEQUENCE_LENGTH],
             f[semconv.TRAINING_BATCH_TOKENS]) for f in forwards] == [(2, 8, 6), (2, 8, 16), (2, 16, 26), (2, 16, 17)]
    assert backwards == forwards  # the micro-batch's backward carries its batch too
    steps = [dict(s.attributes) for s in spans if s.name == semconv.SPAN_STEP]
    assert [(s[semconv.TRAINING_STEP_TOKENS], s[semconv.TRAINING_STEP_PADDED_TOKENS],
             s[semconv.TRAINING_STEP_SEQUENCE_LENGTH]) for s in steps] == [(22, 32, 8), (43, 64, 16)]
    optimizer = [s for s in spans if s.name == semconv.SPAN_OPTIMIZER_STEP]
    assert all(semconv.TRAINING_BATCH_SAMPLES not in s.attributes for s in optimizer)
    metrics = {m.name: m for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
               for m in sm.metrics}
    lengths = metrics[semconv.METRIC_BATCH_SEQUENCE_LENGTH].data.data_points[0]
    assert (lengths.count, lengths.sum) == (4, 48)
    assert metrics[semconv.METRIC_BATCH_TOKENS].data.data_points[0].value == 65
    emitter().drain()


def test_an_evaluation_forward_takes_the_batches_fetched_for_it():
    recorder, engine, exported = recorder_on(0)
    fetch(recorder, [1, 1], 4)  # an evaluation batch
    recorder.not_training()
    fetch(recorder, [4, 4], 4)
    micro_batch(recorder, engine)
    forward, = [s for s in exported.get_finished_spans() if s.name == semconv.SPAN_FORWARD]
    assert forward.attributes[semconv.TRAINING_BATCH_TOKENS] == 8


def test_batches_from_no_instrumented_loader_leave_the_spans_as_they_were():
    recorder, engine, exported = recorder_on(0)
    micro_batch(recorder, engine)
    spans = exported.get_finished_spans()
    step, = [s for s in spans if s.name == semconv.SPAN_STEP]
    assert semconv.TRAINING_STEP_TOKENS not in step.attributes
    assert all(semconv.TRAINING_BATCH_SAMPLES not in s.attributes for s in spans)


@pytest.mark.parametrize("grad_accum", [1, 4])
def test_the_queue_of_fetched_batches_is_bounded(grad_accum):
    recorder, _engine, _exported = recorder_on(0, grad_accum=grad_accum)
    for _ in range(50):
        fetch(recorder, [1], 2)
    assert len(recorder.inputs) == grad_accum + 1
