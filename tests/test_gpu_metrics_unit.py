"""The NVML reader with a fake at the pynvml boundary (the real one: scripts/gpu-check.sh)."""

from __future__ import annotations

import logging
import os
import types
from collections import namedtuple

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from opentelemetry_instrumentation_deepspeed.instrumentors import gpu_metrics

Utilization = namedtuple("Utilization", "gpu memory")
Memory = namedtuple("Memory", "total used free")
Process = namedtuple("Process", "pid usedGpuMemory")


_NVML_ERRORS = {3: "Not Supported", 6: "Not Found", 9: "Driver Not Loaded", 10: "Timeout", 15: "GPU is lost",
                16: "GPU requires restart", 999: "Unknown Error"}


class NVMLError(Exception):
    """As nvidia-ml-py's: made from NVML's return code, which str() names (made from anything else, it fails)."""

    def __init__(self, value):
        super().__init__(value)
        self.value = value

    def __str__(self):
        return _NVML_ERRORS.get(self.value, "NVML Error with code %d" % self.value)  # noqa: UP031 - pynvml's own


class NotSupported(NVMLError):
    def __init__(self, value=3):
        super().__init__(value)


class GpmSample:
    taken_at = None


class GpmQuery:
    """pynvml's c_nvmlGpmMetricsGet_t, as far as the reader fills it."""

    def __init__(self):
        self.metrics = [types.SimpleNamespace(metricId=None, nvmlReturn=None, value=None)]


def fake_nvml(gpus: int = 1, mig: bool = False, unsupported=(), pid: int = 0, gpm: bool = True,  # noqa: PLR0917
              xids=None, rows=(0, 0, 0, 0), throttle=0x4 | 0x40):
    """pynvml as NVML answers on a host with ``gpus`` GPUs; counts calls. ``xids``: the XID events the
    driver has queued (the test may append more); ``rows``: nvmlDeviceGetRemappedRows's answer."""
    calls = []
    xids = [] if xids is None else xids

    def event_wait(event_set, timeout_ms):
        assert timeout_ms == 0, "collection never waits for an event"
        if not xids:
            raise NVMLError(10)
        return types.SimpleNamespace(eventType=0x8, eventData=xids.pop(0), device=None)

    clock = iter(range(1, 10**6))

    def gpm_metrics_get(query):
        calls.append(("gpm", query.sample1.taken_at, query.sample2.taken_at))
        assert query.sample1.taken_at < query.sample2.taken_at, "older sample first"
        assert query.metrics[0].metricId == 2 and query.numMetrics == 1
        query.metrics[0].nvmlReturn, query.metrics[0].value = 0, 62.5
        return query

    def gpm_sample_get(handle, sample):
        sample.taken_at = next(clock)
        return sample
    handles = [f"handle-{index}" for index in range(gpus)]

    def device_call(name, result):
        def call(handle, *args):
            calls.append((name, handle))
            if name in unsupported:
                raise NotSupported()
            return result(handle, *args) if callable(result) else result
        return call

    index_of = {handle: index for index, handle in enumerate(handles)}
    nvml = types.SimpleNamespace(
        calls=calls, NVMLError=NVMLError, NVML_SUCCESS=0, NVML_TEMPERATURE_GPU=0, NVML_CLOCK_SM=1, NVML_CLOCK_MEM=2,
        NVML_PCIE_UTIL_TX_BYTES=0, NVML_PCIE_UTIL_RX_BYTES=1, NVML_MEMORY_ERROR_TYPE_CORRECTED=0,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1, NVML_AGGREGATE_ECC=1,
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByUUID=lambda uuid: handles[int(uuid.rsplit("-", 1)[1])],
        nvmlDeviceGetUUID=lambda handle: (f"MIG-{index_of.get(handle, 9)}" if mig and handle in index_of
                                          else f"GPU-{index_of.get(handle, 9)}").encode(),
        nvmlDeviceGetName=lambda handle: "NVIDIA H100 80GB HBM3",
        nvmlDeviceIsMigDeviceHandle=lambda handle: mig,
        nvmlDeviceGetDeviceHandleFromMigDeviceHandle=lambda handle: "parent",
        nvmlDeviceGetUtilizationRates=device_call("utilization", Utilization(87, 40)),
        nvmlDeviceGetMemoryInfo=device_call("memory", Memory(80 * 2**30, 60 * 2**30, 20 * 2**30)),
        nvmlDeviceGetPowerUsage=device_call("power", 612_500),
        nvmlDeviceGetTotalEnergyConsumption=device_call("energy", 9_000_000),
        nvmlDeviceGetTemperature=device_call("temperature", 71),
        nvmlDeviceGetClockInfo=device_call("clock", lambda handle, kind: 1980 if kind == 1 else 2619),
        nvmlDeviceGetTotalEccErrors=device_call("ecc", lambda handle, kind, counter: 3 if kind == 0 else 0),
        nvmlDeviceGetPcieThroughput=device_call("pcie", lambda handle, kind: 1000),
        nvmlDeviceGetCurrentClocksEventReasons=device_call("throttle", lambda handle: throttle),
        nvmlDeviceGetPcieReplayCounter=device_call("pcie_replay", 5),
        nvmlDeviceGetRemappedRows=device_call("remapped_rows", lambda handle: rows),
        nvmlDeviceGetRetiredPages=device_call("retired_pages", lambda handle, cause: [0x1000] if cause else []),
        NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS=0, NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR=1,
        NVML_ERROR_TIMEOUT=10, nvmlEventTypeXidCriticalError=0x8, nvmlEventSetCreate=lambda: "event-set",
        nvmlDeviceRegisterEvents=lambda handle, types_, event_set: calls.append(("register", handle, types_)),
        nvmlEventSetWait_v2=event_wait,
        nvmlDeviceGetComputeRunningProcesses=device_call("processes", [Process(pid, 2**30), Process(1, 5 * 2**30)]),
        NVML_GPM_METRICS_GET_VERSION=1, NVML_GPM_METRIC_SM_UTIL=2, c_nvmlGpmMetricsGet_t=GpmQuery,
        nvmlGpmQueryDeviceSupport=lambda handle: types.SimpleNamespace(isSupportedDevice=int(gpm)),
        nvmlGpmSampleAlloc=GpmSample, nvmlGpmSampleGet=gpm_sample_get, nvmlGpmMetricsGet=gpm_metrics_get,
    )
    return nvml


