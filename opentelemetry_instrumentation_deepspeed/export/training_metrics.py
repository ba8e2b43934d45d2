"""Training metrics: step and phase durations (with exemplars), samples, tokens, skipped steps,
loss scale, loss and gradient norm (and the anomalies the numerics watch finds in them), GPU memory
from the caching allocator, and MFU.

Everything here runs on the emitter's thread, from closed step records: durations are histograms
recorded in the context of their span, so each bucket keeps the trace of a step that fell in it;
totals and last values are kept here and observed at collection. Nothing read here synchronizes
a device: loss and gradient norm come from the records (copied off the device asynchronously),
the loss scale is reported only where it is a host value.
"""

from __future__ import annotations

import math
import sys
import weakref

from opentelemetry.metrics import Observation

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.diagnose.model import UNSCALED, NumericsWatch
from opentelemetry_instrumentation_deepspeed.export.histograms import TimedHistogram
from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env
from opentelemetry_instrumentation_deepspeed.runtime.safety import Component, observing

# Seconds, from a millisecond step to a ten-minute one.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0,
                    120.0, 300.0, 600.0)
# Tokens, for padded sequence lengths: powers of two from 16 to 128k.
SEQUENCE_LENGTH_BUCKETS = tuple(float(2**power) for power in range(4, 18))

# Dense peak FLOP/s of one device for bf16 matmuls (V100: fp16), by the first substring of the torch device name
# that matches: the PCIe and NVL parts before the SXM ones of their names.
_PEAK_FLOPS = (("H200 NVL", 835e12), ("H200", 989e12), ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12),
               ("A100", 312e12), ("L40S", 362e12), ("A10G", 125e12), ("V100", 125e12), ("B200", 2250e12))


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


