"""The clock offset's exchange (``runtime/clock.py``) with many ranks on one real TCPStore: every rank
answered within the budget, the store asked a bounded number of times, its keys removed. The 32-rank
tests are the slow lane's (their connections take 5 s); two ranks' are the fast lane's."""

from __future__ import annotations

import random
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from opentelemetry_instrumentation_deepspeed.runtime import clock

WORLD = 32


class Counting:
    """A rank's store client whose ``check`` calls (its polls for an answer) are counted."""

    def __init__(self, store):
        self.store, self.checks = store, 0

    def check(self, keys):
        self.checks += 1
        return self.store.check(keys)

    def __getattr__(self, name):
        return getattr(self.store, name)


def _connected(world: int) -> list:
    server = TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=20), wait_for_workers=False)
    return [Counting(server)] + [
        Counting(TCPStore("127.0.0.1", server.port, world, False, timeout=timedelta(seconds=20)))
        for _ in range(1, world)]


@pytest.fixture(scope="module")
def stores():  # one set of connections for the module: a TCPStore connect takes up to 0.3 s here (5 s for 32)
    clients = _connected(WORLD)
    yield clients
    del clients


@pytest.fixture(scope="module")
def pair():  # two ranks' connections: the fast lane's
    clients = _connected(2)
    yield clients
    del clients


def _all_at_once(stores, each):
    """``each(rank, store)`` on a thread per rank, all started together; {rank: (result, seconds)}."""
    found, go = {}, threading.Event()

    def run(rank):
        go.wait()
        started = time.monotonic()
        result = each(rank, stores[rank])
        found[rank] = (result, time.monotonic() - started)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(WORLD)]
    for thread in threads:
        thread.start()
    go.set()
    for thread in threads:
        thread.join(clock.BUDGET_SECONDS + 10)
    return found


def _clock_keys(store):
    return [key for key in store.store.list_keys() if key.startswith(clock._PREFIX)]


@pytest.mark.slow  # 32 connections: 5 s of the fast lane's minute
def test_32_ranks_asking_at_once_all_get_an_offset_within_the_budget_polling_with_a_backoff(stores):
    found = _all_at_once(stores, lambda rank, store: clock.estimate(store, "job", rank, WORLD))
    assert found[0][0] == (0, 0) and found[0][1] < clock.BUDGET_SECONDS, "rank 0 stops once all are answered"
    for rank in range(1, WORLD):
        (offset, error), seconds = found[rank]
        # One clock on both sides: the true offset is 0, within every bound.
        assert abs(offset) <= error + 1_000, (rank, offset, error)
        # The poll: 0.2 ms, then twice as long after each miss, 2 ms at most (~11 looks per rank here).
        assert stores[rank].checks <= 4 * 6 + seconds / 0.002 + 1, (
            rank, stores[rank].checks, seconds)
    assert _clock_keys(stores[0]) == [], "pings and answers removed"


@pytest.mark.slow  # as above
def test_a_refresh_round_at_scale_asks_a_share_of_the_ranks_in_turns(stores, monkeypatch):
    monkeypatch.setattr(clock, "REFRESH_SHARE", 8)  # 31 ranks in turns of 8: each asks every 4th round
    # Their threads wait a million seconds for their first round: the rounds below are called by hand (a stopped
    # refresher's round ends at once).
    refreshers = {rank: clock.Refresher(stores[rank], "refreshed", rank, WORLD, interval=1e6) for rank in range(WORLD)}
    asked = {}
    for round_ in (1, 2, 5):
        before = {rank: refresher.latest for rank, refresher in refreshers.items()}
        found = _all_at_once(stores, lambda rank, _store, r=round_: refreshers[rank].refresh(r))
        assert found[0][1] < clock.BUDGET_SECONDS, "rank 0 answers the ranks of this round, then stops"
        asked[round_] = {rank for rank in range(1, WORLD) if refreshers[rank].latest is not before[rank]}
        for rank in asked[round_]:
            offset, error, sent, received = refreshers[rank].latest
            assert abs(offset) <= error + 1_000 and sent <= received
    assert asked[1] == {rank for rank in range(1, WORLD) if (rank - 1) % 4 == 1}
    assert asked[2] == {rank for rank in range(1, WORLD) if (rank - 1) % 4 == 2}
    assert asked[5] == asked[1], "each rank in turn: round 5 asks round 1's ranks again"
    assert _clock_keys(stores[0]) == []
    for refresher in refreshers.values():
        refresher.stop()


def test_a_rank_waiting_for_a_late_rank_0_asks_the_store_at_most_every_2_ms(pair):
    stores = pair
    # Rank 0 builds its engine 0.3 s after rank 1 (one rank of many, all waiting so): rank 1's first
    # ping waits that long, polling 0.2 ms, then twice as long after each miss, 2 ms at most, so
    # ~150 looks (every 0.2 ms, as before: 956 looks in the 0.3 s on this loaded machine).
    late = threading.Timer(0.3, lambda: clock.estimate(stores[0], "late", 0, 2))
    late.start()
    started = time.monotonic()
    before = stores[1].checks
    offset, error = clock.estimate(stores[1], "late", 1, 2)
    waited = time.monotonic() - started
    late.join()
    assert waited >= 0.29 and abs(offset) <= error + 1_000
    checks = stores[1].checks - before
    assert checks <= 4 * 6 + waited / 0.002 + 1, (checks, waited)


def test_the_exchange_leaves_the_scripts_seeded_random_stream_alone(pair):
    """Every rank but 0 measures at start, on the training thread, and again on the refresher's: a script that
    seeded Python's ``random`` draws what it would without us."""
    random.seed(1234)
    expected = [random.random() for _ in range(3)]
    random.seed(1234)
    rank_0 = threading.Thread(target=clock.estimate, args=(pair[0], "seeded", 0, 2))
    rank_0.start()
    assert clock.estimate(pair[1], "seeded", 1, 2) is not None, "rank 1 measured an offset"
    rank_0.join(clock.BUDGET_SECONDS + 10)
    assert [random.random() for _ in range(3)] == expected


@pytest.mark.parametrize("rank", [0, 1])
def test_a_stopped_refresher_s_round_under_way_ends_before_the_exit_goes_on(pair, rank):
    """A rank whose peer never answers (rank 1 waiting for its pong, rank 0 for the pings) is inside a round for up to
    BUDGET_SECONDS. Its thread, left in a store call as the interpreter exited, aborted the process ("terminate called
    without an active exception") in 1 of 3 jobs refreshing every millisecond: stop() ends the round, and waits."""
    refresher = clock.Refresher(pair[rank], f"stopped-{rank}", rank, 2, interval=0.01)
    time.sleep(0.1)  # into its first round, which the other rank never joins
    assert refresher._thread.is_alive()
    started = time.monotonic()
    refresher.stop()
    assert not refresher._thread.is_alive(), "the round ended"
    assert time.monotonic() - started < clock.STOP_SECONDS
