"""Reliability: a bug of ours, or a bad setting, never reaches the training job (issue #9, cases 6 and 7).

Bugs are planted in this project's own functions by tests/scripts/faulty_train.py (the example,
plus ``RELIABILITY_FAULT``); the job is compared with the same example run without instrumentation.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env
from tests.conftest import launch
from tests.otlp_json import read_last_points
from tests.scripts.launching import launch_script

STEPS = 20
PACKAGE = "opentelemetry_instrumentation_deepspeed"
# Forward, backward and optimizer step start a phase each: the 7th is step 3's forward. Steps 1
# and 2 are traced whole, the bug hits at the start of step 3, as the emitter's thread builds its record.
STEP_FAULT = f"{PACKAGE}.recording.builder:StepBuilder._start_phase:7"
# A metric callback that fails at every collection, as one reading /proc in a locked-down container would.
CALLBACK_FAULT = f"{PACKAGE}.instrumentors.dataloader:WorkerProcesses._children:1+"
# Only collectives inside a step get span attributes: the 3rd is step 2's first all-reduce.
COMM_FAULT = f"{PACKAGE}.export.emitter:span_attributes:3"


def losses(path: Path) -> list[float]:
    return json.loads(path.read_text())


def last_points(run, metric: str) -> list:
    (metrics_file,) = run.cwd.glob("telemetry/*/metrics-rank0.jsonl")
    return [point for point in read_last_points(metrics_file) if point.metric == metric]


def failure_reports(stderr: str, component: str) -> list[str]:
    return re.findall(rf"^.*: {component} failed in (\S+) and is disabled for the rest of this process.*$", stderr,
                      re.MULTILINE)


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def baseline(runs_dir) -> list[float]:
    workdir = runs_dir / "baseline"
    workdir.mkdir()
    launch(workdir, "python", "--steps", str(STEPS), "--loss-file", str(workdir / "losses.json"),
           instrument=False).check()
    return losses(workdir / "losses.json")


@pytest.fixture(scope="module")
def step_fault(runs_dir):
    workdir = runs_dir / "step-fault"
    workdir.mkdir()
    # Frequent collections, so that a callback failing at each of them shows how often it is reported.
    return launch_script(workdir, "faulty_train.py", "python", "--steps", str(STEPS),
                         "--loss-file", str(workdir / "losses.json"), "--comms-log", str(workdir / "comms"),
                         env={"RELIABILITY_FAULT": f"{STEP_FAULT},{CALLBACK_FAULT}",
                              "OTEL_METRIC_EXPORT_INTERVAL": "100"})


@pytest.fixture(scope="module")
def comm_fault(runs_dir):
    workdir = runs_dir / "comm-fault"
    workdir.mkdir()
    return launch_script(workdir, "faulty_train.py", "python", "--steps", str(STEPS),
                         "--loss-file", str(workdir / "losses.json"), env={"RELIABILITY_FAULT": COMM_FAULT})


# -- (6) a bug inside step tracing ---------------------------------------------------------------------


@pytest.mark.slow
def test_a_bug_in_step_tracing_leaves_training_bit_identical(step_fault, baseline):
    step_fault.check()
    assert step_fault.trained() == (STEPS, 0)
    assert losses(step_fault.cwd / "losses.json") == baseline


@pytest.mark.slow
def test_a_bug_in_step_tracing_is_logged_once_with_component_and_traceback(step_fault):
    assert failure_reports(step_fault.stderr, "step tracing") == ["StepBuilder.replay"], step_fault.stderr
    report = step_fault.stderr[step_fault.stderr.index("step tracing failed"):]
    traceback = report[:report.index("RuntimeError: injected fault in StepBuilder._start_phase, call 7")]
    assert "Traceback (most recent call last)" in traceback and "builder.py" in traceback
    assert step_fault.stderr.count("injected fault in StepBuilder._start_phase") == 1


@pytest.mark.slow
def test_step_tracing_stays_off_after_its_bug_while_collectives_and_metrics_go_on(step_fault):
    step_fault.check()
    traced = sorted(s.attributes["training.step"] for s in step_fault.spans if s.name == "training.step")
    assert traced == [1, 2, 3], "steps before the bug are whole; the one it hit ends with it; none after"
    (failed,) = [s for s in step_fault.spans if s.name == "training.step" and s.attributes["training.step"] == 3]
    assert (failed.status, failed.status_message) == (2, "step tracing failed; see the log")
    roots = sorted(s.attributes["training.step"] for s in step_fault.spans if s.name == "training.global_step")
    assert roots == [1, 2, 3]
    (step_duration,) = last_points(step_fault, "training.step.duration")
    assert step_duration.value == 2
    (samples,) = last_points(step_fault, "training.samples")
    assert samples.value == 2 * 8, "the training metrics belong to step tracing: frozen with it"
    # Collective tracing is another component: it measured every collective of the loop, as
    # DeepSpeed's own comms logger counted them.
    oracle = json.loads((step_fault.cwd / "comms.rank0.json").read_text())
    measured = {p.attributes["comm.op"]: p.value for p in last_points(step_fault, "training.comm.duration")}
    assert measured == {op: sum(calls.values()) for op, calls in oracle.items()}
    assert measured["all_reduce"] >= 2 * STEPS


@pytest.mark.slow
def test_after_a_step_tracing_bug_no_collective_lands_in_a_dead_step(step_fault):
    exported = {span.span_id for span in step_fault.spans}
    steps = {span.trace_id: span for span in step_fault.spans if span.name == "training.step"}
    orphans = [span.name for span in step_fault.spans if span.parent_id and span.parent_id not in exported]
    misplaced = [span.name for span in step_fault.spans if span.name.startswith("comm.")
                 and span.trace_id not in steps]
    assert misplaced == [], f"{len(misplaced)} collectives in the trace of a step that was never exported"
    assert orphans == [], f"spans whose parent was never exported: {orphans}"


@pytest.mark.slow
def test_a_bug_in_a_metric_callback_is_logged_once(step_fault):
    step_fault.check()
    reports = step_fault.stderr.count("injected fault in WorkerProcesses._children")
    assert reports == 1, f"the same bug was reported {reports} times"


# -- (6) a bug inside collective tracing ---------------------------------------------------------------


@pytest.mark.slow
def test_a_bug_in_collective_tracing_leaves_training_bit_identical(comm_fault, baseline):
    comm_fault.check()
    assert comm_fault.trained() == (STEPS, 0)
    assert losses(comm_fault.cwd / "losses.json") == baseline


@pytest.mark.slow
def test_a_bug_in_collective_tracing_is_logged_once_and_only_collectives_stop(comm_fault):
    comm_fault.check()
    assert failure_reports(comm_fault.stderr, "collective tracing") == ["Emitter._emit_collective"], comm_fault.stderr
    assert comm_fault.stderr.count("Traceback (most recent call last)") == 1
    assert comm_fault.stderr.count("RuntimeError: injected fault in span_attributes, call 3") == 1
    step_of = {span.trace_id: span.attributes["training.step"] for span in comm_fault.spans
               if span.name == "training.step"}
    assert sorted(step_of.values()) == list(range(1, STEPS + 1)), "every step is still traced"
    for name in ("training.global_step", "training.data.wait", "training.forward", "training.backward",
                 "training.optimizer.step"):
        assert len([s for s in comm_fault.spans if s.name == name]) == STEPS, name
    collectives = [step_of[span.trace_id] for span in comm_fault.spans if span.name.startswith("comm.")]
    assert collectives == [1, 1], "step 1's two all-reduces; none from the bug on"
    # The emitter records a collective's duration, then makes its span, where the bug hit step 2's
    # first: step 1's two durations and that one, none after.
    (duration,) = last_points(comm_fault, "training.comm.duration")
    assert duration.value == 3
    (step_duration,) = last_points(comm_fault, "training.step.duration")
    assert step_duration.value == STEPS


# A bug of ours past the guards the parts keep for themselves (a fault-injection review): each part turns off alone.
PART_FAULTS = {
    # The batch's counting, called by the DataLoader's wrapper: it reached the loop, and both ranks died at step 3.
    "input counting": (f"{PACKAGE}.recording.inputs:left_loader:3", "input batch counting",
                       "inputs.left_loader", list(range(1, STEPS + 1))),
    # One step's spans: a run whose only drain came at exit had lost the spans made before it too.
    "a step's spans": (f"{PACKAGE}.export.emitter:Emitter._step:3", "telemetry emission", "Emitter.drain", [1, 2]),
    # The step's loss: it turned the whole emission off, every span with it.
    "the step loss": (f"{PACKAGE}.recording.scalars:step_loss:3", "step loss and gradient norm", "Emitter._model",
                      list(range(1, STEPS + 1))),
}


@pytest.mark.slow
@pytest.mark.parametrize("part", sorted(PART_FAULTS))
def test_a_bug_in_one_part_leaves_training_bit_identical_and_the_rest_traced(runs_dir, baseline, part):
    spec, component, where, traced = PART_FAULTS[part]
    workdir = runs_dir / part.replace(" ", "-").replace("'", "")
    workdir.mkdir()
    run = launch_script(workdir, "faulty_train.py", "python", "--steps", str(STEPS),
                        "--loss-file", str(workdir / "losses.json"), env={"RELIABILITY_FAULT": spec}).check()
    assert run.trained() == (STEPS, 0)
    assert losses(workdir / "losses.json") == baseline
    assert failure_reports(run.stderr, component) == [where], run.stderr[-3000:]
    assert run.stderr.count("Traceback (most recent call last)") == 1
    steps = {span.attributes["training.step"]: span for span in run.spans if span.name == "training.step"}
    assert sorted(steps) == traced
    if part == "the step loss":
        assert [number for number, span in sorted(steps.items()) if "training.loss" in span.attributes] == [1, 2]


# -- (7) every variable of ours, with garbage, empty and extreme values -------------------------------

LONG_DIGITS = "9" * 10_000  # beyond Python's 4300-digit int() limit
LONG_TEXT = "x" * 10_000

# name -> (reader, default)
VARIABLES = {
    env.OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR: (env.output_dir, "telemetry"),
    env.OTEL_PYTHON_DEEPSPEED_OUTPUT_MAX_MB: (env.output_max_mb, 1024),
    env.OTEL_PYTHON_DEEPSPEED_SIGTERM_FLUSH: (env.sigterm_flush, True),
    env.OTEL_PYTHON_DEEPSPEED_EXIT_TIMEOUT: (env.exit_timeout, 5.0),
    env.OTEL_PYTHON_DEEPSPEED_EXCEPTION_DETAIL: (env.exception_detail, "full"),
    env.OTEL_PYTHON_DEEPSPEED_JOB_ID: (env.job_id, None),
    env.OTEL_PYTHON_DEEPSPEED_JOB_ID_TIMEOUT: (env.job_id_timeout, 60.0),
    env.OTEL_PYTHON_DEEPSPEED_COMM: (env.comm_mode, "spans"),
    env.OTEL_PYTHON_DEEPSPEED_COMM_SPAN_LIMIT: (env.comm_span_limit, 64),
    env.OTEL_PYTHON_DEEPSPEED_FLOPS_PER_TOKEN: (env.flops_per_token, None),
    env.OTEL_PYTHON_DEEPSPEED_PEAK_FLOPS: (env.peak_flops, None),
    env.OTEL_PYTHON_DEEPSPEED_PROMETHEUS_FINAL_SCRAPE_TIMEOUT: (env.prometheus_final_scrape_timeout, 0.0),
    env.OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY: (env.profile_every, 1000),
    env.OTEL_PYTHON_DEEPSPEED_PROFILE_TRIGGER: (env.profile_trigger, "otel-profile-trigger"),
    env.OTEL_PYTHON_DEEPSPEED_PROFILE_TOP: (env.profile_top, 64),
    env.OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR: (env.profile_slow_factor, 3.0),
    env.OTEL_PYTHON_DEEPSPEED_HANG_TIMEOUT: (env.hang_timeout, 30.0),
    env.OTEL_PYTHON_DEEPSPEED_TEST_CLOCK_SKEW: (env.test_clock_skew, None),
    env.OTEL_PYTHON_DEEPSPEED_CLOCK_REFRESH: (env.clock_refresh, 60.0),
    env.OTEL_PYTHON_DEEPSPEED_MEMORY_PEAK_RESET: (env.memory_peak_reset, True),
    env.OTEL_PYTHON_DEEPSPEED_PAD_TOKEN_ID: (env.pad_token_id, None),
}

BAD = "bad"  # the default, and one warning

# The outcome of each garbage value per variable: BAD, or the value accepted.
GARBAGE = ("abc", "", "-1", "1e309", LONG_DIGITS, LONG_TEXT, "0")
OUTCOMES = {
    "OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR": ("abc", BAD, "-1", "1e309", LONG_DIGITS, LONG_TEXT, "0"),
    "OTEL_PYTHON_DEEPSPEED_OUTPUT_MAX_MB": (BAD, BAD, BAD, BAD, BAD, BAD, 0),
    "OTEL_PYTHON_DEEPSPEED_SIGTERM_FLUSH": (BAD, BAD, BAD, BAD, BAD, BAD, BAD),
    "OTEL_PYTHON_DEEPSPEED_EXIT_TIMEOUT": (BAD, BAD, BAD, BAD, BAD, BAD, 0.0),
    "OTEL_PYTHON_DEEPSPEED_EXCEPTION_DETAIL": (BAD, BAD, BAD, BAD, BAD, BAD, BAD),
    "OTEL_PYTHON_DEEPSPEED_JOB_ID": ("abc", BAD, "-1", "1e309", LONG_DIGITS, LONG_TEXT, "0"),
    "OTEL_PYTHON_DEEPSPEED_JOB_ID_TIMEOUT": (BAD, BAD, BAD, BAD, BAD, BAD, BAD),
    "OTEL_PYTHON_DEEPSPEED_COMM": (BAD, BAD, BAD, BAD, BAD, BAD, BAD),
    "OTEL_PYTHON_DEEPSPEED_COMM_SPAN_LIMIT": (BAD, BAD, BAD, BAD, BAD, BAD, 0),
    "OTEL_PYTHON_DEEPSPEED_FLOPS_PER_TOKEN": (BAD, BAD, BAD, BAD, BAD, BAD, BAD),
    "OTEL_PYTHON_DEEPSPEED_PEAK_FLOPS": (BAD, BAD, BAD, BAD, BAD, BAD, BAD),
    "OTEL_PYTHON_DEEPSPEED_PROMETHEUS_FINAL_SCRAPE_TIMEOUT": (BAD, BAD, BAD, BAD, BAD, BAD, 0.0),
    "OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY": (BAD, BAD, BAD, BAD, BAD, BAD, 0),
    # Any text names a file, and empty documentedly means no trigger.
    "OTEL_PYTHON_DEEPSPEED_PROFILE_TRIGGER": ("abc", None, "-1", "1e309", LONG_DIGITS, LONG_TEXT, "0"),
    "OTEL_PYTHON_DEEPSPEED_PROFILE_TOP": (BAD, BAD, BAD, BAD, BAD, BAD, BAD),
    "OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR": (BAD, BAD, BAD, BAD, BAD, BAD, 0.0),
    "OTEL_PYTHON_DEEPSPEED_HANG_TIMEOUT": (BAD, BAD, BAD, BAD, BAD, BAD, 0.0),
    "OTEL_PYTHON_DEEPSPEED_TEST_CLOCK_SKEW": (BAD, BAD, BAD, BAD, BAD, BAD, BAD),
    "OTEL_PYTHON_DEEPSPEED_CLOCK_REFRESH": (BAD, BAD, BAD, BAD, BAD, BAD, 0.0),
    "OTEL_PYTHON_DEEPSPEED_MEMORY_PEAK_RESET": (BAD, BAD, BAD, BAD, BAD, BAD, BAD),
    "OTEL_PYTHON_DEEPSPEED_PAD_TOKEN_ID": (BAD, BAD, BAD, BAD, BAD, BAD, 0),
}
# Cases tests/test_configuration.py already checks.
COVERED = {("OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR", ""), ("OTEL_PYTHON_DEEPSPEED_JOB_ID", ""),
           ("OTEL_PYTHON_DEEPSPEED_JOB_ID_TIMEOUT", ""), ("OTEL_PYTHON_DEEPSPEED_COMM", ""),
           ("OTEL_PYTHON_DEEPSPEED_COMM_SPAN_LIMIT", "-1"), ("OTEL_PYTHON_DEEPSPEED_FLOPS_PER_TOKEN", "0"),
           ("OTEL_PYTHON_DEEPSPEED_PROFILE_TOP", "0")}

# Values at the edges of what each accepts, and just past them.
EXTREMES = [
    ("OTEL_PYTHON_DEEPSPEED_OUTPUT_MAX_MB", "10000000", 10_000_000),
    ("OTEL_PYTHON_DEEPSPEED_OUTPUT_MAX_MB", "10000001", BAD),
    ("OTEL_PYTHON_DEEPSPEED_SIGTERM_FLUSH", " FALSE ", False),
    ("OTEL_PYTHON_DEEPSPEED_SIGTERM_FLUSH", "1", BAD),
    ("OTEL_PYTHON_DEEPSPEED_EXIT_TIMEOUT", "3600", 3600.0),
    ("OTEL_PYTHON_DEEPSPEED_EXIT_TIMEOUT", "3600.5", BAD),
    ("OTEL_PYTHON_DEEPSPEED_EXIT_TIMEOUT", "nan", BAD),
    ("OTEL_PYTHON_DEEPSPEED_EXCEPTION_DETAIL", " Type ", "type"),
    ("OTEL_PYTHON_DEEPSPEED_JOB_ID_TIMEOUT", "86400", 86400.0),
    ("OTEL_PYTHON_DEEPSPEED_JOB_ID_TIMEOUT", "86400.001", BAD),
    ("OTEL_PYTHON_DEEPSPEED_JOB_ID_TIMEOUT", "1e-9", 1e-9),
    ("OTEL_PYTHON_DEEPSPEED_COMM", " OFF\n", "off"),
    ("OTEL_PYTHON_DEEPSPEED_COMM_SPAN_LIMIT", "1000000", 1_000_000),
    ("OTEL_PYTHON_DEEPSPEED_COMM_SPAN_LIMIT", "1000001", BAD),
    ("OTEL_PYTHON_DEEPSPEED_COMM_SPAN_LIMIT", "nan", BAD),
    ("OTEL_PYTHON_DEEPSPEED_FLOPS_PER_TOKEN", "9.99e29", 9.99e29),
    ("OTEL_PYTHON_DEEPSPEED_FLOPS_PER_TOKEN", "1e30", BAD),
    ("OTEL_PYTHON_DEEPSPEED_FLOPS_PER_TOKEN", "nan", BAD),
    ("OTEL_PYTHON_DEEPSPEED_PEAK_FLOPS", "1e-300", 1e-300),
    ("OTEL_PYTHON_DEEPSPEED_PEAK_FLOPS", "-inf", BAD),
    ("OTEL_PYTHON_DEEPSPEED_PROMETHEUS_FINAL_SCRAPE_TIMEOUT", "3600", 3600.0),
    ("OTEL_PYTHON_DEEPSPEED_PROMETHEUS_FINAL_SCRAPE_TIMEOUT", "3600.5", BAD),
    ("OTEL_PYTHON_DEEPSPEED_PROMETHEUS_FINAL_SCRAPE_TIMEOUT", "nan", BAD),
    ("OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY", "1000000", 1_000_000),
    ("OTEL_PYTHON_DEEPSPEED_PROFILE_TOP", "1", 1),
    ("OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR", "1", BAD),
    ("OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR", "1.0001", 1.0001),
    ("OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR", "1000", 1000.0),
    ("OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR", "nan", BAD),
    ("OTEL_PYTHON_DEEPSPEED_PROFILE_TRIGGER", "   ", None),
    ("OTEL_PYTHON_DEEPSPEED_HANG_TIMEOUT", "86400", 86400.0),
    ("OTEL_PYTHON_DEEPSPEED_HANG_TIMEOUT", "nan", BAD),
    ("OTEL_PYTHON_DEEPSPEED_TEST_CLOCK_SKEW", "1:-2.5", (1, -2.5, 0.0)),
    ("OTEL_PYTHON_DEEPSPEED_TEST_CLOCK_SKEW", "1:2.5:0.02", (1, 2.5, 0.02)),
    ("OTEL_PYTHON_DEEPSPEED_TEST_CLOCK_SKEW", "1:2.5:0.6", BAD),
    ("OTEL_PYTHON_DEEPSPEED_TEST_CLOCK_SKEW", "1:2.5:nan", BAD),
    ("OTEL_PYTHON_DEEPSPEED_CLOCK_REFRESH", "0.5", 0.5),
    ("OTEL_PYTHON_DEEPSPEED_TEST_CLOCK_SKEW", "1:nan", BAD),
    ("OTEL_PYTHON_DEEPSPEED_TEST_CLOCK_SKEW", "1:86401", BAD),
    ("OTEL_PYTHON_DEEPSPEED_PAD_TOKEN_ID", "2147483647", 2**31 - 1),
    ("OTEL_PYTHON_DEEPSPEED_PAD_TOKEN_ID", "2147483648", BAD),
]

CASES = [
    pytest.param(name, raw, expected, id=f"{name.removeprefix('OTEL_PYTHON_DEEPSPEED_')}={raw[:12]!r}")
    for name, outcomes in OUTCOMES.items() for raw, expected in zip(GARBAGE, outcomes, strict=True)
    if (name, raw) not in COVERED
] + [pytest.param(*case, id=f"{case[0].removeprefix('OTEL_PYTHON_DEEPSPEED_')}={case[1]!r}") for case in EXTREMES]


@pytest.fixture
def our_variables(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    env.reset_cache()
    yield monkeypatch
    env.reset_cache()


def test_the_tables_cover_every_variable_of_ours():
    declared = {value for name, value in vars(env).items() if name.startswith("OTEL_PYTHON_DEEPSPEED_")}
    assert set(VARIABLES) == declared == set(OUTCOMES)
    assert {reader for reader, _ in VARIABLES.values()} == set(env._READERS)


def assert_names_the_default(message: str, default) -> None:
    if default is None:  # what the default is, in words: not "None" (a review)
        assert "; using the default: " in message and "None" not in message, message
    else:  # a boolean as it is written: 'true'
        said = str(default).lower() if isinstance(default, bool) else default
        assert message.endswith(f"using the default {said!r}."), message


@pytest.mark.parametrize(("name", "raw", "expected"), CASES)
def test_garbage_empty_and_extreme_values(our_variables, caplog, name, raw, expected):
    reader, default = VARIABLES[name]
    our_variables.setenv(name, raw)
    with caplog.at_level(logging.WARNING):
        first, second = reader(), reader()
        env.check_all()
    warnings = [record.getMessage() for record in caplog.records if name in record.getMessage()]
    if expected is BAD:
        assert first == second == default
        (message,) = warnings
        assert message.startswith(f"{name}={raw!r} is not valid (")
        assert_names_the_default(message, default)
    else:
        assert first == second == expected
        assert warnings == []


GARBAGE_AT_ONCE = {
    "OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR": "",
    "OTEL_PYTHON_DEEPSPEED_OUTPUT_MAX_MB": "-1",
    "OTEL_PYTHON_DEEPSPEED_SIGTERM_FLUSH": "0",
    "OTEL_PYTHON_DEEPSPEED_EXIT_TIMEOUT": "-1",
    "OTEL_PYTHON_DEEPSPEED_EXCEPTION_DETAIL": "none",
    "OTEL_PYTHON_DEEPSPEED_JOB_ID": "",
    "OTEL_PYTHON_DEEPSPEED_JOB_ID_TIMEOUT": "1e309",
    "OTEL_PYTHON_DEEPSPEED_COMM": "abc",
    "OTEL_PYTHON_DEEPSPEED_COMM_SPAN_LIMIT": LONG_DIGITS,
    "OTEL_PYTHON_DEEPSPEED_FLOPS_PER_TOKEN": "nan",
    "OTEL_PYTHON_DEEPSPEED_PEAK_FLOPS": "-1",
    "OTEL_PYTHON_DEEPSPEED_PROMETHEUS_FINAL_SCRAPE_TIMEOUT": "abc",
    "OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY": "1e309",
    # No text is invalid here: a name too long for the file system is the worst it can get.
    "OTEL_PYTHON_DEEPSPEED_PROFILE_TRIGGER": LONG_TEXT,
    "OTEL_PYTHON_DEEPSPEED_PROFILE_TOP": "0",
    "OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR": "1",
    "OTEL_PYTHON_DEEPSPEED_PAD_TOKEN_ID": "-1",
    "OTEL_PYTHON_DEEPSPEED_HANG_TIMEOUT": "abc",
    "OTEL_PYTHON_DEEPSPEED_TEST_CLOCK_SKEW": "abc",
    "OTEL_PYTHON_DEEPSPEED_CLOCK_REFRESH": "abc",
    "OTEL_PYTHON_DEEPSPEED_MEMORY_PEAK_RESET": "abc",
}


@pytest.mark.slow
def test_every_variable_garbage_at_once_trains_and_traces(runs_dir):
    assert set(GARBAGE_AT_ONCE) == set(VARIABLES)
    workdir = runs_dir / "garbage"
    workdir.mkdir()
    run = launch(workdir, "python", "--steps", "6", env=GARBAGE_AT_ONCE).check()
    assert run.trained() == (6, 0)
    for name, raw in GARBAGE_AT_ONCE.items():
        warnings = [line for line in run.stderr.splitlines() if line.startswith(f"{name}=")]
        if name == "OTEL_PYTHON_DEEPSPEED_PROFILE_TRIGGER":
            assert warnings == []
        else:
            _, default = VARIABLES[name]
            assert len(warnings) == 1, (name, warnings)
            assert warnings[0].startswith(f"{name}={raw!r} is not valid (")
            assert_names_the_default(warnings[0], default)
    assert "Traceback" not in run.stderr
    assert [path.name for path in run.trace_files] == ["traces-rank0.jsonl"]
    assert run.trace_files[0].parent.parent == workdir / "telemetry"
    assert sorted(s.attributes["training.step"] for s in run.spans if s.name == "training.step") == list(range(1, 7))
    assert any(s.name.startswith("comm.") for s in run.spans), "OTEL_PYTHON_DEEPSPEED_COMM fell back to spans"


@pytest.fixture(scope="module")
def long_job_id(runs_dir):
    workdir = runs_dir / "long-job-id"
    workdir.mkdir()
    return launch(workdir, "python", "--steps", "3", env={"OTEL_PYTHON_DEEPSPEED_JOB_ID": "j" * 10_000})


@pytest.mark.slow
def test_a_job_id_longer_than_a_file_name_still_trains(long_job_id):
    long_job_id.check()
    assert long_job_id.trained() == (3, 0)
    assert "Traceback" not in long_job_id.stderr


@pytest.mark.slow
def test_a_job_id_longer_than_a_file_name_still_writes_telemetry(long_job_id):
    long_job_id.check()
    assert len([s for s in long_job_id.spans if s.name == "training.step"]) == 3
    assert "OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR" not in long_job_id.stderr
