"""The plain PyTorch loop's step rule in-process (one gloo rank, no DeepSpeed): which calls make a step."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from torch import nn

from opentelemetry_instrumentation_deepspeed import TorchTrainingInstrumentor, trace_training
from opentelemetry_instrumentation_deepspeed.export.emitter import emitter
from opentelemetry_instrumentation_deepspeed.instrumentors.patching import original_of
from opentelemetry_instrumentation_deepspeed.recording import registry
from opentelemetry_instrumentation_deepspeed.runtime import session
from tests.conftest import free_port


@pytest.fixture
def traced(monkeypatch):
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(free_port()))):
        monkeypatch.setenv(name, value)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    original = (torch.autograd.backward, nn.parallel.DistributedDataParallel.forward)
    instrumentor = TorchTrainingInstrumentor()
    instrumentor.instrument(tracer_provider=provider)

    def spans():
        emitter().drain()
        return exporter.get_finished_spans()

    yield spans
    instrumentor.uninstrument()
    registry.forget_all()
    session.reset()
    assert (torch.autograd.backward, nn.parallel.DistributedDataParallel.forward) == original


def micro_steps(spans, name):
    return [span.attributes["training.micro_step"] for span in spans if span.name == name]


@pytest.mark.slow  # building a DistributedDataParallel takes seconds (its imports), even for one rank
def test_ddp_steps_end_at_the_first_optimizers_step(traced, request):
    # An earlier in-process DeepSpeed test of the same pytest process may have set up its one-rank
    # group already: DDP runs on that one, and only a group made here is torn down here.
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
        request.addfinalizer(torch.distributed.destroy_process_group)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)  # e.g. a loss-scale or EMA optimizer
    for _ in range(3):
        for micro in range(2):
            with contextlib.nullcontext() if micro else model.no_sync():
                model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        other.step()  # not the step optimizer: inside the next step, it ends nothing
        with torch.no_grad():
            model(torch.randn(5, 4))  # evaluation: no span
    spans = traced()
    steps = [span for span in spans if span.name == "training.step"]
    assert [step.attributes["training.step"] for step in steps] == [1, 2, 3]
    assert all(step.attributes["training.parallelism"] == "ddp" for step in steps)
    assert all(step.attributes["training.step.samples"] == 10 for step in steps)
    assert micro_steps(spans, "training.forward") == micro_steps(spans, "training.backward") == [0, 1] * 3
    assert [span.name for span in spans].count("training.optimizer.step") == 3


def test_a_custom_loop_opts_in_and_names_its_step_optimizer(traced):
    model = nn.Linear(4, 4)
    warmup = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trace_training(model, optimizer)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        warmup.step()  # stepped first, but not the one named
        optimizer.step()
    spans = traced()
    steps = [span for span in spans if span.name == "training.step"]
    assert len(steps) == 2 and steps[0].attributes["training.parallelism"] == "none"
    assert micro_steps(spans, "training.forward") == [0, 0]


def test_a_gan_names_its_generator_s_optimizer_after_the_loop_started(traced):
    """A review: a GAN under DDP (the loop starts with the first DistributedDataParallel) stepped its discriminator's
    optimizer first, which then ended each step in the middle of an iteration; trace_training(optimizer=...) named
    another only before the loop had started."""
    generator, discriminator = nn.Linear(4, 4), nn.Linear(4, 1)
    opt_g = torch.optim.SGD(generator.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=0.1)
    trace_training(discriminator)  # the loop starts (as with the first DDP built)
    trace_training(optimizer=opt_g)
    printed = []
    for _ in range(3):
        loss_d = discriminator(generator(torch.randn(8, 4)).detach()).mean()
        loss_d.backward()
        opt_d.step()
        loss_g = -discriminator(generator(torch.randn(8, 4))).mean()
        loss_g.backward()
        opt_g.step()
        printed.append(loss_d.item() + loss_g.item())
    steps = sorted((s for s in traced() if s.name == "training.step"), key=lambda s: s.attributes["training.step"])
    assert [s.attributes["training.loss"] for s in steps] == pytest.approx(printed, rel=1e-6)


class _IgnoresItsClosure(torch.optim.Optimizer):
    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for parameter in group["params"]:
                if parameter.grad is not None:
                    parameter.add_(parameter.grad, alpha=-group["lr"])


@pytest.mark.parametrize("kind", ["LBFGS", "SGD", "never called"])
def test_a_step_with_a_closure_is_its_first_call_s_micro_batch_and_loss_then_the_optimizer(traced, kind):
    """optimizer.step(closure) runs the forward and backward inside step(): they fell into the optimizer phase, with no
    micro-batch and no loss. The closure's first call is the step's micro-batch; LBFGS's re-evaluations after it are
    optimizer work."""
    model = nn.Linear(4, 1)
    if kind == "LBFGS":
        optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=4)
    elif kind == "SGD":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        optimizer = _IgnoresItsClosure(model.parameters(), lr=0.1)
    trace_training(model, optimizer)
    inputs, targets = torch.randn(8, 4), torch.randn(8, 1)
    calls, returned = [], []
    for _ in range(3):
        def closure():
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            calls.append(loss.item())
            return loss

        if kind == "never called":
            model(inputs).sum().backward()  # the step's own forward and backward, outside the closure
        returned.append(optimizer.step(closure))
    spans = traced()
    steps = [span for span in spans if span.name == "training.step"]
    assert [step.attributes["training.step"] for step in steps] == [1, 2, 3]
    names = [span.name for span in spans]
    assert names.count("training.forward") == names.count("training.backward") == 3
    assert names.count("training.optimizer.step") == 3
    if kind != "never called":
        assert all(step.attributes["training.step.samples"] == 8 for step in steps)
        # What step() returns: the first evaluation's loss (LBFGS's orig_loss), to the bit
        assert [step.attributes["training.loss"] for step in steps] == [loss.item() for loss in returned]
    if kind == "LBFGS":
        assert len(calls) > 3, "re-evaluations, inside the optimizer phase"


class _ScaledSGD(torch.optim.SGD):
    def step(self, factor=1.0):  # an argument that is no closure
        for group in self.param_groups:
            group["lr"] *= factor
        return super().step()


class _Sharpness(torch.optim.Optimizer):
    """SAM as commonly written: the step's own forward and backward first, then step(closure) re-evaluates the loss
    at a perturbed point."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1, "rho": 0.05})

    @torch.no_grad()
    def step(self, closure):
        for group in self.param_groups:
            for parameter in group["params"]:
                parameter.add_(parameter.grad, alpha=group["rho"])
        with torch.enable_grad():
            closure()
        for group in self.param_groups:
            for parameter in group["params"]:
                parameter.sub_(parameter.grad, alpha=group["lr"])


