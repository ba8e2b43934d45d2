"""The step recorder and the emitter at the boundary with the engine, where a run cannot easily reach them."""

from __future__ import annotations

import logging
import os
import uuid

import pytest
from opentelemetry.context import Context
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import StatusCode

from opentelemetry_instrumentation_deepspeed.export import trace_ids
from opentelemetry_instrumentation_deepspeed.export.emitter import emitter
from opentelemetry_instrumentation_deepspeed.instrumentors.engine import build_recorder
from opentelemetry_instrumentation_deepspeed.runtime.job import JobIdentity


class Engine:
    """The few engine methods the recorder reads, as DeepSpeed defines them."""

    def __init__(self, grad_accum=1):
        self.global_steps = 0
        self.skipped_steps = 0
        self.micro_steps = 0
        self.grad_accum = grad_accum

    def train_micro_batch_size_per_gpu(self):
        return 2

    def train_batch_size(self):
        return 2 * self.grad_accum

    def gradient_accumulation_steps(self):
        return self.grad_accum

    def zero_optimization_stage(self):
        return 2

    def managed_gradient_accumulation(self):
        return True

    def is_gradient_accumulation_boundary(self):
        return (self.micro_steps + 1) % self.grad_accum == 0

    def fp16_enabled(self):
        return True

    def _get_optimizer_loss_scale(self):
        return 2.0**16

    def get_global_grad_norm(self):
        return 0.5

    def step(self, recorder):
        span = recorder.optimizer_step_started(self)
        if self.is_gradient_accumulation_boundary():
            self.global_steps += 1
        self.micro_steps += 1
        recorder.optimizer_step_ended(self, span)


class Emitted:
    """The exporter, read once the emitter has drained: spans are made off the training thread."""

    def __init__(self, exporter: InMemorySpanExporter):
        self.exporter = exporter

    def get_finished_spans(self):
        emitter().drain()
        return self.exporter.get_finished_spans()


def recorder_on(rank: int, sampler=None, job="job-1", grad_accum=1, *, cuda=None, provider=None):
    exporter = InMemorySpanExporter()
    if provider is None:
        provider = TracerProvider(sampler=sampler) if sampler else TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine = Engine(grad_accum)
    recorder = build_recorder(engine, JobIdentity(job, rank, rank, 2), provider,
                            NoOpMeterProvider().get_meter("test"), cuda=cuda)
    return recorder, engine, Emitted(exporter)


def train_step(recorder, engine, grad_accum=1):
    for _ in range(grad_accum):
        recorder.phase_ended(recorder.forward_started(engine))
        recorder.phase_ended(recorder.backward_started(engine))
        engine.step(recorder)


def test_step_ids_are_deterministic_and_distinct():
    assert trace_ids.step_ids("job", 1) == trace_ids.step_ids("job", 1)
    ids = {trace_ids.step_ids(job, step) for job in ("a", "b") for step in range(1000)}
    assert len(ids) == 2000
    assert all(trace_id and span_id for trace_id, span_id in ids)


def test_ranks_join_one_trace_under_rank_0s_root():
    job = uuid.uuid4().hex  # a job of its own: this process built other tests' engines on "its" ranks
    rank0, engine0, spans0 = recorder_on(0, job=job)
    rank1, engine1, spans1 = recorder_on(1, job=job)
    for _ in range(3):
        train_step(rank0, engine0)
        train_step(rank1, engine1)
    roots = {s.attributes["training.step"]: s for s in spans0.get_finished_spans() if s.name == "training.global_step"}
    for span in spans1.get_finished_spans():
        if span.name == "training.step":
            root = roots[span.attributes["training.step"]]
            assert span.context.trace_id == root.context.trace_id
            assert span.parent.span_id == root.context.span_id and span.parent.is_remote
    assert all(root.parent is None for root in roots.values())


def test_steps_run_again_after_a_rollback_take_traces_of_their_own_on_every_rank():
    """A review: engine.load_checkpoint() at step 20 of a checkpoint of step 10 ran steps 11-20 again in the traces
    of the first ones, and rank 0 wrote each of those roots twice (one span id, two spans)."""
    job = uuid.uuid4().hex
    ranks = [recorder_on(rank, job=job) for rank in (0, 1)]
    for recorder, engine, _spans in ranks:
        for _ in range(4):
            train_step(recorder, engine)
        engine.global_steps = 2  # the checkpoint of step 2, loaded on every rank
        for _ in range(3):
            train_step(recorder, engine)
    roots = [s for s in ranks[0][2].get_finished_spans() if s.name == "training.global_step"]
    assert [s.attributes["training.step"] for s in roots] == [1, 2, 3, 4, 3, 4, 5]
    assert len({(s.context.trace_id, s.context.span_id) for s in roots}) == 7
    first, again = roots[2], roots[4]  # step 3, run twice
    assert first.context.trace_id != again.context.trace_id
    steps = [s for s in ranks[1][2].get_finished_spans() if s.name == "training.step"]
    assert [(s.context.trace_id, s.parent.span_id) for s in steps] == [
        (root.context.trace_id, root.context.span_id) for root in roots]
    # Before the rollback, the ids are those every rank derives from (job id, step number) alone.
    assert (roots[0].context.trace_id, roots[0].context.span_id) == trace_ids.step_ids(job, 1)


