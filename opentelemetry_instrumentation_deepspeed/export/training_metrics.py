"""Training metrics: step and phase durations (with exemplars), samples, tokens, skipped steps,
loss scale, gradient norm and MFU.

Durations are histograms recorded in the context of their span, so each bucket keeps the trace
of a step that fell in it. Totals and last values are kept here and observed at collection
time: an observable costs the training thread nothing. Nothing read here synchronizes a
device: a value that lives in a CUDA tensor is not reported.
"""

from __future__ import annotations

import math
import sys
import weakref

from opentelemetry.metrics import Observation

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.export import deferred_metrics
from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env
from opentelemetry_instrumentation_deepspeed.runtime.safety import Component, observing

# Seconds, from a millisecond step to a ten-minute one.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0,
                    120.0, 300.0, 600.0)

# Dense peak FLOP/s of one device for bf16/fp16 matmuls, by a substring of the NVML/torch name.
_PEAK_FLOPS = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L40S", 362e12), ("A10G", 125e12),
               ("V100", 125e12), ("B200", 2250e12))


def _host_number(value) -> float | None:
    """A float from ``value`` if reading it cannot synchronize a device, else None."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    device = getattr(value, "device", None)
    if device is not None and getattr(device, "type", "cuda") == "cpu" and value.numel() == 1:
        return float(value.item())
    return None


def peak_flops() -> float | None:
    configured = env.peak_flops()
    if configured:
        return configured
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((flops for key, flops in _PEAK_FLOPS if key in name), None)


def count_parameters(module) -> int:
    # ZeRO-3 partitions parameters: ds_numel is the full size.
    return sum(getattr(p, "ds_numel", None) or p.numel() for p in module.parameters())


def batch_shape(args, kwargs) -> tuple[int | None, int | None]:
    """(samples, tokens) of a forward's batch, from its token ids if it has any.

    Token ids: the ``input_ids`` keyword, an ``input_ids`` entry of a dict argument, or else the
    first positional tensor of an integer dtype. Tokens are its element count, padding included
    (counting a mask would need the device); samples its first dimension.
    """
    ids = kwargs.get("input_ids")
    if ids is None and args:
        first = args[0]
        ids = first.get("input_ids") if isinstance(first, dict) else first
    shape = getattr(ids, "shape", None)
    if not shape or not hasattr(ids, "is_floating_point"):  # a torch tensor, not an array or a list
        return None, None
    dtype = ids.dtype
    is_integer = _INTEGER_DTYPES.get(dtype)
    if is_integer is None:
        is_integer = _INTEGER_DTYPES[dtype] = not dtype.is_floating_point and not dtype.is_complex
    return int(shape[0]), (math.prod(shape) if is_integer else None)


_INTEGER_DTYPES: dict = {}  # torch dtype -> whether it holds integers: two tensor calls fewer per forward


class TrainingMetrics:
    def __init__(self, meter, flops_per_token: float | None, engine=None):
        self._flops_per_token = flops_per_token
        self._peak = peak_flops()
        # Loss scale and gradient norm are read from the engine at collection, not at every step.
        self._engine = weakref.ref(engine) if engine is not None else lambda: None
        self.samples = 0
        self.tokens = 0
        self.skipped = 0
        self.loss_scale: float | None = None
        self.grad_norm: float | None = None
        self.mfu: float | None = None
        self._step = meter.create_histogram(
            semconv.METRIC_STEP_DURATION, unit="s", description="Duration of an optimizer step on this rank",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        self._phase = meter.create_histogram(
            semconv.METRIC_PHASE_DURATION, unit="s",
            description="Duration of a phase of a step (data wait, forward, backward, optimizer step)",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        self._phase_attributes = {name: {semconv.TRAINING_PHASE: name} for name in semconv.PHASES}
        self._deferred = deferred_metrics.for_meter(meter)
        self._observers = Component("training metrics")
        meter.create_observable_counter(semconv.METRIC_SAMPLES, [self._total("samples")], unit="{sample}",
                                        description="Samples this rank trained on")
        meter.create_observable_counter(semconv.METRIC_TOKENS, [self._total("tokens")], unit="{token}",
                                        description="Tokens this rank trained on (token ids, padding included)")
        meter.create_observable_counter(semconv.METRIC_SKIPPED_STEPS, [self._total("skipped")], unit="{step}",
                                        description="Optimizer steps skipped (fp16 overflow)")
        meter.create_observable_gauge(semconv.METRIC_LOSS_SCALE, [self._from_engine("loss_scale", _loss_scale)],
                                      unit="1", description="Dynamic loss scale after the last step (fp16)")
        meter.create_observable_gauge(semconv.METRIC_GRAD_NORM, [self._from_engine("grad_norm", _grad_norm)],
                                      unit="1",
                                      description="Global gradient norm of the last step, where known without a sync")
        meter.create_observable_gauge(semconv.METRIC_MFU, [self._last("mfu")], unit="1",
                                      description="Model FLOPs utilization of the last step")

    def _total(self, name):
        def observe(_options):
            return [Observation(getattr(self, name))]

        return observing(self._observers, observe)

    def _last(self, name):
        def observe(_options):
            value = getattr(self, name)
            return [] if value is None else [Observation(value)]

        return observing(self._observers, observe)

    def _from_engine(self, name, read):
        """The engine's last value, read at collection; the one read before, once the engine is gone."""

        def observe(_options):
            engine = self._engine()
            if engine is not None:
                setattr(self, name, read(engine))
            value = getattr(self, name)
            return [] if value is None else [Observation(value)]

        return observing(self._observers, observe)

    def phases(self, durations) -> None:
        """(phase, seconds, span, end) each: the span its exemplar points to, and when it ended."""
        self._deferred.record_each(self._phase, durations, self._phase_attributes)

    def step(self, seconds: float, span, tokens: int, skipped: bool) -> None:
        self._deferred.record(self._step, seconds, None, span)
        self.skipped += skipped
        if self._flops_per_token and self._peak and tokens:
            self.mfu = tokens * self._flops_per_token / (seconds * self._peak)


def _loss_scale(engine) -> float | None:
    return _host_number(engine._get_optimizer_loss_scale()) if engine.fp16_enabled() else None


def _grad_norm(engine) -> float | None:
    return _host_number(engine.get_global_grad_norm())


def flops_per_token(module) -> float:
    """Configured, else the usual estimate for training a dense transformer: 6 x parameters."""
    return env.flops_per_token() or 6.0 * count_parameters(module)

