"""Seconds and peak memory of `opentelemetry-deepspeed diagnose` on a million spans.

Takes the spans of a real run (a telemetry job directory) and repeats its steps, renumbered and
with fresh trace ids, until the file holds --spans spans; then times the command in a child
process and reads its peak RSS.

    python benchmarks/diagnose_scale.py telemetry/<job> --spans 1000000
"""

from __future__ import annotations

import argparse
import json
import resource
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("job_dir")
    parser.add_argument("--spans", type=int, default=1_000_000)
    args = parser.parse_args()
    requests = [json.loads(line) for path in sorted(Path(args.job_dir).glob("traces-rank*.jsonl"))
                for line in path.read_text().splitlines()]
    per_copy = sum(len(s["spans"]) for r in requests for rs in r["resourceSpans"] for s in rs["scopeSpans"])
    steps = max(int(span["attributes"][0]["value"]["intValue"]) for r in requests for rs in r["resourceSpans"]
                for s in rs["scopeSpans"] for span in s["spans"] if span["name"] == "training.step")
    copies = -(-args.spans // per_copy)
    out = Path(tempfile.mkdtemp()) / "spans.jsonl"
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
    size = out.stat().st_size
    started = time.perf_counter()
    completed = subprocess.run([sys.executable, "-m", "opentelemetry_instrumentation_deepspeed.diagnose.cli",
                                "diagnose", str(out), "--json"], capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    report = json.loads(completed.stdout)
    print(f"{written} spans ({copies} copies of {per_copy}, {steps} steps each), {size / 2**20:.0f} MiB of OTLP JSON: "
          f"{seconds:.1f} s, peak RSS {peak:.0f} MiB; verdict {report['verdict']['layer']}")


if __name__ == "__main__":
    main()
