"""The ``opentelemetry-deepspeed`` command.

    opentelemetry-deepspeed diagnose [PATH ...] [--job ID] [--json] [--html FILE]
    opentelemetry-deepspeed diagnose --tempo URL --job ID
    opentelemetry-deepspeed diagnose --jaeger URL --service NAME [--job ID]

PATH: the embedded default's directory (default ``./telemetry``: its most recent job), OTLP JSON
files (as the Collector's file exporter writes them), or ``-`` for standard input.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import unicodedata
from pathlib import Path

from opentelemetry_instrumentation_deepspeed.diagnose.analysis import PARTS, Analysis, size_text
from opentelemetry_instrumentation_deepspeed.diagnose.backends import BackendError, check_url, jaeger_spans, tempo_spans
from opentelemetry_instrumentation_deepspeed.diagnose.html import input_summary, render_html
from opentelemetry_instrumentation_deepspeed.diagnose.reader import ReadStats, native_crashes, read_spans

SCHEMA_VERSION = 1


def _default_paths() -> list[str]:
    """The latest job's directory under ./telemetry: the latest written that holds telemetry (a job that wrote
    nothing yet, or only empty files, is passed over), named where there are several."""
    root = Path("telemetry")
    jobs = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime) if root.is_dir() else []
    # A job whose only rank died in native code before its first export left its crash file alone.
    written = [job for job in jobs
               if any(_has_lines(path) for path in job.glob("*.jsonl")) or native_crashes([str(job)])]
    chosen = (written or jobs)[-1:]
    if len(jobs) > 1 and chosen:
        print(printable(f"opentelemetry-deepspeed diagnose: reading {chosen[0]}, the latest of {len(jobs)} jobs under "
                        f"{root}/ (name another: opentelemetry-deepspeed diagnose {root}/<job id>)"), file=sys.stderr)
    return [str(chosen[0])] if chosen else [str(root)]


def _has_lines(path: Path) -> bool:
    try:
        return path.is_file() and path.stat().st_size > 0
    except OSError:
        return False


def diagnose(paths: list[str], job: str | None, backend=None) -> dict:
    """``backend``: a function of the read statistics that yields spans, instead of the paths."""
    stats = ReadStats()
    analysis = Analysis()
    try:
        analysis.add(backend(stats) if backend else read_spans(paths, stats))
    except BackendError as error:
        stats.problems.append(f"cannot read the backend: {error}")
    analysis.add_samples(stats.samples)
    crashes = native_crashes(paths) if backend is None else []
    for crash in crashes:
        analysis.add_native_crash(*crash)
    if analysis.duplicates:
        stats.problems.append(f"{analysis.duplicates} span(s) read twice (the same ids, job, rank, name and start: a "
                              "delivery repeated, or files given twice), counted once")
    result = analysis.result(job)
    for rank in result["ranks"].values():
        rank.pop("compute_by_step", None)
    of_job = analysis.jobs.get(result["job_id"], 0)
    # A review: "Read 0 spans from 0/2 file(s)". A rank's native crash is telemetry too (its job's first step's).
    if not stats.spans and backend is None and not stats.problems and not crashes:
        stats.problems.append(
            "no span in the files read: diagnose reads the traces (traces-rank<N>.jsonl, or a Collector's file of "
            "spans); metrics files hold none" if stats.files else
            f"no .json or .jsonl file in {', '.join(paths) or 'the input'}")
    if job is not None and stats.spans and not of_job:
        stats.problems.append(f"no span of job {job!r} in the input; its jobs: {', '.join(sorted(analysis.jobs))}")
    return {"schema_version": SCHEMA_VERSION, **result,
            "input": {"files": stats.files, "lines": stats.lines, "spans": stats.spans, "spans_of_job": of_job,
                      "gpu_samples": len(stats.samples),
                      "native_crashes": sum(crash[0] == result["job_id"] for crash in crashes),
                      "bad_lines": stats.bad_lines, "bad_spans": stats.bad_spans, "problems": stats.problems}}


def _cost(finding: dict) -> list[str]:
    if finding.get("cost_seconds") is None:
        return []
    share = f" ({finding['share_of_run']:.0%} of the run)" if finding.get("share_of_run") is not None else ""
    return [f"  cost: {finding['cost_seconds']:.2f} s{share}; confidence {finding.get('confidence', 1.0):.1%}"]


# What a terminal could act on: C0/C1 controls (escape sequences, carriage return, bell), line and
# paragraph separators, and format characters (bidirectional overrides that reorder what is shown).
_UNPRINTABLE = ("Cc", "Cf", "Zl", "Zp")


def printable(line: str) -> str:
    """``line`` with every character a terminal could act on written as a Python escape (``\\x1b``):
    a job id or a span name from the input can neither forge a line of the report nor drive the
    terminal."""
    if line.isprintable():  # the common case, in C
        return line
    return "".join(c.encode("unicode_escape").decode("ascii") if unicodedata.category(c) in _UNPRINTABLE
                   else c for c in line)


def strict(value):
    """``value`` with every float that JSON cannot hold (NaN, the infinities) made null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(item) for item in value]
    return value


