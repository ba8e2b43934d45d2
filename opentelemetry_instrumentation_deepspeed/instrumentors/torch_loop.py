"""Training with plain PyTorch, no DeepSpeed engine: DDP, FSDP (``FullyShardedDataParallel``, and FSDP2's
``fully_shard``), or a loop that opts in.

What a step is: everything from the first data wait, forward or backward after the previous step
to the return of the step optimizer's ``step()``. The step optimizer is the first optimizer whose
``step()`` runs once training was detected (or the one handed to ``trace_training``). Forwards are
those of the model wrapped by ``DistributedDataParallel``, of the outermost ``FullyShardedDataParallel`` unit or
``fully_shard`` module (or the module handed to ``trace_training``), in training mode with gradients enabled; backwards
are ``torch.autograd.backward`` calls (``loss.backward()``) made while training. Under mixed
precision, ``GradScaler.step(optimizer)`` is the optimizer phase (unscaling, the overflow check and
the optimizer's ``step()``), and a step whose overflow made the scaler skip the optimizer still
ends there, as a skipped step (``training.step.skipped``), as DeepSpeed's fp16 steps do. With
``step(closure)`` the closure's first call is the step's forward and backward, and the optimizer
phase starts as it returns (LBFGS calls it again from there: optimizer work).

Training is detected when a ``DistributedDataParallel`` or a ``FullyShardedDataParallel`` is built or
``fully_shard`` is applied: only then does the process start its telemetry and observe backwards and optimizer
steps (through ``torch.optim``'s global step hooks), so a process that does not train (``torchrun`` itself) only
holds untouched wrappers. A process with a DeepSpeed engine is traced by the engine's
instrumentor alone: no loop starts there, and one started before an engine stops recording.

DDP's gradient all-reduce runs in its C++ reducer: no Python wrapper sees it, so it has no span of
its own; its exposed part is inside the last micro-batch's backward.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import weakref
from collections.abc import Collection

from opentelemetry import trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.metrics import get_meter

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.instrumentors.patching import (
    Patches,
    keep_out_of_compiled_graphs,
    when_imported,
)
from opentelemetry_instrumentation_deepspeed.package import _instruments_torch
from opentelemetry_instrumentation_deepspeed.recording import registry
from opentelemetry_instrumentation_deepspeed.recording.state import State
from opentelemetry_instrumentation_deepspeed.runtime import session
from opentelemetry_instrumentation_deepspeed.version import __version__

_logger = logging.getLogger(__name__)

_DDP_MODULE = "torch.nn.parallel.distributed"
_FSDP1_MODULE = "torch.distributed.fsdp.fully_sharded_data_parallel"
_FSDP_MODULES = ("torch.distributed.fsdp._fully_shard._fully_shard", "torch.distributed.fsdp._fully_shard",
                 "torch.distributed.fsdp")
_MAX_MICRO_BATCHES = 1024
_MAX_STEP_NESTING = 16  # frames between a step() and the step() it calls (super().step() through decorators)
_depth = threading.local()  # forwards of hooked modules running on this thread: the outermost is the micro-batch's


class TorchLoop:
    """The engine-shaped facts the step recorder and the emitter read, for a loop without an engine."""

    # A step's loss is the sum of what its backwards were given: each micro-batch's loss divided by the accumulation
    # count, in PyTorch's, Accelerate's and the Trainer's recipes (DeepSpeed's engine.backward() takes it undivided).
    summed_losses = True

    def __init__(self, parallelism: str):
        self.parallelism = parallelism
        self.global_steps = 0  # steps closed so far: the next one is number global_steps + 1
        self.skipped_steps = 0
        self.module = None  # set by the training metrics' FLOPs estimate only
        self.optimizer = None  # weak reference to the step optimizer, once known
        self.phase = None  # the optimizer phase running now
        self.closure = None  # the step(closure) call's closure until its first call returns (_Closure)
        self.stepping = None  # (id, code) of torch's wrapper frame of the step optimizer's step() running now
        self.scaling = False  # inside GradScaler.step(): the optimizer's own step() opens no phase
        self.stepped = False  # ... and whether it ran
        self.recorder = None

    # What DeepSpeed's engine answers, where a plain loop has no such setting.
    def managed_gradient_accumulation(self):
        return False  # every step() of the step optimizer ends a step

    def is_gradient_accumulation_boundary(self):
        return True

    def train_micro_batch_size_per_gpu(self):
        return 0  # unknown: samples are counted from each forward's batch

    def gradient_accumulation_steps(self):
        # Undeclared: every fetch inside a step is one of its micro-batches, up to this many.
        return _MAX_MICRO_BATCHES

    def train_batch_size(self):
        return 0

    def zero_optimization_stage(self):
        return 0

    def fp16_enabled(self):
        return False

    def get_global_grad_norm(self):
        return None


def _never() -> bool:
    return False


def _is_compiling():
    compiler = sys.modules["torch"].compiler
    if hasattr(compiler, "is_compiling"):
        return compiler.is_compiling
    from torch._dynamo import is_compiling  # torch < 2.3

    return is_compiling


class _State:
    def __init__(self):
        self.loop: TorchLoop | None = None
        self.instrumentor = None
        self.tracer_provider = None
        self.meter_provider = None
        self.patches: Patches | None = None
        self.hooks: list = []  # torch.optim's global hook handles, and module hook handles
        self.optimizer = None  # named by trace_training() before the loop started
        self.watch: Patches | None = None  # looks at the first optimizer step for training nothing traces
        # torch's test for a graph being traced by torch.compile: looked up at run time (the loop starting, a module
        # hooked), not while torch imports, nor by code of ours that dynamo would meet in a graph.
        self.compiling = _never
        # The FSDP units built so far that no later unit took in (each model's outermost): id of the unit (FSDP1's
        # instance, FSDP2's module) -> (the parameters it and the units in it sharded, counted before; whether any of
        # them trains). MFU's FLOPs estimate for FSDP: the largest model that trains (a DPO reference model or a
        # distillation teacher is frozen).
        self.fsdp_models: dict[int, tuple[int, bool]] = {}


_state = _State()


def _recorder():
    """The loop's recorder while it is the one training (not after a DeepSpeed engine came along)."""
    loop = _state.loop
    if loop is None:
        return None, None
    recorder = loop.recorder
    return (loop, recorder) if recorder is not None and registry.active() is recorder else (None, None)


