"""The embedded default's files (export/output.py): whole lines on a full disk, a file that disappears,
special files, and job ids that try to leave the output directory. Real files, real file systems."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from opentelemetry_instrumentation_deepspeed.export import output
from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env
from opentelemetry_instrumentation_deepspeed.runtime.job import JobIdentity


def _spans(count: int, size: int = 100) -> list:
    """``count`` real finished spans, each with an attribute of ``size`` characters."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("test")
    for number in range(count):
        with tracer.start_as_current_span("training.step", attributes={"training.step": number, "pad": "x" * size}):
            pass
    return list(memory.get_finished_spans())


@pytest.fixture
def files(tmp_path, monkeypatch):
    """Point the embedded default at ``directory`` for job ``job_id``: returns a function doing that."""

    def use(directory: Path, job_id: str = "job") -> None:
        monkeypatch.setenv(env.OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR, str(directory))
        env.reset_cache()
        output.reset()
        output.use_identity(JobIdentity(job_id, 1, 1, 2))

    yield use
    output.reset()
    env.reset_cache()


def _whole_lines(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), f"{path.name} ends inside a line"
    return [json.loads(line) for line in data.splitlines()]


def _steps(path: Path) -> list[int]:
    return [int(attribute["value"]["intValue"])
            for request in _whole_lines(path)
            for resource_spans in request["resourceSpans"]
            for scope in resource_spans["scopeSpans"]
            for span in scope["spans"]
            for attribute in span["attributes"] if attribute["key"] == "training.step"]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 256 KiB tmpfs (needs the right to mount: root, or an unprivileged user namespace)."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}); "
                    "test_a_file_size_limit_leaves_whole_lines covers the failing write")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_full_disk_leaves_whole_lines_counts_the_batch_and_the_next_starts_fresh(files, small_tmpfs, caplog):
    files(small_tmpfs)
    exporter = output.JsonLinesSpanExporter()
    assert exporter.export(_spans(2)) is SpanExportResult.SUCCESS
    (path,) = small_tmpfs.glob("job/traces-rank1.jsonl")
    batch = _spans(100, 200)
    line = len(output.SpanEncoder().encode(batch)) + 1
    # Fill the file system, then free room for two and a half batches.
    filler = small_tmpfs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    os.ftruncate(fd, max(0, os.fstat(fd).st_size - int(2.5 * line)))
    os.close(fd)
    results = [exporter.export(batch) for _ in range(4)]
    assert results == [SpanExportResult.SUCCESS] * 2 + [SpanExportResult.FAILURE] * 2, (results, line)
    written = sum(result is SpanExportResult.SUCCESS for result in results)
    assert len(_whole_lines(path)) == 1 + written, "every line whole, the failed batches rolled back"
    # Said once, not once per failed batch.
    assert sum("Cannot write traces" in record.getMessage() for record in caplog.records) == 1
    # Space comes back: the next batch is a line of its own, readable.
    filler.unlink()
    assert exporter.export(_spans(3)) is SpanExportResult.SUCCESS
    lines = _whole_lines(path)
    assert len(lines) == 2 + written
    assert _steps(path)[-3:] == [0, 1, 2]
    exporter.shutdown()


def test_a_file_size_limit_leaves_whole_lines(tmp_path):
    """The same failure where no tmpfs can be mounted: a write that stops part-way (RLIMIT_FSIZE, EFBIG)."""
    probe = textwrap.dedent(f"""
        import json, resource, signal, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
        from tests.test_output_files import _spans
        from opentelemetry_instrumentation_deepspeed.export import output
        from opentelemetry_instrumentation_deepspeed.runtime.job import JobIdentity
        output.use_identity(JobIdentity("job", 0, 0, 1))
        exporter = output.JsonLinesSpanExporter()
        first = exporter.export(_spans(2)).name
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
        resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, resource.RLIM_INFINITY))
        results = [exporter.export(_spans(100, 200)).name for _ in range(3)]
        print(json.dumps([first, *results]))
    """)
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, env.OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR: str(tmp_path / "out")},
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    results = json.loads(result.stdout)
    assert results[:2] == ["SUCCESS", "SUCCESS"] and "FAILURE" in results, results
    (path,) = (tmp_path / "out").glob("job/traces-rank0.jsonl")
    assert len(_whole_lines(path)) == results.count("SUCCESS")
    assert path.stat().st_size <= 60_000


def test_a_file_removed_mid_run_is_created_again(files, tmp_path):
    files(tmp_path / "out")
    exporter = output.JsonLinesSpanExporter()
    exporter.export(_spans(1))
    (path,) = (tmp_path / "out").glob("job/traces-rank1.jsonl")
    path.unlink()  # a cleanup job, or a user
    assert exporter.export(_spans(2)) is SpanExportResult.SUCCESS
    assert _steps(path) == [0, 1], "the later batch is in the file, not in the removed one"
    (tmp_path / "out" / "job" / path.name).unlink()
    (tmp_path / "out" / "job").rmdir()  # the whole directory too
    assert exporter.export(_spans(3)) is SpanExportResult.SUCCESS
    assert _steps(path) == [0, 1, 2]
    exporter.shutdown()


def test_a_line_cut_by_an_earlier_death_is_dropped_before_appending(files, tmp_path):
    files(tmp_path / "out")
    path = tmp_path / "out" / "job" / "traces-rank1.jsonl"
    path.parent.mkdir(parents=True)
    whole = json.dumps({"resourceSpans": []})
    path.write_text(whole + "\n" + whole[:7])  # a process killed mid-write
    exporter = output.JsonLinesSpanExporter()
    assert exporter.export(_spans(1)) is SpanExportResult.SUCCESS
    lines = _whole_lines(path)
    assert len(lines) == 2 and lines[0] == {"resourceSpans": []}
    exporter.shutdown()


