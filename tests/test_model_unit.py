"""Loss, gradient norm and allocator memory at the boundary with torch.cuda (a fake here; the real
one: scripts/gpu-check.sh), the numerics watch, and the MODEL / MEMORY findings of diagnose."""

from __future__ import annotations

import math
import random

import pytest
import torch
from opentelemetry.trace import StatusCode

from opentelemetry_instrumentation_deepspeed.diagnose.model import ModelFindings, NumericsWatch
from opentelemetry_instrumentation_deepspeed.diagnose.reader import Span
from opentelemetry_instrumentation_deepspeed.export.emitter import emitter
from opentelemetry_instrumentation_deepspeed.recording import scalars
from opentelemetry_instrumentation_deepspeed.recording.allocator import AllocatorMemory
from opentelemetry_instrumentation_deepspeed.recording.scalars import DeviceScalars
from opentelemetry_instrumentation_deepspeed.runtime import watchdog
from tests.test_gpu_timing_unit import FakeDevices
from tests.test_steps_unit import recorder_on


def steps_of(exporter):
    return [s for s in exporter.get_finished_spans() if s.name == "training.step"]


# -- loss and gradient norm on the host -------------------------------------------------------------


def test_host_losses_are_averaged_as_a_training_loop_prints_them():
    recorder, engine, exporter = recorder_on(0, grad_accum=3)
    losses = [torch.tensor(v, requires_grad=True) for v in (2.3456789, 1.1, 0.7)]
    printed = 0.0
    for loss in losses:
        recorder.forward_ended(recorder.forward_started(engine), loss)
        recorder.phase_ended(recorder.backward_started(engine, loss=loss))
        engine.step(recorder)
        printed += loss.item() / 3
    (step,) = steps_of(exporter)
    assert step.attributes["training.loss"] == printed  # to the bit
    assert step.attributes["training.grad_norm"] == 0.5


def test_losses_given_as_the_step_s_shares_are_summed():
    """``engine.backward(loss, scale_wrt_gas=False)``: DeepSpeed does not divide the loss, the caller did (the
    Trainer); a partial step of one micro-batch is that loss."""
    recorder, engine, exporter = recorder_on(0, grad_accum=3)
    shares = [torch.tensor(v / 3) for v in (2.3456789, 1.1, 0.7)]
    for share in shares:
        recorder.forward_ended(recorder.forward_started(engine), share)
        recorder.phase_ended(recorder.backward_started(engine, loss=share, share=True))
        engine.step(recorder)
    (step,) = steps_of(exporter)
    assert step.attributes["training.loss"] == sum(share.item() for share in shares)


def test_a_direct_backward_takes_the_forwards_scalar_output_without_keeping_it():
    recorder, engine, exporter = recorder_on(0)
    loss = torch.tensor(3.25, requires_grad=True) * 1.0
    recorder.forward_ended(recorder.forward_started(engine), loss)
    assert recorder._forward_output() is loss
    recorder.backward_started(engine, direct=True)
    recorder.direct_backward_ended()
    engine.step(recorder)
    assert steps_of(exporter)[0].attributes["training.loss"] == 3.25
    recorder.forward_ended(recorder.forward_started(engine), {"loss": torch.tensor(1.0), "logits": None})
    assert recorder._forward_output is not None
    del loss
    kept = recorder._forward_output
    assert kept() is None, "a weak reference: the forward's output dies with the user's last reference"