def collect(reader_factory):
    metric_reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[metric_reader])
    reader = reader_factory(provider.get_meter("test"))

    def points():
        data = metric_reader.get_metrics_data()
        found = {}
        for resource_metrics in data.resource_metrics if data else []:
            for scope in resource_metrics.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        found.setdefault(metric.name, []).append((dict(point.attributes), point.value, metric.unit))
        return found

    return reader, points


def test_names_units_and_attributes(monkeypatch):
    nvml = fake_nvml(pid=4242)
    monkeypatch.setattr(gpu_metrics.os, "getpid", lambda: 4242)
    _, points = collect(lambda meter: gpu_metrics.start(meter, nvml, ["GPU-0"]))
    found = points()
    device = {"hw.id": "GPU-0", "hw.name": "NVIDIA H100 80GB HBM3", "hw.vendor": "NVIDIA", "hw.type": "gpu"}

    def only(name):
        (point,) = found[name]
        return point

    assert only("hw.gpu.utilization") == (device, 0.87, "1")
    assert only("hw.gpu.memory.utilization") == (device, 0.75, "1"), "the conventions' fraction of memory used"
    assert only("nvidia.gpu.memory_controller.utilization") == (device, 0.40, "1"), "NVML's memory busy time"
    assert only("hw.gpu.memory.usage") == (device, 60 * 2**30, "By")
    assert only("hw.gpu.memory.limit") == (device, 80 * 2**30, "By")
    assert only("hw.power") == (device, 612.5, "W")
    assert only("hw.energy") == (device, 9000, "J")
    assert only("hw.temperature") == (device, 71, "Cel")
    for name in ("nvidia.gpu.clock.sm", "hw.gpu.clock.sm"):  # the new name and, for one release, the old one
        assert only(name) == (device, 1980e6, "Hz")
    assert only("nvidia.gpu.clock.memory") == only("hw.gpu.clock.memory") == (device, 2619e6, "Hz")
    assert only("nvidia.gpu.process.memory.usage") == (device, 2**30, "By"), "this rank's process only"
    assert only("hw.gpu.process.memory.usage") == (device, 2**30, "By")
    assert sorted((a["error.type"], v) for a, v, _ in found["hw.errors"]) == [
        ("corrected", 3), ("pcie_replay", 5), ("uncorrected", 0), ("xid", 0)]
    assert {a["network.io.direction"] for a, _, _ in found["hw.gpu.io"]} == {"transmit", "receive"}
    throttled = {a["nvidia.gpu.throttle.reason"] for a, v, _ in found["nvidia.gpu.throttle"] if v == 1}
    assert throttled == {"sw_power_cap", "hw_thermal_slowdown"}
    assert {a["hw.gpu.throttle.reason"] for a, v, _ in found["hw.gpu.throttle"] if v == 1} == throttled
    # A hardware thermal slowdown is active: degraded, one state at 1.
    assert {a["hw.state"]: v for a, v, _ in found["hw.status"]} == {"ok": 0, "degraded": 1, "failed": 0}
    assert all(a["hw.type"] == "gpu" and a["hw.id"] == "GPU-0" for a, _, _ in found["hw.status"])
    assert sorted((a["error.type"], v) for a, v, _ in found["nvidia.gpu.memory.remapped_rows"]) == [
        ("corrected", 0), ("uncorrected", 0)]
    assert sorted((a["error.type"], v) for a, v, _ in found["nvidia.gpu.memory.retired_pages"]) == [
        ("corrected", 0), ("uncorrected", 1)]
    assert "nvidia.gpu.xid" not in found, "no XID yet: no last code"
    # One NVML read per field per collection, although two instruments use utilization and memory.
    reads = [call[0] for call in nvml.calls]
    assert reads.count("utilization") == 1 and reads.count("memory") == 1


