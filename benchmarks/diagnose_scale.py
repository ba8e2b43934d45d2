"""Seconds and peak memory of `opentelemetry-deepspeed diagnose` on large inputs.

    python benchmarks/diagnose_scale.py telemetry/<job> --spans 1000000   # a real run, repeated
    python benchmarks/diagnose_scale.py --one-step 16000                  # one step, 16k phases + 16k collectives
    python benchmarks/diagnose_scale.py --gpu-samples 20000               # 20k steps and 20k GPU samples

A real run's spans (a telemetry job directory) are repeated, renumbered and with fresh trace ids,
until the file holds --spans spans. The synthetic inputs are the two shapes that were quadratic:
every phase of a step against every collective of the step, and every GPU sample against every
step. Each input is diagnosed by the console script in a child process, timed, and its peak RSS
read from ``wait4``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEQUENCE_STRIDE = 1_000_000


def renumber(span: dict, copy: int, steps: int) -> None:
    """The copy-th repetition: its own trace ids, step numbers and collective sequence numbers."""
    span["traceId"] = f"{copy:06x}" + span["traceId"][6:]
    for attribute in span.get("attributes", []):
        value = attribute["value"]
        if attribute["key"] == "training.step":
            value["intValue"] = str(int(value["intValue"]) % steps + copy * steps)
        elif attribute["key"] == "comm.sequence":
            value["intValue"] = str(int(value["intValue"]) % SEQUENCE_STRIDE + copy * SEQUENCE_STRIDE)


def repeated(job_dir: str, spans: int, out: Path) -> str:
    requests = [json.loads(line) for path in sorted(Path(job_dir).glob("traces-rank*.jsonl"))
                for line in path.read_text().splitlines()]
    per_copy = sum(len(s["spans"]) for r in requests for rs in r["resourceSpans"] for s in rs["scopeSpans"])
    steps = max(int(span["attributes"][0]["value"]["intValue"]) for r in requests for rs in r["resourceSpans"]
                for s in rs["scopeSpans"] for span in s["spans"] if span["name"] == "training.step")
    copies = -(-spans // per_copy)
    written = 0
    with out.open("w") as handle:
        for copy in range(copies):
            for request in requests:
                for resource_spans in request["resourceSpans"]:
                    for scope in resource_spans["scopeSpans"]:
                        for span in scope["spans"]:
                            renumber(span, copy, steps)
                            written += 1
                handle.write(json.dumps(request, separators=(",", ":")) + "\n")
    return f"{written} spans ({copies} copies of {per_copy}, {steps} steps each)"


RESOURCE = {"attributes": [{"key": "training.job.id", "value": {"stringValue": "scale"}},
                           {"key": "training.rank", "value": {"intValue": "0"}}]}
T0 = 1_700_000_000 * 10**9


def _span(name: str, trace: int, start: int, end: int, attributes: list) -> dict:
    return {"traceId": f"{trace:032x}", "spanId": f"{start % 2**64:016x}", "name": name,
            "startTimeUnixNano": str(start), "endTimeUnixNano": str(end), "attributes": attributes}


def _write(out: Path, spans: list, metrics: list | None = None) -> None:
    with out.open("w") as handle:
        for first in range(0, len(spans), 512):  # the SDK's batch
            handle.write(json.dumps({"resourceSpans": [{"resource": RESOURCE, "scopeSpans": [
                {"spans": spans[first:first + 512]}]}]}, separators=(",", ":")) + "\n")
        if metrics:
            handle.write(json.dumps({"resourceMetrics": [{"resource": RESOURCE, "scopeMetrics": [
                {"metrics": [{"name": "hw.gpu.utilization", "gauge": {"dataPoints": metrics}}]}]}]}) + "\n")


def one_step(count: int, out: Path) -> str:
    """One step holding ``count`` forward/backward phases of 1 ms, each with a 0.4 ms collective."""
    spans = [_span("training.step", 1, T0, T0 + count * 10**6 + 10**6,
                   [{"key": "training.step", "value": {"intValue": "1"}}])]
    for index in range(count):
        start = T0 + index * 10**6
        spans.append(_span("training.forward" if index % 2 else "training.backward", 1, start, start + 9 * 10**5, []))
        spans.append(_span("comm.all_reduce", 1, start + 4 * 10**5, start + 8 * 10**5, [
            {"key": "comm.sequence", "value": {"intValue": str(index)}},
            {"key": "comm.async", "value": {"boolValue": False}}]))
    _write(out, spans)
    return f"one step of {count} phases and {count} collectives"


def gpu_samples(count: int, out: Path) -> str:
    """``count`` steps of 10 ms, 2 ms apart, and one GPU utilization sample in each."""
    spans, points = [], []
    for step in range(1, count + 1):
        start = T0 + step * 12 * 10**6
        spans.append(_span("training.step", step, start, start + 10**7,
                           [{"key": "training.step", "value": {"intValue": str(step)}}]))
        spans.append(_span("training.forward", step, start, start + 6 * 10**6, []))
        points.append({"timeUnixNano": str(start + 3 * 10**6), "asDouble": 0.9})
    _write(out, spans, points)
    return f"{count} steps and {count} GPU samples"


def measure(path: Path, what: str) -> None:
    size = path.stat().st_size
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as stdout:
        process = subprocess.Popen([sys.executable, "-m", "opentelemetry_instrumentation_deepspeed.diagnose.cli",
                                    "diagnose", str(path), "--json"], stdout=stdout, stderr=subprocess.DEVNULL)
        _, _status, usage = os.wait4(process.pid, 0)  # this child's own peak
        seconds = time.perf_counter() - started
        stdout.seek(0)
        report = json.load(stdout)
    print(f"{what}, {size / 2**20:.0f} MiB of OTLP JSON: {seconds:.1f} s "
          f"({usage.ru_utime + usage.ru_stime:.1f} s of CPU), peak RSS {usage.ru_maxrss / 1024:.0f} MiB; "
          f"{report['input']['spans']} spans read; verdict {report['verdict']['layer']}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("job_dir", nargs="?", help="a real run's telemetry directory, repeated to --spans")
    parser.add_argument("--spans", type=int, default=1_000_000)
    parser.add_argument("--one-step", type=int, metavar="N", help="one step of N phases and N collectives")
    parser.add_argument("--gpu-samples", type=int, metavar="N", help="N steps and N GPU samples")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "spans.jsonl"
        if args.one_step:
            what = one_step(args.one_step, out)
        elif args.gpu_samples:
            what = gpu_samples(args.gpu_samples, out)
        elif args.job_dir:
            what = repeated(args.job_dir, args.spans, out)
        else:
            parser.error("a job directory, --one-step or --gpu-samples")
        measure(out, what)


if __name__ == "__main__":
    main()
