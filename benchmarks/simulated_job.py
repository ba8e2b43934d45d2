"""A simulated 1,024-rank job's telemetry, and `diagnose` on it from files and from a Tempo-like API.

    python benchmarks/simulated_job.py OUT                 # write OUT/<job id>/{traces,metrics}-rank<N>.jsonl
    python benchmarks/simulated_job.py OUT --diagnose      # ... then time diagnose on it, both ways
                                                           # (again on OUT: diagnosed, not written again)

The job: ZeRO-2 data parallelism, one micro-batch per step. Each step a rank waits for its batch,
runs forward, then backward with two gradient buckets all-reduced synchronously (the second at its
end), then the optimizer with a parameter all-gather. A synchronous collective ends for everyone a
transfer time after the last rank arrives; whoever arrived earlier waits. Every rank's compute has
its own jitter (2% gaussian, and a 5-20 ms host hiccup in 1% of steps), its data wait is
exponential (mean 1.5 ms), clocks differ by up to --skew-us. Two ranks are faulty:

- ``--slow-rank`` computes ``--slow-factor`` times longer in ``--slow-share`` of the steps (a
  throttled GPU): the others wait for it in the collectives of those steps;
- ``--stall-rank``'s data loader stalls ``--stall-ms`` every ``--stall-every``-th step: everyone
  waits for it at the first collective of those steps.

The files are what the package writes (``export/output.py``, ``export/otlp_json.py``): one OTLP JSON
``ExportTraceServiceRequest`` per line, a line per batch the SDK's batch processor exports (every
second of the run, at most 512 spans), the resource and span attributes of ``docs/telemetry.md``,
ids in hex, every step's spans in the trace of ``trace_ids.step_ids`` under rank 0's
``training.global_step``; GPU utilization every --metric-interval seconds in ``metrics-rank<N>.jsonl``.
For the Tempo path each step's trace is also written as Tempo's ``/api/traces/<id>`` answers it
(resource spans as ``batches``, ids in base64), and a loopback server answers ``/api/search`` and
``/api/traces/<id>`` from them.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from opentelemetry_instrumentation_deepspeed.export.trace_ids import step_ids

MS = 1_000_000
FORWARD, BACKWARD, OPTIMIZER = 110 * MS, 220 * MS, 40 * MS
TRANSFER = {"bucket": 18 * MS, "all_gather": 12 * MS}
BUCKET_BYTES, GATHER_BYTES = 400 * 2**20, 400 * 2**20
SCOPE = '{"name":"opentelemetry_instrumentation_deepspeed","version":"0.1.0"}'
BATCH_SECONDS, BATCH_SPANS = 1.0, 512  # the distro's OTEL_BSP_SCHEDULE_DELAY, the SDK's max export batch


def _attribute(key: str, value) -> str:
    if isinstance(value, bool):
        return f'{{"key":"{key}","value":{{"boolValue":{"true" if value else "false"}}}}}'
    if isinstance(value, int):
        return f'{{"key":"{key}","value":{{"intValue":"{value}"}}}}'
    if isinstance(value, float):
        return f'{{"key":"{key}","value":{{"doubleValue":{value!r}}}}}'
    return f'{{"key":"{key}","value":{{"stringValue":{json.dumps(value)}}}}}'


def resource(job: str, rank: int, world: int) -> str:
    attributes = {"telemetry.sdk.language": "python", "telemetry.sdk.name": "opentelemetry",
                  "telemetry.sdk.version": "1.45.2", "service.instance.id": f"{job}-rank{rank}",
                  "service.name": "train", "host.name": f"node{rank // 8:04d}", "process.pid": 4000 + rank % 8,
                  "training.job.id": job, "training.rank": rank, "training.local_rank": rank % 8,
                  "training.world_size": world, "training.framework": "deepspeed", "deepspeed.version": "0.19.8",
                  "telemetry.auto.version": "0.66b2"}
    return '{"attributes":[' + ",".join(_attribute(k, v) for k, v in attributes.items()) + "]}"


class Ids:
    """Span ids, hex for the files and base64 for Tempo's answers."""

    def __init__(self, seed: int):
        self.random = random.Random(seed)

    def new(self) -> int:
        return self.random.getrandbits(64) or 1