class TrainingMetrics:
    def __init__(self, meter, flops_per_token: float | None, engine=None):
        self._flops_per_token = flops_per_token
        self._parameters_later = None  # a function that counts the model's parameters, read at the first step's end
        self._peak = peak_flops()
        # Loss scale and gradient norm are read from the engine at collection, not at every step.
        self._engine = weakref.ref(engine) if engine is not None else lambda: None
        self.samples = 0
        self.tokens = 0
        self.real_tokens = 0
        self.skipped = 0
        self.loss_scale: float | None = None
        self.loss: float | None = None
        self.grad_norm: float | None = None
        self.precision = precision(engine)
        self.numerics = NumericsWatch(scaled=self.precision not in UNSCALED)
        self.anomalies = dict.fromkeys(semconv.NUMERICS_KINDS, 0)
        self.memory = None  # the allocator's last reading (recording.allocator.Memory), on CUDA
        self.memory_peaks: dict[str, int] = {}  # each phase's peak in the last step that ran it
        self.mfu: float | None = None
        self._step = TimedHistogram(meter.create_histogram(
            semconv.METRIC_STEP_DURATION, unit="s", description="Duration of an optimizer step on this rank",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS))
        self._phase = TimedHistogram(meter.create_histogram(
            semconv.METRIC_PHASE_DURATION, unit="s",
            description="Duration of a phase of a step (data wait, forward, backward, optimizer step)",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS))
        self._sequence_length = TimedHistogram(meter.create_histogram(
            semconv.METRIC_BATCH_SEQUENCE_LENGTH, unit="{token}",
            description="Padded sequence length of each micro-batch, as it left the DataLoader",
            explicit_bucket_boundaries_advisory=SEQUENCE_LENGTH_BUCKETS))
        self._phase_attributes = {name: {semconv.TRAINING_PHASE: name} for name in semconv.PHASES}
        self._observers = Component("training metrics")
        meter.create_observable_counter(semconv.METRIC_SAMPLES, [self._total("samples")], unit="{sample}",
                                        description="Samples this rank trained on")
        meter.create_observable_counter(semconv.METRIC_TOKENS, [self._total("tokens")], unit="{token}",
                                        description="Tokens this rank trained on (token ids, padding included)")
        meter.create_observable_counter(semconv.METRIC_BATCH_TOKENS, [self._total("real_tokens")], unit="{token}",
                                        description="Real (non-padding) tokens of the micro-batches this rank took "
                                                    "from its DataLoader, where countable on the host")
        meter.create_observable_counter(semconv.METRIC_SKIPPED_STEPS, [self._total("skipped")], unit="{step}",
                                        description="Optimizer steps skipped (fp16 overflow, inf or NaN gradients)")
        meter.create_observable_gauge(semconv.METRIC_LOSS_SCALE, [self._from_engine("loss_scale", _loss_scale)],
                                      unit="1", description="Dynamic loss scale after the last step (fp16)")
        meter.create_observable_gauge(semconv.METRIC_GRAD_NORM, [self._last("grad_norm")], unit="1",
                                      description="Global gradient norm of the last step")
        meter.create_observable_gauge(semconv.METRIC_LOSS, [self._last("loss")], unit="1",
                                      description="Loss of the last step (mean over its micro-batches)")
        anomalies = observing(self._observers, self._anomalies)
        meter.create_observable_counter(semconv.METRIC_NUMERICS_ANOMALIES, [anomalies],
                                        unit="{step}", description="Steps whose loss or gradient norm was non-finite "
                                        "or spiked, and runs of skipped steps, by training.numerics.kind")
        self._memory_instruments(meter)
        meter.create_observable_gauge(semconv.METRIC_MFU, [self._last("mfu")], unit="1",
                                      description="Model FLOPs utilization of the last step")

    def _memory_instruments(self, meter) -> None:
        def reading(read):
            def observe(_options):
                memory = self.memory
                return [] if memory is None else [Observation(read(memory))]

            return observing(self._observers, observe)

        meter.create_observable_gauge(semconv.METRIC_MEMORY_ALLOCATED, [reading(lambda m: m.allocated)], unit="By",
                                      description="GPU memory allocated to tensors (PyTorch's caching allocator), "
                                                  "at the end of the last phase")
        meter.create_observable_gauge(semconv.METRIC_MEMORY_RESERVED, [reading(lambda m: m.reserved)], unit="By",
                                      description="GPU memory the caching allocator holds, at the end of the last "
                                                  "phase")
        meter.create_observable_gauge(semconv.METRIC_MEMORY_FRAGMENTATION, [reading(lambda m: m.fragmentation)],
                                      unit="By", description="Reserved minus allocated GPU memory: cached blocks")
        meter.create_observable_counter(semconv.METRIC_MEMORY_ALLOC_RETRIES, [reading(lambda m: m.retries)],
                                        unit="{retry}", description="cudaMalloc retries after the allocator freed "
                                        "its cache (what DeepSpeed calls allocator cache flushes)")
        meter.create_observable_counter(semconv.METRIC_MEMORY_OOMS, [reading(lambda m: m.ooms)], unit="{error}",
                                        description="Out-of-memory errors the caching allocator raised")

        def peaks(_options):
            return [Observation(value, self._phase_attributes[phase]) for phase, value in self.memory_peaks.items()]

        meter.create_observable_gauge(semconv.METRIC_MEMORY_PEAK, [observing(self._observers, peaks)], unit="By",
                                      description="Peak GPU memory allocated during each phase of the last step")

    def _anomalies(self, _options):
        return [Observation(count, {semconv.TRAINING_NUMERICS_KIND: kind}) for kind, count in self.anomalies.items()]

    def model(self, loss: float | None, grad_norm: float | None, skipped: bool) -> list[str]:
        """A closed step's loss and gradient norm: the last values, and the kinds of anomaly they show."""
        if loss is not None:
            self.loss = loss
        if grad_norm is not None:
            self.grad_norm = grad_norm
        kinds = [kind for kind, _detail in self.numerics.step(loss, grad_norm, skipped)]
        for kind in kinds:
            self.anomalies[kind] += 1
        return kinds

    def memory_read(self, memory, phase: str | None = None) -> None:
        """A phase's reading: the last figures, and (``phase``) that phase's peak."""
        self.memory = memory
        if phase is not None:
            self.memory_peaks[phase] = memory.peak

    def _total(self, name):
        def observe(_options):
            return [Observation(getattr(self, name))]

        return observing(self._observers, observe)

    def _last(self, name):
        def observe(_options):
            value = getattr(self, name)
            # A NaN or infinite loss is no point: the SDK drops it with a warning at every collection (the span keeps
            # it; training.numerics.anomalies counts it).
            return [] if value is None or not math.isfinite(value) else [Observation(value)]

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

    def phase(self, phase: str, start: int, end: int, span_context) -> None:
        """A phase (or data wait) that ended at ``end``; ``span_context``: its span, for the exemplar."""
        self._phase.record((end - start) / 1e9, end, span_context, self._phase_attributes[phase])

    def batches(self, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens

    def inputs(self, batches: list, taken: int, span_context) -> None:
        """The step's counted micro-batches: (samples, padded length, real tokens or None) each."""
        for _samples, length, tokens in batches:
            self._sequence_length.record(length, taken, span_context)
            if tokens is not None:
                self.real_tokens += tokens

    def count_parameters_later(self, count) -> None:
        """The FLOPs estimate from ``count()`` at the first step's end, not from the model now (FSDP's units: built
        one by one, a shard each on a rank once built)."""
        self._parameters_later = count

    def step(self, start: int, end: int, span_context, tokens: int, skipped: bool) -> None:
        """A step that closed normally (a failed one counts its phases and batches, not itself)."""
        seconds = (end - start) / 1e9
        self._step.record(seconds, end, span_context)
        self.skipped += skipped
        if self._parameters_later is not None:
            self._flops_per_token, self._parameters_later = flops_per_parameters(self._parameters_later()), None
        if self._flops_per_token and self._peak and tokens:
            self.mfu = tokens * self._flops_per_token / (seconds * self._peak)


def precision(engine) -> str | None:
    """``fp16``, ``bf16`` or ``fp32``, as DeepSpeed's configuration says (fp16: a loss scaler that skips a step on
    overflow); None where nothing says (a plain loop's, whose scaler, if any, is the program's)."""
    try:
        if engine.fp16_enabled():
            return "fp16"
        if engine.bfloat16_enabled():
            return "bf16"
        if engine.torch_autocast_enabled():
            return {"torch.float16": "fp16", "torch.bfloat16": "bf16"}.get(str(engine.torch_autocast_dtype()), "fp32")
    except AttributeError:  # not DeepSpeed's engine, or a version without one of these
        return None
    return "fp32"


def _loss_scale(engine) -> float | None:
    return _host_number(engine._get_optimizer_loss_scale()) if engine.fp16_enabled() else None


def flops_per_token(module) -> float:
    """Configured, else the usual estimate for training a dense transformer: 6 x parameters."""
    return flops_per_parameters(count_parameters(module))


def flops_per_parameters(parameters: int) -> float:
    return env.flops_per_token() or 6.0 * parameters