def start(parallelism: str, module=None, optimizer=None, parameters=None) -> bool:
    """Begin tracing this process's loop (once); False where it cannot (a DeepSpeed engine traces it).

    ``module``: the model whose parameters MFU's FLOPs estimate counts now; ``parameters``: else a function that
    returns their count, read at the first step's end."""
    if _state.loop is not None or _state.instrumentor is None:
        return _state.loop is not None
    if registry.all_recorders():
        return False
    unwatch()  # this loop's training is traced, or its start failed and says so
    try:
        _state.compiling = _is_compiling()
        loop = TorchLoop(parallelism)
        identity = session.start({semconv.TRAINING_FRAMEWORK: semconv.TRAINING_FRAMEWORK_PYTORCH})
        if session.silent and _state.tracer_provider is None and _state.meter_provider is None:
            return False
        from opentelemetry_instrumentation_deepspeed.instrumentors.engine import build_recorder

        loop.module = module
        recorder = build_recorder(loop, identity, _state.tracer_provider or trace.get_tracer_provider(),
                                  get_meter(semconv.SCOPE_NAME, __version__, _state.meter_provider))
        loop.module = None  # the FLOPs estimate is taken: the loop keeps no model alive
        if parameters is not None:
            recorder.facts.metrics.count_parameters_later(parameters)
        facts = recorder.facts
        facts.static = {semconv.TRAINING_PARALLELISM: parallelism}
        facts.root_attributes = {semconv.TRAINING_WORLD_SIZE: identity.world_size}
        loop.recorder = recorder
        registry.track(loop, recorder)
        _state.loop = loop
        if optimizer is not None or _state.optimizer is not None:
            loop.optimizer = weakref.ref(optimizer if optimizer is not None else _state.optimizer)
        _observe_steps_and_backwards()
    except Exception:
        _logger.exception("opentelemetry-instrumentation-deepspeed could not start tracing this training loop; "
                          "training is not affected")
        return False
    return True