def _span(trace: int, span: int, parent: int, name: str, start: int, end: int, attributes: list, *,  # noqa: PLR0917
          tempo: bool, remote_parent: bool = False) -> str:
    if tempo:
        ids = (base64.b64encode(trace.to_bytes(16, "big")).decode(), base64.b64encode(span.to_bytes(8, "big")).decode(),
               base64.b64encode(parent.to_bytes(8, "big")).decode() if parent else "")
    else:
        ids = (f"{trace:032x}", f"{span:016x}", f"{parent:016x}" if parent else "")
    parent_text = f',"parentSpanId":"{ids[2]}"' if parent else ""
    return (f'{{"traceId":"{ids[0]}","spanId":"{ids[1]}"{parent_text},"flags":{768 if remote_parent else 256},'
            f'"name":"{name}","kind":1,"startTimeUnixNano":"{start}","endTimeUnixNano":"{end}",'
            f'"attributes":[{",".join(attributes)}],"status":{{}}}}')


class Rank:
    def __init__(self, rank: int, world: int, job: str, folder: Path, skew: int):
        self.rank, self.skew = rank, skew
        self.resource = resource(job, rank, world)
        self.traces, self.metrics = folder / f"traces-rank{rank}.jsonl", folder / f"metrics-rank{rank}.jsonl"
        self.pending: list[str] = []
        self.flushed_at = 0
        self.cursor = 0  # this rank's clock at the end of its last step (true time)
        self.points: list[str] = []
        self.lines = 0

    def add(self, text: str, now: int) -> None:
        self.pending.append(text)
        if len(self.pending) >= BATCH_SPANS or now - self.flushed_at >= BATCH_SECONDS * 1e9:
            self.flush(now)

    def flush(self, now: int) -> None:
        if self.pending:
            with self.traces.open("a") as handle:
                handle.write(f'{{"resourceSpans":[{{"resource":{self.resource},"scopeSpans":[{{"scope":{SCOPE},'
                             f'"spans":[{",".join(self.pending)}]}}]}}]}}\n')
            self.pending, self.lines = [], self.lines + 1
        self.flushed_at = now

    def write_metrics(self) -> None:
        points = ",".join(self.points)
        with self.metrics.open("w") as handle:
            handle.write(f'{{"resourceMetrics":[{{"resource":{self.resource},"scopeMetrics":[{{"scope":'
                         f'{{"name":"opentelemetry_instrumentation_deepspeed","version":"0.1.0"}},"metrics":[{{'
                         f'"name":"hw.gpu.utilization","description":"GPU utilization","unit":"1",'
                         f'"gauge":{{"dataPoints":[{points}]}}}}]}}]}}]}}\n')