def test_a_direct_backward_takes_the_loss_it_was_called_on_not_the_forwards_output():
    """DeepSpeed opens a direct backward from a hook on the engine's outputs: here logits, from which the loop made
    its loss (a criterion, then a scale)."""
    from opentelemetry_instrumentation_deepspeed.instrumentors import engine as engine_instrumentor
    from opentelemetry_instrumentation_deepspeed.recording.recorder import BackwardRoot

    recorder, engine, exporter = recorder_on(0)
    original = torch.autograd.backward
    weight = torch.tensor(2.0, requires_grad=True)
    logits = weight * torch.tensor([1.0, 3.0])
    recorder.forward_ended(recorder.forward_started(engine), logits)

    def deepspeed_prologue(_grad):
        recorder.backward_started(engine, direct=True)

    logits.register_hook(deepspeed_prologue)
    engine_instrumentor._follow_backward_roots()
    try:
        loss = (logits ** 2).mean() * 8  # 8 x (4 + 36) / 2
        loss.backward()
        assert not BackwardRoot.by_thread, "the loss is not kept past its backward"
    finally:
        engine_instrumentor._leave_backward_roots()
    assert torch.autograd.backward is original
    recorder.direct_backward_ended()
    engine.step(recorder)
    assert steps_of(exporter)[0].attributes["training.loss"] == 160.0


def test_a_direct_backward_s_loss_is_its_own_thread_s_not_another_backward_s():
    """Another thread's backward running meanwhile (a second model, a data pipeline's) is not the step's loss."""
    import threading

    from opentelemetry_instrumentation_deepspeed.instrumentors import engine as engine_instrumentor

    recorder, engine, exporter = recorder_on(0)
    weight = torch.tensor(2.0, requires_grad=True)
    logits = weight * torch.tensor([1.0, 3.0])
    recorder.forward_ended(recorder.forward_started(engine), logits)
    inside, release = threading.Event(), threading.Event()

    def elsewhere():
        other = torch.tensor(1.0, requires_grad=True)
        waiting = other * 1.0
        waiting.register_hook(lambda grad: (inside.set(), release.wait(10)) and None)
        (waiting * 1000.0).backward()

    logits.register_hook(lambda _grad: recorder.backward_started(engine, direct=True) and None)
    engine_instrumentor._follow_backward_roots()
    thread = threading.Thread(target=elsewhere)

    def start_the_other(_grad):  # the loss's own hook, before the engine's output's: the other backward begins
        thread.start()
        inside.wait(10)

    try:
        loss = (logits ** 2).mean() * 8
        loss.register_hook(start_the_other)
        loss.backward()
    finally:
        release.set()
        thread.join(10)
        engine_instrumentor._leave_backward_roots()
    recorder.direct_backward_ended()
    engine.step(recorder)
    assert steps_of(exporter)[0].attributes["training.loss"] == 160.0


# -- a CUDA scalar: copied into the pinned ring, read once its event completed ----------------------


class FakeCudaEvent:
    def __init__(self, gpu):
        self.gpu, self.done = gpu, False

    def record(self, stream=None):
        self.gpu.events.append(self)

    def query(self):
        self.gpu.asked_on.append(self.gpu.current)
        return self.done

    def elapsed_time(self, other):
        assert self.done and other.done, "elapsed_time on an unfinished event blocks"
        return 1.0

    def synchronize(self):
        raise AssertionError("Event.synchronize blocks")


class FakeCuda(FakeDevices):
    """torch.cuda at the boundary: events complete when the test says the GPU ran; the allocator's
    counters are what the test sets."""

    def __init__(self):
        self.events = []
        self.asked_on = []  # the thread's current device at each event query
        self.stats = {"allocated_bytes": {"all": {"current": 0, "peak": 0}},
                      "reserved_bytes": {"all": {"current": 0}}, "num_alloc_retries": 0, "num_ooms": 0}
        self.resets = 0
        cuda = self

        class Event:
            def __new__(cls, enable_timing=False):
                return FakeCudaEvent(cuda)

        self.Event = Event

    def run(self):
        for event in self.events:
            event.done = True

    def current_stream(self):
        return self  # a stream that is never idle

    def query(self):
        return False

    def synchronize(self):
        raise AssertionError("torch.cuda.synchronize blocks")

    def reset_peak_memory_stats(self, device=None):
        self.resets += 1
        self.stats["allocated_bytes"]["all"]["peak"] = self.stats["allocated_bytes"]["all"]["current"]

    def allocate(self, size: int, reserve: int = 0):
        allocated = self.stats["allocated_bytes"]["all"]
        allocated["current"] += size
        allocated["peak"] = max(allocated["peak"], allocated["current"])
        self.stats["reserved_bytes"]["all"]["current"] += reserve

    def memory_stats_as_nested_dict(self, device=None):
        return {key: (dict(value, all=dict(value["all"])) if isinstance(value, dict) else value)
                for key, value in self.stats.items()}