def test_a_step_argument_that_is_no_closure_and_a_closure_after_the_micro_batch_are_optimizer_work(traced):
    """A subclass's step(0.5) got our closure wrapper in place of its float (TypeError in the program); SAM's closure,
    called after the step's own forward and backward, made each step two micro-batches with twice the samples."""
    model = nn.Linear(4, 1)
    scaled = _ScaledSGD(model.parameters(), lr=0.1)
    trace_training(model, scaled)
    inputs = torch.randn(8, 4)
    model(inputs).sum().backward()
    scaled.step(0.5)
    assert scaled.param_groups[0]["lr"] == pytest.approx(0.05)
    spans = traced()
    (step,) = [span for span in spans if span.name == "training.step"]
    assert step.attributes["training.step.micro_batches"] == 1


def test_sam_s_closure_is_optimizer_work_of_a_step_of_one_micro_batch(traced):
    model = nn.Linear(4, 1)
    optimizer = _Sharpness(model.parameters())
    trace_training(model, optimizer)
    inputs, losses = torch.randn(8, 4), []
    for _ in range(3):
        loss = model(inputs).square().mean()
        loss.backward()
        losses.append(loss.item())
        optimizer.step(lambda: model(inputs).square().mean().backward())
        optimizer.zero_grad()
    spans = traced()
    steps = [span for span in spans if span.name == "training.step"]
    assert [(s.attributes["training.step.samples"], s.attributes["training.step.micro_batches"]) for s in steps] == [
        (8, 1)] * 3
    assert [s.attributes["training.loss"] for s in steps] == losses
    assert [span.name for span in spans].count("training.forward") == 3


