"""NVML GPU metrics of the GPU this rank trains on, as OpenTelemetry ``hw.*`` observable instruments.

Names follow the OpenTelemetry hardware semantic conventions where they define one
(``hw.gpu.utilization``, ``hw.gpu.memory.utilization``, ``hw.gpu.memory.usage``,
``hw.gpu.memory.limit``, ``hw.gpu.io``, ``hw.power``, ``hw.energy``, ``hw.temperature``,
``hw.errors``) and extend them in the same style (``hw.gpu.clock.*``, ``hw.gpu.nvlink.io``,
``hw.gpu.throttle``, ``hw.gpu.process.memory.usage``). Every point carries ``hw.id`` (the GPU's
UUID), ``hw.name``, ``hw.vendor`` and ``hw.type``; a MIG instance also ``hw.parent`` (its GPU's UUID).

NVML is only called from the metric reader's thread, at collection. Handles are looked up once.
A field the device does not support, or that starts failing, reports nothing from then on
(never a made-up 0), with one warning per field.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Collection

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.metrics import Observation, get_meter

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.package import _instruments_torch
from opentelemetry_instrumentation_deepspeed.runtime import session
from opentelemetry_instrumentation_deepspeed.version import __version__

_logger = logging.getLogger(__name__)

# Bits of nvmlDeviceGetCurrentClocksEventReasons (formerly ...ThrottleReasons).
THROTTLE_REASONS = (
    (0x1, semconv.THROTTLE_GPU_IDLE), (0x2, semconv.THROTTLE_APPLICATIONS_CLOCKS_SETTING),
    (0x4, semconv.THROTTLE_SW_POWER_CAP), (0x8, semconv.THROTTLE_HW_SLOWDOWN), (0x10, semconv.THROTTLE_SYNC_BOOST),
    (0x20, semconv.THROTTLE_SW_THERMAL_SLOWDOWN), (0x40, semconv.THROTTLE_HW_THERMAL_SLOWDOWN),
    (0x80, semconv.THROTTLE_HW_POWER_BRAKE_SLOWDOWN), (0x100, semconv.THROTTLE_DISPLAY_CLOCK_SETTING),
)
_CACHE_SECONDS = 0.5  # one NVML read serves every instrument of one collection


class _Device:
    def __init__(self, nvml, handle):
        self.handle = handle
        uuid = nvml.nvmlDeviceGetUUID(handle)
        self.attributes = {semconv.HW_ID: _text(uuid), semconv.HW_NAME: _text(nvml.nvmlDeviceGetName(handle)),
                           semconv.HW_VENDOR: semconv.HW_VENDOR_NVIDIA, semconv.HW_TYPE: semconv.HW_TYPE_GPU}
        try:
            if nvml.nvmlDeviceIsMigDeviceHandle(handle):
                parent = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
                self.attributes[semconv.HW_PARENT] = _text(nvml.nvmlDeviceGetUUID(parent))
        except nvml.NVMLError:
            pass
        self.with_direction = {
            direction: {**self.attributes, semconv.NETWORK_IO_DIRECTION: direction}
            for direction in (semconv.DIRECTION_TRANSMIT, semconv.DIRECTION_RECEIVE)
        }
        self.pcie_bytes = {semconv.DIRECTION_TRANSMIT: 0.0, semconv.DIRECTION_RECEIVE: 0.0}
        self.pcie_read_at: float | None = None
        self.gpm_samples: list | None = None  # [previous, current] GPM samples, once known supported


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlReader:
    """Observable ``hw.*`` instruments over the given NVML devices."""

    def __init__(self, nvml, handles: list):
        self._nvml = nvml
        self._devices = [_Device(nvml, handle) for handle in handles]
        self._failed: set[str] = set()
        self._stopped = False
        self._cache: dict[tuple[int, str], tuple[float, object]] = {}
        self._lock = threading.Lock()

    def register(self, meter) -> None:
        nvml = self._nvml
        gauge, updown, counter = (meter.create_observable_gauge, meter.create_observable_up_down_counter,
                                  meter.create_observable_counter)
        gauge(semconv.METRIC_HW_GPU_UTILIZATION,
              [self._each("utilization", nvml.nvmlDeviceGetUtilizationRates, lambda u: u.gpu / 100)], unit="1",
              description="Fraction of time the GPU ran kernels")
        gauge(semconv.METRIC_HW_GPU_MEMORY_UTILIZATION,
              [self._each("utilization", nvml.nvmlDeviceGetUtilizationRates, lambda u: u.memory / 100)], unit="1",
              description="Fraction of time the GPU memory was read or written")
        updown(semconv.METRIC_HW_GPU_MEMORY_USAGE,
               [self._each("memory", nvml.nvmlDeviceGetMemoryInfo, lambda m: m.used)],
               unit="By", description="GPU memory in use")
        updown(semconv.METRIC_HW_GPU_MEMORY_LIMIT,
               [self._each("memory", nvml.nvmlDeviceGetMemoryInfo, lambda m: m.total)],
               unit="By", description="GPU memory size")
        gauge(semconv.METRIC_HW_POWER, [self._each("power", nvml.nvmlDeviceGetPowerUsage, lambda mw: mw / 1000)],
              unit="W", description="GPU power draw")
        counter(semconv.METRIC_HW_ENERGY,
                [self._each("energy", nvml.nvmlDeviceGetTotalEnergyConsumption, lambda mj: mj / 1000)],
                unit="J", description="GPU energy consumed since the driver loaded")
        gauge(semconv.METRIC_HW_TEMPERATURE,
              [self._each("temperature", lambda h: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU),
                          float)], unit="Cel", description="GPU temperature")
        gauge(semconv.METRIC_HW_GPU_CLOCK_SM,
              [self._each("clock.sm", lambda h: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM),
                          lambda mhz: mhz * 1e6)], unit="Hz", description="SM clock")
        gauge(semconv.METRIC_HW_GPU_CLOCK_MEMORY,
              [self._each("clock.memory", lambda h: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM),
                          lambda mhz: mhz * 1e6)], unit="Hz", description="Memory clock")
        counter(semconv.METRIC_HW_ERRORS, [self._ecc], unit="{error}",
                description="GPU memory ECC errors over the GPU's lifetime")
        counter(semconv.METRIC_HW_GPU_IO, [self._pcie], unit="By",
                description="PCIe bytes, integrated from NVML's throughput samples between collections")
        counter(semconv.METRIC_HW_GPU_NVLINK_IO, [self._nvlink], unit="By", description="NVLink data bytes")
        gauge(semconv.METRIC_HW_GPU_THROTTLE, [self._throttle], unit="1",
              description="1 while a clock-throttle reason is active, else 0, per reason")
        updown(semconv.METRIC_HW_GPU_PROCESS_MEMORY_USAGE, [self._process_memory], unit="By",
               description="GPU memory used by this rank's process")
        gauge(semconv.METRIC_HW_GPU_SM_ACTIVITY, [self._sm_activity], unit="1",
              description="Fraction of SMs busy between two collections (NVML GPM, Hopper and newer)")

    # -- reading --------------------------------------------------------------------------------

    def stop(self) -> None:
        self._stopped = True

    def _read(self, device: _Device, field: str, read):
        """NVML's value of ``field``, or None once that field failed (said once)."""
        if self._stopped or field in self._failed:
            return None
        key = (id(device), field)
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and now - cached[0] < _CACHE_SECONDS:
                return cached[1]
            try:
                value = read(device.handle)
            except self._nvml.NVMLError as error:
                self._fail(field, device, error)
                return None
            self._cache[key] = (now, value)
            return value

    def _fail(self, field: str, device: _Device, error) -> None:
        self._failed.add(field)
        _logger.warning("NVML %s of GPU %s: %s; it is not reported from now on.", field,
                        device.attributes[semconv.HW_ID], error)

    def _each(self, field: str, read, convert):
        def observe(_options):
            observations = []
            for device in self._devices:
                value = self._read(device, field, read)
                if value is not None:
                    observations.append(Observation(convert(value), device.attributes))
            return observations

        return observe

    def _ecc(self, _options):
        nvml, observations = self._nvml, []
        for device in self._devices:
            for error_type, kind in ((semconv.ECC_CORRECTED, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                                     (semconv.ECC_UNCORRECTED, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)):
                count = self._read(device, f"ecc.{error_type}", lambda h, kind=kind: nvml.nvmlDeviceGetTotalEccErrors(
                    h, kind, nvml.NVML_AGGREGATE_ECC))
                if count is not None:
                    observations.append(Observation(count, {**device.attributes, semconv.ERROR_TYPE: error_type}))
        return observations

    def _pcie(self, _options):
        nvml, observations, now = self._nvml, [], time.monotonic()
        for device in self._devices:
            rates = {direction: self._read(device, f"pcie.{direction}",
                                           lambda h, c=counter: nvml.nvmlDeviceGetPcieThroughput(h, c))
                     for direction, counter in ((semconv.DIRECTION_TRANSMIT, nvml.NVML_PCIE_UTIL_TX_BYTES),
                                                (semconv.DIRECTION_RECEIVE, nvml.NVML_PCIE_UTIL_RX_BYTES))}
            elapsed = 0.0 if device.pcie_read_at is None else now - device.pcie_read_at
            device.pcie_read_at = now
            for direction, kilobytes_per_second in rates.items():
                if kilobytes_per_second is not None:
                    device.pcie_bytes[direction] += kilobytes_per_second * 1024 * elapsed
                    observations.append(Observation(int(device.pcie_bytes[direction]),
                                                    device.with_direction[direction]))
        return observations

    def _nvlink(self, _options):
        nvml, observations = self._nvml, []
        fields = ((semconv.DIRECTION_TRANSMIT, getattr(nvml, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", None)),
                  (semconv.DIRECTION_RECEIVE, getattr(nvml, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", None)))
        for device in self._devices:
            for direction, field_id in fields:
                if field_id is None:
                    continue
                value = self._read(device, f"nvlink.{direction}",
                                   lambda h, f=field_id: _field_value(nvml, h, f))
                if value is not None:
                    observations.append(Observation(value * 1024, device.with_direction[direction]))
        return observations

    def _throttle(self, _options):
        nvml, observations = self._nvml, []
        read = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        for device in self._devices:
            mask = self._read(device, "throttle", read)
            if mask is not None:
                observations += [
                    Observation(1 if mask & bit else 0, {**device.attributes, semconv.HW_GPU_THROTTLE_REASON: name})
                    for bit, name in THROTTLE_REASONS]
        return observations

    def _process_memory(self, _options):
        nvml, observations, pid = self._nvml, [], os.getpid()
        for device in self._devices:
            processes = self._read(device, "process.memory", nvml.nvmlDeviceGetComputeRunningProcesses)
            if processes is None:
                continue
            mine = [p.usedGpuMemory or 0 for p in processes if p.pid == pid]
            if mine:  # in a container NVML may list host pids: then nothing, not a made-up 0
                observations.append(Observation(sum(mine), device.attributes))
        return observations


    def _sm_activity(self, _options):
        """SM utilization between this collection's GPM sample and the previous one."""
        nvml, observations = self._nvml, []
        for device in self._devices:
            if self._stopped or "gpm" in self._failed:
                continue
            try:
                if device.gpm_samples is None:
                    if not nvml.nvmlGpmQueryDeviceSupport(device.handle).isSupportedDevice:
                        raise nvml.NVMLError("GPM not supported by this GPU")
                    device.gpm_samples = [None, nvml.nvmlGpmSampleAlloc()]
                previous, current = device.gpm_samples
                nvml.nvmlGpmSampleGet(device.handle, current)
                if previous is not None:
                    query = nvml.c_nvmlGpmMetricsGet_t()
                    query.version, query.numMetrics = nvml.NVML_GPM_METRICS_GET_VERSION, 1
                    query.sample1, query.sample2 = previous, current
                    query.metrics[0].metricId = nvml.NVML_GPM_METRIC_SM_UTIL
                    metric = nvml.nvmlGpmMetricsGet(query).metrics[0]
                    if metric.nvmlReturn != nvml.NVML_SUCCESS:
                        raise nvml.NVMLError(metric.nvmlReturn)
                    observations.append(Observation(metric.value / 100, device.attributes))
                device.gpm_samples = [current, previous or nvml.nvmlGpmSampleAlloc()]
            except nvml.NVMLError as error:
                self._fail("gpm", device, error)
        return observations


_ALL_LINKS = 0xFFFFFFFF  # NVML's scope for "summed over every NVLink link"


def _field_value(nvml, handle, field_id):
    (value,) = nvml.nvmlDeviceGetFieldValues(handle, [(field_id, _ALL_LINKS)])
    if value.nvmlReturn != nvml.NVML_SUCCESS:
        raise nvml.NVMLError(value.nvmlReturn)
    return value.value.ullVal


def rank_device_uuids() -> list[str]:
    """UUIDs of the CUDA device this process trains on, as torch names it (honours CUDA_VISIBLE_DEVICES)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    index = torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    return [uuid] if uuid.startswith(("GPU-", "MIG-")) else [f"GPU-{uuid}", f"MIG-{uuid}"]


def start(meter, nvml=None, uuids: list[str] | None = None) -> NvmlReader | None:
    """Register the rank's GPU metrics; None (and one warning) when NVML cannot serve them."""
    uuids = rank_device_uuids() if uuids is None else uuids
    if not uuids:
        return None  # this rank trains on no CUDA device: nothing to report, nothing to say
    try:
        if nvml is None:
            import pynvml as nvml
        nvml.nvmlInit()
    except Exception as error:  # noqa: BLE001 - NVML missing or broken: GPU metrics off, training on
        _logger.warning("NVML is not available (%s); GPU metrics are not reported.", error)
        return None
    for uuid in uuids:
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
        except nvml.NVMLError:
            continue
        reader = NvmlReader(nvml, [handle])
        reader.register(meter)
        return reader
    _logger.warning("NVML does not know this rank's GPU %s; GPU metrics are not reported.", uuids[0])
    return None


class GpuMetricsInstrumentor(BaseInstrumentor):
    """NVML metrics of each rank's own GPU, from the moment its DeepSpeed engine is built."""

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments_torch

    def _instrument(self, **kwargs):
        self._active = True
        meter_provider = kwargs.get("meter_provider")

        def started(_identity):
            if self._active:
                self.reader = start(get_meter(semconv.SCOPE_NAME, __version__, meter_provider))

        session.on_start(started)

    def _uninstrument(self, **kwargs):
        # Observable instruments cannot be removed from a meter; the reader stops reading instead.
        self._active = False
        reader = getattr(self, "reader", None)
        if reader is not None:
            reader.stop()
