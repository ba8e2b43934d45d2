"""Test-only stand-in for nvidia-ml-py's ``pynvml``: the GPUs of fake_cuda.py, as NVML reports them.

First on PYTHONPATH of a launched run, it shadows the real module. Readings are plausible for a
training H100 and move with time where NVML's do (energy, NVLink bytes, GPM samples). The global
ranks listed in ``FAKE_NVML_FAULTY_RANKS`` (comma-separated) get a sick GPU instead: idle, hot,
throttled by hardware thermal slowdown and power brake, and counting uncorrected ECC errors.
"""

from __future__ import annotations

import os
import time
import types

from fake_cuda import device_uuid

NVML_SUCCESS = 0
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2
NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1
NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
NVML_AGGREGATE_ECC = 1
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 138, 139
NVML_GPM_METRICS_GET_VERSION, NVML_GPM_METRIC_SM_UTIL = 1, 2
HW_THERMAL_SLOWDOWN, HW_POWER_BRAKE_SLOWDOWN = 0x40, 0x80
_GIB = 2**30
_STARTED = time.monotonic()


NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_NOT_FOUND = 2, 6


class NVMLError(Exception):
    """As nvidia-ml-py's: made from NVML's return code, which str() names (made from a message, it fails)."""

    def __init__(self, value):
        super().__init__(value)
        self.value = value

    def __str__(self):
        return {2: "Invalid Argument", 6: "Not Found"}.get(self.value, "NVML Error with code %d" % self.value)  # noqa: UP031


class _Handle:
    def __init__(self, index: int):
        self.index = index
        self.uuid = device_uuid(index)


def _faulty() -> bool:
    ranks = {part.strip() for part in os.environ.get("FAKE_NVML_FAULTY_RANKS", "").split(",")}
    return os.environ.get("RANK", "0") in ranks


def _elapsed() -> float:
    return time.monotonic() - _STARTED


def nvmlInit():
    pass


def nvmlDeviceGetHandleByUUID(uuid):
    for index in range(8):
        if device_uuid(index) == uuid:
            return _Handle(index)
    raise NVMLError(NVML_ERROR_NOT_FOUND)


def nvmlDeviceGetUUID(handle):
    return handle.uuid


def nvmlDeviceGetName(handle):
    return "NVIDIA H100 80GB HBM3"


def nvmlDeviceIsMigDeviceHandle(handle):
    return False


def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle):
    raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)


def nvmlDeviceGetUtilizationRates(handle):
    return types.SimpleNamespace(gpu=0, memory=0) if _faulty() else types.SimpleNamespace(gpu=93, memory=41)


def nvmlDeviceGetMemoryInfo(handle):
    return types.SimpleNamespace(total=80 * _GIB, used=61 * _GIB, free=19 * _GIB)


def nvmlDeviceGetPowerUsage(handle):
    return 180_000 if _faulty() else 612_000  # mW


def nvmlDeviceGetTotalEnergyConsumption(handle):
    return int(_elapsed() * nvmlDeviceGetPowerUsage(handle))  # mJ


def nvmlDeviceGetTemperature(handle, sensor):
    return 94 if _faulty() else 67


def nvmlDeviceGetClockInfo(handle, clock):
    boost = 1110 if _faulty() else 1980
    return boost if clock == NVML_CLOCK_SM else 2619  # MHz


def nvmlDeviceGetTotalEccErrors(handle, error_type, counter_type):
    if error_type == NVML_MEMORY_ERROR_TYPE_CORRECTED:
        return 12
    return int(_elapsed() / 2) if _faulty() else 0


def nvmlDeviceGetPcieThroughput(handle, counter):
    return 2_500_000 if counter == NVML_PCIE_UTIL_TX_BYTES else 9_800_000  # KB/s


def nvmlDeviceGetCurrentClocksEventReasons(handle):
    return HW_THERMAL_SLOWDOWN | HW_POWER_BRAKE_SLOWDOWN if _faulty() else 0


def nvmlDeviceGetComputeRunningProcesses(handle):
    return [types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=58 * _GIB)]


def nvmlDeviceGetFieldValues(handle, fields):
    kib_per_second = {NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: 40_000_000,
                      NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: 39_000_000}
    return [types.SimpleNamespace(nvmlReturn=NVML_SUCCESS,
                                  value=types.SimpleNamespace(ullVal=int(_elapsed() * kib_per_second[field])))
            for field, _scope in fields]


def nvmlGpmQueryDeviceSupport(handle):
    return types.SimpleNamespace(isSupportedDevice=1)


def nvmlGpmSampleAlloc():
    return types.SimpleNamespace(taken_at=None)


def nvmlGpmSampleGet(handle, sample):
    sample.taken_at = time.monotonic()
    return sample


def c_nvmlGpmMetricsGet_t():
    return types.SimpleNamespace(version=None, numMetrics=0, sample1=None, sample2=None,
                                 metrics=[types.SimpleNamespace(metricId=None, nvmlReturn=None, value=None)])


def nvmlGpmMetricsGet(query):
    query.metrics[0].nvmlReturn = NVML_SUCCESS
    query.metrics[0].value = 0.0 if _faulty() else 78.0
    return query


def nvmlDeviceGetPcieReplayCounter(handle):
    return 7 if _faulty() else 0


def nvmlDeviceGetRemappedRows(handle):
    # corrected, uncorrected, pending, failure: the sick GPU has a remapping pending
    return (3, 1, 1, 0) if _faulty() else (0, 0, 0, 0)
