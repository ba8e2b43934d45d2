"""The diagnosis as one self-contained HTML page: inline CSS and SVG, no script, nothing fetched."""

from __future__ import annotations

import html

from opentelemetry_instrumentation_deepspeed.diagnose.analysis import PARTS
from opentelemetry_instrumentation_deepspeed.diagnose.model import RANK_COLORS, charts_html

COLORS = {"data_wait": "#e4572e", "forward": "#4c9be8", "backward": "#2e5aac", "optimizer": "#8e6bbf",
          "exposed_comm": "#f3a712", "comm_wait": "#f6d186", "unaccounted": "#b8b8b8", "comm": "#f3a712"}
LABELS = {"data_wait": "data wait", "forward": "forward", "backward": "backward", "optimizer": "optimizer step",
          "exposed_comm": "exposed communication", "comm_wait": "waiting for other ranks",
          "unaccounted": "unaccounted", "comm": "collective"}


def _e(value) -> str:
    return html.escape(str(value))


def _breakdown(shares: dict) -> str:
    x, bars, legend = 0.0, [], []
    for part in PARTS:
        width = max(shares.get(part, 0.0), 0.0) * 900
        if width > 0:
            bars.append(f'<rect x="{x:.1f}" y="0" width="{width:.1f}" height="28" fill="{COLORS[part]}">'
                        f"<title>{_e(LABELS[part])}: {shares[part]:.1%}</title></rect>")
        x += width
        legend.append(f'<span class="key"><i style="background:{COLORS[part]}"></i>{_e(LABELS[part])} '
                      f"{shares.get(part, 0.0):.0%}</span>")
    return f'<svg width="900" height="28" role="img">{"".join(bars)}</svg><p>{"".join(legend)}</p>'


def _series(series: dict, anomaly: dict | None, change_step: int | None = None, until_step: int | None = None) -> str:
    points = [(step, seconds) for values in series.values() for step, seconds in values]
    if not points:
        return "<p>No steps.</p>"
    width, height = 900, 220
    first, last = min(s for s, _ in points), max(s for s, _ in points)
    top = max(seconds for _, seconds in points) * 1.1 or 1.0
    slow = set(anomaly.get("steps") or ()) if anomaly else set()

    def x(step):
        return 40 + (step - first) / max(last - first, 1) * (width - 60)

    def y(seconds):
        return height - 25 - seconds / top * (height - 40)

    shapes = [f'<line x1="40" y1="{height - 25}" x2="{width - 20}" y2="{height - 25}" stroke="#888"/>',
              # The longest step's time above its level, right of the axis: at its left the label ran into the line.
              f'<line x1="40" y1="{y(top / 1.1):.0f}" x2="{width - 20}" y2="{y(top / 1.1):.0f}" stroke="#ddd"/>',
              f'<text x="44" y="{y(top / 1.1) - 5:.0f}" class="axis">{top / 1.1 * 1e3:.0f} ms</text>',
              f'<text x="4" y="{height - 28}" class="axis">0 ms</text>',
              f'<text x="40" y="{height - 8}" class="axis">step {first}</text>',
              f'<text x="{width - 80}" y="{height - 8}" class="axis">step {last}</text>']
    if change_step is not None and first <= change_step <= last:
        shapes.append(f'<line x1="{x(change_step):.1f}" y1="10" x2="{x(change_step):.1f}" y2="{height - 25}" '
                      f'stroke="#e4572e" stroke-dasharray="5,4"><title>change point: step {_e(change_step)}</title>'
                      f'</line><text x="{x(change_step) + 4:.1f}" y="20" class="axis">change at step '
                      f"{_e(change_step)}</text>")
    if until_step is not None and first <= until_step <= last:  # the stretch's end: the change came back after it
        shapes.append(f'<line x1="{x(until_step + 0.5):.1f}" y1="10" x2="{x(until_step + 0.5):.1f}" '
                      f'y2="{height - 25}" stroke="#e4572e" stroke-dasharray="5,4"><title>back after step '
                      f'{_e(until_step)}</title></line><text x="{x(until_step + 0.5) + 4:.1f}" y="34" class="axis">'
                      f"back after step {_e(until_step)}</text>")
    for rank, values in sorted(series.items()):
        color = RANK_COLORS[int(rank) % len(RANK_COLORS)]
        path = " ".join(f"{x(step):.1f},{y(seconds):.1f}" for step, seconds in values)
        shapes.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.5">'
                      f"<title>rank {_e(rank)}</title></polyline>")
        for step, seconds in values:
            if step in slow:
                shapes.append(f'<circle cx="{x(step):.1f}" cy="{y(seconds):.1f}" r="4" fill="#e4572e">'
                              f"<title>rank {_e(rank)} step {step}: {seconds * 1e3:.1f} ms</title></circle>")
    return f'<svg width="{width}" height="{height}" role="img">{"".join(shapes)}</svg>' + _rank_legend(series)


