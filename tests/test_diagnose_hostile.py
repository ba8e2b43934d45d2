"""`diagnose` cannot be crashed or stalled (issue 18, item 2): hostile numbers, types, files and text.

Every case gives a report or a clear error, never a traceback or a hang; text output escapes control
characters, JSON output is strict (no NaN / Infinity), HTML output is escaped.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.parse

import pytest

from opentelemetry_instrumentation_deepspeed.diagnose import cli
from opentelemetry_instrumentation_deepspeed.diagnose.html import render_html
from tests.conftest import BIN
from tests.otlp_receiver import serve

JOB = {"key": "training.job.id", "value": {"stringValue": "job"}}
RANK0 = {"key": "training.rank", "value": {"intValue": "0"}}


def span(name: str, start, end, number: int | None = None, *, trace_id: str = "11" * 16,
         attributes: tuple = ()) -> dict:
    items = list(attributes)
    if number is not None:
        items.append({"key": "training.step", "value": {"intValue": str(number)}})
    return {"name": name, "traceId": trace_id, "spanId": "aa" * 8, "startTimeUnixNano": start,
            "endTimeUnixNano": end, "attributes": items}


def request(*spans: dict, resource: tuple = (JOB, RANK0)) -> str:
    return json.dumps({"resourceSpans": [{"resource": {"attributes": list(resource)},
                                          "scopeSpans": [{"spans": list(spans)}]}]})


def gauge(value: dict, time) -> str:
    return json.dumps({"resourceMetrics": [{"resource": {"attributes": [JOB, RANK0]}, "scopeMetrics": [{"metrics": [
        {"name": "hw.gpu.utilization", "gauge": {"dataPoints": [{"timeUnixNano": time, **value}]}}]}]}]})


# Eight healthy steps of rank 0 (10 s apart, 100 ms each), with a collective and a GPU sample each.
GOOD = "\n".join(request(
    span("training.step", str(n * 10**10), str(n * 10**10 + 10**8), n, trace_id=f"{n:032x}"),
    span("training.forward", str(n * 10**10), str(n * 10**10 + 5 * 10**7), trace_id=f"{n:032x}"),
    span("comm.all_reduce", str(n * 10**10 + 6 * 10**7), str(n * 10**10 + 7 * 10**7), trace_id=f"{n:032x}",
         attributes=({"key": "comm.busbw", "value": {"doubleValue": 1e9}},
                     {"key": "comm.sequence", "value": {"intValue": str(n)}})),
) + "\n" + gauge({"asDouble": 0.5}, str(n * 10**10 + 10**7)) for n in range(1, 9)) + "\n"

HUGE = "9" * 400
# The numbers are legal JSON (1e999) or what Python's json module accepts (Infinity): written raw.
INF = "1e999"


def _raw(text: str, **replace: str) -> str:
    for key, value in replace.items():
        text = text.replace(f'"@{key}"', value)
    return text


# name -> (the last line of the input, whether the line must be counted as bad)
NUMBERS = {
    "span start 1e999": (_raw(request(span("training.step", "@t", "@t", 9)), t=INF), True),
    "span start Infinity": (_raw(request(span("training.step", "@t", "@t", 9)), t="Infinity"), True),
    "span end -Infinity": (_raw(request(span("training.step", "5", "@t", 9)), t="-Infinity"), True),
    "span start NaN": (_raw(request(span("training.step", "@t", "7", 9)), t="NaN"), True),
    "span time a 400-digit number": (_raw(request(span("training.step", "@t", "@t", 9)), t=HUGE), True),
    "span time a 400-digit string": (request(span("training.step", HUGE, HUGE, 9)), True),
    "span time a fraction": (_raw(request(span("training.step", "@t", "@t", 9)), t="1.5"), True),
    "intValue 1e999": (_raw(request(span("training.step", "5", "7", attributes=(
        {"key": "training.step", "value": {"intValue": "@t"}},))), t=INF), True),
    "intValue of 400 digits": (request(span("training.step", "5", "7", attributes=(
        {"key": "training.step", "value": {"intValue": HUGE}},))), True),
    "training.rank of 400 digits": (request(span("training.step", "5", "7", 9),
                                            resource=(JOB, {"key": "training.rank", "value": {"intValue": HUGE}})),
                                    True),
    "training.rank 1e999": (_raw(request(span("training.step", "5", "7", 9), resource=(
        JOB, {"key": "training.rank", "value": {"doubleValue": "@t"}})), t=INF), True),
    "training.rank negative": (request(span("training.step", "5", "7", 9), resource=(
        JOB, {"key": "training.rank", "value": {"intValue": "-3"}})), True),
    "comm.busbw of 400 digits": (request(span("comm.all_reduce", "5", "7", attributes=(
        {"key": "comm.busbw", "value": {"intValue": HUGE}},))), True),
    "comm.busbw 1e999": (_raw(request(span("comm.all_reduce", "5", "7", attributes=(
        {"key": "comm.busbw", "value": {"doubleValue": "@t"}},))), t=INF), False),
    "comm.busbw Infinity (OTLP's string)": (request(span("comm.all_reduce", "5", "7", attributes=(
        {"key": "comm.busbw", "value": {"doubleValue": "Infinity"}},))), False),
    "comm.busbw NaN": (request(span("comm.all_reduce", "5", "7", attributes=(
        {"key": "comm.busbw", "value": {"doubleValue": "NaN"}},))), False),
    "comm.sequence 1e999": (_raw(request(span("comm.all_reduce", "5", "7", attributes=(
        {"key": "comm.sequence", "value": {"intValue": "@t"}},))), t=INF), True),
    "timeUnixNano 1e999": (_raw(gauge({"asDouble": 0.5}, "@t"), t=INF), True),
    "timeUnixNano of 400 digits": (gauge({"asDouble": 0.5}, HUGE), True),
    "asInt of 400 digits": (gauge({"asInt": HUGE}, "5"), False),
    "asDouble Infinity": (_raw(gauge({"asDouble": "@t"}, "5"), t="Infinity"), False),
    "asDouble NaN": (gauge({"asDouble": "NaN"}, "5"), False),
    "job id a number": (request(span("training.step", "5", "7", 9), resource=(
        {"key": "training.job.id", "value": {"intValue": "12"}}, RANK0)), False),
    "job id a list": (request(span("training.step", "5", "7", 9), resource=(
        {"key": "training.job.id", "value": {"stringValue": [[[1]]]}}, RANK0)), True),
    "parent id a number": (request({**span("training.step", "5", "7", 9), "parentSpanId": 5}), True),
}


def strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """The console script is ``sys.exit(cli.main())``: an exception here would be its traceback."""
    code = cli.main(["diagnose", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(("line", "bad"), [pytest.param(*NUMBERS[name], id=name) for name in NUMBERS])
def test_hostile_numbers_give_a_report_in_every_format(tmp_path, capsys, line, bad):
    path = tmp_path / "spans.jsonl"
    path.write_text(GOOD + line + "\n")
    code, out, _ = run_cli(capsys, str(path), "--json", "--html", str(tmp_path / "report.html"))
    report = strict_json(out)
    assert code == 0 and report["ranks"]["0"]["steps"] >= 8
    assert report["input"]["bad_lines"] + report["input"]["bad_spans"] == (1 if bad else 0), report["input"]["problems"]
    if bad:
        assert report["input"]["problems"][0].startswith(f"{path}:{GOOD.count(chr(10)) + 1}: ")
    assert report["bandwidth"]["all_reduce"]["median_busbw"] == 1e9
    code, text, _ = run_cli(capsys, str(path))
    assert code == 0 and "Verdict: " in text and "rank 0: " in text


def test_json_output_is_strict_where_a_figure_is_not_finite(tmp_path, capsys):
    # Every bandwidth the run measured is NaN: the report says null, not NaN.
    lines = [request(span("training.step", str(n * 10**9), str(n * 10**9 + 10**8), n, trace_id=f"{n:032x}"),
                     span("comm.all_reduce", str(n * 10**9), str(n * 10**9 + 10**7), attributes=(
                         {"key": "comm.busbw", "value": {"doubleValue": "NaN"}},)))
             for n in range(1, 6)]
    (tmp_path / "nan.jsonl").write_text("\n".join(lines) + "\n")
    code, out, _ = run_cli(capsys, str(tmp_path / "nan.jsonl"), "--json")
    report = strict_json(out)
    assert code == 0 and report["ranks"]["0"]["steps"] == 5
    assert "NaN" not in out and "Infinity" not in out


def test_a_report_holding_nan_is_written_as_strict_json(capsys):
    report = cli.diagnose([], None)
    report["job"] = {"figure": float("nan"), "nested": [float("inf"), {"x": -float("inf")}]}
    cli.write_json(report)
    out = capsys.readouterr().out
    assert strict_json(out)["job"] == {"figure": None, "nested": [None, {"x": None}]}


FORGED = "x\nVerdict: NONE: all good\x1b[2J\x1b]0;owned\x07\r\u202e\u2028"


def test_text_output_escapes_control_characters_from_the_input(tmp_path, capsys):
    lines = [request(span("training.step", str(n * 10**9), str(n * 10**9 + 10**8 + n), n, trace_id=FORGED + str(n)),
                     resource=({"key": "training.job.id", "value": {"stringValue": FORGED}}, RANK0))
             for n in range(1, 6)]
    lines.append(request(span("training.step", "1", "2", 1),
                         resource=({"key": "training.job.id", "value": {"stringValue": "other" + FORGED}}, RANK0)))
    bad_name = tmp_path / "bad\x1b[31m\nVerdict: FAKE.jsonl"
    bad_name.write_text("not json\n")
    (tmp_path / "good.jsonl").write_text("\n".join(lines) + "\n")
    code, text, err = run_cli(capsys, str(tmp_path / "good.jsonl"), str(bad_name))
    assert code == 0
    for output in (text, err):
        assert not any(c in output for c in "\x1b\x07\r\u202e\u2028"), repr(output)
        assert [line for line in output.splitlines() if line.startswith("Verdict")] == (
            [line for line in text.splitlines() if line.startswith("Verdict: NONE: no finding")] if output is text
            else [])
    assert "\\x1b[2J" in text and "\\n" in text, "shown, escaped"
    code, out, _ = run_cli(capsys, str(tmp_path / "good.jsonl"), "--json")
    assert strict_json(out)["job_id"] == FORGED, "JSON keeps the value, escaped by the JSON encoder"
    assert "\x1b" not in out


def test_html_output_escapes_the_input(tmp_path, capsys):
    evil = '<script>alert(1)</script><img src=x onerror=alert(2)>"\''
    lines = [request(span("training.step", str(n * 10**9), str(n * 10**9 + 10**8), n, trace_id=evil + str(n)),
                     resource=({"key": "training.job.id", "value": {"stringValue": evil}}, RANK0))
             for n in range(1, 6)]
    (tmp_path / "spans.jsonl").write_text("\n".join(lines) + "\n")
    run_cli(capsys, str(tmp_path / "spans.jsonl"), "--html", str(tmp_path / "report.html"))
    page = (tmp_path / "report.html").read_text()
    assert "<script" not in page and "<img" not in page and "&lt;script&gt;" in page
    assert render_html(cli.diagnose([str(tmp_path / "spans.jsonl")], None)) == page


def console(*args: str, stdin=subprocess.DEVNULL, timeout: float = 60) -> subprocess.CompletedProcess:
    completed = subprocess.run([str(BIN / "opentelemetry-deepspeed"), "diagnose", *args], stdin=stdin,
                               capture_output=True, text=True, timeout=timeout, check=False)
    assert "Traceback" not in completed.stderr, completed.stderr
    return completed


def test_devices_and_fifos_are_refused_or_read_never_waited_on(tmp_path):
    (tmp_path / "good.jsonl").write_text(GOOD)
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)  # no writer: opening it for reading would block for ever
    completed = console("/dev/zero", str(fifo), str(tmp_path / "good.jsonl"), "--json")
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    assert report["ranks"]["0"]["steps"] == 8
    assert any("/dev/zero: not a regular file" in problem for problem in report["input"]["problems"])
    # A directory holding a FIFO and a link to a device: its regular files are read.
    (tmp_path / "zero.json").symlink_to("/dev/zero")
    completed = console(str(tmp_path), "--json")
    assert completed.returncode == 0 and json.loads(completed.stdout)["ranks"]["0"]["steps"] == 8
    with open("/dev/zero", "rb") as zero:
        completed = console("-", stdin=zero)
    assert completed.returncode == 1 and "standard input: not a regular file or pipe" in completed.stderr


def test_binary_on_standard_input_is_skipped_not_a_decoding_error(tmp_path):
    (tmp_path / "in").write_bytes(GOOD.encode() + bytes(range(256)) * 4 + b"\n")
    with open(tmp_path / "in", "rb") as handle:
        completed = console("-", "--json", stdin=handle)
    report = json.loads(completed.stdout)
    assert completed.returncode == 0 and report["ranks"]["0"]["steps"] == 8 and report["input"]["bad_lines"] >= 1


@pytest.mark.parametrize(("args", "message"), [
    (["--tempo", "http://127.0.0.1:9", "--job", "x", "--since", "nan"], "--since"),
    (["--tempo", "http://127.0.0.1:9", "--job", "x", "--since", "1e999"], "--since"),
    (["--tempo", "http://127.0.0.1:9", "--job", "x", "--limit", "-1"], "--limit"),
    (["--tempo", "not a url", "--job", "x"], "--tempo"),
    (["--jaeger", "file:///etc/passwd", "--service", "x"], "--jaeger"),
])
def test_bad_options_are_usage_errors(args, message):
    completed = console(*args)
    assert completed.returncode == 2 and message in completed.stderr, completed.stderr


def test_an_unwritable_html_file_is_a_clear_error(tmp_path):
    (tmp_path / "good.jsonl").write_text(GOOD)
    completed = console(str(tmp_path / "good.jsonl"), "--html", str(tmp_path / "missing" / "report.html"))
    assert completed.returncode == 1 and "cannot write" in completed.stderr and "report.html" in completed.stderr


def test_a_job_not_in_the_input_is_said_so_with_the_jobs_it_holds(tmp_path):
    """A review: `--job nosuchjob` printed "Job nosuchjob: 0 rank(s)", a NONE verdict, and exited 0."""
    (tmp_path / "good.jsonl").write_text(GOOD)
    completed = console(str(tmp_path / "good.jsonl"), "--job", "nosuchjob")
    assert completed.returncode == 1, completed.stdout
    assert "no span of job 'nosuchjob' in the input; its jobs: job" in completed.stderr
    assert console(str(tmp_path / "good.jsonl"), "--job", "job").returncode == 0


def test_spans_read_twice_are_counted_once(tmp_path, capsys):
    """A review: the same files given twice read "156% compute" (a Collector may deliver a batch twice, too)."""
    (tmp_path / "good.jsonl").write_text(GOOD)
    assert cli.main(["diagnose", "--json", str(tmp_path / "good.jsonl")]) == 0
    once = json.loads(capsys.readouterr().out)
    assert cli.main(["diagnose", "--json", str(tmp_path / "good.jsonl"), str(tmp_path / "good.jsonl")]) == 0
    twice = json.loads(capsys.readouterr().out)
    assert twice["ranks"] == once["ranks"] and twice["job"] == once["job"]
    assert "24 span(s) read twice" in twice["input"]["problems"][0]


def test_with_no_path_the_latest_job_with_telemetry_is_read_and_named(tmp_path):
    """A review: an empty job directory written last was read (0 spans, exit 1) though an older one held the run."""
    older, newer = tmp_path / "telemetry" / "older", tmp_path / "telemetry" / "newer"
    older.mkdir(parents=True)
    (older / "traces-rank0.jsonl").write_text(GOOD)
    newer.mkdir()
    (newer / "traces-rank0.jsonl").write_text("")
    completed = subprocess.run([str(BIN / "opentelemetry-deepspeed"), "diagnose"], cwd=tmp_path, capture_output=True,
                               text=True, timeout=60, check=False)
    assert completed.returncode == 0 and "Read 24 spans" in completed.stdout, completed.stdout + completed.stderr
    assert "reading telemetry/older, the latest of 2 jobs" in completed.stderr


def test_ranks_the_world_size_counts_that_have_no_telemetry_are_named(tmp_path):
    world = {"key": "training.world_size", "value": {"intValue": "2"}}
    (tmp_path / "rank0.jsonl").write_text("\n".join(request(span("training.step", str(n * 10**10),
                                                                 str(n * 10**10 + 10**8), n, trace_id=f"{n:032x}"),
                                                            resource=(JOB, RANK0, world)) for n in range(1, 9)))
    completed = console(str(tmp_path / "rank0.jsonl"))
    assert "Job job: 1 rank(s); no telemetry of rank 1 in the input" in completed.stdout
    assert "CRASH" not in completed.stdout, "no rank failed: files left out, not a crash"


def test_the_ranks_read_are_counted_where_no_step_closed(tmp_path):
    """A review: a job whose ranks all failed in their first step read "Job ...: 0 rank(s)"."""
    lines = []
    for rank in (0, 1):
        failed = span("training.step", "1000", "2000", 1)
        failed["status"] = {"code": 2, "message": "RuntimeError: boom"}
        lines.append(request(failed, resource=(JOB, {"key": "training.rank", "value": {"intValue": str(rank)}})))
    (tmp_path / "traces.jsonl").write_text("\n".join(lines))
    completed = console(str(tmp_path / "traces.jsonl"))
    assert "Job job: 2 rank(s)" in completed.stdout, completed.stdout


TRACE = json.loads(request(span("training.step", "1000", "2000", 1)))
HOSTILE_TRACES = {
    "t-not-an-object": [1, 2],
    "t-bad-base64": {"batches": [{"resource": {"attributes": [JOB, RANK0]}, "scopeSpans": [
        {"spans": [{**span("training.step", "1", "2", 1), "traceId": "%%%"}]}]}]},
    "t-infinite-time": b'{"batches": [{"resource": {"attributes": [' + json.dumps(JOB).encode() + b"," +
                       json.dumps(RANK0).encode() + b']}, "scopeSpans": [{"spans": [{"name": "training.step", '
                       b'"traceId": "ab", "spanId": "cd", "startTimeUnixNano": 1e999, "endTimeUnixNano": 1e999}]}]}]}',
    "t-batches-a-string": {"batches": "abc"},
    "t-good": {"batches": TRACE["resourceSpans"]},
}


def test_hostile_backend_answers_are_skipped_with_a_message():
    def tempo(url):
        if url.path == "/api/search":
            return 200, {"traces": [{"traceID": "../../etc"}, 5, {"x": 1},
                                    *({"traceID": trace_id} for trace_id in HOSTILE_TRACES)]}
        trace_id = urllib.parse.unquote(url.path.rsplit("/", 1)[1])
        return (200, HOSTILE_TRACES[trace_id]) if trace_id in HOSTILE_TRACES else (404, {"error": "not found"})

    server, url = serve(tempo)
    try:
        completed = console("--tempo", url, "--job", "job", "--json")
    finally:
        server.shutdown()
    report = json.loads(completed.stdout)
    assert completed.returncode == 0 and report["ranks"]["0"]["steps"] == 1
    assert report["input"]["bad_lines"] >= 4, report["input"]["problems"]
