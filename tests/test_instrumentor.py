"""The instrumentors in-process: programmatic use, and uninstrument() restoring every patched function."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from opentelemetry_instrumentation_deepspeed import (
    CommInstrumentor,
    DataLoaderInstrumentor,
    DeepSpeedInstrumentor,
)
from opentelemetry_instrumentation_deepspeed.runtime import session
from tests.conftest import REPO, free_port, launch

pytestmark = pytest.mark.slow  # trains the example with real DeepSpeed, in this process


@pytest.fixture(scope="module")
def train(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(free_port())), ("OMP_NUM_THREADS", "1")):
        mp.setenv(name, value)
    mp.syspath_prepend(str(REPO / "examples"))
    import train as example

    yield example.main
    mp.undo()
    sys.modules.pop("train", None)


def _patched_functions():
    import deepspeed.comm
    import deepspeed.comm.comm
    import torch.distributed
    from deepspeed.runtime.dataloader import DeepSpeedDataLoader, RepeatingLoader
    from deepspeed.runtime.engine import DeepSpeedEngine
    from torch.distributed import distributed_c10d
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    names = ("__init__", "forward", "backward", "_backward_prologue", "_backward_epilogue", "step")
    functions = {f"DeepSpeedEngine.{name}": DeepSpeedEngine.__dict__[name] for name in names}
    for owner in (_BaseDataLoaderIter, DeepSpeedDataLoader, RepeatingLoader):
        functions[f"{owner.__name__}.__next__"] = owner.__dict__["__next__"]
    for module in (deepspeed.comm, deepspeed.comm.comm):
        for op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "barrier"):
            functions[f"{module.__name__}.{op}"] = getattr(module, op)
    for module in (torch.distributed, distributed_c10d):
        for op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "send"):
            functions[f"{module.__name__}.{op}"] = getattr(module, op)
    return functions


def _work_wait():
    from torch.distributed import distributed_c10d

    return distributed_c10d.Work.__dict__["wait"]


def test_instrument_traces_and_uninstrument_restores_everything(train):
    import deepspeed  # noqa: F401 - the classes must exist before we look at them
    import torch

    from opentelemetry_instrumentation_deepspeed.instrumentors import comm

    original, original_wait = _patched_functions(), _work_wait()
    late = types.ModuleType("late")  # a module imported while instrumented: uninstrument() cannot see its copy
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentors = (DeepSpeedInstrumentor(), DataLoaderInstrumentor(), CommInstrumentor())
    for instrumentor in instrumentors:
        instrumentor.instrument(tracer_provider=provider)
    instrumentors[0].instrument(tracer_provider=provider)  # a second call must not stack wrappers
    try:
        patched = _patched_functions()
        late.all_reduce = torch.distributed.all_reduce
        assert [name for name in original if patched[name] is original[name]] == []
        assert all(patched[name].__wrapped__ is original[name] for name in original)

        train(["--steps", "3", "--grad-accum", "2"])
        provider.force_flush()  # steps are emitted off the training thread, as a batch processor exports
        names = [span.name for span in exporter.get_finished_spans()]
        assert names.count("training.step") == 3
        assert names.count("training.global_step") == 3
        assert names.count("training.forward") == names.count("training.data.wait") == 6
        assert names.count("comm.all_reduce") >= 3, "ZeRO-1 on one rank still all-reduces each step"
        # Work.wait is wrapped at the first async collective, before its handle reaches the caller.
        assert _work_wait() is original_wait, "synchronous collectives only: their own waits run unwrapped"
        train(["--steps", "2", "--average-loss", "async"])
        assert _work_wait().__wrapped__ is original_wait
        # Its last step may still wait in the emitter for the schedstat read after it (up to about 0.7 s): out
        # now, so that what the exporter holds below is the uninstrumented run's alone.
        provider.force_flush()
    finally:
        for instrumentor in instrumentors:
            instrumentor.uninstrument()
        session.reset()

    assert _patched_functions() == original and _work_wait() is original_wait
    exporter.clear()
    train(["--steps", "2"])
    assert [(span.name, span.attributes.get("training.step")) for span in exporter.get_finished_spans()] == []
    sequences = comm.last_sequences()
    late.all_reduce(torch.ones(1))
    assert comm.last_sequences() == sequences, "the late copy passes the call on unobserved"


def test_with_no_sdk_every_wrapper_leaves_when_training_starts(train):
    import deepspeed  # noqa: F401 - the classes must exist before we look at them

    original = _patched_functions()
    instrumentors = (DeepSpeedInstrumentor(), DataLoaderInstrumentor(), CommInstrumentor())
    for instrumentor in instrumentors:
        instrumentor.instrument()
    try:
        assert [name for name in original if _patched_functions()[name] is original[name]] == []
        train(["--steps", "2"])
        assert session.silent, "no tracer or meter provider is set in this process"
        assert _patched_functions() == original, "nothing records: the steps run the original functions"
        assert not any(instrumentor.is_instrumented_by_opentelemetry for instrumentor in instrumentors)
    finally:
        for instrumentor in instrumentors:
            if instrumentor.is_instrumented_by_opentelemetry:
                instrumentor.uninstrument()
        session.reset()


_REINSTRUMENT = """
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry_instrumentation_deepspeed import CommInstrumentor
from opentelemetry_instrumentation_deepspeed.instrumentors import comm