def test_sm_activity_from_gpm_between_collections():
    nvml = fake_nvml()
    _, points = collect(lambda meter: gpu_metrics.start(meter, nvml, ["GPU-0"]))
    assert "nvidia.gpu.sm.activity" not in points(), "one GPM sample is not an interval yet"
    for _ in range(3):
        found = points()
        ((_, value, unit),) = found["nvidia.gpu.sm.activity"]
        assert (value, unit) == (0.625, "1")
        assert found["hw.gpu.sm.activity"] == found["nvidia.gpu.sm.activity"], "the alias repeats, samples nothing"
    assert [call[1:] for call in nvml.calls if call[0] == "gpm"] == [(1, 2), (2, 3), (3, 4)]


def test_gpu_without_gpm_reports_no_sm_activity(caplog):
    nvml = fake_nvml(gpm=False)
    with caplog.at_level(logging.DEBUG, logger=gpu_metrics.__name__):
        _, points = collect(lambda meter: gpu_metrics.start(meter, nvml, ["GPU-0"]))
        assert "hw.gpu.sm.activity" not in points() | points()
    assert caplog.text.count("GPM not supported") == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "an A100 has no GPM by design"


def test_unsupported_field_reports_nothing_and_warns_once(caplog):
    nvml = fake_nvml(unsupported={"power", "utilization"}, gpm=False)
    with caplog.at_level(logging.WARNING):
        _, points = collect(lambda meter: gpu_metrics.start(meter, nvml, ["GPU-0"]))
        first, second = points(), points()
    for found in (first, second):
        assert "hw.power" not in found, "never a made-up 0"
        assert "hw.gpu.utilization" not in found and "nvidia.gpu.memory_controller.utilization" not in found
        assert "hw.gpu.memory.utilization" in found, "from the memory info, not the utilization rates"
        assert "hw.temperature" in found
    warnings = [r.getMessage() for r in caplog.records if "GPM" not in r.getMessage()]
    assert len(warnings) == 2 and all("not reported from now on" in w for w in warnings)
    assert [call[0] for call in nvml.calls].count("power") == 1, "a failed field is not read again"