def test_a_closure_that_raises_ends_its_step_and_is_not_kept(traced):
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trace_training(model, optimizer)
    held = torch.randn(8, 4)

    def closure():
        model(held).sum().backward()
        raise FloatingPointError("non-finite loss")

    with pytest.raises(FloatingPointError):
        optimizer.step(closure)
    assert registry.active() is not None and _loop_closure() is None, "no reference to the closure, nor to its tensors"
    model(held).sum().backward()
    optimizer.step()
    steps = [(span.attributes["training.step"], span.status.is_ok) for span in traced() if span.name == "training.step"]
    assert steps == [(1, False), (1, True)], "the failed step ends with the closure's error; the retry is a step"


def _loop_closure():
    from opentelemetry_instrumentation_deepspeed.instrumentors import torch_loop

    return torch_loop._state.loop.closure


def test_a_subclass_s_step_calling_its_parent_s_is_one_step(traced):
    """torch hooks the step() of each optimizer class it makes an instance of: a subclass whose step() calls
    super().step() runs the hooks twice, nested. Each step was a failed one (its forward and backward) and an empty
    one (the inner optimizer step); then a step() that raises must still end its step."""
    torch.optim.AdamW([nn.Parameter(torch.zeros(1))])  # an AdamW made anywhere in the process: AdamW.step is hooked

    class Clipped(torch.optim.AdamW):
        def step(self, closure=None):
            if getattr(self, "fail", False):
                raise FloatingPointError("non-finite gradient")
            return super().step(closure)

    model = nn.Linear(4, 1)
    optimizer = Clipped(model.parameters())
    trace_training(model, optimizer)
    inputs = torch.randn(8, 4)

    def closure():
        optimizer.zero_grad()
        loss = model(inputs).square().mean()
        loss.backward()
        return loss

    for _ in range(2):
        model(inputs).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.step(closure)
    optimizer.fail = True
    model(inputs).sum().backward()
    with pytest.raises(FloatingPointError):
        optimizer.step()
    optimizer.fail = False
    model(inputs).sum().backward()
    optimizer.step()
    spans = traced()
    steps = [(span.attributes["training.step"], span.status.is_ok) for span in spans if span.name == "training.step"]
    assert steps == [(1, True), (2, True), (3, True), (4, False), (4, True)]
    assert [span.name for span in spans].count("training.optimizer.step") == 5


def test_a_pass_without_gradients_in_training_mode_keeps_the_wait_an_evaluation_drops(traced):
    """Pseudo-labelling runs the model without gradients on the batch the step then trains on; an evaluation (eval
    mode, or an evaluation loop under no_grad alone: a fetch follows its passes) was fed by the waits before it."""
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trace_training(model, optimizer)
    recorder = registry.active()

    def fetch():  # as the loader's wrapper reports one
        now = time.time_ns()
        recorder.data_waited(now - 1_000_000, now)

    for before in ("pseudo-labels", "evaluation", "evaluation in training mode", "pseudo-labels, two loaders"):
        for _ in range(3 if before.startswith("evaluation") else 1):
            fetch()
            model.train(before != "evaluation")
            with torch.no_grad():
                model(torch.randn(3, 4))
        if before != "pseudo-labels":
            fetch()  # the step's own batch (its unlabelled one, with two loaders)
        model.train()
        model(torch.randn(3, 4)).sum().backward()
        with torch.no_grad():
            model(torch.randn(3, 4))  # a metric after the backward, in training mode: nothing dropped by it
        optimizer.step()
    spans = traced()
    steps = {span.context.span_id: span.attributes["training.step"] for span in spans if span.name == "training.step"}
    assert sorted(steps.values()) == [1, 2, 3, 4]
    assert sorted(steps[span.parent.span_id] for span in spans if span.name == "training.data.wait") == [1, 2, 3, 4, 4]


