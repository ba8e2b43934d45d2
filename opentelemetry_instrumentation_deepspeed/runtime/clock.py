"""This rank's clock against rank 0's, estimated at start through the process group's store, then
refreshed during the run on a thread of its own.

Each rank other than 0 sends ``ROUNDS`` pings through the store; rank 0 answers each with its
clock. A ping sent at ``t1`` and answered (with rank 0's time ``t0``) when read at ``t2`` bounds
the offset: rank 0's reading was taken between the two, so this clock minus rank 0's lies in
``[t1 - t0, t2 - t0]``. The round with the shortest round trip gives the estimate (its middle)
and its error (half the round trip). It runs while the engine is built, when the job id is agreed
the same way: never during a step. The result is a resource attribute (``training.clock.offset``),
and ``diagnose`` moves the rank's times by it.

The exchange is built to stay cheap for the store at a thousand ranks (the store torch and DeepSpeed
use too; ``benchmarks/clock_scale.py`` measures it):

- a ping is an ``append`` of ``"<rank>.<round> "`` to one log key; rank 0 reads the log in sweeps and
  answers every ping that came since the last sweep at once: one reading of its clock (taken after
  the pings were read, before the answers are visible: inside every one of their round trips) and
  one ``multi_set`` of the answers, so it answers in the order pings come instead of one rank after
  another (each rank waited for all lower ranks' rounds before: at 256 ranks most got no answer
  within the budget);
- each ping leaves at a random moment of a window of ``SPREAD_SECONDS`` per rank asking (50 ms at
  1,024 ranks; 0.05 ms at 2), so ranks that start together do not all wait at once;
- a waiting rank polls its answer with ``check`` (never a blocking ``wait``, which would hold the
  store client's lock from the training thread's own store calls), first after ``POLL_SECONDS``,
  then twice as long after each miss, up to ``POLL_CAP_SECONDS`` per 64 ranks asking: the
  waiting ranks together ask about as often at any size, and the best of the rounds is kept anyway;
- everything ends within ``BUDGET_SECONDS``; rank 0 stops as soon as every expected ping is
  answered (each once), removes the log, and each rank removes its answers at the end of its exchange.

Clocks drift apart (and get stepped) during a long run, so the same exchange is made again every
``OTEL_PYTHON_DEEPSPEED_CLOCK_REFRESH`` seconds by a daemon thread on each rank (``Refresher``):
never by the training thread, which does nothing for it. Every rank counts the rounds from the end
of the start estimate on its own monotonic clock, so rank 0 answers round ``k`` while the others
ask (its answer waits ``BUDGET_SECONDS`` at most). Beyond ``REFRESH_SHARE`` ranks a round takes the
ranks in turns (rank ``r`` asks in rounds ``k`` with ``(r - 1) % turns == k % turns``), so every rank
is still measured every ``turns`` rounds. Each reading goes to the emitter, which writes a
``training.clock.sync`` span (``export/clock.py``); ``diagnose`` moves each span by the readings
read before it: the latest, carried forward at the rate between the last two (a drifting clock).
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time

_logger = logging.getLogger(__name__)
# The pings' moments: the OS's randomness. The global generator belongs to the user's script, whose seeded draws must
# be those of a run without us; a generator of our own would draw the same in ranks forked from one parent.
_jitter = random.SystemRandom()
_NEVER = threading.Event()  # the start estimate's rounds: nothing stops them but their deadline

ROUNDS = 4
BUDGET_SECONDS = 3.0
POLL_SECONDS = 0.0002
POLL_CAP_SECONDS = 0.002
SPREAD_SECONDS = 0.00005
REFRESH_SHARE = 256
STOP_SECONDS = 0.5  # the exit waits this long at most for a round under way to see it is stopped
_PREFIX = "opentelemetry-instrumentation-deepspeed/clock"


def apply_test_skew(rank: int) -> None:
    """``OTEL_PYTHON_DEEPSPEED_TEST_CLOCK_SKEW`` (tests only): this rank's ``time.time_ns`` runs off by that much,
    and drifts on by its rate (seconds per second) from now on."""
    from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env

    skew = env.test_clock_skew()
    if skew is None or skew[0] != rank or getattr(time.time_ns, "skewed", False):
        return
    real, offset, rate = time.time_ns, int(skew[1] * 1e9), skew[2]
    since = real()

    def skewed() -> int:
        now = real()
        return now + offset + int((now - since) * rate)

    skewed.skewed = True
    time.time_ns = skewed
    _logger.warning("Test clock skew: rank %d's time.time_ns() runs %+.3f s off, drifting %+.6f s/s from %d", rank,
                    skew[1], rate, since)


def estimate(store, key: str, rank: int, world_size: int) -> tuple[int, int] | None:
    """(offset, error) in nanoseconds of this clock against rank 0's; rank 0: (0, 0); None: no answer in time."""
    if world_size < 2:
        return None
    prefix = f"{_PREFIX}/{key}"
    deadline = time.monotonic() + BUDGET_SECONDS
    if rank == 0:
        _answer(store, prefix, range(1, world_size), deadline)
        return 0, 0
    found = _measure(store, prefix, rank, world_size - 1, deadline)
    return None if found is None else found[:2]