class DeviceScalar:
    """A CUDA scalar tensor as the recorder sees it: reading it on the host would block."""

    is_cuda = True
    is_cpu = False

    def __init__(self, value: float, shape: tuple = ()):
        self._value = torch.full(shape, value, dtype=torch.float32)
        self.ndim = len(shape)
        self.requires_grad = True

    def numel(self):
        return self._value.numel()

    def detach(self):
        return self._value

    def item(self):
        raise AssertionError("item() on a CUDA tensor synchronizes")

    __float__ = item


def cuda_recorder(grad_accum=1, norm=None):
    cuda = FakeCuda()
    recorder, engine, exporter = recorder_on(0, grad_accum=grad_accum, cuda=cuda)
    recorder._device_scalars = DeviceScalars(torch, cuda, pin_memory=False)
    if norm is not None:
        engine.get_global_grad_norm = lambda: norm
    return cuda, recorder, engine, exporter


def micro_batch(recorder, engine, loss):
    recorder.forward_ended(recorder.forward_started(engine), loss)
    recorder.phase_ended(recorder.backward_started(engine, loss=loss))
    engine.step(recorder)


def test_cuda_scalars_are_read_after_their_event_completed_never_before():
    cuda, recorder, engine, exporter = cuda_recorder(grad_accum=2, norm=DeviceScalar(0.75))
    micro_batch(recorder, engine, DeviceScalar(1.5))
    micro_batch(recorder, engine, DeviceScalar(2.5))
    emitter().drain()
    assert steps_of(exporter) == [], "the copies have not run: the step waits for a later drain"
    cuda.run()
    (step,) = steps_of(exporter)
    expected = 0.0
    for value in (1.5, 2.5):
        expected += value / 2
    assert step.attributes["training.loss"] == expected
    assert step.attributes["training.grad_norm"] == 0.75


def test_a_cuda_loss_of_one_element_in_any_shape_is_copied_and_a_longer_one_left_out():
    """DeepSpeed's backward takes a loss of shape [1]; a tensor of several elements is no loss to report."""
    cuda, recorder, engine, exporter = cuda_recorder(norm=DeviceScalar(0.75, (1, 1)))
    micro_batch(recorder, engine, DeviceScalar(1.5, (1,)))
    micro_batch(recorder, engine, DeviceScalar(2.5, (2,)))
    cuda.run()
    first, second = steps_of(exporter)
    assert not recorder.broken
    assert (first.attributes["training.loss"], first.attributes["training.grad_norm"]) == (1.5, 0.75)
    assert "training.loss" not in second.attributes and second.attributes["training.grad_norm"] == 0.75


def test_a_step_whose_copies_never_complete_is_emitted_without_them_at_exit():
    _cuda, recorder, engine, exporter = cuda_recorder(norm=DeviceScalar(0.75))
    micro_batch(recorder, engine, DeviceScalar(1.5))
    emitter().drain(final=True)
    step = next(s for s in exporter.exporter.get_finished_spans() if s.name == "training.step")
    assert "training.loss" not in step.attributes and "training.grad_norm" not in step.attributes


