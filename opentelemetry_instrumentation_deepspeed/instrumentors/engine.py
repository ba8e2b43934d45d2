"""The DeepSpeed engine: one ``training.step`` span tree per optimizer step.

Patch points (deepspeed 0.19): ``DeepSpeedEngine.__init__`` starts the process's telemetry;
``forward``, ``backward`` and ``step`` are the phases; ``_backward_prologue`` /
``_backward_epilogue`` also run when the user calls ``loss.backward()`` directly (ZeRO >= 1),
which is how that path gets its backward span. A ``PipelineEngine`` starts at the end of its own
``__init__`` and steps in ``train_batch()`` (``pipeline.py``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Collection
from threading import get_ident

from opentelemetry import trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.metrics import get_meter

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.instrumentors import cuda_graphs, pipeline, torch_loop
from opentelemetry_instrumentation_deepspeed.instrumentors.patching import (
    Patches,
    keep_out_of_compiled_graphs,
    unwrap_methods,
    when_imported,
    wrap_methods,
)
from opentelemetry_instrumentation_deepspeed.package import _instruments
from opentelemetry_instrumentation_deepspeed.recording import registry
from opentelemetry_instrumentation_deepspeed.recording.recorder import BackwardRoot, StepRecorder
from opentelemetry_instrumentation_deepspeed.runtime import session
from opentelemetry_instrumentation_deepspeed.version import __version__

_logger = logging.getLogger(__name__)

_ENGINE_MODULE = "deepspeed.runtime.engine"


def _init_wrapper(tracer_provider, meter_provider, pipeline_init: bool = False):
    def factory(init):
        def wrapper(self, *args, **kwargs):
            init(self, *args, **kwargs)
            if pipeline.is_pipeline(self) != pipeline_init:
                # A PipelineEngine's DeepSpeedEngine.__init__ returns before its stage is known: its own
                # __init__'s wrapper starts it.
                return
            torch_loop.unwatch()  # an engine trains here, traced or not (its tracing may fail to start: said so)
            try:
                coordinates = pipeline.coordinates(self) if pipeline_init else None
                identity = session.start(coordinates)
                if session.silent and tracer_provider is None and meter_provider is None:
                    return
                provider = tracer_provider or trace.get_tracer_provider()
                meter = get_meter(semconv.SCOPE_NAME, __version__, meter_provider)
                recorder = build_recorder(self, identity, provider, meter)
                if pipeline_init:
                    recorder.facts.static.update(coordinates)
                    recorder.facts.peer_stages = pipeline.peer_stages(self)
                    recorder.pipelined = True
                registry.track(self, recorder)
            except Exception:
                _logger.exception("opentelemetry-instrumentation-deepspeed could not start tracing this engine; "
                                  "training is not affected")

        return wrapper

    return factory


def _autograd_backward(backward):
    # Per calling thread: the hook reads its training thread's (another thread's backward meanwhile is not its). A
    # backward inside it (reentrant checkpointing's, on the same thread on CPU) replaces and clears the root:
    # DeepSpeed's hook, the first of the pass, has read it by then.
    roots = BackwardRoot.by_thread

    def wrapper(*args, **kwargs):
        thread = get_ident()
        roots[thread] = args[0] if args else kwargs.get("tensors")
        try:
            return backward(*args, **kwargs)
        finally:
            roots.pop(thread, None)

    return wrapper


_backward_roots: Patches | None = None  # torch.autograd.backward's replacement, from the first direct backward on


def _follow_backward_roots() -> None:
    """Wrap ``torch.autograd.backward`` (which ``Tensor.backward`` calls) so that a direct backward's loss is the
    tensor it started from. Done at the first direct backward, whose loss is the forward's output: a loop that only
    calls ``engine.backward(loss)`` (which knows its loss) never pays for the wrapper. Not where another replacement of
    ours is there already (a plain loop's): replacements do not stack, and the loss is the forward's output."""
    global _backward_roots  # noqa: PLW0603 - one replacement per process
    if _backward_roots is None:
        _backward_roots = patches = Patches()  # set first: a wrap that fails is not tried again
        try:
            patches.wrap(sys.modules["torch"].autograd, "backward", _autograd_backward)
        except Exception:  # ours: direct backwards' losses stay the forward's output, training goes on
            _logger.debug("cannot wrap torch.autograd.backward", exc_info=True)


def _leave_backward_roots() -> None:
    global _backward_roots  # noqa: PLW0603
    if _backward_roots is not None:
        _backward_roots.restore()
        _backward_roots = None


def build_recorder(engine, identity, tracer_provider, meter, cuda=None):
    """The recorder of ``engine``'s steps, and the facts the emitter needs to turn its records into telemetry."""
    from opentelemetry_instrumentation_deepspeed.export.emitter import StepFacts, emitter
    from opentelemetry_instrumentation_deepspeed.export.spans import SpanWriter
    from opentelemetry_instrumentation_deepspeed.export.training_metrics import TrainingMetrics, flops_per_token
    from opentelemetry_instrumentation_deepspeed.recording import profiler
    from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env

    session.end_with_the_process()
    sink = emitter()
    sink.watch_collections(meter)
    module = getattr(engine, "module", None)
    metrics = TrainingMetrics(meter, flops_per_token(module) if module is not None else None, engine)
    step_profiler = profiler.from_environment()
    facts = StepFacts(SpanWriter(tracer_provider), metrics, identity, engine,
                      profile_top=step_profiler.top if step_profiler is not None else 0,
                      comm_span_limit=env.comm_span_limit())
    if step_profiler is not None:
        step_profiler.worth = lambda number: sink.emits_profiles and facts.recorded(number)
        facts.profile_cost = step_profiler.emitted
    on_cuda = _on_cuda(engine, cuda)
    recorder = StepRecorder(engine, facts, sink.submit, step_profiler, _gpu_timeline(on_cuda), _allocator(on_cuda),
                            _device_scalars(on_cuda))
    from opentelemetry_instrumentation_deepspeed.runtime import watchdog

    watchdog.watch(recorder, meter, engine)  # its own thread reads the open record: nothing per step here
    from opentelemetry_instrumentation_deepspeed.export import clock

    clock.attach(facts)  # the clock offset's refreshes (runtime/clock.py, on their own thread) become spans
    return recorder


def _on_cuda(engine, cuda):
    """torch.cuda (or the test's fake at that boundary) when the engine trains on a CUDA device, else None."""
    if cuda is None and getattr(getattr(engine, "device", None), "type", None) != "cuda":
        return None
    return cuda or sys.modules["torch"].cuda


def _gpu_timeline(cuda):
    if cuda is None:
        return None
    from opentelemetry_instrumentation_deepspeed.recording.gpu_timing import GpuTimeline

    cuda_graphs.follow("engine")
    return GpuTimeline(cuda)


def _allocator(cuda):
    if cuda is None or not hasattr(cuda, "memory_stats_as_nested_dict"):
        return None
    from opentelemetry_instrumentation_deepspeed.recording.allocator import AllocatorMemory
    from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env

    return AllocatorMemory(cuda, env.memory_peak_reset())


def _device_scalars(cuda):
    if cuda is None:
        return None
    from opentelemetry_instrumentation_deepspeed.recording.scalars import DeviceScalars

    try:
        return DeviceScalars(sys.modules["torch"], cuda)
    except Exception:  # no pinned memory (a fake CUDA, a broken driver): no device losses, the rest runs
        _logger.debug("no pinned buffer for loss and gradient norm", exc_info=True)
        return None


# The wrappers read the registry's dict themselves, and the fail-open guards of the recorder's
# methods are inline below (the method's __wrapped__ in a try of the wrapper's own, the same checks
# and the same report): recorder_for() and a guard would be two more Python frames per phase, and
# at ~80 calls per step the number of frames is most of what a step pays. The user's call is never
# inside those tries. A broken recorder's methods do nothing, so its engine runs unobserved.
_forward_started = StepRecorder.forward_started.__wrapped__
_forward_ended = StepRecorder.forward_ended.__wrapped__
_backward_started = StepRecorder.backward_started.__wrapped__
_phase_ended = StepRecorder.phase_ended.__wrapped__
_optimizer_step_started = StepRecorder.optimizer_step_started.__wrapped__
_optimizer_step_ended = StepRecorder.optimizer_step_ended.__wrapped__


def _forward(forward):
    def wrapper(self, *args, **kwargs):
        recorder = registry._by_id.get(id(self))
        if recorder is None or recorder.broken:
            return forward(self, *args, **kwargs)
        if not (self.training and sys.modules["torch"].is_grad_enabled()):
            # No phase. An evaluation (eval mode) was fed by the waits since the last step; passes without
            # gradients in training mode are an evaluation loop's where a fetch comes between two of them, else a
            # pseudo-labelling pass (or a probe) on what the step trains on next. DeepSpeed's own eval() and train()
            # set the mode of the module it wraps, not its own: an evaluation through engine.eval() read as such a
            # pass (a review: its batch counted in the next step's, and every step's after). With gradients, the
            # wrapped module's eval mode is training without dropout (a code review), so it is read only here, from
            # _modules (the attribute goes through nn.Module.__getattr__, ten times slower).
            module = self._modules.get("module")
            if self.training and (module is None or module.training):
                recorder.without_gradients()
            else:
                recorder.not_training()
            return forward(self, *args, **kwargs)
        try:
            phase = _forward_started(recorder, self, args, kwargs)
        except Exception:  # noqa: BLE001 - ours only
            recorder.fail(_forward_started.__qualname__)
            phase = None
        try:
            result = forward(self, *args, **kwargs)
        except BaseException as error:
            recorder.phase_failed(phase, error)
            raise
        if not recorder.broken:
            try:
                _forward_ended(recorder, phase, result)
            except Exception:  # noqa: BLE001 - ours only
                recorder.fail(_forward_ended.__qualname__)
        return result

    return wrapper


def _backward(backward):
    def wrapper(self, *args, **kwargs):
        recorder = registry._by_id.get(id(self))
        if recorder is None or recorder.broken:
            return backward(self, *args, **kwargs)
        loss = args[0] if args else kwargs.get("loss")
        # scale_wrt_gas=False (the Trainer's, by keyword): the loss is the step's share already, undivided by DeepSpeed.
        share = bool(kwargs) and kwargs.get("scale_wrt_gas", True) is False
        try:
            phase = _backward_started(recorder, self, False, loss, share)
        except Exception:  # noqa: BLE001 - ours only
            recorder.fail(_backward_started.__qualname__)
            phase = None
        try:
            result = backward(self, *args, **kwargs)
        except BaseException as error:
            recorder.phase_failed(phase, error)
            raise
        if not recorder.broken:
            try:
                _phase_ended(recorder, phase)
            except Exception:  # noqa: BLE001 - ours only
                recorder.fail(_phase_ended.__qualname__)
        return result

    return wrapper


def _backward_prologue(prologue):
    def wrapper(self, *args, **kwargs):
        # Inside engine.backward() the phase is already open; this catches a direct loss.backward().
        recorder = None
        if not getattr(self, "_running_engine_backward", True):
            recorder = registry._by_id.get(id(self))
            if recorder is not None:
                recorder.backward_started(self, direct=True)
                if _backward_roots is None:
                    _follow_backward_roots()
        try:
            return prologue(self, *args, **kwargs)
        except BaseException as error:
            if recorder is not None:
                recorder.direct_backward_failed(error)
            raise

    return wrapper


def _backward_epilogue(epilogue):
    def wrapper(self, *args, **kwargs):
        # Inside engine.backward(), its own wrapper ends the phase: only a direct loss.backward()'s is ours.
        if getattr(self, "_running_engine_backward", True):
            return epilogue(self, *args, **kwargs)
        recorder = registry._by_id.get(id(self))
        try:
            result = epilogue(self, *args, **kwargs)
        except BaseException as error:
            if recorder is not None:
                recorder.direct_backward_failed(error)
            raise
        if recorder is not None:
            recorder.direct_backward_ended()
        return result

    return wrapper


def _step(step):
    def wrapper(self, *args, **kwargs):
        recorder = registry._by_id.get(id(self))
        if recorder is None or recorder.broken:
            return step(self, *args, **kwargs)
        try:
            phase = _optimizer_step_started(recorder, self)
        except Exception:  # noqa: BLE001 - ours only
            recorder.fail(_optimizer_step_started.__qualname__)
            phase = None
        if phase is None:
            return step(self, *args, **kwargs)
        try:
            result = step(self, *args, **kwargs)
        except BaseException as error:
            recorder.phase_failed(phase, error)
            raise
        if not recorder.broken:
            try:
                _optimizer_step_ended(recorder, self, phase)
            except Exception:  # noqa: BLE001 - ours only
                recorder.fail(_optimizer_step_ended.__qualname__)
        return result

    return wrapper


_PHASES = {
    "forward": _forward,
    "backward": _backward,
    "_backward_prologue": _backward_prologue,
    "_backward_epilogue": _backward_epilogue,
    "step": _step,
}


class DeepSpeedInstrumentor(BaseInstrumentor):
    """Traces every optimizer step of every ``DeepSpeedEngine`` in the process.

    ``instrument(tracer_provider=...)`` uses that provider; by default the global one.
    """

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs):
        wrappers = {"__init__": _init_wrapper(kwargs.get("tracer_provider"), kwargs.get("meter_provider")),
                    **_PHASES}
        # Our own flag: the base class sets its own only after _instrument returns, and an
        # import hook registered here may fire after uninstrument().
        self._patching = True
        session.leave_if_silent(self, kwargs)
        keep_out_of_compiled_graphs()

        def patch(module):
            if self._patching:
                wrap_methods(module.DeepSpeedEngine, wrappers)

        def patch_pipeline(module):
            if self._patching:
                wrap_methods(module.PipelineEngine, {
                    "__init__": _init_wrapper(kwargs.get("tracer_provider"), kwargs.get("meter_provider"), True),
                    "train_batch": pipeline.train_batch})
                pipeline.patch_schedule(module)

        when_imported(_ENGINE_MODULE, patch)
        when_imported(pipeline.MODULE, patch_pipeline)

    def _uninstrument(self, **kwargs):
        self._patching = False
        module = sys.modules.get(_ENGINE_MODULE)
        unwrap_methods(getattr(module, "DeepSpeedEngine", None), ["__init__", *_PHASES])
        unwrap_methods(getattr(sys.modules.get(pipeline.MODULE), "PipelineEngine", None), ["__init__", "train_batch"])
        pipeline.restore_schedule()
        _leave_backward_roots()
        cuda_graphs.leave("engine")
        registry.forget_all()