def _measure(store, prefix: str, rank: int, asking: int, deadline: float, *,
             stopped: threading.Event = _NEVER) -> tuple[int, int, int, int] | None:
    """(offset, error, sent, received) of the best of ``ROUNDS`` pings to rank 0, ``asking`` ranks asking
    with it; None: no answer in time, or ``stopped``. Removes its answers from the store at the end."""
    best, cap = None, _poll_cap(asking)
    for round_ in range(ROUNDS):
        # Each ping at a random moment of a window as long as SPREAD_SECONDS per rank asking: ranks that
        # start together do not all wait at once (their answers would queue behind each other's looks).
        time.sleep(max(0.0, min(_jitter.random() * asking * SPREAD_SECONDS, deadline - time.monotonic())))
        pong = f"{prefix}/{rank}/{round_}/pong"
        sent = time.time_ns()
        store.append(f"{prefix}/pings", f"{rank}.{round_} ")
        if not _arrived(store, pong, deadline, cap, stopped=stopped):
            break
        received = time.time_ns()
        theirs = int(store.get(pong))
        if best is None or received - sent < best[1] - best[0]:
            best = (sent, received, theirs)
    for round_ in range(ROUNDS):  # all of them at the end, answered or not (rank 0 is done with them)
        with contextlib.suppress(Exception):
            store.delete_key(f"{prefix}/{rank}/{round_}/pong")
    if best is None:
        _logger.debug("No clock offset to rank 0: no answer within %s s", BUDGET_SECONDS)
        return None
    sent, received, theirs = best
    return (sent + received) // 2 - theirs, (received - sent + 1) // 2, sent, received


def _answer(store, prefix: str, ranks, deadline: float, *, stopped: threading.Event = _NEVER) -> None:
    """Answer ``ranks``' pings in the order they come, every ping read in one sweep with one reading of
    this clock, until each rank had its ``ROUNDS``, the deadline passed or ``stopped``; then remove the pings' log."""
    log, expected, answered = f"{prefix}/pings", set(ranks), set()
    read = 0
    try:
        while len(answered) < len(expected) * ROUNDS:
            pings = store.get(log)[read:] if read or store.check([log]) else b""
            read += len(pings)
            # Each ping once (an answer set again after its rank removed it would stay in the store).
            asked = {entry.decode() for entry in pings.split()} - answered
            asked = [entry for entry in asked if int(entry.partition(".")[0]) in expected]
            if asked:
                now = str(time.time_ns())
                store.multi_set([f"{prefix}/{entry.replace('.', '/')}/pong" for entry in asked], [now] * len(asked))
                answered.update(asked)
            elif time.monotonic() > deadline or stopped.is_set():
                return
            else:
                time.sleep(POLL_SECONDS)
    finally:
        with contextlib.suppress(Exception):
            store.delete_key(log)