def trace_training(module=None, optimizer=None) -> None:
    """Opt a custom loop in: trace this process's training from now on.

    For a loop that neither wraps its model in ``DistributedDataParallel`` nor applies ``fully_shard``
    (one process, model parallelism of its own). ``module``: the model whose forward is one
    micro-batch's forward (else only backwards and optimizer steps are seen); ``optimizer``: the
    one whose ``step()`` ends a step (else the first to step). Call it before the first step, on
    every rank. In a process with a DeepSpeed engine it does nothing: the engine is traced. Also after
    ``DistributedDataParallel`` or ``fully_shard`` started the tracing, to name the step optimizer of a loop whose
    optimizers step in turn (a GAN's discriminator, then its generator: the last one ends the iteration).
    """
    if optimizer is not None:
        _state.optimizer = optimizer
        if _state.loop is not None:
            _state.loop.optimizer = weakref.ref(optimizer)
    if module is not None:
        try:
            _hook_forward(module)
        except Exception:  # a module that takes no hooks (a TorchScript one): its forwards are not seen
            _logger.warning("opentelemetry-instrumentation-deepspeed: trace_training() cannot observe the forward of "
                            "this %s; backwards and optimizer steps are traced", type(module).__name__, exc_info=True)
    if not start("none", module, optimizer):
        _logger.info("trace_training(): not started (a DeepSpeed engine is traced, or nothing would record)")


# -- the phases -----------------------------------------------------------------------------------


def _ddp_init(init):
    def wrapper(self, *args, **kwargs):
        init(self, *args, **kwargs)
        start("ddp", getattr(self, "module", None))

    return wrapper


def _fsdp1_init(init):
    """``FullyShardedDataParallel`` (FSDP1, what Accelerate, the Trainer and Lightning's FSDP strategy build): an
    ``auto_wrap_policy`` builds the inner units inside the outermost one's ``__init__``, which starts the loop with
    the whole model."""

    def wrapper(self, *args, **kwargs):
        depth = getattr(_depth, "fsdp1_init", 0)
        module = args[0] if args else kwargs.get("module")
        # Deeper: a unit an auto-wrap policy builds inside the outer one, whose count holds it.
        counted = None if depth else _count_sharded(module, "FullyShardedDataParallel")
        _depth.fsdp1_init = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            _depth.fsdp1_init = depth
        if not depth:
            _remember(self, counted)
            # The first unit a program builds starts the loop: with its layers wrapped one by one before the model,
            # the first layer's. The FLOPs estimate reads the count once the first step ended, all units built.
            start("fsdp", None, parameters=_sharded_parameters)

    return wrapper


def _count_sharded(modules, unit: str) -> tuple[int, bool] | None:
    """(parameters, whether any trains) of what an FSDP unit (``unit``: its class in ``torch.distributed.fsdp``) is
    about to shard, its modules, counted before it shards them; with the units built in them before (a model's layers,
    wrapped first), counted then, which are no model's outermost any more. None where they cannot be counted."""
    try:
        unit = getattr(sys.modules["torch.distributed.fsdp"], unit)
        modules = list(modules) if isinstance(modules, (list, tuple)) else [modules]
        seen, count, trains = set(), 0, False
        while modules:
            module = modules.pop()
            if isinstance(module, unit):
                inner, inner_trains = _state.fsdp_models.pop(id(module), (0, False))
                count, trains = count + inner, trains or inner_trains
                continue
            for parameter in module.parameters(recurse=False):
                if id(parameter) not in seen:  # a weight tied to another (an embedding and its output layer)
                    seen.add(id(parameter))
                    count += parameter.numel()
                    trains = trains or parameter.requires_grad
            modules.extend(module.children())
    except Exception:  # not a module FSDP would take: FSDP's own error is the program's
        _logger.debug("opentelemetry-instrumentation-deepspeed: FSDP's parameters not counted", exc_info=True)
        return None
    return count, trains


def _remember(unit, counted: tuple[int, bool] | None) -> None:
    """``unit`` was built (it raised nothing): what it sharded is a model's, until a unit built later takes it in."""
    if counted is not None:
        _state.fsdp_models[id(unit)] = counted


def _sharded_parameters() -> int:
    """The parameters of the largest model FSDP sharded that trains (of the largest, where none does)."""
    models = list(_state.fsdp_models.values())
    return max((count for count, trains in models if trains), default=max((count for count, _ in models), default=0))