def test_a_hang_report_does_not_wait_behind_a_step_whose_copies_have_not_completed():
    """A collective that hangs on the GPU keeps the last closed step's loss copies from completing (they run after it
    on the stream): the hang report must not wait SCALARS_WAIT_SECONDS behind that step, which keeps its place."""
    cuda, recorder, engine, exporter = cuda_recorder(norm=DeviceScalar(0.75))
    micro_batch(recorder, engine, DeviceScalar(1.5))  # step 1 closes; its copies are stuck behind the collective
    dog = watchdog.Watchdog(floor=2.0)
    dog.watch(recorder, start=False)
    recorder.forward_started(engine)  # step 2 opens, and the training thread blocks
    assert len(dog.check(recorder.open.start + int(30e9))) == 1
    names = [s.name for s in exporter.exporter.get_finished_spans()]
    assert "training.hang" in names and "training.step" not in names
    cuda.run()
    emitter().drain()
    assert steps_of(exporter)[0].attributes["training.loss"] == 1.5, "step 1 written once its copies completed"


def test_once_reading_the_copies_failed_no_step_waits_for_them(monkeypatch, caplog):
    """A CUDA error in the copies' event turns device losses off: the steps are written without them at once, not
    after SCALARS_WAIT_SECONDS each."""

    def failing_query(_event):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(FakeCudaEvent, "query", failing_query)
    _cuda, recorder, engine, exporter = cuda_recorder(norm=DeviceScalar(0.75))
    for loss in (1.5, 2.5):
        micro_batch(recorder, engine, DeviceScalar(loss))
        emitter().drain()
    steps = steps_of(exporter)
    assert len(steps) == 2, "neither step waits for copies nobody can read"
    assert all("training.loss" not in step.attributes for step in steps)
    assert caplog.text.count("loss and gradient norm copies failed") == 1


def test_an_overwritten_ring_slot_reads_as_unknown_not_wrong():
    ring = DeviceScalars(torch, FakeCuda(), pin_memory=False)
    first = ring.copy(DeviceScalar(1.0))
    assert scalars.value(first) == 1.0
    for index in range(scalars.SLOTS):
        ring.copy(DeviceScalar(float(index)))
    assert scalars.value(first) is None


# -- the caching allocator, by phase; an OOM ------------------------------------------------------------


def test_each_phase_carries_its_own_peak_and_the_step_its_figures():
    cuda, recorder, engine, exporter = cuda_recorder()
    recorder._memory = AllocatorMemory(cuda)
    forward = recorder.forward_started(engine)
    cuda.allocate(300, reserve=1000)
    cuda.allocate(-100)
    recorder.forward_ended(forward, None)
    backward = recorder.backward_started(engine)
    cuda.allocate(50)
    recorder.phase_ended(backward)
    cuda.stats["num_alloc_retries"] = 2
    engine.step(recorder)
    cuda.run()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["training.forward"].attributes["training.memory.peak"] == 300
    assert spans["training.backward"].attributes["training.memory.peak"] == 250, "reset at the phase start"
    step = spans["training.step"].attributes
    assert step["training.memory.forward.peak"] == 300
    assert step["training.memory.backward.peak"] == 250
    assert step["training.memory.allocated"] == 250 and step["training.memory.reserved"] == 1000
    assert step["training.memory.alloc_retries"] == 2
    assert cuda.resets == 3
    metrics = recorder.facts.metrics
    assert metrics.memory.fragmentation == 750
    assert metrics.memory_peaks == {"forward": 300, "backward": 250, "optimizer.step": 250}