def _poll_cap(asking: int) -> float:
    """The longest wait between two looks for an answer: ``POLL_CAP_SECONDS`` per 64 ranks asking, so the
    waiting ranks together ask the store about as often at any world size."""
    return POLL_CAP_SECONDS * max(1.0, asking / 64)


def _arrived(store, key: str, deadline: float, cap: float = POLL_SECONDS, *,
             stopped: threading.Event = _NEVER) -> bool:
    """``key`` is in the store before the deadline (and before ``stopped``); polled with ``check``, every
    ``POLL_SECONDS`` at first, then twice as long after each miss up to ``cap``."""
    pause = POLL_SECONDS
    while not store.check([key]):
        if time.monotonic() > deadline or stopped.is_set():
            return False
        time.sleep(pause)
        pause = min(pause * 2, cap)
    return True


class Refresher:
    """Estimates the offset again every ``interval`` seconds, off the training thread; ``readings``
    go to ``send`` (rank 0 only answers)."""

    def __init__(self, store, key: str, rank: int, world_size: int, interval: float):
        self.store, self.key, self.rank, self.world_size, self.interval = store, key, rank, world_size, interval
        self.origin = time.monotonic()  # the start estimate's end: every rank counts rounds from it
        self.latest: tuple[int, int, int, int] | None = None  # (offset, error, sent, received)
        self.send = None  # called with each reading, on this thread
        self.rounds = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="otel-deepspeed-clock")
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                self.rounds += 1
                if self._stopped.wait(max(0.0, self.origin + self.rounds * self.interval - time.monotonic())):
                    return
                self.refresh(self.rounds)
        except Exception:  # only later readings are lost: the start estimate stays
            _logger.debug("Clock refresh stopped", exc_info=True)

    def stop(self) -> None:
        """No more rounds; a round under way ends at its next look at the store. Waited for, briefly: a thread left
        inside a store call as the interpreter exits can abort the process ("terminate called without an active
        exception", a rank's exit code -6 in 1 of 3 jobs refreshing every millisecond)."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(STOP_SECONDS)

    def refresh(self, round_: int) -> None:
        prefix = f"{_PREFIX}/{self.key}/{round_}"
        deadline = time.monotonic() + BUDGET_SECONDS
        asking = [r for r in range(1, self.world_size) if self.asks(r, round_)]
        if self.rank == 0:
            _answer(self.store, prefix, asking, deadline, stopped=self._stopped)
            return
        if not self.asks(self.rank, round_):
            return
        found = _measure(self.store, prefix, self.rank, len(asking), deadline, stopped=self._stopped)
        if found is not None:
            self.latest = found
            if self.send is not None:
                self.send(found)

    def asks(self, rank: int, round_: int) -> bool:
        """Whether ``rank`` measures in round ``round_``: all of them up to ``REFRESH_SHARE`` ranks, else each
        rank every ``ceil((world_size - 1) / REFRESH_SHARE)``-th round, in turns."""
        turns = -(-(self.world_size - 1) // REFRESH_SHARE)
        return (rank - 1) % turns == round_ % turns


_refresher: Refresher | None = None


def keep_fresh(store, key: str, rank: int, world_size: int) -> None:
    """Start the refreshing thread, once per process (after the start estimate, on every rank)."""
    global _refresher  # noqa: PLW0603 - one per process
    from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env
    from opentelemetry_instrumentation_deepspeed.runtime import lifecycle

    interval = env.clock_refresh()
    if _refresher is None and interval and world_size > 1:
        _refresher = refresher = Refresher(store, key, rank, world_size, interval)
        lifecycle.at_exit(lifecycle.STOP_CLOCK, lambda _reason: refresher.stop())


def refresher() -> Refresher | None:
    return _refresher