def _ddp_forward(forward):
    def wrapper(self, *args, **kwargs):
        if _state.compiling():  # traced by torch.compile: nothing of ours in its graph (no break, none it refuses)
            return forward(self, *args, **kwargs)
        loop, recorder = _recorder()
        if recorder is None or getattr(_depth, "value", 0):
            return forward(self, *args, **kwargs)
        training = self.training or _in_training(self)
        if not (training and sys.modules["torch"].is_grad_enabled()):
            # No phase. An evaluation (eval mode) was fed by the waits since the last step; passes without
            # gradients in training mode are an evaluation loop's where a fetch comes between two of them, else a
            # pseudo-labelling pass (or a probe) on what the step trains on next.
            if training:
                recorder.without_gradients()
            else:
                recorder.not_training()
            return forward(self, *args, **kwargs)
        _depth.value = 1
        phase = recorder.forward_started(loop, args, kwargs)
        if phase is None:
            # No phase of its own (an FSDP unit that non-reentrant checkpointing runs again in the backward): what it
            # raises is not the step's failure (the recomputation's early stop is raised through it, and caught).
            try:
                return forward(self, *args, **kwargs)
            finally:
                _depth.value = 0
        try:
            result = forward(self, *args, **kwargs)
        except BaseException as error:
            recorder.phase_failed(phase, error)
            raise
        finally:
            _depth.value = 0
        recorder.forward_ended(phase, result)
        return result

    return wrapper


def _in_training(module) -> bool:
    """Whether any module inside ``module`` is in training mode, where ``module`` itself is not: Lightning's evaluation
    puts the whole wrapped model in eval mode, and afterwards back only the LightningModule, leaving the
    DistributedDataParallel around it in eval mode for the rest of the run (every later forward then read as an
    evaluation's). A model that ``eval()`` put in eval mode whole is evaluated; only such forwards pay this walk."""
    return any(inner.training for inner in module.modules())


def _fully_shard(fully_shard):
    def wrapper(*args, **kwargs):
        counted = _count_sharded(args[0] if args else kwargs.get("module"), "FSDPModule")
        result = fully_shard(*args, **kwargs)
        try:
            modules = result if isinstance(result, (list, tuple)) else [result]
            if modules:
                _remember(modules[0], counted)
            for module in modules:
                _hook_forward(module)
            # Applied to a model's layers first, then to the model: the first call starts the loop.
            start("fsdp", None, parameters=_sharded_parameters)
        except Exception:
            _logger.exception("opentelemetry-instrumentation-deepspeed could not observe this fully_shard module")
        return result

    return wrapper


def _hook_forward(module) -> None:
    """Forward hooks on ``module``: its forward is a micro-batch's when no hooked forward encloses it."""

    _state.compiling = _is_compiling()

    def before(hooked, args, kwargs):
        if _state.compiling():  # a compiled module's hooks run in its graph: nothing of ours goes there
            return
        depth = getattr(_depth, "value", 0)
        _depth.value = depth + 1
        if depth:
            return
        loop, recorder = _recorder()
        if recorder is None:
            return
        training = hooked.training or _in_training(hooked)
        if not (training and sys.modules["torch"].is_grad_enabled()):
            if training:  # as in _ddp_forward
                recorder.without_gradients()
            else:
                recorder.not_training()
            return
        _depth.phase = recorder.forward_started(loop, args, kwargs)
        # The exception being handled where the forward was called (one called in an except block), if any.
        _depth.handling = sys.exc_info()[1]

    def after(_hooked, _args, output):
        if _state.compiling():
            return
        _depth.value = depth = getattr(_depth, "value", 1) - 1
        if depth:
            return
        phase, _depth.phase = getattr(_depth, "phase", None), None
        handling, _depth.handling = getattr(_depth, "handling", None), None
        _loop, recorder = _recorder()
        if recorder is None or phase is None:
            return
        # always_call: the hook also runs, in torch's except block and with no output, when the forward raised (the
        # exception its caller handles, re-raised, among others).
        error = sys.exc_info()[1]
        if error is not None and (error is not handling or output is None):
            recorder.phase_failed(phase, error)
        else:
            recorder.forward_ended(phase, output)

    _state.hooks.append(module.register_forward_pre_hook(before, prepend=True, with_kwargs=True))
    _state.hooks.append(module.register_forward_hook(after, always_call=True))