def simulate(out: Path, args) -> dict:  # noqa: PLR0912, PLR0915 - the steps of a whole job, in order
    job = f"sim-{args.ranks}-ranks-{args.seed}"
    folder, tempo = out / job, out / "tempo"
    folder.mkdir(parents=True)
    tempo.mkdir()
    rng = random.Random(args.seed)
    ids = Ids(args.seed)
    ranks = [Rank(r, args.ranks, job, folder, int(rng.uniform(-args.skew_us, args.skew_us) * 1000))
             for r in range(args.ranks)]
    begin = (int(time.time()) - 3600) * 10**9  # an hour ago: inside diagnose's default search window
    for rank in ranks:
        rank.cursor = begin + rng.randrange(2 * MS)
    sequence, interval = 0, int(args.metric_interval * 1e9)
    next_sample = [begin + interval] * args.ranks
    slow_steps = {step for step in range(1, args.steps + 1) if rng.random() < args.slow_share}
    spans = 0
    for step in range(1, args.steps + 1):
        trace, root = step_ids(job, step)
        stalled = step % args.stall_every == args.stall_offset
        per_rank = []  # (rank, list of (name, start, end, attributes, parent key))
        starts = {}
        clock = {}
        for rank in ranks:
            factor = args.slow_factor if rank.rank == args.slow_rank and step in slow_steps else 1.0
            start = rank.cursor + int(rng.uniform(0.2, 0.8) * MS)
            wait = int(rng.expovariate(1 / 1.5) * MS) + (args.stall_ms * MS if stalled and
                                                          rank.rank == args.stall_rank else 0)
            hiccup = int(rng.uniform(5, 20) * MS) if rng.random() < 0.01 else 0

            def jitter(base, factor=factor):
                return int(base * factor * max(0.9, rng.gauss(1.0, 0.02)))

            starts[rank.rank] = start
            clock[rank.rank] = {"start": start, "data": (start, start + wait)}
            forward_start = start + wait + int(0.05 * MS)
            forward_end = forward_start + jitter(FORWARD) + hiccup
            clock[rank.rank]["forward"] = (forward_start, forward_end)
            backward_start = forward_end + int(0.1 * MS)
            clock[rank.rank]["backward_start"] = backward_start
            clock[rank.rank]["arrive1"] = backward_start + jitter(BACKWARD // 2)
            clock[rank.rank]["compute2"] = jitter(BACKWARD // 2)
            clock[rank.rank]["optimizer"] = jitter(OPTIMIZER)
        # Bucket 1: everyone leaves a transfer after the last arrives, then computes the rest of backward.
        collectives = []
        for name, arrive_key, end_key in (("bucket1", "arrive1", "end1"), ("bucket2", "arrive2", "end2"),
                                          ("all_gather", "arrive3", "end3")):
            sequence += 1
            for times in clock.values():
                if name == "bucket2":
                    times["arrive2"] = times["end1"] + times["compute2"]
                elif name == "all_gather":
                    times["optimizer_start"] = times["end2"] + int(0.2 * MS)
                    times["arrive3"] = times["optimizer_start"] + times["optimizer"]
            last = max(times[arrive_key] for times in clock.values())
            transfer = TRANSFER["all_gather" if name == "all_gather" else "bucket"] * rng.uniform(0.97, 1.05)
            for times in clock.values():
                times[end_key] = int(last + transfer + rng.uniform(0, 0.2) * MS)
            collectives.append((name, arrive_key, end_key, sequence))
        for rank in ranks:
            c = clock[rank.rank]
            skew = rank.skew
            step_span, backward_span, optimizer_span = ids.new(), ids.new(), ids.new()
            backward_end = c["end2"] + int(0.3 * MS)
            optimizer_end = c["end3"] + int(0.5 * MS)
            step_end = optimizer_end + int(0.1 * MS)
            items = [
                ("training.data.wait", ids.new(), step_span, *c["data"], [_attribute("training.micro_step", 0)]),
                ("training.forward", ids.new(), step_span, *c["forward"], [_attribute("training.micro_step", 0)]),
                ("training.backward", backward_span, step_span, c["backward_start"], backward_end,
                 [_attribute("training.micro_step", 0), _attribute("comm.count", 2)]),
                ("training.optimizer.step", optimizer_span, step_span, c["optimizer_start"], optimizer_end,
                 [_attribute("comm.count", 1)]),
            ]
            for name, arrive_key, end_key, number in collectives:
                op = "all_gather_into_tensor" if name == "all_gather" else "all_reduce"
                size = GATHER_BYTES if name == "all_gather" else BUCKET_BYTES
                seconds = (c[end_key] - c[arrive_key]) / 1e9
                algbw = size / seconds
                busbw = algbw * (2 if op == "all_reduce" else 1) * (args.ranks - 1) / args.ranks
                items.append((f"comm.{op}", ids.new(), optimizer_span if name == "all_gather" else backward_span,
                              c[arrive_key], c[end_key], [
                                  _attribute("comm.op", op), _attribute("comm.backend", "nccl"),
                                  _attribute("comm.group.size", args.ranks), _attribute("comm.group.name", "0"),
                                  _attribute("comm.bytes", size), _attribute("comm.dtype", "bfloat16"),
                                  _attribute("comm.async", False), _attribute("comm.sequence", number),
                                  _attribute("comm.algbw", algbw), _attribute("comm.busbw", busbw)]))
            items.append(("training.step", step_span, root, c["start"], step_end, [
                _attribute("training.step", step), _attribute("training.gradient_accumulation_steps", 1),
                _attribute("training.zero_stage", 2), _attribute("training.micro_batch_size", 4),
                _attribute("training.step.samples", 4), _attribute("training.step.micro_batches", 1),
                _attribute("training.step.skipped", False), _attribute("comm.count", 3)]))
            if rank.rank == 0:
                items.append(("training.global_step", root, 0, min(starts.values()) - int(0.3 * MS),
                              step_end + int(0.4 * MS), [_attribute("training.step", step),
                                                         _attribute("training.step.samples", 4 * args.ranks),
                                                         _attribute("training.world_size", args.ranks)]))
            tempo_spans = []
            for name, span, parent, start, end, attributes in items:
                remote = name == "training.step"
                rank.add(_span(trace, span, parent, name, start + skew, end + skew, attributes, tempo=False,
                               remote_parent=remote), step_end + skew)
                tempo_spans.append(_span(trace, span, parent, name, start + skew, end + skew, attributes, tempo=True,
                                         remote_parent=remote))
            spans += len(items)
            per_rank.append((rank, tempo_spans))
            # GPU utilization samples that fall in this step: busy in compute, idle while waiting.
            while next_sample[rank.rank] <= step_end:
                at = next_sample[rank.rank]
                busy = (c["forward"][0] <= at <= c["forward"][1] or
                        c["backward_start"] <= at <= c["arrive1"] or c["end1"] <= at <= c["arrive2"] or
                        c["optimizer_start"] <= at <= c["arrive3"])
                value = min(1.0, rng.gauss(0.97, 0.01)) if busy else max(0.0, rng.gauss(0.05, 0.02))
                rank.points.append(f'{{"attributes":[{_attribute("hw.id", f"GPU-{rank.rank:08x}")}],'
                                   f'"timeUnixNano":"{at + skew}","asDouble":{value!r}}}')
                next_sample[rank.rank] += interval
            rank.cursor = step_end
        batches = ",".join(f'{{"resource":{rank.resource},"scopeSpans":[{{"scope":{SCOPE},'
                           f'"spans":[{",".join(texts)}]}}]}}' for rank, texts in per_rank)
        (tempo / f"{trace:032x}.json").write_text(f'{{"batches":[{batches}]}}')
        (tempo / f"{trace:032x}.start").write_text(str(min(starts.values())))
    for rank in ranks:
        rank.flush(rank.cursor)
        rank.write_metrics()
    return {"job": job, "folder": folder, "tempo": tempo, "spans": spans, "slow_steps": len(slow_steps),
            "stalled_steps": sum(1 for s in range(1, args.steps + 1) if s % args.stall_every == args.stall_offset)}


def serve_tempo(folder: Path, job: str) -> tuple[ThreadingHTTPServer, str]:
    """A loopback server answering as Tempo's HTTP API: /api/search by tag, /api/traces/<id>."""
    traces = {path.stem: int(path.with_suffix(".start").read_text()) for path in folder.glob("*.json")}

    class Tempo(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            url = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(url.query)
            if url.path == "/api/search":
                if query.get("tags") != [f"training.job.id={job}"]:
                    return self._answer(200, b'{"traces":[]}')
                low, high = int(query["start"][0]) * 10**9, int(query["end"][0]) * 10**9
                found = sorted((start, trace) for trace, start in traces.items() if low <= start <= high)
                found = found[:int(query.get("limit", ["20"])[0])]
                return self._answer(200, json.dumps({"traces": [
                    {"traceID": trace, "rootServiceName": "train", "rootTraceName": "training.global_step",
                     "startTimeUnixNano": str(start)} for start, trace in found]}).encode())
            if url.path.startswith("/api/traces/") and url.path.rsplit("/", 1)[1] in traces:
                return self._answer(200, (folder / f"{url.path.rsplit('/', 1)[1]}.json").read_bytes())
            return self._answer(404, b"trace not found")

        def _answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Tempo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def diagnose(*args: str) -> tuple[dict, float, float, float]:
    """(report, wall seconds, CPU seconds, peak RSS MiB) of the console script in a child process."""
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "opentelemetry_instrumentation_deepspeed.diagnose.cli",
                                    "diagnose", *args, "--json"], stdout=stdout, stderr=stderr)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - started
        stdout.seek(0)
        stderr.seek(0)
        if os.waitstatus_to_exitcode(status) != 0:
            sys.exit(f"diagnose failed: {stderr.read()[-2000:]}")
        return json.load(stdout), seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def named(report: dict, rank: int) -> list[str]:
    """The findings that name ``rank`` (the verdict, when the report has no list of findings), and the
    straggler block."""
    places = []
    for index, finding in enumerate(report.get("findings") or [report["verdict"]]):
        if finding.get("rank") == rank or f"rank {rank} " in finding.get("summary", ""):
            places.append(f"finding {index + 1}: {finding['layer'].upper()}: {finding['summary']}")
    if (report.get("straggler") or {}).get("rank") == rank:
        places.append(f"straggler block: +{report['straggler']['extra_compute_seconds'] * 1e3:.0f} ms compute per step")
    return places


def show(label: str, run: tuple, args) -> None:
    report, seconds, cpu, peak = run
    (Path(args.out) / f"report-{label.split(maxsplit=1)[0].lower()}.json").write_text(json.dumps(report, indent=1))
    verdict = report["verdict"]
    print(f"{label}: {report['input']['spans']} spans in {seconds:.1f} s ({cpu:.1f} s of CPU), peak RSS {peak:.0f} MiB")
    print(f"  verdict: {verdict['layer'].upper()}: {verdict['summary']}")
    for rank, fault in ((args.slow_rank, "slow compute"), (args.stall_rank, "loader stall")):
        places = named(report, rank)
        anomaly = (report["ranks"].get(str(rank)) or {}).get("anomaly")
        own = (f" (its own step series: every {anomaly['period']}th step +{anomaly['extra_seconds'] * 1e3:.0f} ms, "
               f"most in {anomaly['phase']})" if anomaly and anomaly.get("period") else "")
        print(f"  rank {rank} ({fault}): " + ("; ".join(places) if places else "not named") + own)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="an empty or new directory")
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--slow-rank", type=int, default=417)
    parser.add_argument("--slow-factor", type=float, default=1.3)
    parser.add_argument("--slow-share", type=float, default=0.85)
    parser.add_argument("--stall-rank", type=int, default=731)
    parser.add_argument("--stall-every", type=int, default=7)
    parser.add_argument("--stall-offset", type=int, default=3)
    parser.add_argument("--stall-ms", type=int, default=600)
    parser.add_argument("--skew-us", type=float, default=50.0, help="clock offsets of the ranks, up to +-")
    parser.add_argument("--metric-interval", type=float, default=10.0, help="seconds between GPU samples")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--diagnose", action="store_true", help="then time diagnose from files and from Tempo")
    parser.add_argument("--sources", default="files,tempo", help="what --diagnose reads: files, tempo or both")
    args = parser.parse_args()
    out = Path(args.out)
    started = time.perf_counter()
    name = f"sim-{args.ranks}-ranks-{args.seed}"
    if (out / name).is_dir():  # written by an earlier run with the same arguments: diagnosed again
        job = {"job": name, "folder": out / name, "tempo": out / "tempo"}
    else:
        job = simulate(out, args)
        print(f"{args.ranks} ranks x {args.steps} steps: {job['spans']} spans in {job['folder']} "
              f"({time.perf_counter() - started:.0f} s); rank {args.slow_rank} slow in {job['slow_steps']} steps, "
              f"rank {args.stall_rank} stalls in {job['stalled_steps']}")
    size = sum(p.stat().st_size for p in job["folder"].iterdir())
    print(f"{size / 2**20:.0f} MiB of OTLP JSON lines in {len(list(job['folder'].iterdir()))} files")
    if not args.diagnose:
        return
    if "files" in args.sources:
        show("files", diagnose(str(job["folder"])), args)
    if "tempo" not in args.sources:
        return
    server, url = serve_tempo(job["tempo"], job["job"])
    try:
        show("Tempo API", diagnose("--tempo", url, "--job", job["job"]), args)
    finally:
        server.shutdown()


if __name__ == "__main__":
    main()