def _rank_legend(*charts: dict) -> str:
    """Which line is which rank in ``charts`` (a review: the charts' lines had no legend)."""
    ranks = sorted({int(rank) for chart in charts for rank in chart})
    shown = len(RANK_COLORS)
    keys = [f'<span class="key"><i style="background:{RANK_COLORS[rank % shown]}"></i>rank {rank}</span>'
            for rank in ranks[:shown]]
    more = f" (rank r takes rank r - {shown}'s colour)" if len(ranks) > shown else ""
    return f"<p>{''.join(keys)}{_e(more)}</p>"


def _timeline(timeline: dict) -> str:
    lanes = timeline.get("ranks", {})
    if not lanes:
        return "<p>No spans for this step.</p>"
    start = min(lane["start"] for lane in lanes.values())
    end = max(lane["end"] for lane in lanes.values())
    span = max(end - start, 1)
    width, lane_height = 900, 34
    shapes = []

    def x(at):
        return 70 + (at - start) / span * (width - 80)

    for row, (rank, lane) in enumerate(sorted(lanes.items(), key=lambda item: int(item[0]))):
        top = row * lane_height + 4
        shapes.append(f'<text x="0" y="{top + 16}" class="axis">rank {_e(rank)}</text>')
        shapes.append(f'<rect x="{x(lane["start"]):.1f}" y="{top}" width="{x(lane["end"]) - x(lane["start"]):.1f}" '
                      f'height="22" fill="#eee" stroke="#ccc"/>')
        for part, begin, finish in lane["phases"]:
            shapes.append(f'<rect x="{x(begin):.1f}" y="{top}" width="{max(x(finish) - x(begin), 0.5):.1f}" '
                          f'height="14" fill="{COLORS[part]}"><title>{_e(LABELS[part])}: '
                          f"{(finish - begin) / 1e6:.2f} ms</title></rect>")
        for begin, finish in lane["comm"]:
            shapes.append(f'<rect x="{x(begin):.1f}" y="{top + 15}" width="{max(x(finish) - x(begin), 0.5):.1f}" '
                          f'height="7" fill="{COLORS["comm"]}"><title>collective: {(finish - begin) / 1e6:.2f} ms'
                          "</title></rect>")
    height = len(lanes) * lane_height + 24
    shapes.append(f'<text x="70" y="{height - 4}" class="axis">0 ms</text>'
                  f'<text x="{width - 70}" y="{height - 4}" class="axis">{span / 1e6:.1f} ms</text>')
    return f'<svg width="{width}" height="{height}" role="img">{"".join(shapes)}</svg>'


def _cost(finding: dict) -> str:
    if finding.get("cost_seconds") is None:
        return "cost not measured"
    share = f" ({finding['share_of_run']:.0%} of the run)" if finding.get("share_of_run") is not None else ""
    return f"cost {finding['cost_seconds']:.2f} s{share} · confidence {finding.get('confidence', 1.0):.1%}"


