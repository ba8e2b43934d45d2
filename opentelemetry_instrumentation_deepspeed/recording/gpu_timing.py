"""GPU-side times from CUDA events, put on the epoch clock, without ever blocking.

Events are only read once ``query()`` says they completed, so ``elapsed_time`` never waits
and nothing calls ``synchronize``. GPU times become epoch times through an origin: an event
recorded while the stream was idle (``Stream.query()`` true), which the GPU therefore ran
at the host time it was recorded. The origin is renewed whenever the stream is seen idle
again, so clock drift between GPU and host stays bounded by the gap between idle moments.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

# Unresolved intervals kept at most: a GPU that never completes must not grow memory.
MAX_PENDING = 4096


class GpuTimeline:
    def __init__(self, cuda):
        self._cuda = cuda  # torch.cuda, or a fake at that boundary in tests
        self._origin: tuple[object, int] | None = None
        self._pending: deque = deque()
        self.dropped = 0

    def event(self):
        """A timing event recorded now on the current stream."""
        event = self._cuda.Event(enable_timing=True)
        event.record()
        return event

    def anchor_if_idle(self) -> None:
        # Before any idle moment, a first origin that may lag by the queue's depth beats none.
        if self._origin is None or self._cuda.current_stream().query():
            self._origin = (self.event(), time.time_ns())

    def defer(self, start, end, done: Callable[[int | None, int | None], None]) -> None:
        """Call ``done(start_ns, end_ns)`` on the epoch clock once both events completed."""
        if len(self._pending) >= MAX_PENDING:
            self._pending.popleft()[2](None, None)
            self.dropped += 1
        self._pending.append((start, end, done))

    def resolve(self, final: bool = False) -> None:
        """Hand over every interval whose events completed; with ``final``, the rest without GPU times."""
        origin = self._origin
        while self._pending:
            start, end, done = self._pending[0]
            if origin is not None and origin[0].query() and start.query() and end.query():
                base = origin[1]
                done(base + int(origin[0].elapsed_time(start) * 1e6), base + int(origin[0].elapsed_time(end) * 1e6))
            elif final:
                done(None, None)
            else:
                # The stream runs in order: a later interval cannot be done before this one.
                return
            self._pending.popleft()