def write_json(report: dict, stream=None) -> None:
    """The report as strict JSON (RFC 8259: no NaN or Infinity, which strict parsers refuse)."""
    stream = stream or sys.stdout
    json.dump(strict(report), stream, indent=2, default=str, allow_nan=False)
    stream.write("\n")


def _slowest(summary: dict) -> str:
    slowest = summary.get("slowest")
    if not slowest:
        return ""
    # The first step pays for warm-up and is left out of the slowest (max above counts it).
    # A review read "slowest step 12, the first left out" as step 12 being the first step left out.
    first = ", the first step (warm-up) aside" if slowest["seconds"] < summary["step_seconds"]["max"] else ""
    return f"; slowest step {slowest['step']} (trace {slowest['trace_id']}){first}"


def render_text(report: dict) -> str:
    """The report for a terminal: one line per fact, each escaped by ``printable``."""
    return "\n".join(printable(line) for line in _text_lines(report))


def _text_lines(report: dict) -> list[str]:
    lines = []
    verdict = report["verdict"]
    missing = report.get("missing_ranks") or []
    lines.append(f"Job {report['job_id'] or '-'}: {report.get('ranks_read', 0)} rank(s)"
                 + (f"; no telemetry of rank {', '.join(map(str, missing[:8]))}{' ...' if len(missing) > 8 else ''}"
                    " in the input (training.world_size counts it)" if missing else ""))
    lines.append(f"Verdict: {verdict['layer'].upper()}: {verdict['summary']}")
    lines += _cost(verdict)
    lines += [f"  evidence: {item}" for item in verdict.get("evidence", [])]
    lines += [f"  remedy: {item}" for item in verdict.get("remedies", [])]
    lines += [f"  traces: {', '.join(verdict['trace_ids'][:3])}"] if verdict.get("trace_ids") else []
    for other in report.get("findings", []):  # the other findings, by the time they cost
        if other != verdict:
            lines.append(f"Also: {other['layer'].upper()}: {other['summary']}")
            lines += _cost(other)
    job = report.get("job") or {}
    if job:
        shares = job["shares"]
        lines.append("Where step time goes (mean over ranks): " +
                     ", ".join(f"{part.replace('_', ' ')} {shares[part]:.0%}" for part in PARTS))
    loop_work = report.get("loop_work")
    if loop_work and report["verdict"].get("layer") != "none":  # a "none" verdict says it already
        lines.append(f"Between steps: {loop_work['summary']}")
    for rank, summary in report["ranks"].items():
        seconds = summary["step_seconds"]
        lines.append(f"  rank {rank}: {summary['steps']} steps, step p50 {seconds['p50'] * 1e3:.1f} ms, "
                     f"p95 {seconds['p95'] * 1e3:.1f} ms, max {seconds['max'] * 1e3:.1f} ms"
                     + _slowest(summary))
    for stage, summary in (report.get("pipeline") or {}).get("stages", {}).items():  # diagnose/pipeline.py
        lines.append(f"  pipeline stage {stage} (ranks {', '.join(map(str, summary['ranks']))}): compute "
                     f"{summary['compute_seconds'] * 1e3:.1f} ms, bubble {summary['bubble_seconds'] * 1e3:.1f} ms "
                     f"({summary['bubble_share']:.0%}) per step")
    for rank, gpu in report.get("gpu", {}).items():
        if gpu["utilization_mean"] is not None:
            parts = ", ".join(f"{part.replace('_', ' ')} {value:.0%}"
                              for part, value in gpu["utilization_by_part"].items())
            lines.append(f"  rank {rank}: GPU utilization {gpu['utilization_mean']:.0%} (by phase: {parts})")
    for op, bandwidth in report.get("bandwidth", {}).items():
        sizes = [(size, of_size) for size, of_size in bandwidth.get("by_size", {}).items()
                 if of_size["median_busbw"] is not None]
        # Calls of different sizes apart (a review: a median of 4.4 MB/s mixed 4-byte all-reduces with the gradients').
        by_size = "; ".join(f"{size_text(int(size))} x {of_size['calls']}: median "
                            f"{of_size['median_busbw'] / 1e6:.1f} MB/s" for size, of_size in sizes[:3]
                            ) if len(sizes) > 1 else ""
        lines.append(f"  comm.{op}: {bandwidth['calls']} calls, bus bandwidth median "
                     f"{bandwidth['median_busbw'] / 1e6:.1f} MB/s, best {bandwidth['best_busbw'] / 1e6:.1f} MB/s"
                     + (f" (by size, the longest in total first: {by_size})" if by_size else ""))
    lines.append(input_summary(report))
    lines += [f"  {problem}" for problem in report["input"]["problems"]]
    return lines


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:  # argparse would name the function: "invalid _seconds value"
        value = math.nan
    if not 0 < value <= 10 * 366 * 86400:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds in (0, 10 years]")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 0 < value <= 10**6:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count in [1, 1000000]")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="opentelemetry-deepspeed", description="Tools for DeepSpeed telemetry")
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("diagnose", help="name the layer that holds training back")
    command.add_argument("paths", nargs="*", help="telemetry directory, OTLP JSON files, or - for stdin")
    command.add_argument("--job", help="training.job.id to analyse (default: the one with the most spans)")
    command.add_argument("--json", action="store_true", help="the report as JSON (schema in docs/diagnose.md)")
    command.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report to FILE")
    source = command.add_mutually_exclusive_group()
    source.add_argument("--tempo", metavar="URL", help="read from Tempo's HTTP API (needs --job)")
    source.add_argument("--jaeger", metavar="URL", help="read from Jaeger v2's HTTP API (/api/v3; needs --service)")
    command.add_argument("--service", help="service.name to search in Jaeger")
    command.add_argument("--since", type=_seconds, default=86400.0, metavar="SECONDS",
                         help="backends: how far back to search (default one day)")
    command.add_argument("--limit", type=_count, default=1000, help="backends: most traces to fetch")
    args = parser.parse_args(argv)
    for option, url in (("--tempo", args.tempo), ("--jaeger", args.jaeger)):
        if url is not None and (why := check_url(url)):
            parser.error(f"{option}: {why}")
    try:
        return _run(parser, args)
    except KeyboardInterrupt:
        print("opentelemetry-deepspeed diagnose: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of the output left (| head): nothing more to say
        # Python would complain again at exit, flushing stdout into the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    backend = None
    if args.tempo:
        if not args.job:
            parser.error("--tempo needs --job (Tempo is searched by training.job.id)")
        def backend(stats):
            return tempo_spans(args.tempo, args.job, args.since, args.limit, stats)
    elif args.jaeger:
        if not args.service:
            parser.error("--jaeger needs --service (Jaeger searches by service name)")
        def backend(stats):
            return jaeger_spans(args.jaeger, args.service, args.job, since_seconds=args.since, limit=args.limit,
                                stats=stats)
    paths = args.paths or ([] if backend else _default_paths())
    # Reading builds millions of small objects with no cycles among them; the cycle collector's passes
    # over them cost a sixth of the time on files, a third on a backend's large answers.
    gc.disable()
    try:
        report = diagnose(paths, args.job, backend)
    finally:
        gc.enable()
    written = True
    if args.html:
        try:
            Path(args.html).write_text(render_html(report), encoding="utf-8")
        except OSError as error:
            report["input"]["problems"].append(f"cannot write {args.html}: {error.strerror or error}")
            written = False
    if args.json:
        write_json(report)
    else:
        print(render_text(report))
    for problem in report["input"]["problems"]:
        print(printable(f"opentelemetry-deepspeed diagnose: {problem}"), file=sys.stderr)
    return 0 if (report["input"]["spans_of_job"] or report["input"]["native_crashes"]) and written else 1


if __name__ == "__main__":
    sys.exit(main())