def _backward(backward):
    def wrapper(*args, **kwargs):
        loop, recorder = _recorder()
        if recorder is None:
            return backward(*args, **kwargs)
        tensors = args[0] if args else kwargs.get("tensors")
        loss = tensors if getattr(tensors, "ndim", None) == 0 else _summed(tensors)
        scaled = getattr(_depth, "scaled", None)
        if scaled is not None and loss is not None and scaled[0]() is loss:
            loss = scaled[1]  # the loss GradScaler.scale() was given, as taken then: it does not move with the scale
        phase = recorder.backward_started(loop, loss=loss)
        try:
            result = backward(*args, **kwargs)
        except BaseException as error:
            recorder.phase_failed(phase, error)
            raise
        recorder.phase_ended(phase)
        return result

    return wrapper


def _summed(tensors):
    """The sum of scalar tensors given together (``torch.autograd.backward([loss_a, loss_b])``), detached; else None."""
    if type(tensors) not in (list, tuple) or not tensors or any(getattr(t, "ndim", None) != 0 for t in tensors):
        return None
    try:
        total = tensors[0].detach()
        for tensor in tensors[1:]:
            total = total + tensor.detach()  # no sync: on a device, the sum stays there, as one loss does
    except Exception:  # noqa: BLE001 - scalars on different devices: no loss, the backward goes on
        return None
    return total


def _before_step(optimizer, args, kwargs):
    loop, recorder = _recorder()
    if recorder is None:
        return None
    if loop.scaling:
        loop.stepped = True
        return None
    if loop.optimizer is None:
        loop.optimizer = weakref.ref(optimizer)
    elif loop.optimizer() is not optimizer:
        return None  # another optimizer (a GAN's second one): its step is work inside this step
    call = sys._getframe(1)  # torch's wrapper of this step() call, which runs the hooks (or GradScaler.step)
    if loop.stepping is not None and _inside(loop.stepping, call.f_back):
        return None  # a subclass's step() calling super().step(), each class's step() hooked: one step
    loop.stepping = (id(call), call.f_code)
    return _optimizer_started(loop, recorder, args, kwargs)


def _optimizer_started(loop: TorchLoop, recorder, args, kwargs):
    """The step optimizer's step() starts: its phase, or (``step(closure)``) the closure's first call first; what the
    pre-hook returns (new arguments, or None)."""
    # No forward encloses the step optimizer's step: one still open here was left by an interrupt (a KeyboardInterrupt
    # skips the always-called hooks). It ends here, or no later forward would be seen.
    left, _depth.phase, _depth.value = getattr(_depth, "phase", None), None, 0
    if left is not None:
        recorder.interrupted("the forward did not complete")
    if loop.phase is not None or loop.closure is not None:  # the last step() raised: its step ended with it
        loop.phase = loop.closure = None
        recorder.interrupted("the optimizer step did not complete")
    closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0]: the optimizer
    # No closure (an argument of another kind: a subclass's step(factor)); or one called after the step's own forward
    # and backward (SAM's, at a perturbed point): optimizer work. Unless a batch was fetched since: the closure then
    # runs the step's last micro-batch (Lightning's accumulation calls the closure itself for the others).
    if not callable(closure) or (recorder.state != State.IDLE and not recorder.fetched_since_phase()):
        loop.phase = recorder.optimizer_step_started(loop)
        return None
    # step(closure): the closure's first call is the step's forward and backward (its micro-batch and its loss); the
    # optimizer phase starts as it returns, and holds the calls after it (LBFGS's re-evaluations: optimizer work).
    loop.closure = closure = _Closure(loop, recorder, closure)
    if len(args) > 1:
        return (args[0], closure, *args[2:]), kwargs
    return args, {**kwargs, "closure": closure}


class _Closure:
    """The closure handed to the step optimizer's ``step()``, which may call it any number of times (LBFGS: once per
    evaluation of its line search; SGD and Adam: once, first)."""

    __slots__ = ("_closure", "_loop", "_recorder", "pending")

    def __init__(self, loop: TorchLoop, recorder, closure):
        self._loop, self._recorder, self._closure = loop, recorder, closure
        self.pending = True

    def __call__(self, *args, **kwargs):
        try:
            result = self._closure(*args, **kwargs)
        except BaseException as error:
            if self._loop.closure is self:  # its step fails with it; the closure, and what it holds, go
                self._loop.closure = None
                self._recorder.phase_failed(None, error)
            raise
        if self.pending:
            self.optimizer_started()
        return result

    def optimizer_started(self) -> None:
        self.pending = False
        loop = self._loop
        if loop.closure is self and _recorder()[1] is self._recorder:
            loop.closure = None
            loop.phase = self._recorder.optimizer_step_started(loop)


