"""The clock offset's exchange (``runtime/clock.py``) at N ranks: one real TCPStore, N-1 simulated ranks.

    python benchmarks/clock_scale.py --ranks 8 64 256 1024            # start estimate and one refresh round
    PYTHONPATH=/path/to/other/checkout python benchmarks/clock_scale.py ...   # another version of clock.py

This process is rank 0: it holds the store's server (``torch.distributed.TCPStore``, as rank 0's
process does under ``torchrun``) and runs ``clock.estimate`` (then ``Refresher.refresh``) on it, as
rank 0 does. The other ranks are threads in ``--processes`` worker processes, each with a store client
of its own (a connection, as each rank has), running the same functions of the package (not a
copy) at the same moment. Every store call is counted by a wrapper around each client, rank 0's
included. All ranks share this machine's clock, so each estimate's true offset is 0: its error
bound is what is reported, and an estimate whose offset lies outside its bound is counted as wrong.

Per world size and exchange, one line: the ranks with an estimate, the wall time of the exchange
(from the go to the last rank's return), the store requests and their rate, rank 0's process CPU
seconds (its answering thread and the store server's thread), and the error bounds' median / 90th
percentile / maximum.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

from torch.distributed import TCPStore

from opentelemetry_instrumentation_deepspeed.runtime import clock


class Counting:
    """A store whose calls are counted (each call is one request to the server)."""

    def __init__(self, store):
        self._store, self.calls = store, {}

    def __getattr__(self, name):
        method = getattr(self._store, name)

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return method(*args, **kwargs)

        return counted


def _exchange(store, key: str, rank: int, world: int, mode: str):
    """One rank's part; (offset, error) or None."""
    if mode == "estimate":
        return clock.estimate(store, key, rank, world)
    refresher = clock.Refresher(store, key, rank, world, interval=1e6)  # its own thread never refreshes
    refresher.stop()
    refresher.refresh(1)
    if rank == 0:
        return 0, 0
    return None if refresher.latest is None else refresher.latest[:2]


def worker(port: int, key: str, world: int, ranks: list[int], modes: list[str]) -> None:
    stores = {rank: Counting(TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=60)))
              for rank in ranks}
    control = stores[ranks[0]]._store
    control.add(f"{key}/ready", len(ranks))
    for mode in modes:
        results, threads, go = {}, [], threading.Event()

        def run(rank, mode=mode, results=results, go=go):
            go.wait()
            store = stores[rank]
            store.calls = {}
            found = _exchange(store, f"{key}/{mode}", rank, world, mode)
            results[rank] = {"found": found, "end": time.monotonic(), "calls": store.calls}

        for rank in ranks:
            threads.append(threading.Thread(target=run, args=(rank,), daemon=True))
            threads[-1].start()
        control.add(f"{key}/{mode}/ready", len(ranks))
        while not control.check([f"{key}/{mode}/go"]):
            time.sleep(0.001)
        go.set()
        for thread in threads:
            thread.join(30)
        print(json.dumps(results), flush=True)


def sitting(world: int, processes: int, modes: list[str], round_: int) -> list[dict]:
    key = f"bench-{world}-{round_}"
    server = TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    ranks = list(range(1, world))
    shares = [ranks[i::processes] for i in range(min(processes, len(ranks)))]
    children, connected = [], 0
    for share in shares:  # one after another: TCPStore clients connecting from several processes at once
        # take ~0.2-0.3 s each here (one at a time: ~1 ms)
        children.append(subprocess.Popen([sys.executable, __file__, "--worker", str(server.port), key, str(world),
                                          ",".join(modes), ",".join(map(str, share))], stdout=subprocess.PIPE,
                                         text=True))
        connected += len(share)
        while int(server.add(f"{key}/ready", 0)) < connected:
            time.sleep(0.01)
    lines = [[] for _ in children]
    readers = [threading.Thread(target=_read, args=(child.stdout, out), daemon=True)
               for child, out in zip(children, lines, strict=True)]
    for reader in readers:
        reader.start()
    found = []
    for index, mode in enumerate(modes):
        found.append(_one(server, f"{key}/{mode}", world, mode, lines=lines, index=index))
    for child in children:
        child.wait(60)
    del server
    return found


def _read(stream, out: list) -> None:
    for line in stream:  # a line per exchange, as each ends
        out.append(line)


def _one(server, key: str, world: int, mode: str, *, lines: list, index: int) -> dict:
    while int(server.add(f"{key}/ready", 0)) < world - 1:
        time.sleep(0.01)
    time.sleep(0.2)  # the workers' threads sit in their go wait
    rank0 = Counting(server)
    cpu = time.process_time()
    start = time.monotonic()
    server.set(f"{key}/go", b"1")
    found0 = _exchange(rank0, key, 0, world, mode)
    rank0_end = time.monotonic()
    cpu = time.process_time() - cpu
    deadline = time.monotonic() + 60
    while any(len(out) <= index for out in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    results = {}
    for out in lines:
        results.update({int(rank): value for rank, value in json.loads(out[index]).items()})
    got = [r for r in results.values() if r["found"] is not None]
    errors = sorted(r["found"][1] / 1e6 for r in got)
    wrong = sum(abs(r["found"][0]) > r["found"][1] for r in got)
    end = max([rank0_end] + [r["end"] for r in results.values()])
    calls = {}
    for r in [*results.values(), {"calls": rank0.calls}]:
        for name, count in r["calls"].items():
            calls[name] = calls.get(name, 0) + count
    requests = sum(calls.values())
    left = [k for k in server.list_keys() if k.startswith(clock._PREFIX)]
    pct = (lambda q: errors[min(len(errors) - 1, int(q * len(errors)))]) if errors else (lambda q: float("nan"))
    return {"mode": mode, "world": world, "estimates": len(got), "of": world - 1, "wrong": wrong,
            "wall_s": round(end - start, 3), "rank0_wall_s": round(rank0_end - start, 3),
            "requests": requests, "requests_per_s": round(requests / (end - start)),
            "rank0_cpu_s": round(cpu, 3), "rank0_requests": sum(rank0.calls.values()),
            "error_ms_median": round(pct(0.5), 3), "error_ms_p90": round(pct(0.9), 3),
            "error_ms_max": round(errors[-1] if errors else float("nan"), 3), "calls": calls,
            "keys_left": len(left), "keys_left_e.g.": left[:3], "rank0_ok": found0 is not None}


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        port, key, world, modes, ranks = sys.argv[2:7]
        worker(int(port), key, int(world), [int(r) for r in ranks.split(",")], modes.split(","))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--processes", type=int, default=8, help="worker processes the simulated ranks share")
    parser.add_argument("--modes", nargs="+", default=["estimate", "refresh"])
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    print(f"clock.py: {clock.__file__}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
          flush=True)
    for world in args.ranks:
        for round_ in range(args.repeat):
            for found in sitting(world, args.processes, args.modes, round_):
                print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