def test_failure_mid_run_stops_that_field(caplog):
    nvml = fake_nvml()
    _, points = collect(lambda meter: gpu_metrics.start(meter, nvml, ["GPU-0"]))
    assert "hw.temperature" in points()
    nvml.nvmlDeviceGetTemperature = lambda handle, kind: (_ for _ in ()).throw(NVMLError(999))
    gpu_metrics._CACHE_SECONDS, saved = 0.0, gpu_metrics._CACHE_SECONDS
    try:
        with caplog.at_level(logging.WARNING):
            found = points()
    finally:
        gpu_metrics._CACHE_SECONDS = saved
    assert "hw.temperature" not in found and "hw.power" in found
    assert "Unknown Error" in caplog.text


def test_nvml_missing_or_failing_at_init(caplog):
    broken = fake_nvml()
    broken.nvmlInit = lambda: (_ for _ in ()).throw(NVMLError(9))
    with caplog.at_level(logging.WARNING):
        _, points = collect(lambda meter: gpu_metrics.start(meter, broken, ["GPU-0"]))
    assert not [name for name in points() if name.startswith("hw.")]
    assert "Driver Not Loaded" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert gpu_metrics.start(None, broken, []) is None
    assert not caplog.records, "a rank without a CUDA device has nothing to say"


def test_mig_instance_is_reported_as_such():
    nvml = fake_nvml(mig=True)
    _, points = collect(lambda meter: gpu_metrics.start(meter, nvml, ["MIG-0"]))
    ((attributes, _, _),) = points()["hw.gpu.memory.usage"]
    assert attributes["hw.id"] == "MIG-0" and attributes["hw.parent"] == "GPU-9"


@pytest.mark.parametrize("gpus", [4])
def test_each_rank_of_a_multi_gpu_host_reports_only_its_own_gpu(gpus):
    nvml = fake_nvml(gpus=gpus)
    reported = []
    for rank in range(gpus):
        _, points = collect(lambda meter, rank=rank: gpu_metrics.start(meter, nvml, [f"GPU-{rank}"]))
        reported.append({attributes["hw.id"] for attributes, _, _ in points()["hw.power"]})
    assert reported == [{f"GPU-{rank}"} for rank in range(gpus)]


def test_xid_events_are_counted_without_waiting_and_set_the_status():
    xids = []
    nvml = fake_nvml(xids=xids, throttle=0)
    _, points = collect(lambda meter: gpu_metrics.start(meter, nvml, ["GPU-0"]))

    def read():
        found = points()
        errors = {a["error.type"]: v for a, v, _ in found["hw.errors"]}
        state = next(a["hw.state"] for a, v, _ in found["hw.status"] if v == 1)
        return errors["xid"], [v for _, v, _ in found.get("nvidia.gpu.xid", [])], state

    assert read() == (0, [], "ok")
    assert ("register", "handle-0", 0x8) in nvml.calls
    xids += [13, 31]  # graphics engine exception, MMU fault: the job's own errors, the GPU is degraded
    assert read() == (2, [31], "degraded")
    xids.append(79)  # fallen off the bus
    assert read() == (3, [79], "failed")


def test_a_failed_row_remapping_is_a_failed_gpu_a_pending_one_degraded():
    for rows, state in (((2, 1, 1, 0), "degraded"), ((2, 1, 0, 1), "failed"), ((2, 0, 0, 0), "ok")):
        _, points = collect(lambda meter, r=rows: gpu_metrics.start(meter, fake_nvml(rows=r, throttle=0x4), ["GPU-0"]))
        found = points()
        assert next(a["hw.state"] for a, v, _ in found["hw.status"] if v == 1) == state, rows