def _chain(finding: dict) -> str:
    """The late rank's own phase, then the others' wait: who waits for whom, as boxes and an arrow."""
    chain = finding.get("chain") or {}
    late, waiting = chain.get("late_ranks") or [], chain.get("waiting") or {}
    if not late or not waiting:
        return ""
    phase = chain.get("phase", "")
    extra = finding.get("extra_seconds")
    cause = (f"{', '.join(f'rank {r}' for r in late)}: {LABELS.get(phase, phase)}"
             + (f" +{extra * 1e3:.0f} ms" if extra else ""))
    boxes = [f'<rect x="0" y="10" width="330" height="40" rx="6" fill="{COLORS.get(phase, "#b8b8b8")}"/>'
             f'<text x="12" y="35" class="chain">{_e(cause)}</text>',
             '<line x1="330" y1="30" x2="430" y2="30" stroke="#444" stroke-width="2"/>'
             '<polygon points="430,24 442,30 430,36" fill="#444"/>'
             '<text x="338" y="22" class="axis">they wait</text>']
    for row, (rank, seconds) in enumerate(sorted(waiting.items(), key=lambda item: int(item[0]))[:6]):
        top = 10 + row * 46
        boxes.append(f'<rect x="445" y="{top}" width="330" height="40" rx="6" fill="{COLORS["comm_wait"]}"/>'
                     f'<text x="457" y="{top + 25}" class="chain">rank {_e(rank)}: waits {seconds * 1e3:.0f} ms '
                     f"in collectives</text>")
    height = 20 + max(len(waiting), 1) * 46
    return f'<h3>Who waits for whom</h3><svg width="900" height="{min(height, 300)}" role="img">{"".join(boxes)}</svg>'


def _stacks(finding: dict) -> str:
    """A hang's stacks (diagnose/hangs.py): each reporting rank's training thread, where it stopped or waits."""
    stacks = finding.get("stacks") or []
    if not stacks:
        return ""
    parts = []
    for item in stacks:
        role = "stopped" if item.get("stopped") else "waiting"
        where = f": {item['where']}" if item.get("where") else ""
        parts.append(f'<details class="stack" open><summary>rank {_e(item.get("rank"))} ({role}){_e(where)}'
                     f"</summary><pre>{_e(item.get('stack', ''))}</pre></details>")
    return "<h3>Stacks of the training threads (innermost call last)</h3>" + "".join(parts)


def _findings(findings: list[dict]) -> str:
    if len(findings) < 2:
        return ""
    rows = "".join(f"<tr><td>{_e(f['layer'].upper())}</td><td>{_e(f['summary'])}</td><td>{_e(_cost(f))}</td></tr>"
                   for f in findings)
    return f"<h2>All findings, by the time they cost</h2><table>{rows}</table>"


def _pipeline(pipeline: dict) -> str:
    """Each stage's compute and bubble per step, as the text report lists them."""
    stages = (pipeline or {}).get("stages") or {}
    if not stages:
        return ""
    rows = "".join(f"<tr><td>stage {_e(stage)}</td><td>ranks {_e(', '.join(map(str, summary['ranks'])))}</td>"
                   f"<td>compute {summary['compute_seconds'] * 1e3:.1f} ms</td>"
                   f"<td>bubble {summary['bubble_seconds'] * 1e3:.1f} ms ({summary['bubble_share']:.0%})</td></tr>"
                   for stage, summary in stages.items())
    return f"<h2>Pipeline stages, per step</h2><table>{rows}</table>"


def input_summary(report: dict) -> str:
    """What was read, and what was not (the text report's line and the page's)."""
    read = report["input"]
    return (f"Read {read.get('spans', 0)} spans from {read.get('files', 0)} file(s)"
            + (f"; {read['bad_lines']} malformed line(s) skipped" if read.get("bad_lines") else "")
            + (f"; {read['bad_spans']} malformed span(s) skipped" if read.get("bad_spans") else "")
            + (f"; other jobs ignored: {', '.join(report['other_jobs'])}" if report.get("other_jobs") else ""))