def _inside(stepping: tuple, frame) -> bool:
    """Whether the step() call ``stepping`` names (its wrapper frame's id and code) runs below ``frame``. By id and
    code: a frame held past a step() that raised would keep the optimizer's arguments (the closure, what it holds)."""
    ident, code = stepping
    for _ in range(_MAX_STEP_NESTING):
        if frame is None:
            return False
        if id(frame) == ident and frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _after_step(optimizer, _args, _kwargs):
    loop, recorder = _recorder()
    if recorder is None or loop.scaling or loop.optimizer is None or loop.optimizer() is not optimizer:
        return
    call = sys._getframe(1)
    if loop.stepping != (id(call), call.f_code):
        return  # the inner step() of a nested call: the outer one ends the phase
    loop.stepping = None
    if loop.closure is not None:  # an optimizer that never called its closure: the step ends with an empty phase
        loop.closure.optimizer_started()
    phase, loop.phase = loop.phase, None
    if phase is not None:
        loop.global_steps += 1
        recorder.optimizer_step_ended(loop, phase)


def _scaler_step(step):
    """``GradScaler.step(optimizer)``: the step optimizer's phase, whether or not the scaler runs it."""

    def wrapper(self, *args, **kwargs):
        loop, recorder = _recorder()
        optimizer = args[0] if args else kwargs.get("optimizer")
        if recorder is None or loop.scaling or (loop.optimizer is not None and loop.optimizer() is not optimizer):
            return step(self, *args, **kwargs)
        if loop.optimizer is None:
            loop.optimizer = weakref.ref(optimizer)
        _before_step(optimizer, (), {})  # GradScaler refuses a closure
        loop.scaling, loop.stepped = True, False
        try:
            result = step(self, *args, **kwargs)
        except BaseException as error:
            phase, loop.phase = loop.phase, None
            recorder.phase_failed(phase, error)
            raise
        finally:
            loop.scaling = False
        if not loop.stepped:  # an inf or NaN gradient: the scaler skipped the optimizer
            loop.skipped_steps += 1
        _after_step(optimizer, (), {})
        return result

    return wrapper


def _scaler_scale(scale):
    """``GradScaler.scale(loss)``: the scaled loss is what the backward gets; the loss is what the step reports. It
    is taken here (a host float, or a pending copy on CUDA), as the backward would have taken it: the loss may be a
    temporary that no one references by the backward (``scaler.scale(compute_loss()).backward()``)."""

    def wrapper(self, outputs, *args, **kwargs):
        result = scale(self, outputs, *args, **kwargs)
        if getattr(outputs, "ndim", None) == 0:
            _loop, recorder = _recorder()
            if recorder is not None and not recorder.broken:
                try:
                    _depth.scaled = (weakref.ref(result), recorder.take(outputs))  # weak: the user's tensor
                except Exception:  # noqa: BLE001 - ours (a tensor subclass the copy refuses): step tracing goes off
                    recorder.fail(_scaler_scale.__qualname__)
        return result

    return wrapper


def _observe_steps_and_backwards() -> None:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    _state.hooks += [register_optimizer_step_pre_hook(_before_step), register_optimizer_step_post_hook(_after_step)]
    _state.patches.wrap(torch.autograd, "backward", _backward)

    def patch_scaler(module):
        if _state.patches is not None and _state.patches.active:
            _state.patches.wrap(module.GradScaler, "step", _scaler_step)
            _state.patches.wrap(module.GradScaler, "scale", _scaler_scale)

    def patch_sharded_scaler(module):  # FSDP's scaler has a scale() of its own
        if _state.patches is not None and _state.patches.active:
            _state.patches.wrap(module.ShardedGradScaler, "scale", _scaler_scale)

    when_imported("torch.amp.grad_scaler", patch_scaler)
    when_imported("torch.distributed.fsdp.sharded_grad_scaler", patch_sharded_scaler)


