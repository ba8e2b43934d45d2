"""OpenTelemetry instrumentation for DeepSpeed training.

Run a training script under ``opentelemetry-instrument`` and every rank traces every
optimizer step; see README.md and docs/telemetry.md. Programmatic use::

    from opentelemetry_instrumentation_deepspeed import (
        CommInstrumentor, DataLoaderInstrumentor, DeepSpeedInstrumentor, GpuMetricsInstrumentor)

    DeepSpeedInstrumentor().instrument(tracer_provider=provider)
    DataLoaderInstrumentor().instrument()
    CommInstrumentor().instrument(tracer_provider=provider, meter_provider=meter_provider)
    GpuMetricsInstrumentor().instrument(meter_provider=meter_provider)
    TorchTrainingInstrumentor().instrument()  # plain PyTorch loops: DDP, FSDP2, trace_training()

Importing this package imports neither torch nor DeepSpeed: classes are patched when
their modules are imported.
"""

from opentelemetry_instrumentation_deepspeed.instrumentors.comm import CommInstrumentor
from opentelemetry_instrumentation_deepspeed.instrumentors.dataloader import DataLoaderInstrumentor
from opentelemetry_instrumentation_deepspeed.instrumentors.engine import DeepSpeedInstrumentor
from opentelemetry_instrumentation_deepspeed.instrumentors.gpu_metrics import GpuMetricsInstrumentor
from opentelemetry_instrumentation_deepspeed.instrumentors.torch_loop import TorchTrainingInstrumentor, trace_training
from opentelemetry_instrumentation_deepspeed.version import __version__

__all__ = ["CommInstrumentor", "DataLoaderInstrumentor", "DeepSpeedInstrumentor", "GpuMetricsInstrumentor",
           "TorchTrainingInstrumentor", "__version__", "trace_training"]