def _input(report: dict) -> str:
    """What was read, and what was not: the lines and spans skipped, the problems named."""
    if not report.get("input"):
        return ""
    problems = "".join(f"<li>{_e(problem)}</li>" for problem in report["input"].get("problems") or ())
    return (f"<h2>Files read</h2><p class=job>{_e(input_summary(report))}</p>"
            + (f"<ul>{problems}</ul>" if problems else ""))


def render_html(report: dict) -> str:
    verdict, job = report["verdict"], report.get("job") or {}
    timelines = report.get("timelines") or {}
    found = report.get("findings") or []
    changed = next((f for f in found if f.get("change_step") is not None), {})
    change, until = changed.get("change_step"), changed.get("until_step")
    missing = report.get("missing_ranks") or []
    # The steps the chart marks: a periodic stall's (a late rank's are most steps, which would mark them all).
    marked = next((f for f in (verdict, *found) if f.get("period") and f.get("steps")), None)
    sections = [
        f"<h1>Training diagnosis</h1><p class=job>job {_e(report['job_id'])} · {report.get('ranks_read', 0)} rank(s)"
        + (f" · no telemetry of rank{'s' if len(missing) > 1 else ''} {_e(', '.join(map(str, missing)))} in the input"
           if missing else "")
        + f" · median step {job.get('step_seconds_p50', 0) * 1e3:.1f} ms</p>",
        f'<div class="verdict {_e(verdict["layer"]).replace(" ", "-")}"><h2>{_e(verdict["layer"].upper())}</h2>'
        f"<p>{_e(verdict['summary'])}</p>"
        + (f"<p class=job>{_e(_cost(verdict))}</p>" if verdict.get("cost_seconds") is not None else "")
        + (f"<p class=job>traces: {_e(', '.join(verdict['trace_ids']))}</p>" if verdict.get("trace_ids") else "")
        + _chain(verdict) + _stacks(verdict) + "<ul>"
        + "".join(f"<li>{_e(item)}</li>" for item in verdict.get("evidence", []))
        + "</ul>" + ("<h3>Usual remedies</h3><ul>" + "".join(f"<li>{_e(r)}</li>" for r in verdict["remedies"])
                     + "</ul>" if verdict.get("remedies") else "") + "</div>",
        _findings(found),
        "<h2>Where step time goes</h2>" + _breakdown(job.get("shares", {})),
        _pipeline(report.get("pipeline")),
        "<h2>Step time</h2>" + _series(report.get("step_series", {}), marked, change, until),
    ]
    model_charts = charts_html(report)  # the model layer beside step time (diagnose/model.py)
    if model_charts:
        series = report.get("model_series") or {}
        named = " and ".join(label for name, label in (("loss", "Loss"), ("grad_norm", "gradient norm"))
                             if series.get(name))
        sections.append(f"<h2>{named[:1].upper() + named[1:]}</h2>" + model_charts
                        + _rank_legend(series.get("loss") or {}, series.get("grad_norm") or {}))
    for label in ("slowest", "typical"):
        if label in timelines:
            timeline = timelines[label]
            sections.append(f"<h2>The {label} step: {timeline['step']} <small>trace {_e(timeline['trace_id'])}"
                            f"</small></h2>" + _timeline(timeline))
    sections.append(_input(report))
    style = ("body{font:14px system-ui,sans-serif;margin:24px;color:#222;max-width:940px}"
             ".axis{font-size:11px;fill:#555}.key{margin-right:14px;white-space:nowrap}"
             ".key i{display:inline-block;width:10px;height:10px;margin-right:4px}"
             ".verdict{border-left:6px solid #e4572e;padding:4px 16px;background:#fafafa}"
             ".verdict.none{border-color:#17a398}.job{color:#555}small{color:#777;font-weight:normal}"
             ".chain{font-size:13px;fill:#111}table{border-collapse:collapse}"
             "td{border-top:1px solid #ddd;padding:4px 8px;vertical-align:top}"
             ".stack pre{font-size:12px;background:#f3f3f3;padding:8px;overflow-x:auto;white-space:pre}")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>Training diagnosis</title>'
            f"<style>{style}</style></head><body>{''.join(sections)}</body></html>\n")