def test_sampling_decision_is_the_same_on_every_rank():
    sampler = ParentBased(TraceIdRatioBased(0.5))
    job = uuid.uuid4().hex  # as above
    rank0, engine0, spans0 = recorder_on(0, sampler, job=job)
    rank1, engine1, spans1 = recorder_on(1, sampler, job=job)
    for _ in range(40):
        train_step(rank0, engine0)
        train_step(rank1, engine1)

    def kept(exporter):
        return {s.attributes["training.step"] for s in exporter.get_finished_spans() if s.name == "training.step"}

    assert kept(spans0) == kept(spans1)
    assert 5 < len(kept(spans0)) < 35


def test_a_ranks_second_engine_traces_its_steps_apart_from_the_first_s_alike_on_every_rank():
    """An RL job's actor and critic, or an engine rebuilt in the same process: its step 1 is not the first engine's
    (one trace and one root span id for both); every rank counts its engines alike."""
    job = uuid.uuid4().hex
    built = [[recorder_on(rank, job=job) for rank in (0, 1)] for _engine in range(2)]
    roots = []
    for engine_recorders in built:
        for rank, (recorder, engine, spans) in enumerate(engine_recorders):
            train_step(recorder, engine)
            (step,) = [span for span in spans.get_finished_spans() if span.name == "training.step"]
            roots.append((step.context.trace_id, step.parent.span_id, rank))
    (first0, first1), (second0, second1) = roots[:2], roots[2:]
    assert first0[:2] == first1[:2] and second0[:2] == second1[:2], "each engine's step 1: one trace on every rank"
    assert first0[0] != second0[0] and first0[1] != second0[1]


@pytest.mark.parametrize("sampler", [ParentBased(TraceIdRatioBased(0.3)), TraceIdRatioBased(0.7), ALWAYS_OFF,
                                     ParentBased(ALWAYS_ON)], ids=repr)
def test_root_decisions_known_beforehand_are_the_samplers_own(sampler):
    decide = trace_ids.root_decision(sampler)
    for step in range(500):
        trace_id, _ = trace_ids.step_ids("job", step)
        assert decide(trace_id) == sampler.should_sample(Context(), trace_id, "root").decision.is_sampled()


@pytest.mark.parametrize("profile_every", ["0", "1"])
def test_any_other_sampler_is_asked_at_every_step_and_only_by_the_emitter(profile_every, monkeypatch):
    """A step to be profiled asked the sampler ahead, on the training thread, whether its spans would be recorded:
    a second question for the same root, which a rate-limiting sampler answers with its next token."""
    monkeypatch.setenv("OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY", profile_every)
    monkeypatch.setenv("OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR", "0")

    class EveryOther(Sampler):
        def __init__(self):
            self.asked = 0

        def should_sample(self, parent_context, trace_id, name, *args, **kwargs):
            self.asked += 1
            return SamplingResult(Decision.RECORD_AND_SAMPLE if self.asked % 2 else Decision.DROP)

        def get_description(self):
            return "EveryOther"

    assert trace_ids.root_decision(EveryOther()) is None
    sampler = ParentBased(EveryOther())
    recorder, engine, exporter = recorder_on(0, sampler)
    for _ in range(6):
        train_step(recorder, engine)
    kept = sorted(s.attributes["training.step"] for s in exporter.get_finished_spans() if s.name == "training.step")
    assert sampler._root.asked == 6, "once per step, by the emitter"
    assert kept == [1, 3, 5]
    assert recorder.facts.recorded(7), "not known ahead: profiled, and the profile dropped with its trace"
    assert sampler._root.asked == 6


def test_gradient_accumulation_opens_one_step_per_boundary():
    recorder, engine, exporter = recorder_on(1, grad_accum=3)
    train_step(recorder, engine, grad_accum=3)
    names = [s.name for s in exporter.get_finished_spans()]
    assert names.count("training.step") == 1 and names.count("training.optimizer.step") == 1
    assert names.count("training.forward") == 3