instrumentor = CommInstrumentor()
instrumentor.instrument(tracer_provider=TracerProvider())
import torch
import torch.distributed as dist  # imported while instrumented, as under opentelemetry-instrument

instrumentor.uninstrument()
from torch.distributed import distributed_c10d
assert dist.all_reduce is distributed_c10d.all_reduce, "the copy made after the patch is restored too"
instrumentor.instrument(tracer_provider=TracerProvider())
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
dist.all_reduce(torch.ones(1))
dist.all_reduce(torch.ones(1))
print("sequences", comm.last_sequences())
dist.destroy_process_group()
"""


def test_instrumented_again_after_uninstrument_observes_collectives():
    """torch.distributed's ``from .distributed_c10d import *`` copies the replacements after the patch ran; a second
    instrument() must take those copies over, or every collective passes through the first, disabled one."""
    result = subprocess.run([sys.executable, "-c", _REINSTRUMENT % free_port()], check=False, capture_output=True,
                            text=True, timeout=120, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "sequences {'0': 1}" in result.stdout, result.stdout + result.stderr[-2000:]


_COMPILED_ENGINE = """
import os
import torch, deepspeed
from torch import nn

for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
    os.environ.setdefault(name, value)

model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1},
          "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}}
engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
compiled = torch.compile(engine, backend="eager")
for _ in range(4):
    loss = compiled(torch.randn(4, 16)).pow(2).mean()
    engine.backward(loss)
    engine.step()
"""


def test_a_torch_compiled_engine_warns_as_without_us_and_every_forward_is_seen(tmp_path):
    """torch.compile(engine) traced our wrapper: "Dynamo does not know how to trace the builtin `time.time_ns`" (and
    `_thread.get_ident`), and graph breaks there, besides DeepSpeed's own (its timers' `time.time`)."""
    script = tmp_path / "compiled_engine.py"
    script.write_text(_COMPILED_ENGINE)
    runs = {}
    for instrumented in (False, True):
        (tmp_path / str(instrumented)).mkdir()
        runs[instrumented] = launch(tmp_path / str(instrumented), "python", script=script, instrument=instrumented)
    for run in runs.values():
        run.check()

    def dynamo_warnings(run) -> list[str]:
        return sorted(line.split("UserWarning: ")[1][:80] for line in run.output.splitlines()
                      if "UserWarning: Dynamo" in line)

    assert dynamo_warnings(runs[True]) == dynamo_warnings(runs[False]), runs[True].output[-3000:]
    assert "time_ns" not in runs[True].output and "get_ident" not in runs[True].output
    names = [span.name for span in runs[True].spans]
    assert names.count("training.forward") == names.count("training.step") == 4


def test_an_evaluation_in_deepspeed_s_eval_mode_feeds_no_step(train):
    """DeepSpeed's engine.eval() sets the wrapped module's mode, not the engine's: its evaluation forward (a batch of
    4 samples under no_grad, after every 2nd step) read as a training pass without gradients, and its batch was
    counted in the next step's, every step after it one batch behind (a review: 704 tokens where 512 were)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentors = (DeepSpeedInstrumentor(), DataLoaderInstrumentor())
    for instrumentor in instrumentors:
        instrumentor.instrument(tracer_provider=provider)
    try:
        train(["--steps", "6", "--eval-every", "2", "--micro-batch-size", "8", "--seq-len", "16"])
        provider.force_flush()
    finally:
        for instrumentor in instrumentors:
            instrumentor.uninstrument()
        session.reset()
    spans = exporter.get_finished_spans()
    steps = sorted((span for span in spans if span.name == "training.step"), key=lambda span: span.start_time)
    assert [span.attributes.get("training.step.tokens") for span in steps] == [8 * 16] * 6
    forwards = [span.attributes.get("training.batch.samples") for span in spans if span.name == "training.forward"]
    assert forwards == [8] * 6, "the evaluation's forwards are no phases"
