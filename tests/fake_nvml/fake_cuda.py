"""Test-only: a CUDA device that only the package's NVML reader sees, on a CPU-only torch.

torch calls ``install`` at the end of its import (a ``torch.backends`` entry point, declared by the
dist-info next to this file) when this directory is on PYTHONPATH. The NVML reader asks torch for
the rank's current device and its UUID; those questions, asked from that module alone, are
answered as on a host with one GPU per local rank. DeepSpeed, the profiler and the MFU peak lookup
keep seeing no CUDA, so the run trains exactly as it would without the fake.
"""

from __future__ import annotations

import os
import sys
import types

_READER = "opentelemetry_instrumentation_deepspeed.instrumentors.gpu_metrics"


def device_uuid(index: int) -> str:
    return f"GPU-00000000-0000-0000-0000-{index:012d}"


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def _for_reader(real, fake):
    def answer(*args, **kwargs):
        # Frame 1 is whoever called torch.cuda.<function>.
        if sys._getframe(1).f_globals.get("__name__") == _READER:
            return fake(*args, **kwargs)
        return real(*args, **kwargs)

    answer.__wrapped__ = real
    return answer


def install() -> None:
    cuda = sys.modules["torch"].cuda
    cuda.is_available = _for_reader(cuda.is_available, lambda: True)
    cuda.is_initialized = _for_reader(cuda.is_initialized, lambda: True)
    cuda.current_device = _for_reader(cuda.current_device, _local_rank)
    cuda.get_device_properties = _for_reader(
        cuda.get_device_properties,
        lambda device=None: types.SimpleNamespace(name="NVIDIA H100 80GB HBM3",
                                                  uuid=device_uuid(_local_rank() if device is None else int(device))))