def test_a_wrapper_left_in_eval_mode_around_a_model_in_training_mode_trains(traced):
    """The Lightning review: its validation puts the whole wrapped model in eval mode and afterwards back only the
    LightningModule: the DistributedDataParallel around it stayed in eval mode, and every later forward (and the waits
    before it) was dropped as an evaluation's."""

    class Wrapper(nn.Module):  # Lightning's wrapper of the LightningModule, under DDP
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 1)

        def forward(self, batch):
            return self.inner(batch)

    model = Wrapper()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trace_training(model, optimizer)
    model.eval()  # the whole model: an evaluation
    with torch.no_grad():
        model(torch.randn(8, 4))
    model.inner.train()  # what Lightning restores
    for _ in range(2):
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
    model.eval()  # evaluated whole again: no phase, even with gradients on
    model(torch.randn(8, 4))
    spans = traced()
    steps = {span.context.span_id: span.attributes["training.step"] for span in spans if span.name == "training.step"}
    assert sorted(steps[span.parent.span_id] for span in spans if span.name == "training.forward") == [1, 2]


def test_a_closure_after_a_fetch_runs_the_step_s_last_micro_batch(traced):
    """The Lightning review: its accumulation calls the closure itself for all micro-batches but the last, and hands
    the last one's to step(closure); taken as optimizer work after the step's own backward, the last micro-batch's
    forward and backward went into the optimizer phase and its loss was lost."""
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trace_training(model, optimizer)
    recorder = registry.active()
    printed = []

    def fetch():  # as the loader's wrapper reports one
        now = time.time_ns()
        recorder.data_waited(now - 1_000_000, now)
        return torch.randn(8, 4)

    def closure(batch):
        def run():
            loss = model(batch).square().mean() / 2
            loss.backward()
            printed.append(loss.item())
            return loss
        return run

    for _ in range(3):
        closure(fetch())()  # the first micro-batch: Lightning calls its closure itself
        optimizer.step(closure=closure(fetch()))
        optimizer.zero_grad()
    spans = traced()
    steps = sorted((s for s in spans if s.name == "training.step"), key=lambda s: s.attributes["training.step"])
    assert [s.attributes["training.step.micro_batches"] for s in steps] == [2, 2, 2]
    assert [s.attributes["training.loss"] for s in steps] == [printed[0] + printed[1], printed[2] + printed[3],
                                                              printed[4] + printed[5]]
    phases = {s.context.span_id: s.name for s in spans}
    assert not [s for s in spans if s.name == "training.forward" and phases.get(s.parent.span_id) != "training.step"]


def test_no_loop_beside_a_deepspeed_engine(traced, caplog):
    class Engine:
        pass

    engine = Engine()
    registry.track(engine, object())  # a DeepSpeed engine's recorder: the engine traces this process
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trace_training(model, optimizer)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    registry.forget_all()
    assert traced() == ()
    assert not _untraced_warnings(caplog)


def _untraced_warnings(caplog):
    return [r for r in caplog.records if "this training is not traced" in r.getMessage()]


def test_training_that_nothing_traces_is_said_once_at_its_first_step(traced, caplog):
    assert original_of(vars(torch.optim.Optimizer)["_optimizer_step_code"]) is not None  # looking
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):  # one process, no DDP, no fully_shard, no trace_training(): what Accelerate on CPU runs
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
    (warning,) = _untraced_warnings(caplog)
    assert "trace_training(model, optimizer)" in warning.getMessage()
    assert "trains alone" not in warning.getMessage(), "the fixture's WORLD_SIZE is 1"
    # Once looked, the original is back: the later steps run nothing of ours.
    assert original_of(vars(torch.optim.Optimizer)["_optimizer_step_code"]) is None
    assert traced() == ()


