"""This rank's clock against rank 0's, estimated once at start through the process group's store.

Each rank other than 0 sends ``ROUNDS`` pings through the store; rank 0 answers each with its
clock. A ping sent at ``t1`` and answered (with rank 0's time ``t0``) when read at ``t2`` bounds
the offset: rank 0's reading was taken between the two, so this clock minus rank 0's lies in
``[t1 - t0, t2 - t0]``. The round with the shortest round trip gives the estimate (its middle)
and its error (half the round trip). The store is polled with ``check`` (never a blocking
``wait``, which would hold the store client's lock from the training thread's own store calls),
within ``BUDGET_SECONDS`` in all; a rank not answered in time has no estimate. It runs while the
engine is built, when the job id is agreed the same way: never during a step. The result is a
resource attribute (``training.clock.offset``), and ``diagnose`` moves the rank's times by it.
"""

from __future__ import annotations

import logging
import time

_logger = logging.getLogger(__name__)

ROUNDS = 4
BUDGET_SECONDS = 3.0
POLL_SECONDS = 0.0002
_PREFIX = "opentelemetry-instrumentation-deepspeed/clock"


def apply_test_skew(rank: int) -> None:
    """``OTEL_PYTHON_DEEPSPEED_TEST_CLOCK_SKEW`` (tests only): this rank's ``time.time_ns`` runs off by that much."""
    from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env

    skew = env.test_clock_skew()
    if skew is None or skew[0] != rank or getattr(time.time_ns, "skewed", False):
        return
    real, offset = time.time_ns, int(skew[1] * 1e9)

    def skewed() -> int:
        return real() + offset

    skewed.skewed = True
    time.time_ns = skewed
    _logger.warning("Test clock skew: rank %d's time.time_ns() runs %+.3f s off", rank, skew[1])


def estimate(store, key: str, rank: int, world_size: int) -> tuple[int, int] | None:
    """(offset, error) in nanoseconds of this clock against rank 0's; rank 0: (0, 0); None: no answer in time."""
    if world_size < 2:
        return None
    prefix = f"{_PREFIX}/{key}"
    deadline = time.monotonic() + BUDGET_SECONDS
    if rank == 0:
        _answer(store, prefix, world_size, deadline)
        return 0, 0
    best = None
    for round_ in range(ROUNDS):
        ping, pong = f"{prefix}/{rank}/{round_}/ping", f"{prefix}/{rank}/{round_}/pong"
        sent = time.time_ns()
        store.set(ping, b"1")
        if not _arrived(store, pong, deadline):
            break
        received = time.time_ns()
        theirs = int(store.get(pong))
        if best is None or received - sent < best[1] - best[0]:
            best = (sent, received, theirs)
    if best is None:
        _logger.debug("No clock offset to rank 0: no answer within %s s", BUDGET_SECONDS)
        return None
    sent, received, theirs = best
    return (sent + received) // 2 - theirs, (received - sent + 1) // 2


def _answer(store, prefix: str, world_size: int, deadline: float) -> None:
    for rank in range(1, world_size):
        for round_ in range(ROUNDS):
            if not _arrived(store, f"{prefix}/{rank}/{round_}/ping", deadline):
                return
            store.set(f"{prefix}/{rank}/{round_}/pong", str(time.time_ns()).encode())


def _arrived(store, key: str, deadline: float) -> bool:
    while not store.check([key]):
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True