def test_an_oom_ends_phase_and_step_in_error_with_the_figures_at_the_failure():
    cuda, recorder, engine, exporter = cuda_recorder()
    recorder._memory = AllocatorMemory(cuda)
    recorder.forward_ended(recorder.forward_started(engine), None)
    backward = recorder.backward_started(engine)
    cuda.allocate(7 * 2**30, reserve=8 * 2**30)
    cuda.stats["num_ooms"] = 1
    recorder.phase_failed(backward, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    spans = {s.name: s for s in exporter.get_finished_spans()}
    step, phase = spans["training.step"], spans["training.backward"]
    assert step.status.status_code is StatusCode.ERROR and phase.status.status_code is StatusCode.ERROR
    assert step.attributes["training.memory.oom"] == "backward"
    assert phase.attributes["training.memory.allocated"] == 7 * 2**30
    assert step.attributes["training.memory.backward.peak"] == 7 * 2**30
    assert recorder.facts.metrics.memory.ooms == 1


# -- the numerics watch: found when injected, silent on healthy noise -----------------------------------


def healthy(steps: int, seed: int) -> list[tuple[float, float]]:
    """A decreasing loss with noise, and a noisy gradient norm: what a healthy run looks like."""
    rng = random.Random(seed)
    return [(4.0 * math.exp(-n / 200) + 1.0 + rng.gauss(0, 0.08), abs(rng.gauss(0.8, 0.25)) + 0.05)
            for n in range(steps)]


@pytest.mark.parametrize("seed", range(20))
def test_no_alarm_on_healthy_noise(seed):
    watch = NumericsWatch()
    assert [found for loss, norm in healthy(300, seed) if (found := watch.step(loss, norm, False))] == []


@pytest.mark.parametrize(("kind", "at", "change"), [
    ("loss_spike", 40, lambda loss, norm: (loss * 3, norm)),
    ("loss_spike", 150, lambda loss, norm: (loss * 10, norm)),
    ("grad_norm_spike", 60, lambda loss, norm: (loss, norm * 20)),
    ("nonfinite_loss", 12, lambda loss, norm: (math.nan, norm)),
    ("nonfinite_grad_norm", 99, lambda loss, norm: (loss, math.inf)),
])
def test_an_injected_anomaly_is_found_at_its_step(kind, at, change):
    watch = NumericsWatch()
    found = {}
    for step, values in enumerate(healthy(200, at)):
        loss, norm = change(*values) if step == at else values
        for name, _detail in watch.step(loss, norm, False):
            found.setdefault(name, step)
    assert found == {kind: at}


def test_a_run_of_skipped_steps_counts_after_training_started_not_while_the_scale_calibrates():
    watch = NumericsWatch()
    calibration = [watch.step(5.0, math.inf, True) for _ in range(10)]
    assert not any(calibration), "fp16 finding its loss scale skips the first steps by design"
    for _ in range(5):
        watch.step(5.0, 1.0, False)
    kinds = [kind for _ in range(4) for kind, _ in watch.step(5.0, math.nan, True)]
    assert kinds == ["skipped_run"]


def test_without_a_loss_scale_a_skipped_step_is_a_non_finite_gradient_at_once():
    """DeepSpeed's ZeRO optimizers skip a step whose gradients hold an inf or a NaN in bf16 and fp32 too (a review:
    fp32 and bf16 runs with a NaN gradient read NONE, and a NaN every step from step 10 read "fp16 overflows")."""
    for precision_scaled, expected in ((True, []), (False, ["nonfinite_grad_norm"])):
        watch = NumericsWatch(scaled=precision_scaled)
        for _ in range(10):
            watch.step(5.0, 1.0, False)
        assert [kind for kind, _ in watch.step(5.0, math.inf, True)] == expected
        later = [kind for _ in range(4) for kind, _ in watch.step(5.0, math.nan, True)]
        assert later == (["skipped_run"] if precision_scaled else ["nonfinite_grad_norm"] * 4)


@pytest.mark.parametrize("samples", [1, 4, 16])
def test_no_spike_on_the_skewed_noise_of_a_small_batchs_loss(samples):
    """A healthy small-batch regression's loss is a scaled chi-square: a long right tail, which the median and MAD of
    the values put 6 deviations out in about 1 run of 4 at 4 samples (a review's false alarm; 93% at 1 sample)."""
    alarms = 0
    for seed in range(100):
        rng = random.Random(seed)
        watch = NumericsWatch()
        losses = [sum(rng.gauss(0, 1) ** 2 for _ in range(samples)) / samples for _ in range(60)]
        alarms += any(kind == "loss_spike" for loss in losses for kind, _ in watch.step(loss, None, False))
    assert alarms <= 3, f"{alarms} of 100 healthy runs"


def test_negative_losses_are_judged_on_their_values():
    watch = NumericsWatch()
    found = [kind for step in range(40) for kind, _ in watch.step((50.0 if step == 30 else -1.0 + 0.01 * (step % 3)),
                                                                  None, False)]
    assert found == [], "a median at or below zero judges no spike, as before"
    watch = NumericsWatch()
    values = [0.5 + 0.01 * (step % 5) - (0.6 if step % 7 == 0 else 0) for step in range(40)]
    values[30] = 5.0
    assert [kind for value in values for kind, _ in watch.step(value, None, False)] == ["loss_spike"]


@pytest.mark.parametrize("seed", range(5))
def test_a_spike_while_the_loss_still_falls_is_found(seed):
    """A review: labels shuffled at step 30 took the loss from 1.92 to 8.61 (x4.5) in a run falling from 5.6, and
    nothing was found: the falling values' MAD made the bar x20-50 over the median, where x2.2 sufficed on a flat
    loss. The spread is now the step-to-step noise's."""
    rng = random.Random(seed)
    losses = [5.6 * math.exp(-step / 8) + 1.5 + rng.gauss(0, 0.03) for step in range(40)]
    losses[30] *= 4.5
    watch = NumericsWatch()
    found = [(step, kind) for step, loss in enumerate(losses) for kind, _ in watch.step(loss, None, False)]
    assert found == [(30, "loss_spike")]


@pytest.mark.parametrize("seed", range(5))
def test_a_loss_that_climbs_step_after_step_is_one_spike_at_most(seed):
    """A code review: a loss tripling over 20 steps (x1.057 a step) read as a spike at 15-17 of them, each counted in
    the live metric and in the finding's cost. A spike is a jump from the step before."""
    rng = random.Random(seed)
    losses = [2.0 * math.exp(rng.gauss(0, 0.05)) for _ in range(30)]
    losses += [losses[-1] * 1.057 ** step * math.exp(rng.gauss(0, 0.05)) for step in range(1, 21)]
    watch = NumericsWatch()
    assert sum(kind == "loss_spike" for loss in losses for kind, _ in watch.step(loss, None, False)) <= 1


def test_no_spike_on_a_noisy_loss_s_first_steps():
    """A healthy run's loss of a few samples per step (the review's kill test): 3.57 at its 9th step, x4.6 the median
    of 8 values from 0.29 to 1.35. The MAD of 7 differences alone put it 6 deviations out."""
    watch = NumericsWatch()
    losses = [0.3828, 0.5581, 0.7352, 1.3456, 0.345, 0.2941, 0.8252, 1.2039, 3.5691, 0.7439, 0.9346, 1.8785]
    assert [kind for loss in losses for kind, _ in watch.step(loss, None, False)] == []


def test_a_run_of_skipped_steps_is_found_from_its_first_step_with_all_of_it():
    """A review: steps 12-15 skipped read "at step 14: 3 consecutive steps skipped", costed as one step."""
    findings = ModelFindings()
    for number, (loss, norm) in enumerate(healthy(20, 5), start=1):
        skipped = 12 <= number <= 15
        findings.add(step_span(0, number, {"training.loss": loss, "training.precision": "fp16",
                                           "training.grad_norm": math.inf if skipped else norm,
                                           "training.step.skipped": skipped}))
    (finding,) = findings.findings("job", 0.5)
    assert (finding["kind"], finding["step"], finding["cost_seconds"]) == ("skipped_run", 12, 0.5 * 4)
    assert finding["summary"].startswith("run of skipped steps on rank 0 at step 12: 4 consecutive steps skipped")
    assert finding["trace_ids"] == [f"trace{number:04d}" for number in (12, 13, 14, 15)]


# -- diagnose: MODEL and MEMORY findings with rank, step and trace ids ------------------------------------


def step_span(rank, number, attributes=None):
    attributes = {"training.step": number, **(attributes or {})}
    return Span("training.step", f"trace{number:04d}", f"span{rank}{number}", "", number * 10**9,
                number * 10**9 + 5 * 10**8, "job", rank, attributes)


def test_diagnose_names_the_first_non_finite_step_and_rank_with_its_trace():
    findings = ModelFindings()
    for rank in (0, 1):
        for number, (loss, norm) in enumerate(healthy(30, rank), start=1):
            broken = rank == 1 and number >= 17
            findings.add(step_span(rank, number, {"training.loss": math.nan if broken else loss,
                                                  "training.grad_norm": norm}))
    (finding,) = findings.findings("job", 0.5)
    assert (finding["layer"], finding["kind"], finding["rank"], finding["step"]) == ("MODEL", "nonfinite_loss", 1, 17)
    assert finding["trace_ids"][0] == "trace0017"
    assert finding["cost_seconds"] == pytest.approx(0.5 * 14)
    assert set(finding) >= {"summary", "evidence", "remedies", "confidence"}


@pytest.mark.parametrize(("precision", "fp16_named"), [("bf16", False), ("fp32", False), ("fp16", True), (None, True)])
def test_a_non_finite_loss_s_remedies_name_fp16_only_where_it_may_be_in_use(precision, fp16_named):
    findings = ModelFindings()
    for number, (loss, norm) in enumerate(healthy(20, 0), start=1):
        attributes = {"training.loss": math.nan if number == 12 else loss, "training.grad_norm": norm}
        if precision is not None:
            attributes["training.precision"] = precision
        findings.add(step_span(0, number, attributes))
    (finding,) = findings.findings("job", 0.5)
    assert finding["kind"] == "nonfinite_loss"
    assert any("fp16" in remedy and "bf16" in remedy for remedy in finding["remedies"]) == fp16_named


def test_the_same_anomaly_at_the_same_step_on_every_rank_names_no_rank():
    """DeepSpeed's gradient norm is the job's: a spike in one rank's gradients shows on every rank at once, and the
    first rank found used to be named (a review: rank 1's spike read "on rank 0")."""
    findings = ModelFindings()
    for rank in (0, 1):
        for number, (loss, norm) in enumerate(healthy(30, 5), start=1):
            findings.add(step_span(rank, number, {"training.loss": loss + rank * 0.01,
                                                  "training.grad_norm": norm * (30 if number == 18 else 1)}))
    (finding,) = findings.findings("job", 0.5)
    assert (finding["kind"], finding["rank"], finding["step"]) == ("grad_norm_spike", None, 18)
    assert finding["summary"].startswith("gradient-norm spike on every rank at step 18")


def test_a_non_finite_gradient_in_bf16_is_found_on_every_rank_with_no_fp16_remedy():
    findings = ModelFindings()
    for rank in (0, 1):
        for number, (loss, norm) in enumerate(healthy(20, 5), start=1):
            broken = number == 12
            findings.add(step_span(rank, number, {"training.loss": loss, "training.precision": "bf16",
                                                  "training.grad_norm": math.inf if broken else norm,
                                                  "training.step.skipped": broken}))
    (finding,) = findings.findings("job", 0.5)
    assert (finding["kind"], finding["rank"], finding["step"]) == ("nonfinite_grad_norm", None, 12)
    assert "not an overflow" in finding["summary"] and "fp16" not in " ".join(finding["remedies"])


def test_diagnose_names_memory_with_rank_step_phase_and_figures():
    findings = ModelFindings()
    findings.add(step_span(0, 1))
    findings.add(step_span(1, 4, {"training.memory.oom": "backward", "training.memory.allocated": 70 * 2**30,
                                  "training.memory.reserved": 79 * 2**30, "training.memory.forward.peak": 60 * 2**30}))
    (finding,) = findings.findings("job")
    assert (finding["layer"], finding["rank"], finding["step"], finding["phase"]) == ("MEMORY", 1, 4, "backward")
    assert "allocated 71680 MiB" in finding["evidence"][0]
    assert "forward 61440 MiB" in finding["evidence"][1]


def test_the_html_report_shows_loss_and_gradient_norm_with_the_finding_circled():
    from opentelemetry_instrumentation_deepspeed.diagnose.analysis import Analysis
    from opentelemetry_instrumentation_deepspeed.diagnose.html import render_html

    analysis = Analysis()
    for number, (loss, norm) in enumerate(healthy(20, 3), start=1):
        analysis.add([step_span(0, number, {"training.loss": loss * (10 if number == 15 else 1),
                                            "training.grad_norm": norm})])
    report = analysis.result()
    assert report["verdict"]["layer"] == "MODEL" and report["verdict"]["step"] == 15
    assert [step for step, _ in report["model_series"]["loss"][0]] == list(range(1, 21))
    page = render_html(report)
    assert "<h2>Loss and gradient norm</h2>" in page
    assert page.count("<polyline") == 3, "step time, loss, gradient norm"
    assert "rank 0 step 15:" in page


def test_a_broken_run_outranks_a_slow_one_a_spike_does_not():
    from opentelemetry_instrumentation_deepspeed.diagnose.analysis import Analysis

    def run(last_loss):
        analysis = Analysis()
        for number, (loss, norm) in enumerate(healthy(20, 5), start=1):
            step = step_span(0, number, {"training.loss": last_loss if number == 18 else loss,
                                         "training.grad_norm": norm})
            wait = Span("training.data.wait", step.trace_id, f"w{number}", step.span_id, step.start,
                        step.start + 3 * 10**8, "job", 0, {})  # 60% of each step waits for data
            analysis.add([step, wait])
        return analysis.result()["verdict"]

    assert run(math.nan)["layer"] == "MODEL", "a NaN loss: the run is broken, whatever else is slow"
    assert run(50.0)["layer"] == "data loading", "a spike stays a finding beside the time-based verdict"


def test_a_non_finite_loss_or_gradient_norm_is_no_gauge_point_and_no_sdk_warning(caplog):
    """A review: the SDK dropped a NaN loss and an infinite norm with a warning at every collection; the gauges must
    say nothing rather than their values, and the program's output stay quiet."""
    import logging

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from opentelemetry_instrumentation_deepspeed.export.training_metrics import TrainingMetrics

    reader = InMemoryMetricReader()
    metrics = TrainingMetrics(MeterProvider(metric_readers=[reader]).get_meter("test"), None)

    def gauges():
        data = reader.get_metrics_data()
        return {metric.name: [point.value for point in metric.data.data_points]
                for resource in data.resource_metrics for scope in resource.scope_metrics for metric in scope.metrics
                if metric.name in ("training.loss", "training.grad_norm")}

    metrics.loss, metrics.grad_norm = 2.5, 0.75
    assert gauges() == {"training.loss": [2.5], "training.grad_norm": [0.75]}
    metrics.loss, metrics.grad_norm = math.nan, math.inf
    with caplog.at_level(logging.WARNING):
        assert gauges() == {}
    assert not [record for record in caplog.records if "non-finite" in record.getMessage()]


def test_the_copies_are_asked_about_on_the_engine_s_device_from_any_thread():
    cuda = FakeCuda()
    cuda.current = 1  # the training thread's device
    ring = DeviceScalars(torch, cuda, pin_memory=False)
    ring.copy(torch.tensor(2.5))
    copied = ring.event()
    cuda.current = 0  # the emitter's thread
    cuda.run()
    assert copied.query() and cuda.asked_on == [1] and cuda.current == 0
