"""GPU memory as PyTorch's caching allocator counts it, read on the host at phase boundaries.

``torch.cuda.memory_stats_as_nested_dict`` reads the allocator's own counters (host memory, no
device work, no sync); every ``torch.cuda.memory_*`` helper calls it, so one call per phase end
gives all the figures at once. The peak is reset when a phase starts, so each phase's reading
holds that phase's own peak: as a side effect ``torch.cuda.max_memory_allocated()`` then reports
the peak since the last phase start (DeepSpeed's ``see_memory_usage`` resets it the same way);
``OTEL_PYTHON_DEEPSPEED_MEMORY_PEAK_RESET=false`` leaves the peak alone, and phases then carry
the process's running peak.
"""

from __future__ import annotations


class Memory:
    """One reading: bytes allocated, reserved, the peak allocated since the last reset; the
    allocator's cumulative cudaMalloc retries (cache flushes) and out-of-memory errors."""

    __slots__ = ("allocated", "ooms", "peak", "reserved", "retries")

    def __init__(self, allocated: int, reserved: int, peak: int, retries: int, ooms: int):
        self.allocated, self.reserved, self.peak, self.retries, self.ooms = allocated, reserved, peak, retries, ooms

    @property
    def fragmentation(self) -> int:
        """Reserved but not allocated: cached blocks, split or free, that other sizes may not fit."""
        return max(self.reserved - self.allocated, 0)


class AllocatorMemory:
    def __init__(self, cuda, reset_peaks: bool = True):
        self._cuda = cuda  # torch.cuda, or a fake at that boundary in tests
        self._reset = reset_peaks

    def phase_started(self) -> None:
        if self._reset:
            self._cuda.reset_peak_memory_stats()

    def read(self) -> Memory:
        stats = self._cuda.memory_stats_as_nested_dict()
        allocated = stats.get("allocated_bytes", {}).get("all", {})
        reserved = stats.get("reserved_bytes", {}).get("all", {})
        return Memory(allocated.get("current", 0), reserved.get("current", 0), allocated.get("peak", 0),
                      stats.get("num_alloc_retries", 0), stats.get("num_ooms", 0))


def is_out_of_memory(failure_type: str) -> bool:
    """A ``Failure.type`` of torch.OutOfMemoryError (``torch.cuda.OutOfMemoryError`` is the same class)."""
    return failure_type == "OutOfMemoryError"
