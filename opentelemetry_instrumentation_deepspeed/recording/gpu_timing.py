"""GPU-side times from CUDA events, put on the epoch clock, without ever blocking.

The training thread records events (``event``) around phases and collectives; the emitter's thread
reads them once ``query()`` says they completed (``times``), so ``elapsed_time`` never waits and
nothing calls ``synchronize``. GPU times become epoch times through an origin: an event recorded
while the stream was idle (``Stream.query()`` true), which the GPU therefore ran at the host time
it was recorded. The origin is renewed whenever the stream is seen idle at a step's start, so
clock drift between GPU and host stays bounded by the gap between idle moments.
"""

from __future__ import annotations

import time


class GpuTimeline:
    def __init__(self, cuda):
        self._cuda = cuda  # torch.cuda, or a fake at that boundary in tests
        self._origin: tuple[object, int] | None = None  # replaced whole: readable from another thread

    def event(self):
        """A timing event recorded now on the current stream."""
        event = self._cuda.Event(enable_timing=True)
        event.record()
        return event

    def anchor_if_idle(self) -> None:
        # Before any idle moment, a first origin that may lag by the queue's depth beats none.
        if self._origin is None or self._cuda.current_stream().query():
            self._origin = (self.event(), time.time_ns())

    def times(self, start, end) -> tuple[int, int] | None:
        """(start, end) of the interval between two events on the epoch clock; None while either
        (or the origin) has not completed on the GPU."""
        origin = self._origin
        if origin is None or not (origin[0].query() and start.query() and end.query()):
            return None
        event, base = origin
        return base + int(event.elapsed_time(start) * 1e6), base + int(event.elapsed_time(end) * 1e6)
