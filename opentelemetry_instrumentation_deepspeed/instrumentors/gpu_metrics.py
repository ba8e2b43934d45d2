"""NVML GPU metrics of the GPU this rank trains on, as OpenTelemetry ``hw.*`` observable instruments.

Names follow the OpenTelemetry hardware semantic conventions where they define one
(``hw.gpu.utilization``, ``hw.gpu.memory.utilization`` (the fraction of memory used),
``hw.gpu.memory.usage``, ``hw.gpu.memory.limit``, ``hw.gpu.io``, ``hw.power``, ``hw.energy``,
``hw.temperature``, ``hw.errors``, ``hw.status``); NVML's other readings are ours, named under
``nvidia.gpu.*`` (memory-controller busy time, clocks, NVLink, throttle reasons, the process's
memory, SM activity, the last XID, remapped rows, retired pages), outside the namespace the
conventions own. Their earlier ``hw.gpu.*`` names are still emitted for one release
(``semconv.ALIASES``). Every point carries ``hw.id`` (the GPU's UUID), ``hw.name``, ``hw.vendor``
and ``hw.type``; a MIG instance also ``hw.parent`` (its GPU's UUID).

XID errors arrive as NVML events: an event set is registered once, and each collection takes what
it holds without waiting (timeout 0).

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
_HARDWARE_THROTTLE = 0x8 | 0x40 | 0x80  # hw_slowdown, hw_thermal_slowdown, hw_power_brake_slowdown
# XIDs after which NVIDIA's guidance is to reset the GPU or drain the node: 48 double-bit ECC, 63/64
# row-remapping events that failed, 74 NVLink error, 79 fallen off the bus, 94/95 contained and
# uncontained ECC errors, 119/120 GSP errors.
_FATAL_XIDS = frozenset({48, 64, 74, 79, 95, 119, 120})
_EVENTS_PER_COLLECTION = 64  # XID events taken per collection at most
# Fields newer or older GPUs lack by design (retired pages before Ampere, remapped rows since, GPM before Hopper,
# NVLink on PCIe cards): their absence is said at debug level, not as a warning.
_GENERATIONAL = frozenset({"retired_pages.corrected", "retired_pages.uncorrected", "remapped_rows", "xid",
                           "pcie_replay", "gpm", "nvlink.transmit", "nvlink.receive"})
# NVML's return codes of a GPU that can no longer be read (fallen off the bus, or waiting for a reset).
_LOST = frozenset({15, 16})  # NVML_ERROR_GPU_IS_LOST, NVML_ERROR_RESET_REQUIRED


class _Unavailable(Exception):
    """A reading this GPU or this nvidia-ml-py cannot give. Not pynvml's NVMLError, which takes NVML's return code
    (an int) and names it with nvmlErrorString: made from a message, its str() fails."""


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
        except Exception:  # noqa: BLE001 - an older nvidia-ml-py, a driver without MIG: a whole GPU
            pass
        self.with_direction = {
            direction: {**self.attributes, semconv.NETWORK_IO_DIRECTION: direction}
            for direction in (semconv.DIRECTION_TRANSMIT, semconv.DIRECTION_RECEIVE)
        }
        self.pcie_bytes = {semconv.DIRECTION_TRANSMIT: 0.0, semconv.DIRECTION_RECEIVE: 0.0}
        self.pcie_read_at: float | None = None
        self.gpm_samples: list | None = None  # [previous, current] GPM samples, once known supported
        self.xids = 0  # XID events seen since the reader started
        self.last_xid: int | None = None
        self.fatal_xid = False
        self.uncorrected_at_start: int | None = None
        self.lost = False  # NVML said the GPU is lost or needs a reset: hw.status failed, nothing else read
        self.mig = semconv.HW_PARENT in self.attributes  # a MIG instance answers few device-wide queries


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
        self._events = self._xid_events()

    def register(self, meter) -> None:
        nvml = self._nvml
        gauge, updown, counter = (meter.create_observable_gauge, meter.create_observable_up_down_counter,
                                  meter.create_observable_counter)
        gauge(semconv.METRIC_HW_GPU_UTILIZATION,
              [self._each("utilization", nvml.nvmlDeviceGetUtilizationRates, lambda u: u.gpu / 100)], unit="1",
              description="Fraction of time the GPU ran kernels")
        gauge(semconv.METRIC_HW_GPU_MEMORY_UTILIZATION,
              [self._each("memory", nvml.nvmlDeviceGetMemoryInfo, lambda m: m.used / m.total if m.total else None)],
              unit="1", description="Fraction of GPU memory used")
        gauge(semconv.METRIC_NVIDIA_GPU_MEMORY_CONTROLLER_UTILIZATION,
              [self._each("utilization", nvml.nvmlDeviceGetUtilizationRates, lambda u: u.memory / 100)], unit="1",
              description="Fraction of time the GPU memory was read or written (NVML's memory utilization)")
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
        counter(semconv.METRIC_HW_ERRORS, [self._errors], unit="{error}",
                description="GPU errors: memory ECC errors over the GPU's lifetime, PCIe replays, XID errors "
                            "since the rank started")
        updown(semconv.METRIC_HW_STATUS, [self._status], unit="1",
               description="1 for the GPU's current state (ok, degraded, failed), 0 for the others")
        counter(semconv.METRIC_HW_GPU_IO, [self._pcie], unit="By",
                description="PCIe bytes, integrated from NVML's throughput samples between collections")
        gauge(semconv.METRIC_NVIDIA_GPU_XID, [self._last_xid], unit="1",
              description="Code of the last XID error NVML reported since the rank started")
        counter(semconv.METRIC_NVIDIA_GPU_REMAPPED_ROWS, [self._remapped_rows], unit="{row}",
                description="GPU memory rows remapped after correctable or uncorrectable errors (Ampere and newer)")
        counter(semconv.METRIC_NVIDIA_GPU_RETIRED_PAGES, [self._retired_pages], unit="{page}",
                description="GPU memory pages retired after ECC errors (before Ampere)")
        sm = self._each("clock.sm", lambda h: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM), lambda mhz: mhz * 1e6)
        memory = self._each("clock.memory", lambda h: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM),
                            lambda mhz: mhz * 1e6)
        ours = (
            (gauge, semconv.METRIC_NVIDIA_GPU_CLOCK_SM, sm, "Hz", "SM clock"),
            (gauge, semconv.METRIC_NVIDIA_GPU_CLOCK_MEMORY, memory, "Hz", "Memory clock"),
            (counter, semconv.METRIC_NVIDIA_GPU_NVLINK_IO, self._nvlink, "By", "NVLink data bytes"),
            (gauge, semconv.METRIC_NVIDIA_GPU_THROTTLE, self._throttle, "1",
             "1 while a clock-throttle reason is active, else 0, per reason"),
            (updown, semconv.METRIC_NVIDIA_GPU_PROCESS_MEMORY_USAGE, self._process_memory, "By",
             "GPU memory used by this rank's process"),
            (gauge, semconv.METRIC_NVIDIA_GPU_SM_ACTIVITY, self._sm_activity, "1",
             "Fraction of SMs busy between two collections (NVML GPM, Hopper and newer)"),
        )
        for create, name, callback, unit, description in ours:
            current, alias = _shared(callback)
            create(name, [current], unit=unit, description=description)
            # The name it shipped under, for one release: the same points (the throttle reason under its old key).
            alias = _renamed(alias) if name == semconv.METRIC_NVIDIA_GPU_THROTTLE else alias
            create(semconv.ALIASES[name], [alias], unit=unit, description=f"Deprecated: renamed {name}")

    # -- reading --------------------------------------------------------------------------------

    def stop(self) -> None:
        self._stopped = True

    def _read(self, device: _Device, field: str, read):
        """NVML's value of ``field``, or None once that field failed (said once)."""
        if self._stopped or field in self._failed or device.lost:
            return None
        key = (id(device), field)
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and now - cached[0] < _CACHE_SECONDS:
                return cached[1]
            try:
                value = read(device.handle)
            except Exception as error:  # noqa: BLE001 - NVMLError, or another of pynvml's (a library mismatch)
                self._fail(field, device, error)
                return None
            self._cache[key] = (now, value)
            return value

    def _function(self, name: str):
        """pynvml's ``name``; where this nvidia-ml-py lacks it, a call that fails as an unsupported field does."""
        function = getattr(self._nvml, name, None)
        if function is not None:
            return function
        def missing(*_args):
            raise _Unavailable(f"{name} is not in this nvidia-ml-py")

        return missing

    def _fail(self, field: str, device: _Device, error) -> None:
        if getattr(error, "value", None) in _LOST:
            if not device.lost:
                device.lost = True
                _logger.warning("NVML: GPU %s is lost (%s); hw.status says failed, its other readings stop.",
                                device.attributes[semconv.HW_ID], error)
            return
        self._failed.add(field)
        log = _logger.debug if field in _GENERATIONAL or device.mig else _logger.warning
        log("NVML %s of GPU %s: %s; it is not reported from now on.", field, device.attributes[semconv.HW_ID], error)

    def _each(self, field: str, read, convert):
        def observe(_options):
            observations = []
            for device in self._devices:
                value = self._read(device, field, read)
                converted = None if value is None else convert(value)
                if converted is not None:
                    observations.append(Observation(converted, device.attributes))
            return observations

        return observe

    def _ecc_count(self, device: _Device, error_type: str) -> int | None:
        nvml = self._nvml
        kind = (nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED if error_type == semconv.ECC_CORRECTED
                else nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)
        return self._read(device, f"ecc.{error_type}",
                          lambda h: nvml.nvmlDeviceGetTotalEccErrors(h, kind, nvml.NVML_AGGREGATE_ECC))

    def _errors(self, _options):
        observations = []
        self._take_xids()
        for device in self._devices:
            for error_type in (semconv.ECC_CORRECTED, semconv.ECC_UNCORRECTED):
                count = self._ecc_count(device, error_type)
                if count is not None:
                    observations.append(Observation(count, {**device.attributes, semconv.ERROR_TYPE: error_type}))
            replays = self._read(device, "pcie_replay", self._function("nvmlDeviceGetPcieReplayCounter"))
            if replays is not None:
                observations.append(Observation(replays, {**device.attributes,
                                                          semconv.ERROR_TYPE: semconv.PCIE_REPLAY}))
            if self._events is not None:
                observations.append(Observation(device.xids, {**device.attributes, semconv.ERROR_TYPE: semconv.XID}))
        return observations

    # -- XID errors, hw.status --------------------------------------------------------------------

    def _xid_events(self):
        """An NVML event set with every device's XID errors registered, or None where NVML has none."""
        nvml = self._nvml
        try:
            events = nvml.nvmlEventSetCreate()
            for device in self._devices:
                nvml.nvmlDeviceRegisterEvents(device.handle, nvml.nvmlEventTypeXidCriticalError, events)
        except (nvml.NVMLError, AttributeError) as error:
            if self._devices:
                self._fail("xid", self._devices[0], error)
            return None
        return events

    def _take_xids(self) -> None:
        """The XID events NVML holds now, without waiting; with one device per rank, each is that device's."""
        if self._events is None or self._stopped or not self._devices:
            return
        nvml, device = self._nvml, self._devices[0]
        with self._lock:
            for _ in range(_EVENTS_PER_COLLECTION):
                try:
                    data = nvml.nvmlEventSetWait_v2(self._events, 0)
                except Exception as error:  # noqa: BLE001 - NVMLError (a timeout: none queued), or another
                    if getattr(error, "value", None) != getattr(nvml, "NVML_ERROR_TIMEOUT", 10):
                        self._fail("xid", device, error)
                        self._events = None
                    return  # a timeout: nothing (more) to take
                device.xids += 1
                device.last_xid = int(data.eventData)
                device.fatal_xid = device.fatal_xid or device.last_xid in _FATAL_XIDS

    def _last_xid(self, _options):
        self._take_xids()
        return [Observation(device.last_xid, device.attributes) for device in self._devices
                if device.last_xid is not None]

    def _remapped_rows(self, _options):
        observations = []
        for device in self._devices:
            rows = self._read(device, "remapped_rows", self._function("nvmlDeviceGetRemappedRows"))
            if rows is not None:
                observations += [Observation(count, {**device.attributes, semconv.ERROR_TYPE: error_type})
                                 for count, error_type in ((rows[0], semconv.ECC_CORRECTED),
                                                           (rows[1], semconv.ECC_UNCORRECTED))]
        return observations

    def _retired_pages(self, _options):
        nvml, observations = self._nvml, []
        retired = self._function("nvmlDeviceGetRetiredPages")
        causes = ((semconv.ECC_CORRECTED,
                   getattr(nvml, "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS", 0)),
                  (semconv.ECC_UNCORRECTED, getattr(nvml, "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR", 1)))
        for device in self._devices:
            for error_type, cause in causes:
                pages = self._read(device, f"retired_pages.{error_type}",
                                   lambda h, c=cause: retired(h, c))
                if pages is not None:
                    observations.append(Observation(len(pages), {**device.attributes, semconv.ERROR_TYPE: error_type}))
        return observations

    def state(self, device: _Device) -> str:
        """failed: the GPU is lost, a row remapping failed, or a fatal XID; degraded: a remapping pending, any other
        XID, uncorrected ECC errors since the rank started, or a hardware throttle reason active; else ok."""
        self._take_xids()
        rows = self._read(device, "remapped_rows", self._function("nvmlDeviceGetRemappedRows"))
        if device.lost or device.fatal_xid or (rows is not None and rows[3]):
            return semconv.HW_STATE_FAILED
        uncorrected = self._ecc_count(device, semconv.ECC_UNCORRECTED)
        if uncorrected is not None and device.uncorrected_at_start is None:
            device.uncorrected_at_start = uncorrected
        throttle = self._read(device, "throttle", self._throttle_reasons())
        if ((rows is not None and rows[2]) or device.xids or (throttle or 0) & _HARDWARE_THROTTLE
                or (uncorrected or 0) > (device.uncorrected_at_start or 0)):
            return semconv.HW_STATE_DEGRADED
        return semconv.HW_STATE_OK

    def _status(self, _options):
        observations = []
        for device in self._devices:
            if self._stopped:
                break
            current = self.state(device)
            observations += [Observation(int(state == current), {**device.attributes, semconv.HW_STATE: state})
                             for state in semconv.HW_STATES]
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

    def _throttle_reasons(self):
        nvml = self._nvml
        return getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nvml.nvmlDeviceGetCurrentClocksThrottleReasons

    def _throttle(self, _options):
        observations, read = [], self._throttle_reasons()
        for device in self._devices:
            mask = self._read(device, "throttle", read)
            if mask is not None:
                observations += [
                    Observation(1 if mask & bit else 0, {**device.attributes, semconv.NVIDIA_GPU_THROTTLE_REASON: name})
                    for bit, name in THROTTLE_REASONS]
        return observations

    def _process_memory(self, _options):
        nvml, observations, pid = self._nvml, [], os.getpid()
        for device in self._devices:
            processes = self._read(device, "process.memory", nvml.nvmlDeviceGetComputeRunningProcesses)
            if processes is None:
                continue
            # In a container NVML may list host pids; it may not know a process's memory (None): then nothing, not a
            # made-up 0.
            mine = [p.usedGpuMemory for p in processes if p.pid == pid and p.usedGpuMemory is not None]
            if mine:
                observations.append(Observation(sum(mine), device.attributes))
        return observations


    def _sm_activity(self, _options):
        """SM utilization between this collection's GPM sample and the previous one."""
        nvml, observations = self._nvml, []
        for device in self._devices:
            if self._stopped or "gpm" in self._failed or device.lost:
                continue
            try:
                if device.gpm_samples is None:
                    if not nvml.nvmlGpmQueryDeviceSupport(device.handle).isSupportedDevice:
                        raise _Unavailable("GPM not supported by this GPU")
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
            except Exception as error:  # noqa: BLE001 - NVMLError, or ours (_Unavailable)
                self._fail("gpm", device, error)
        return observations


def _shared(callback):
    """Two callbacks for one reading: the alias's, run after the first in a collection, repeats its points
    (a GPM sample or a throttle mask is taken once per collection, not once per name)."""
    last: list = [0.0, []]

    def first(options):
        last[:] = [time.monotonic(), callback(options)]
        return last[1]

    def again(options):
        if time.monotonic() - last[0] < _CACHE_SECONDS:
            return last[1]
        return first(options)

    return first, again


def _renamed(callback):
    """``callback``'s points with the throttle reason under the key the alias shipped with."""
    old, new = semconv.HW_GPU_THROTTLE_REASON, semconv.NVIDIA_GPU_THROTTLE_REASON

    def observe(options):
        return [Observation(o.value, {(old if key == new else key): value for key, value in o.attributes.items()})
                for o in callback(options)]

    return observe


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