def test_ranks_that_made_no_process_group_are_told_they_train_alone(traced, caplog, monkeypatch):
    """The review of Accelerate without DeepSpeed: on a machine without GPUs, without cpu=True, Accelerate counts one
    process on each of the launcher's ranks, which each trained the whole dataset alone; the warning named only
    trace_training()."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    (warning,) = _untraced_warnings(caplog)
    assert "WORLD_SIZE is 2, but this rank made no process group: it trains alone" in warning.getMessage()


def test_training_a_loop_traces_is_not_said_to_be_untraced(traced, caplog):
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trace_training(model, optimizer)
    assert original_of(vars(torch.optim.Optimizer)["_optimizer_step_code"]) is None
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    assert not _untraced_warnings(caplog)
    assert [span.name for span in traced() if span.name == "training.step"] == ["training.step"]


@pytest.mark.parametrize("name_the_optimizer", [True, False])
def test_a_grad_scaler_skipping_an_overflow_step_still_ends_it(traced, name_the_optimizer):
    """Mixed precision: GradScaler.step() is the optimizer phase; an overflow step is one step, skipped."""
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    trace_training(model, optimizer if name_the_optimizer else None)
    overflow_at = 2
    for step in range(1, 5):
        loss = model(torch.randn(3, 4)).sum()
        scaler.scale(loss * (float("inf") if step == overflow_at else 1.0)).backward()
        before = [parameter.detach().clone() for parameter in model.parameters()]
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        assert changed is (step != overflow_at)  # the scaler skipped the optimizer at the overflow only
    spans = traced()
    steps = [span for span in spans if span.name == "training.step"]
    assert [step.attributes["training.step"] for step in steps] == [1, 2, 3, 4]
    assert [step.attributes.get("training.step.skipped", False) for step in steps] == [False, True, False, False]
    assert [span.name for span in spans].count("training.optimizer.step") == 4
    assert micro_steps(spans, "training.forward") == micro_steps(spans, "training.backward") == [0] * 4


@pytest.mark.parametrize("sharded", [False, True])
def test_the_step_loss_is_the_loop_s_own_under_accumulation_and_a_grad_scaler(traced, request, sharded):
    """The usual recipe: each micro-batch's loss divided by the accumulation count, scaled for the backward. The step
    reports what the loop prints, not the scaled (x 65536) or divided (/ 2) value its backwards get; also where the
    loss handed to the scaler is a temporary, gone by the backward, and under FSDP's own scaler."""
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if sharded:  # its unscaling all-reduces the overflow flag: a process group of one
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo", rank=0, world_size=1)
            request.addfinalizer(torch.distributed.destroy_process_group)
        scaler = ShardedGradScaler("cpu")
    else:
        scaler = torch.amp.GradScaler("cpu")
    trace_training(model, optimizer)
    printed = []
    for _ in range(3):
        total = 0.0
        for micro in range(2):
            loss = model(torch.randn(3, 4)).pow(2).mean() / 2
            scaler.scale(loss if micro else loss * 1.0).backward()  # micro-batch 0: a temporary
            total += loss.item()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        printed.append(total)
    steps = [span for span in traced() if span.name == "training.step"]
    assert [step.attributes["training.loss"] for step in steps] == printed


def test_scalar_losses_given_to_one_backward_together_are_the_step_s_loss(traced):
    """``torch.autograd.backward([loss_a, loss_b])``: no step had a loss."""
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    trace_training(model, optimizer)
    printed = []
    for _ in range(2):
        output = model(torch.randn(3, 4))
        losses = (output.pow(2).mean(), output.abs().mean())
        torch.autograd.backward(losses)
        optimizer.step()
        optimizer.zero_grad()
        printed.append((losses[0].detach() + losses[1].detach()).item())
    steps = [span for span in traced() if span.name == "training.step"]
    assert [step.attributes["training.loss"] for step in steps] == printed


