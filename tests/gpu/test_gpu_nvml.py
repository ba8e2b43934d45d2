"""GPU check (scripts/gpu-check.sh): the NVML reader against the real driver, printing what it read."""

from __future__ import annotations

import time

import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from opentelemetry_instrumentation_deepspeed.instrumentors import gpu_metrics

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_reader_reads_the_rank_gpu_from_real_nvml():
    torch.cuda.set_device(0)
    torch.ones(1, device="cuda")  # initializes CUDA, as an engine does
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    assert gpu_metrics.start(provider.get_meter("gpu-check")) is not None
    x = torch.randn(8192, 8192, device="cuda")
    for _ in range(20):
        x = x @ x / 8192
    reader.get_metrics_data()  # the first GPM sample
    time.sleep(1.0)
    found = {}
    for resource_metrics in reader.get_metrics_data().resource_metrics:
        for scope in resource_metrics.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    found.setdefault(metric.name, []).append((dict(point.attributes), point.value))
    for name in sorted(found):
        print(name, [(value, {k: v for k, v in attrs.items() if k not in ("hw.name", "hw.vendor", "hw.type")})
                     for attrs, value in found[name]])
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    ((attributes, limit),) = found["hw.gpu.memory.limit"]
    assert attributes["hw.id"].endswith(uuid.removeprefix("GPU-")) and attributes["hw.vendor"] == "NVIDIA"
    assert limit == pytest.approx(torch.cuda.get_device_properties(0).total_memory, rel=0.05)
    assert 0 <= found["hw.gpu.utilization"][0][1] <= 1
    assert found["hw.power"][0][1] > 0 and 0 < found["hw.temperature"][0][1] < 120
    # In a sandbox NVML may list the processes by the host's pids, or not at all: then no point, never a wrong one.
    if "nvidia.gpu.process.memory.usage" in found:
        assert found["nvidia.gpu.process.memory.usage"][0][1] > 8192 * 8192 * 4, "this process's tensors"
    else:
        print("nvidia.gpu.process.memory.usage: absent (NVML lists no process of this pid namespace)")
    # The conventions' memory utilization is the fraction used; NVML's busy time is ours, by another name.
    ((_, used),) = found["hw.gpu.memory.utilization"]
    assert used == pytest.approx(found["hw.gpu.memory.usage"][0][1] / limit, rel=0.05) and 0 < used < 1
    assert 0 <= found["nvidia.gpu.memory_controller.utilization"][0][1] <= 1
    states = {attrs["hw.state"]: value for attrs, value in found["hw.status"]}
    assert sorted(states) == ["degraded", "failed", "ok"] and sum(states.values()) == 1
    # Data-center GPUs count PCIe replays and (Ampere and newer) remap rows, where a sandbox's driver proxy lets NVML
    # answer; XID events need the driver's permission. Printed above either way.
    errors = {attrs["error.type"] for attrs, _ in found.get("hw.errors", ())}
    print("hw.errors types:", sorted(errors), "remapped rows:", "nvidia.gpu.memory.remapped_rows" in found)
