"""DeepSpeed's pipeline parallelism: ``PipelineEngine.train_batch()`` as one step on each stage.

``train_batch()`` runs a whole optimizer step in one call: the schedule's instructions (load a
micro-batch, receive activations, forward, send, receive gradients, backward, reduce, optimizer
step) are functions looked up in ``PipelineEngine._INSTRUCTION_MAP``, not methods, so the map's
forward, backward and optimizer-step entries are replaced by wrappers (and put back by
``restore``). The sends and receives reach ``deepspeed.comm``, where the collectives'
instrumentor sees them with their peer rank; the step's facts map that rank to its stage.

``PipelineEngine.__init__`` calls ``DeepSpeedEngine.__init__`` first: the stage and the grid exist
only once its own ``__init__`` returned, which is when its recorder is built.
"""

from __future__ import annotations

import functools
import sys

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.instrumentors.patching import original_of, replacement
from opentelemetry_instrumentation_deepspeed.recording import registry
from opentelemetry_instrumentation_deepspeed.recording.state import State

MODULE = "deepspeed.runtime.pipe.engine"


def is_pipeline(engine) -> bool:
    module = sys.modules.get(MODULE)
    return module is not None and isinstance(engine, module.PipelineEngine)


def coordinates(engine) -> dict:
    """The rank's place in the pipeline grid, as step and resource attributes."""
    grid = engine.grid
    return {semconv.TRAINING_PIPELINE_STAGE: int(engine.stage_id),
            semconv.TRAINING_PIPELINE_STAGES: int(engine.num_stages),
            semconv.TRAINING_DATA_PARALLEL_RANK: int(grid.data_parallel_id),
            semconv.TRAINING_DATA_PARALLEL_SIZE: int(grid.data_parallel_size)}


def peer_stages(engine) -> dict[int, int]:
    """{global rank: stage} of the ranks of this rank's own pipeline (its data-parallel replica)."""
    return {int(engine.grid.stage_to_global(stage_id=stage)): stage for stage in range(engine.num_stages)}


def train_batch(original):
    def wrapper(self, *args, **kwargs):
        recorder = registry.recorder_for(self)
        if recorder is None or not sys.modules["torch"].is_grad_enabled():
            return original(self, *args, **kwargs)  # DeepSpeed refuses it without gradients
        recorder.batch_started(self)
        try:
            result = original(self, *args, **kwargs)
        except BaseException as error:
            recorder.phase_failed(None, error)
            raise
        recorder.batch_ended(self)
        return result

    return wrapper


def _phase(original, start):
    """An instruction as a phase of the open step; outside one (``eval_batch()``) it runs untouched."""

    def instruction(self, *args, **kwargs):
        recorder = registry.recorder_for(self)
        if recorder is None or recorder.state == State.IDLE:
            return original(self, *args, **kwargs)
        phase = start(recorder, self)
        try:
            result = original(self, *args, **kwargs)
        except BaseException as error:
            recorder.phase_failed(phase, error)
            raise
        recorder.phase_ended(phase)
        return result

    return instruction


def patch_schedule(module) -> None:
    """Wrap the forward, backward and optimizer-step instructions of ``PipelineEngine``'s map, once."""
    schedule = sys.modules["deepspeed.runtime.pipe.schedule"]
    starts = {schedule.ForwardPass: lambda recorder, engine: recorder.forward_started(engine),
              schedule.BackwardPass: lambda recorder, engine: recorder.backward_started(
                  engine, loss=engine.loss if engine.is_last_stage() else None),
              schedule.OptimizerStep: lambda recorder, engine: recorder.pipeline_optimizer_started(engine)}
    instructions = module.PipelineEngine._INSTRUCTION_MAP
    for kind, start in starts.items():
        original = instructions.get(kind)
        if original is not None and original_of(original) is None:
            instructions[kind] = replacement(original, functools.partial(_phase, start=start))


def restore_schedule() -> None:
    module = sys.modules.get(MODULE)
    if module is None:
        return
    instructions = module.PipelineEngine._INSTRUCTION_MAP
    for kind, function in list(instructions.items()):
        if original_of(function) is not None:
            instructions[kind] = original_of(function)