def test_a_loss_the_scaler_s_copy_refuses_turns_step_tracing_off_not_the_loop(traced, monkeypatch, caplog):
    """Taken as GradScaler.scale() scales it, on the user's call: a failure there (a tensor subclass the CUDA copy
    refuses, a DTensor) is logged once and turns step tracing off; scale() returns its result."""
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    trace_training(model, optimizer)
    recorder = registry.active()

    def refuse(_tensor):
        raise AssertionError("a DTensor's copy into a plain tensor")

    monkeypatch.setattr(recorder, "take", refuse)
    loss = model(torch.randn(3, 4)).pow(2).mean()
    scaled = scaler.scale(loss)
    assert torch.equal(scaled, loss * 4.0) and recorder.broken
    assert "_scaler_scale" in caplog.text


def test_a_forward_called_while_the_loop_handles_an_exception_succeeds(traced):
    """An out-of-memory fallback calls the forward again inside ``except``: that forward did not raise."""
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trace_training(model, optimizer)
    for _ in range(2):
        try:
            raise torch.OutOfMemoryError("the large batch did not fit")
        except torch.OutOfMemoryError:
            loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        optimizer.step()
    spans = traced()
    assert [span.name for span in spans].count("training.step") == 2
    assert all(span.status.is_ok for span in spans), [(span.name, span.status.description) for span in spans]
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        try:
            raise KeyError("handled")
        except KeyError:
            model(torch.randn(2, 5))  # a forward that raises there fails, as anywhere
    failed = [span for span in traced() if span.name == "training.forward" and not span.status.is_ok]
    assert len(failed) == 1


