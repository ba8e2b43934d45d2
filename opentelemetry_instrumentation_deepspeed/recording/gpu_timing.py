"""GPU-side times from CUDA events, put on the epoch clock, without ever blocking.

The training thread records events (``event``) around phases and collectives; the emitter's thread
reads them once ``query()`` says they completed (``times``), so ``elapsed_time`` never waits and
nothing calls ``synchronize``. GPU times become epoch times through an origin: an event recorded
while the stream was idle (``Stream.query()`` true), which the GPU therefore ran at the host time
it was recorded. The origin is renewed whenever the stream is seen idle at a step's start, so
clock drift between GPU and host stays bounded by the gap between idle moments.

``elapsed_time`` is a float32 of milliseconds: from an origin an hour old its steps are 0.25 ms, a day old
8 ms. A loop that never lets its stream idle would keep its first origin for good; so once the origin is
more than ``CARRY_NS`` older than a completed event read here, that event, at the time it was given,
becomes the origin (its error: half a float32 step of a second, 30 ns, unbiased).
"""

from __future__ import annotations

import contextlib
import threading
import time

CARRY_NS = 1_000_000_000


class Captures:
    """CUDA graph captures under way in this process (counted by ``instrumentors/cuda_graphs.py``).

    While one runs, no thread of ours asks the device anything: in torch's default ("global") capture mode, a
    query from any thread (an event's progress, a stream's idleness) is refused, and the user's graph with it.
    The queries hold ``lock``, which a capture takes to begin: none begins in the middle of one. Events recorded
    meanwhile are none (their interval has no GPU times)."""

    running = 0
    lock = threading.Lock()


class GpuTimeline:
    def __init__(self, cuda):
        self._cuda = cuda  # torch.cuda, or a fake at that boundary in tests
        self._origin: tuple[object, int] | None = None  # replaced whole: readable from another thread
        self.device = current_device(cuda)  # built on the training thread, whose device DeepSpeed set

    def event(self):
        """A timing event recorded now on the current stream; None while a CUDA graph is captured."""
        if Captures.running:
            return None
        event = self._cuda.Event(enable_timing=True)
        event.record()
        return event

    def anchor_if_idle(self) -> None:
        # Before any idle moment, a first origin that may lag by the queue's depth beats none. The stream's query
        # under the captures' lock: a capture begun on another thread meanwhile would refuse it.
        if Captures.running:
            return
        with Captures.lock:
            if not Captures.running and (self._origin is None or self._cuda.current_stream().query()):
                event = self._cuda.Event(enable_timing=True)
                event.record()
                self._origin = (event, time.time_ns())

    def times(self, start, end) -> tuple[int, int] | None:
        """(start, end) of the interval between two events on the epoch clock; None while either
        (or the origin) has not completed on the GPU, or while a CUDA graph is captured."""
        origin = self._origin
        if origin is None:
            return None
        with Captures.lock, on_device(self._cuda, self.device):
            if Captures.running or not (origin[0].query() and start.query() and end.query()):
                return None
            event, base = origin
            start_ns = base + round(event.elapsed_time(start) * 1e6)
            end_ns = base + round(event.elapsed_time(end) * 1e6)
        if end_ns - base > CARRY_NS and self._origin is origin:  # not if the training thread renewed it meanwhile
            self._origin = (end, end_ns)
        return start_ns, end_ns


def current_device(cuda) -> int | None:
    """The calling thread's current CUDA device; None where torch cannot say (the queries then run where they are)."""
    try:
        return cuda.current_device()
    except Exception:  # noqa: BLE001 - a broken runtime: GPU times may still come, from any device
        return None


def on_device(cuda, index: int | None):
    """A block run with ``index`` the thread's current CUDA device, as it was then after it.

    The emitter's thread (or a metrics collection's) asks events about their progress. Its current device is 0:
    CUDA would create a context there on its first call, half a GiB on GPU 0 for every rank that trains on another.
    torch's ``device`` guard restores the thread's device after the block only where that device has a context."""
    return contextlib.nullcontext() if index is None else cuda.device(index)