def test_a_failing_phase_marks_its_step_and_the_next_step_starts_clean():
    recorder, engine, exporter = recorder_on(0)
    span = recorder.forward_started(engine)
    recorder.phase_failed(span, RuntimeError("CUDA out of memory"))
    train_step(recorder, engine)
    spans = exporter.get_finished_spans()
    failed_forward = next(s for s in spans if s.name == "training.forward" and s.status.status_code == StatusCode.ERROR)
    assert failed_forward.events[0].name == "exception"
    steps = [s for s in spans if s.name == "training.step"]
    assert [s.status.status_code for s in steps] == [StatusCode.ERROR, StatusCode.UNSET]
    assert [s.attributes["training.step"] for s in steps] == [1, 1], "the retried step keeps its number"


def test_evaluation_forwards_drop_the_waits_that_fed_them():
    recorder, engine, exporter = recorder_on(1)
    recorder.data_waited(1, 2)
    recorder.not_training()
    recorder.data_waited(10, 20)
    train_step(recorder, engine)
    waits = [s for s in exporter.get_finished_spans() if s.name == "training.data.wait"]
    assert [(s.start_time, s.end_time) for s in waits] == [(10, 20)]


def test_waits_without_training_are_bounded_by_the_micro_batches_of_a_step():
    recorder, engine, exporter = recorder_on(1, grad_accum=4)
    for i in range(10_000):
        recorder.data_waited(i, i + 1)
    train_step(recorder, engine, grad_accum=4)
    waits = [s for s in exporter.get_finished_spans() if s.name == "training.data.wait"]
    assert [s.start_time for s in waits] == [9996, 9997, 9998, 9999], "the most recent ones"


def test_a_caught_failure_in_direct_backward_ends_its_span_and_the_retry_shares_the_root():
    recorder, engine, exporter = recorder_on(0)
    recorder.phase_ended(recorder.forward_started(engine))
    recorder.backward_started(engine, direct=True)
    recorder.direct_backward_failed(RuntimeError("out of memory"))  # the user catches it and retries
    train_step(recorder, engine)
    spans = exporter.get_finished_spans()
    backward = [s for s in spans if s.name == "training.backward"]
    assert backward[0].status.status_code == StatusCode.ERROR and backward[0].end_time is not None
    roots = [s for s in spans if s.name == "training.global_step"]
    steps = [s for s in spans if s.name == "training.step"]
    assert len(roots) == 1 and len(steps) == 2, "one root for the step and its retry"
    assert {s.parent.span_id for s in steps} == {roots[0].context.span_id}


def test_a_bug_in_the_recorder_is_logged_once_and_disables_it(caplog):
    recorder, engine, exporter = recorder_on(1)
    train_step(recorder, engine)

    class Broken(Engine):
        @property
        def global_steps(self):
            raise AttributeError("renamed in a future DeepSpeed")

        @global_steps.setter
        def global_steps(self, value):
            pass

    broken = Broken()
    with caplog.at_level(logging.ERROR):
        for _ in range(5):
            assert recorder.forward_started(broken) is None
            recorder.phase_ended(None)
            assert recorder.optimizer_step_started(broken) is None
            recorder.optimizer_step_ended(broken, None)
    assert len(caplog.records) == 1
    assert "step tracing failed" in caplog.records[0].getMessage()
    assert "renamed in a future DeepSpeed" in caplog.text
    assert len([s for s in exporter.get_finished_spans() if s.name == "training.step"]) == 1


@pytest.mark.parametrize("rank", [0, 1])
def test_no_sdk_means_no_spans_and_no_errors(rank, caplog):
    from opentelemetry.trace import NoOpTracerProvider

    recorder, engine, _ = recorder_on(rank, provider=NoOpTracerProvider())
    with caplog.at_level(logging.ERROR):
        train_step(recorder, engine)
        emitter().drain()
    assert not caplog.records


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="schedstat is Linux's")
def test_each_phase_span_says_how_much_of_it_the_training_thread_waited_for_a_cpu():
    recorder, engine, spans = recorder_on(0)
    for _ in range(2):
        train_step(recorder, engine)
    phases = [s for s in spans.get_finished_spans()
              if s.name in ("training.forward", "training.backward", "training.optimizer.step")]
    assert len(phases) == 6
    assert all(0 <= s.attributes["training.phase.thread.cpu.wait"] <= 1 for s in phases)


class _AttributesRaiseKeyError:
    def __getattr__(self, name):
        raise KeyError(name)