def test_a_module_that_takes_no_hooks_leaves_trace_training_running(traced, caplog):
    model = torch.jit.script(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trace_training(model, optimizer)  # a TorchScript module refuses forward hooks
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    assert "cannot observe the forward of this RecursiveScriptModule" in caplog.text
    assert [span.name for span in traced()].count("training.step") == 1


@pytest.mark.slow  # compiling takes seconds
@pytest.mark.parametrize("compile_how", ["module", "torch.compile"])
def test_a_module_compiled_whole_graph_trains_as_without_us(traced, compile_how):
    """Our forward hooks would run inside the compiled graph, which ``fullgraph=True`` lets nothing break."""

    class Model(nn.Module):  # a user's class: dynamo traces its hooks (torch's own classes it may skip)
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 1)

        def forward(self, x):
            return self.second(torch.relu(self.first(x)))

    def train(instrumented: bool) -> list[float]:
        torch.manual_seed(0)
        model = Model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        if instrumented:
            trace_training(model, optimizer)
        if compile_how == "module":
            model.compile(fullgraph=True, backend="eager")
            forward = model
        else:
            forward = torch.compile(model, fullgraph=True, backend="eager")
        losses = []
        for _ in range(3):
            loss = forward(torch.randn(8, 16)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    assert train(True) == train(False)
    assert [span.name for span in traced()].count("training.step") == 3


def test_a_forward_that_re_raises_the_exception_being_handled_fails(traced):
    class Reraises(nn.Linear):
        def forward(self, x):
            if x.shape[-1] != self.in_features:
                raise  # noqa: PLE0704 - the exception its caller handles: this forward fails with it
            return super().forward(x)

    model = Reraises(4, 1)
    trace_training(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(KeyError):
        try:
            raise KeyError("handled")
        except KeyError:
            model(torch.randn(2, 5))
    (forward,) = [span for span in traced() if span.name == "training.forward"]
    assert not forward.status.is_ok


def test_an_interrupted_forward_leaves_the_next_steps_forwards_seen(traced):
    """A KeyboardInterrupt (a notebook's stop) skips torch's always-called hooks: the forward it left must not
    hide every later one."""

    class Interrupted(nn.Linear):
        calls = 0

        def forward(self, x):
            Interrupted.calls += 1
            if Interrupted.calls == 1:
                raise KeyboardInterrupt
            return super().forward(x)

    model = Interrupted(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trace_training(model, optimizer)
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(2, 4))
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    spans = traced()
    steps = [span for span in spans if span.name == "training.step"]
    assert not steps[0].status.is_ok, "the interrupted step ends at the next optimizer step, interrupted"
    assert [span.name for span in spans].count("training.forward") == 3, "the last two steps see their forwards"


@pytest.mark.slow  # building a DistributedDataParallel and compiling it take seconds
def test_a_compiled_ddp_meets_none_of_our_code_in_its_graph(traced, request):
    import torch._dynamo
    from torch._dynamo.utils import counters

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
        request.addfinalizer(torch.distributed.destroy_process_group)
    torch._dynamo.reset()
    counters.clear()
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="eager")
    for _ in range(3):
        compiled(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    reasons = [reason for reason in counters["graph_break"] if "time_ns" in reason or "opentelemetry" in reason]
    assert reasons == [], "graph breaks of ours (torch's own DDP makes some)"
    steps = [span for span in traced() if span.name == "training.step"]
    assert len(steps) == 3 and all("training.step.samples" not in step.attributes for step in steps)


@pytest.mark.slow  # FullyShardedDataParallel's imports take seconds
@pytest.mark.parametrize("reentrant", [False, True])
def test_fsdp_units_checkpointed_and_run_again_in_the_backward_fail_no_step(traced, request, reentrant):
    """A code review: with non-reentrant activation checkpointing (the Trainer's gradient_checkpointing), FSDP's
    units run their forward again in the backward, and the recomputation's early stop is raised through it: each
    optimizer step read as three failed steps and one whole."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.utils.checkpoint import checkpoint

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
        request.addfinalizer(torch.distributed.destroy_process_group)

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = checkpoint(layer.__call__, x, use_reentrant=reentrant)
            return x

    model = FullyShardedDataParallel(Checkpointed(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                                     device_id=torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(5, 4, requires_grad=True)).sum().backward()
        optimizer.step()
    steps = [span for span in traced() if span.name == "training.step"]
    assert [(s.attributes["training.step"], s.status.is_ok) for s in steps] == [(1, True), (2, True)]
    assert all(s.attributes["training.step.micro_batches"] == 1 for s in steps)


def test_fsdp_s_parameter_count_takes_a_tied_weight_once_and_a_layer_wrapped_first_into_its_model(monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    from opentelemetry_instrumentation_deepspeed.instrumentors import torch_loop

    class LanguageModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(10, 4)
            self.layer = nn.Linear(4, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embedding.weight

    monkeypatch.setattr(torch_loop._state, "fsdp_models", {})
    model = LanguageModel()
    counted = torch_loop._count_sharded(model.layer, "FSDPModule")  # sharded first
    model.layer.__class__ = type("FSDPLinear", (FSDPModule, nn.Linear), {})  # as fully_shard leaves it
    torch_loop._remember(model.layer, counted)
    assert torch_loop._sharded_parameters() == 20
    torch_loop._remember(model, torch_loop._count_sharded([model], "FSDPModule"))
    assert torch_loop._state.fsdp_models == {id(model): (20 + 10 * 4, True)}, "the layer is the model's now"


def test_mfu_counts_the_model_that_trains_not_a_frozen_reference_beside_it(monkeypatch):
    """A review: a DPO reference model, or a distillation teacher, wrapped in FSDP too, doubled the FLOPs estimate."""
    from opentelemetry_instrumentation_deepspeed.instrumentors import torch_loop

    monkeypatch.setattr(torch_loop._state, "fsdp_models", {})
    policy, teacher = nn.Linear(8, 8), nn.Linear(32, 32).requires_grad_(False)
    for model in (policy, teacher):
        torch_loop._remember(model, torch_loop._count_sharded(model, "FSDPModule"))
    assert torch_loop._sharded_parameters() == 8 * 8 + 8
    assert torch_loop._count_sharded(object(), "FSDPModule") is None, "not a module: no count, no error"