@pytest.mark.parametrize("kind", ["fifo", "symlink to /dev/null", "directory"])
def test_a_special_file_at_the_files_name_is_refused(files, tmp_path, kind, caplog):
    files(tmp_path / "out")
    path = tmp_path / "out" / "job" / "traces-rank1.jsonl"
    path.parent.mkdir(parents=True)
    if kind == "fifo":
        os.mkfifo(path)  # opening it for writing would block forever
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/null")
    exporter = output.JsonLinesSpanExporter()
    assert exporter.export(_spans(1)) is SpanExportResult.FAILURE
    assert sum("Cannot write traces" in record.getMessage() for record in caplog.records) == 1


HOSTILE_JOB_IDS = {
    "dot dot": "..",
    "dot": ".",
    "slash": "/",
    "absolute": "/etc/cron.d/x",
    "climbing": "../../../../tmp/escaped",
    "NUL": "a\0b",
    "control characters": "\x1b[31mred\n",
    "10 kB": "j" * 10_000,
    "10 kB of dots and slashes": "../" * 3_400,
    "a lone surrogate": "job\udcff",
    "empty": "",
}


@pytest.mark.parametrize("job_id", HOSTILE_JOB_IDS.values(), ids=HOSTILE_JOB_IDS.keys())
def test_no_job_id_leaves_the_output_directory(files, tmp_path, job_id):
    out = tmp_path / "nest" / "out"
    files(out)
    output.use_identity(JobIdentity(job_id, 1, 1, 2))
    exporter = output.JsonLinesSpanExporter()
    assert exporter.export(_spans(1)) is SpanExportResult.SUCCESS
    written = [path for path in tmp_path.rglob("*") if path.is_file()]
    (path,) = written
    # One directory level below the output directory, a plain name, a regular file.
    assert path.parent.parent == out
    name = path.parent.name
    assert name not in (".", "..") and not name.startswith(".") and len(name.encode()) <= 255
    assert all((char.isalnum() and char.isascii()) or char in "._-" for char in name)
    assert path.is_file() and not path.is_symlink()
    exporter.shutdown()


def test_a_job_directory_planted_as_a_symlink_is_refused(files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the default output directory is tried next
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "job").symlink_to(elsewhere)
    files(out)
    exporter = output.JsonLinesSpanExporter()
    exporter.export(_spans(1))
    assert not list(elsewhere.iterdir()), "nothing written through the link"
    assert (tmp_path / env.DEFAULT_OUTPUT_DIR / "job" / "traces-rank1.jsonl").is_file(), "the default instead"


@pytest.mark.parametrize(("set_", "hint"), [
    ({}, "(set OTEL_EXPORTER_OTLP_ENDPOINT to export over OTLP instead)"),
    # A review: an endpoint that is no URL went to the files with its warning, then "set ... instead", though set.
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "not a url"}, "(OTEL_EXPORTER_OTLP_ENDPOINT set, not used for them)"),
    # The traces' own endpoint does not concern the metrics written to files.
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://tempo:4318"}, "(set OTEL_EXPORTER_OTLP_ENDPOINT to export"),
    # Both exporters for the metrics: the endpoint is used (a code review).
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_METRICS_EXPORTER": "otlp,deepspeed_file"},
     "(the metrics over OTLP too)")])
def test_the_announcement_of_the_files_names_an_endpoint_only_where_none_is_set(tmp_path, monkeypatch, capsys, set_,
                                                                                 hint):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_METRICS_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    for name, value in set_.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(env.OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR, str(tmp_path))
    env.reset_cache()
    output.reset()
    try:
        output.use_identity(JobIdentity("job", 0, 0, 1))
        output.announce(["metrics"])
    finally:
        output.reset()
        env.reset_cache()
    said = capsys.readouterr().err
    assert f"to {tmp_path / 'job'}/ {hint}" in said, said


NATIVE_CRASH = """
import ctypes, os, sys
from opentelemetry_instrumentation_deepspeed.export import native_crash, output
from opentelemetry_instrumentation_deepspeed.runtime.job import JobIdentity

identity = JobIdentity("job-1", 3, 1, 4)
output.use_identity(identity)
native_crash.watch(identity)
if sys.argv[1] == "exit":
    sys.exit(0)
child = os.fork()
if child == 0:  # a DataLoader worker's fault: the rank's file is not its
    ctypes.string_at(0)
os.waitpid(child, 0)
ctypes.string_at(0)
"""


@pytest.mark.parametrize("how", ["exit", "crash"])
def test_a_native_crash_leaves_the_ranks_stacks_and_a_normal_exit_no_file(tmp_path, how):
    completed = subprocess.run([sys.executable, "-c", NATIVE_CRASH, how], cwd=tmp_path, capture_output=True, text=True,
                               timeout=60, env={**os.environ, "OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR": str(tmp_path)},
                               check=False)
    crash_file = tmp_path / "job-1" / "native-crash-rank3.txt"
    if how == "exit":
        assert completed.returncode == 0 and not crash_file.exists(), completed.stderr
        return
    assert completed.returncode == -11
    header, _, text = crash_file.read_text().partition("\n")
    assert json.loads(header) == {"job": "job-1", "rank": 3, "pid": json.loads(header)["pid"]}
    assert text.count("Fatal Python error: Segmentation fault") == 1, "the parent's; the child's went nowhere"
    assert 'line 15 in <module>' in text