def _watch_the_first_step(module) -> None:
    """Training that nothing here traces (one process; Accelerate on a machine without GPUs and without its CPU flag,
    which builds no DDP; a framework's own parallelism) would otherwise leave no telemetry and no word why. Every
    optimizer's ``step()`` calls ``_optimizer_step_code()`` (empty: the profiler's entry point) once it stepped; its
    replacement looks once and puts the original back. Not a global step hook: removed from inside, it would fail
    the ``step()`` that iterates the hooks."""
    if _state.patches is not None and _state.patches.active and _state.watch is None:
        _state.watch = Patches()
        _state.watch.wrap(module.Optimizer, "_optimizer_step_code", _first_step)


def unwatch() -> None:
    """Training is traced (or the instrumentation leaves): no optimizer step looks."""
    if _state.watch is not None:
        _state.watch.restore()


def _first_step(original):
    def wrapper(self):
        original(self)
        try:
            if _is_compiling()():  # traced by torch.compile: looked at where it runs
                return
            unwatch()
            if _state.loop is not None or registry.all_recorders():
                return
            if not session.would_record(_state.tracer_provider, _state.meter_provider):
                return  # nothing would be traced anyway
        except Exception:  # ours, inside the user's step(): it goes on, unwatched
            _logger.debug("opentelemetry-instrumentation-deepspeed: the first optimizer step was not looked at",
                          exc_info=True)
            with contextlib.suppress(Exception):
                unwatch()
            return
        _logger.warning(
            "opentelemetry-instrumentation-deepspeed: an optimizer steps in this process, but no DeepSpeed engine "
            "was built, no model was wrapped in DistributedDataParallel or FullyShardedDataParallel and fully_shard "
            "was not applied: this training is not traced.%s A loop of one process, or with a parallelism of its "
            "own, opts in with opentelemetry_instrumentation_deepspeed.trace_training(model, optimizer) before its "
            "first step.", _alone())

    return wrapper


def _alone() -> str:
    """What the warning adds where the launcher started several ranks that made no process group."""
    world = os.environ.get("WORLD_SIZE", "").strip()
    distributed = sys.modules.get("torch.distributed")
    if not world.isdigit() or int(world) < 2 or (distributed is not None and distributed.is_initialized()):
        return ""
    return (f" WORLD_SIZE is {world}, but this rank made no process group: it trains alone, as each other rank does "
            "(Accelerate on a machine without GPUs does so unless Accelerator(cpu=True) or ACCELERATE_USE_CPU=true).")


class TorchTrainingInstrumentor(BaseInstrumentor):
    """Steps of a plain PyTorch loop (DDP, FSDP2, or ``trace_training``) where no DeepSpeed engine trains."""

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments_torch

    def _instrument(self, **kwargs):
        patches = Patches()
        _state.instrumentor, _state.patches = self, patches
        keep_out_of_compiled_graphs()
        _state.tracer_provider, _state.meter_provider = kwargs.get("tracer_provider"), kwargs.get("meter_provider")

        def patch_ddp(module):
            if patches.active:
                patches.wrap(module.DistributedDataParallel, "__init__", _ddp_init)
                patches.wrap(module.DistributedDataParallel, "forward", _ddp_forward)

        def patch_fsdp(module):
            if patches.active:
                patches.wrap(module, "fully_shard", _fully_shard)
                patches.rebind([sys.modules[name] for name in _FSDP_MODULES if name in sys.modules])

        when_imported(_DDP_MODULE, patch_ddp)
        def patch_fsdp1(module):
            if patches.active:
                patches.wrap(module.FullyShardedDataParallel, "__init__", _fsdp1_init)
                # Its forward is a micro-batch's as DDP's is: the outermost unit's, the inner ones' inside it.
                patches.wrap(module.FullyShardedDataParallel, "forward", _ddp_forward)

        when_imported(_FSDP1_MODULE, patch_fsdp1)
        when_imported(_FSDP_MODULES[0], patch_fsdp)
        when_imported(_FSDP_MODULES[-1], lambda _module: patch_fsdp(sys.modules[_FSDP_MODULES[0]]))
        when_imported("torch.optim.optimizer", _watch_the_first_step)

    def _uninstrument(self, **kwargs):
        unwatch()
        for handle in _state.hooks:
            handle.remove()
        if _state.patches is not None:
            _state.patches.restore()
        if _state.loop is not None:
            registry.forget(_state.loop)
        _state.__init__()