def test_a_forward_argument_not_foreseen_turns_off_its_reading_not_the_steps(monkeypatch, caplog):
    import torch

    from opentelemetry_instrumentation_deepspeed.recording import batches
    from tests.test_state_machine import recorder

    monkeypatch.setattr(batches._reading, "broken", False)  # whatever this test does to it is undone after
    jagged = torch.nested.nested_tensor([torch.arange(3), torch.arange(5)], layout=torch.jagged)
    strided = torch.nested.nested_tensor([torch.arange(3), torch.arange(5)])
    ids = torch.ones(4, 6, dtype=torch.long)
    rec, engine, records = recorder()
    for argument in (ids, jagged, strided, _AttributesRaiseKeyError(), ids):
        rec.phase_ended(rec.forward_started(engine, (argument,), {}))
        rec.phase_ended(rec.backward_started(engine))
        engine.step(rec)
    assert not rec.broken and not rec.builder.broken and len(records) == 5
    assert (records[0].samples, records[0].tokens) == (4, 24)
    assert (records[1].samples, records[1].tokens) == (2, 0), "a jagged batch's samples; its tokens are symbolic"
    assert records[2].samples == 2, "a strided one's shape raises: not read (the micro-batch size), reading stays on"
    assert caplog.text.count("batch shape reading failed") == 1, "the object whose attributes raise: once"
    assert records[4].tokens == 0, "the reading stays off"


def test_a_step_s_samples_are_those_its_batches_held():
    """Micro-batch size 2 configured: an epoch's partial last batch of 1 sample, a batch whose size was not read
    (counted as configured), a loop feeding 5. The step said micro-batch size x micro-batches: 6 where it trained
    on 8, while training.samples counted 8."""
    import torch

    recorder, engine, exporter = recorder_on(1, grad_accum=3)
    for batch in (torch.zeros(1, 4, dtype=torch.long), object(), torch.zeros(5, 4, dtype=torch.long)):
        recorder.phase_ended(recorder.forward_started(engine, (batch,)))
        recorder.phase_ended(recorder.backward_started(engine))
        engine.step(recorder)
    (step,) = [span for span in exporter.get_finished_spans() if span.name == "training.step"]
    assert (step.attributes["training.step.samples"], step.attributes["training.step.micro_batches"]) == (8, 3)


def test_a_batch_passed_whole_counts_its_inputs_and_a_list_of_samples_is_not_read():
    """The Lightning review: its forward gets the loader's batch whole, ``model([x, y], batch_idx)``; no step said its
    samples, and training.samples stayed 0. The code review of the fix: a list of samples (torchvision's detection
    images, sequences of their own lengths) read by its first element counted an image's channels as samples."""
    import torch

    from opentelemetry_instrumentation_deepspeed.recording.batches import batch_shape

    assert batch_shape(([torch.randn(6, 4), torch.randint(0, 9, (6,))], 0), {}) == (6, None)  # features, labels
    assert batch_shape(((torch.randn(5, 3, 8, 8), torch.zeros(5, 8, 8, dtype=torch.long)),), {})[0] == 5  # masks
    ids = torch.zeros(4, 7, dtype=torch.long)
    assert batch_shape(([ids, ids.clone()],), {}) == (4, 28)  # a language model's token ids and labels
    assert batch_shape(((ids, torch.ones(4, 7, dtype=torch.long), ids.clone()),), {}) == (4, 28)  # ids, mask, labels
    assert batch_shape((({"input_ids": ids}, torch.zeros(4)),), {}) == (4, 28)
    assert batch_shape(([ids],), {}) == (4, 28)  # a TensorDataset of token ids
    images = [torch.randn(3, 64, 80), torch.randn(3, 50, 70)]
    sequences = [torch.zeros(17, dtype=torch.long), torch.zeros(9, dtype=torch.long), torch.zeros(30, dtype=torch.long)]
    alike = [torch.randn(6, 4), torch.randn(6, 1)]  # a regression's: as a list of two samples would look
    for unknown in (images, sequences, alike, [torch.randn(6, 4)], [], [torch.randn(6, 4), "labels"],
                    [torch.randn(3, 64, 80)]):
        assert batch_shape((unknown,), {}) == (None, None), unknown

    recorder, engine, exporter = recorder_on(1, grad_accum=2)
    for batch in ([torch.randn(6, 4), torch.randint(0, 9, (6,))], images):
        recorder.phase_ended(recorder.forward_started(engine, (batch, 0)))
        recorder.phase_ended(recorder.backward_started(engine))
        engine.step(recorder)
    (step,) = [span for span in exporter.get_finished_spans() if span.name == "training.step"]
    assert step.attributes["training.step.samples"] == 6 + 2  # the images' micro-batch: the configured size