def test_fields_older_gpus_or_pynvml_lack_report_nothing_quietly(caplog):
    nvml = fake_nvml(unsupported=("remapped_rows", "pcie_replay"))
    del nvml.nvmlEventSetCreate, nvml.nvmlDeviceGetRetiredPages
    _, points = collect(lambda meter: gpu_metrics.start(meter, nvml, ["GPU-0"]))
    with caplog.at_level(logging.WARNING):
        found = points()
    assert "nvidia.gpu.memory.remapped_rows" not in found and "nvidia.gpu.memory.retired_pages" not in found
    assert sorted(a["error.type"] for a, _, _ in found["hw.errors"]) == ["corrected", "uncorrected"]
    assert found["hw.status"], "the state still comes from what is known"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "by design, not worth a warning"


def test_a_lost_gpu_is_failed_said_once_and_read_no_more(caplog):
    nvml = fake_nvml()
    _, points = collect(lambda meter: gpu_metrics.start(meter, nvml, ["GPU-0"]))
    assert next(a["hw.state"] for a, v, _ in points()["hw.status"] if v == 1) == "degraded"  # the fake's throttle
    gpu_metrics._CACHE_SECONDS, saved = 0.0, gpu_metrics._CACHE_SECONDS
    try:
        def lost(*_args):
            raise NVMLError(15)

        for name in vars(nvml):
            if name.startswith("nvmlDeviceGet"):
                setattr(nvml, name, lost)
        with caplog.at_level(logging.WARNING):
            first, second = points(), points()
    finally:
        gpu_metrics._CACHE_SECONDS = saved
    for found in (first, second):
        assert next(a["hw.state"] for a, v, _ in found["hw.status"] if v == 1) == "failed"
    assert not {"hw.temperature", "hw.power", "hw.gpu.utilization"} & set(second), "once known lost, nothing is read"
    assert [r.getMessage() for r in caplog.records] == [
        "NVML: GPU GPU-0 is lost (GPU is lost); hw.status says failed, its other readings stop."]


def test_errors_that_are_not_nvml_errors_fail_their_field_and_only_it(caplog):
    """nvidia-ml-py raises NVMLLibraryMismatchError (an Exception) where the driver lacks a function's version."""
    class NVMLLibraryMismatchError(Exception):
        pass

    nvml = fake_nvml()
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda handle: (_ for _ in ()).throw(NVMLLibraryMismatchError("v3"))
    with caplog.at_level(logging.WARNING):
        _, points = collect(lambda meter: gpu_metrics.start(meter, nvml, ["GPU-0"]))
        first, second = points(), points()
    assert "nvidia.gpu.process.memory.usage" not in first | second and "hw.power" in second
    assert len(caplog.records) == 1 and "process.memory" in caplog.text and "Traceback" not in caplog.text


def test_a_process_memory_nvml_does_not_know_is_no_point():
    nvml = fake_nvml(pid=os.getpid())
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda handle: [Process(os.getpid(), None), Process(1, 2**30)]
    _, points = collect(lambda meter: gpu_metrics.start(meter, nvml, ["GPU-0"]))
    assert "nvidia.gpu.process.memory.usage" not in points(), "not a made-up 0"


def test_a_reading_this_nvidia_ml_py_lacks_is_said_with_its_name(caplog):
    nvml = fake_nvml()
    del nvml.nvmlDeviceGetPcieReplayCounter
    with caplog.at_level(logging.DEBUG, logger=gpu_metrics.__name__):
        _, points = collect(lambda meter: gpu_metrics.start(meter, nvml, ["GPU-0"]))
        points()
    assert "nvmlDeviceGetPcieReplayCounter is not in this nvidia-ml-py" in caplog.text


@pytest.mark.parametrize(("name", "peak"), [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                            ("NVIDIA H100 NVL", 835e12), ("NVIDIA H200", 989e12),
                                            ("NVIDIA H200 NVL", 835e12),
                                            ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA GeForce RTX 4090", None)])
def test_the_peak_is_the_device_s_own(monkeypatch, name, peak):
    import torch

    from opentelemetry_instrumentation_deepspeed.export import training_metrics

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_args: name)
    assert training_metrics.peak_flops() == peak
