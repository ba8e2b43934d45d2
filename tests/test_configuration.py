"""Configuration: defaults, bad values (one clear message, the default, the run goes on), laziness."""

from __future__ import annotations

import logging
import subprocess
import time

import pytest

from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env
from opentelemetry_instrumentation_deepspeed.runtime import job
from opentelemetry_instrumentation_deepspeed.runtime.distro import DeepSpeedDistro
from tests.conftest import BIN, clean_env, launch


@pytest.fixture
def environ(monkeypatch):
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_LOGS_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
                 "OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR", "OTEL_PYTHON_DEEPSPEED_JOB_ID",
                 "OTEL_PYTHON_DEEPSPEED_EXIT_TIMEOUT", "OTEL_PYTHON_DEEPSPEED_EXCEPTION_DETAIL",
                 "OTEL_PYTHON_DEEPSPEED_JOB_ID_TIMEOUT", "OTEL_PYTHON_DEEPSPEED_COMM",
                 "OTEL_PYTHON_DEEPSPEED_COMM_SPAN_LIMIT", "OTEL_PYTHON_DEEPSPEED_FLOPS_PER_TOKEN",
                 "OTEL_PYTHON_DEEPSPEED_PEAK_FLOPS", "OTEL_PYTHON_DEEPSPEED_PROMETHEUS_FINAL_SCRAPE_TIMEOUT",
                 "OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY", "OTEL_PYTHON_DEEPSPEED_PROFILE_TOP",
                 "OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR", "OTEL_PYTHON_DEEPSPEED_PROFILE_TRIGGER",
                 "OTEL_RESOURCE_ATTRIBUTES", "TORCHELASTIC_RUN_ID",
                 "SLURM_JOB_ID", "SLURM_STEP_ID", "OTEL_BSP_SCHEDULE_DELAY", "OTEL_PYTHON_ID_GENERATOR",
                 "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
                 "OTEL_BSP_MAX_QUEUE_SIZE", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_COMPRESSION"):
        monkeypatch.delenv(name, raising=False)
    env.reset_cache()
    yield monkeypatch
    env.reset_cache()


def test_distro_defaults_to_local_files(environ):
    import os

    DeepSpeedDistro().configure()
    assert os.environ["OTEL_TRACES_EXPORTER"] == "deepspeed_file"
    assert os.environ["OTEL_METRICS_EXPORTER"] == "deepspeed_file"
    assert os.environ["OTEL_LOGS_EXPORTER"] == "none"
    assert os.environ["OTEL_BSP_SCHEDULE_DELAY"] == "1000", "spans leave the queue young"


def test_distro_defaults_to_otlp_with_an_endpoint_and_keeps_user_choices(environ):
    import os

    environ.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    environ.setenv("OTEL_METRICS_EXPORTER", "prometheus")
    environ.setenv("OTEL_BSP_SCHEDULE_DELAY", "250")
    DeepSpeedDistro().configure()
    assert os.environ["OTEL_BSP_SCHEDULE_DELAY"] == "250"
    assert os.environ["OTEL_TRACES_EXPORTER"] == "otlp"
    assert os.environ["OTEL_METRICS_EXPORTER"] == "prometheus"
    assert os.environ["OTEL_LOGS_EXPORTER"] == "otlp"


def test_the_first_cpu_utilization_is_of_the_time_since_the_start_not_zero(environ, monkeypatch):
    """The audit of the emitted files: every process.cpu.utilization and system.cpu.utilization point of jobs shorter
    than the export interval read 0.0, psutil's first reading."""
    from opentelemetry.instrumentation.system_metrics import SystemMetricsInstrumentor
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    monkeypatch.setenv("LOCAL_RANK", "0")
    reader = InMemoryMetricReader()

    class EntryPoint:
        name = "system_metrics"

        @staticmethod
        def load():
            return SystemMetricsInstrumentor

    DeepSpeedDistro().load_instrumentor(EntryPoint(), meter_provider=MeterProvider(metric_readers=[reader]))
    try:
        deadline = time.process_time() + 0.3
        while time.process_time() < deadline:  # this process busy
            pass
        points = {metric.name: [point.value for point in metric.data.data_points]
                  for resource in reader.get_metrics_data().resource_metrics
                  for scope in resource.scope_metrics for metric in scope.metrics}
    finally:
        SystemMetricsInstrumentor().uninstrument()
    assert max(points["process.cpu.utilization"]) > 0
    assert max(points["system.cpu.utilization"]) > 0


def test_signal_endpoint_only_affects_its_signal(environ):
    import os

    environ.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://tempo:4318/v1/traces")
    DeepSpeedDistro().configure()
    assert os.environ["OTEL_TRACES_EXPORTER"] == "otlp"
    assert os.environ["OTEL_METRICS_EXPORTER"] == "deepspeed_file"


@pytest.mark.parametrize("case", [
    ("OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR", "", env.output_dir, "telemetry"),
    ("OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR", "   ", env.output_dir, "telemetry"),
    ("OTEL_PYTHON_DEEPSPEED_JOB_ID", "", env.job_id, None),
    ("OTEL_PYTHON_DEEPSPEED_JOB_ID_TIMEOUT", "banana", env.job_id_timeout, 60.0),
    ("OTEL_PYTHON_DEEPSPEED_JOB_ID_TIMEOUT", "", env.job_id_timeout, 60.0),
    ("OTEL_PYTHON_DEEPSPEED_JOB_ID_TIMEOUT", "-5", env.job_id_timeout, 60.0),
    ("OTEL_PYTHON_DEEPSPEED_JOB_ID_TIMEOUT", "1e300", env.job_id_timeout, 60.0),
    ("OTEL_PYTHON_DEEPSPEED_JOB_ID_TIMEOUT", "nan", env.job_id_timeout, 60.0),
    ("OTEL_PYTHON_DEEPSPEED_COMM", "verbose", env.comm_mode, "spans"),
    ("OTEL_PYTHON_DEEPSPEED_COMM", "", env.comm_mode, "spans"),
    ("OTEL_PYTHON_DEEPSPEED_COMM_SPAN_LIMIT", "-1", env.comm_span_limit, 64),
    ("OTEL_PYTHON_DEEPSPEED_COMM_SPAN_LIMIT", "lots", env.comm_span_limit, 64),
    ("OTEL_PYTHON_DEEPSPEED_COMM_SPAN_LIMIT", "99999999999", env.comm_span_limit, 64),
    ("OTEL_PYTHON_DEEPSPEED_FLOPS_PER_TOKEN", "six billion", env.flops_per_token, None),
    ("OTEL_PYTHON_DEEPSPEED_FLOPS_PER_TOKEN", "0", env.flops_per_token, None),
    ("OTEL_PYTHON_DEEPSPEED_PEAK_FLOPS", "-989e12", env.peak_flops, None),
    ("OTEL_PYTHON_DEEPSPEED_PEAK_FLOPS", "inf", env.peak_flops, None),
    ("OTEL_PYTHON_DEEPSPEED_PROMETHEUS_FINAL_SCRAPE_TIMEOUT", "forever", env.prometheus_final_scrape_timeout, 0.0),
    ("OTEL_PYTHON_DEEPSPEED_PROMETHEUS_FINAL_SCRAPE_TIMEOUT", "7200", env.prometheus_final_scrape_timeout, 0.0),
    ("OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY", "often", env.profile_every, 1000),
    ("OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY", "-3", env.profile_every, 1000),
    ("OTEL_PYTHON_DEEPSPEED_PROFILE_TOP", "0", env.profile_top, 64),
    ("OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR", "0.5", env.profile_slow_factor, 3.0),
    ("OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR", "slow", env.profile_slow_factor, 3.0),
    ("OTEL_PYTHON_DEEPSPEED_PAD_TOKEN_ID", "-1", env.pad_token_id, None),
    ("OTEL_PYTHON_DEEPSPEED_TEST_CLOCK_SKEW", "abc", env.test_clock_skew, None),
    ("OTEL_PYTHON_DEEPSPEED_SIGTERM_FLUSH", "yes", env.sigterm_flush, True),
    ("OTEL_PYTHON_DEEPSPEED_MEMORY_PEAK_RESET", "maybe", env.memory_peak_reset, True),
])
def test_bad_values_warn_once_and_use_the_default(environ, caplog, case):
    variable, raw, reader, default = case
    environ.setenv(variable, raw)
    with caplog.at_level(logging.WARNING):
        assert reader() == default
        assert reader() == default
        assert caplog.records == [], "said only once this process is known to train: it may be a launcher"
        env.check_all()  # training starts
        env.check_all()
    (record,) = caplog.records
    message = record.getMessage()
    assert variable in message and repr(raw) in message
    if default is None:  # a review: "using the default None"; the message says what the default is
        assert "using the default: " in message and "None" not in message, message
    else:  # a boolean as the documentation writes it: 'true', not True
        assert f"default {str(default).lower() if isinstance(default, bool) else default!r}" in message, message


@pytest.mark.parametrize("case", [
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json", None, "using the default 'grpc'"),
    # A signal's own setting falls back to the general one (a review: it was set to the default, over a valid general)
    ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "bogus", None, "using OTEL_EXPORTER_OTLP_PROTOCOL's value"),
    ("OTEL_EXPORTER_OTLP_COMPRESSION", "zstd", None, "using no compression"),
    ("OTEL_EXPORTER_OTLP_COMPRESSION", "none", None, "over http/protobuf deflate or none"),  # gRPC raises on it
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "-5", None, "using the default '10'"),
    ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "abc", None, "using OTEL_EXPORTER_OTLP_TIMEOUT's value"),
    ("OTEL_BSP_MAX_QUEUE_SIZE", "-1", None, "using the default '2048'"),
    ("OTEL_BSP_SCHEDULE_DELAY", "1.5", "1000", "using the default '1000'"),  # the SDK reads it with int()
    ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4096", "2048", "larger than OTEL_BSP_MAX_QUEUE_SIZE, 2048"),
    ("OTEL_METRIC_EXPORT_INTERVAL", "0", None, "using the default '60000'"),
    ("OTEL_TRACES_EXPORTER", "bogus", "deepspeed_file", "using the default 'deepspeed_file'"),
    ("OTEL_TRACES_EXPORTER", "deepspeed_file, bogus", "deepspeed_file", "using the others 'deepspeed_file'"),
    ("OTEL_TRACES_EXPORTER", "console,", "console", "no exporter named ''"),  # the SDK looks '' up
    ("OTEL_METRICS_EXPORTER", "bogus", "deepspeed_file", "using the default 'deepspeed_file'"),
    ("OTEL_LOGS_EXPORTER", "bogus", "none", "using the default 'none'"),
    ("OTEL_PYTHON_ID_GENERATOR", "bogus", "deepspeed_random", "using the default 'deepspeed_random'"),
])
def test_sdk_variables_the_sdk_would_fail_on_are_named_once_and_settled(environ, caplog, case):
    """A review: each of these made the SDK's set-up raise (every signal's telemetry lost, a traceback, no variable
    named), or retried every export for ever (a negative timeout)."""
    import os

    name, value, settled, said = case
    environ.setenv(name, value)
    env.check_all()
    with caplog.at_level(logging.WARNING):
        env.settle_sdk_variables()
        env.settle_sdk_variables()  # a second engine: nothing more to say
    assert os.environ.get(name) == settled
    messages = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(messages) == 1 and f"{name}={value!r} is not valid" in messages[0] and said in messages[0], messages


@pytest.mark.parametrize(("name", "value"), [
    ("OTEL_TRACES_EXPORTER", "NONE"), ("OTEL_TRACES_EXPORTER", "console,deepspeed_file"),
    ("OTEL_METRIC_EXPORT_INTERVAL", "inf"),  # the SDK's reader: no periodic collection
    ("OTEL_EXPORTER_OTLP_TIMEOUT", " 10 "), ("OTEL_BSP_MAX_QUEUE_SIZE", "4096"),
    ("OTEL_EXPORTER_OTLP_COMPRESSION", "GZIP"), ("OTEL_PYTHON_ID_GENERATOR", "random"),
])
def test_values_the_sdk_takes_are_left_alone(environ, caplog, name, value):
    """A review of the settling: NONE (the SDK turns the signal off in any case) and inf were called not valid."""
    import os

    environ.setenv(name, value)
    env.check_all()
    with caplog.at_level(logging.WARNING):
        env.settle_sdk_variables()
    assert os.environ[name] == value and not caplog.records


def test_a_queue_below_the_default_batch_takes_batches_of_its_size(environ, caplog):
    import os

    environ.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "100")
    env.check_all()
    with caplog.at_level(logging.WARNING):
        env.settle_sdk_variables()
    assert os.environ["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"] == "100"
    (record,) = caplog.records
    assert "OTEL_BSP_MAX_QUEUE_SIZE='100' is not valid" in record.getMessage()
    os.environ.pop("OTEL_BSP_MAX_EXPORT_BATCH_SIZE")  # set by the settling, not by the test: not undone for it


@pytest.mark.parametrize("value", ["   ", " http://127.0.0.1:4318 "])
def test_an_endpoint_is_taken_without_the_spaces_around_it(environ, value):
    """A review: a blank endpoint chose OTLP and every span was lost; one with spaces around it passed the URL check,
    and the HTTP exporter refused the host with a space in it."""
    import os

    environ.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", value)
    DeepSpeedDistro().configure()
    env.settle_sdk_variables()
    assert os.environ["OTEL_TRACES_EXPORTER"] == ("otlp" if value.strip() else "deepspeed_file")
    assert os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") == (value.strip() or None)


def test_good_values(environ):
    environ.setenv("OTEL_PYTHON_DEEPSPEED_JOB_ID_TIMEOUT", "2.5")
    environ.setenv("OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR", "/data/otel")
    environ.setenv("OTEL_PYTHON_DEEPSPEED_COMM", " Metrics ")
    environ.setenv("OTEL_PYTHON_DEEPSPEED_COMM_SPAN_LIMIT", "0")
    assert env.job_id_timeout() == 2.5
    assert env.output_dir() == "/data/otel"
    assert env.comm_mode() == "metrics"
    assert env.comm_span_limit() == 0


def test_job_id_sources_in_order(environ):
    assert job.job_id_from_environment() is None
    environ.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's value when no rendezvous id is given
    assert job.job_id_from_environment() is None
    environ.setenv("OTEL_RESOURCE_ATTRIBUTES", "k8s.job.uid=42ab,team=ml")
    assert job.job_id_from_environment() == "k8s-42ab"
    environ.setenv("SLURM_JOB_ID", "1234")
    assert job.job_id_from_environment() == "slurm-1234"
    environ.setenv("SLURM_STEP_ID", "3")
    assert job.job_id_from_environment() == "slurm-1234.3"
    environ.setenv("TORCHELASTIC_RUN_ID", "run-7")
    assert job.job_id_from_environment() == "run-7"
    environ.setenv("OTEL_RESOURCE_ATTRIBUTES", "training.job.id=from-resource")
    assert job.job_id_from_environment() == "from-resource"
    environ.setenv("OTEL_PYTHON_DEEPSPEED_JOB_ID", "explicit")
    env.reset_cache()
    assert job.job_id_from_environment() == "explicit"
    # An elastic restart is a run of its own (a review: torchrun --rdzv-id restarts wrote both attempts under one id,
    # their steps of the same number in one trace: "432% compute").
    environ.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert job.job_id_from_environment() == "explicit"
    environ.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert job.job_id_from_environment() == "explicit-restart1"
    environ.delenv("TORCHELASTIC_RESTART_COUNT")
    environ.setenv("SLURM_RESTART_COUNT", "2")
    assert job.job_id_from_environment() == "explicit-restart2"


def test_user_resource_attributes_win(environ):
    environ.setenv("OTEL_RESOURCE_ATTRIBUTES", "host.name=node-a,training.framework=custom")
    environ.setenv("OTEL_SERVICE_NAME", "pretrain")
    attributes = job.JobIdentity("j", 1, 1, 2).resource_attributes()
    assert "host.name" not in attributes and "training.framework" not in attributes
    assert "service.name" not in attributes
    assert attributes["training.rank"] == 1 and attributes["service.instance.id"] == "j-rank1"


@pytest.mark.slow
def test_unwritable_output_dir_falls_back_to_the_default(workdir):
    blocker = workdir / "a-file"
    blocker.write_text("not a directory")
    bad = str(blocker / "telemetry")
    run = launch(workdir, "python", "--steps", "2", env={"OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR": bad}).check()
    assert run.trained() == (2, 0)
    messages = [line for line in run.stderr.splitlines() if "OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR" in line]
    assert len(messages) == 1, run.stderr
    assert repr(bad) in messages[0] and "'telemetry'" in messages[0]
    assert len([s for s in run.spans if s.name == "training.step"]) == 2, "the default directory got them"


@pytest.mark.slow
def test_unwritable_output_dir_and_default_still_trains(workdir):
    blocker = workdir / "telemetry"
    blocker.write_text("the default is taken by a file")
    run = launch(workdir, "python", "--steps", "2", "--loss-file", str(workdir / "losses.json"),
                 env={"OTEL_PYTHON_DEEPSPEED_OUTPUT_DIR": str(blocker / "x")}).check()
    assert run.trained() == (2, 0)
    assert "not written anywhere" in run.stderr
    assert (workdir / "losses.json").exists()


@pytest.mark.slow
def test_garbage_in_our_variable_is_reported_once_and_the_run_completes(workdir):
    run = launch(workdir, "python", "--steps", "2", env={"OTEL_PYTHON_DEEPSPEED_JOB_ID_TIMEOUT": "soon"}).check()
    assert run.trained() == (2, 0)
    assert run.stderr.count("OTEL_PYTHON_DEEPSPEED_JOB_ID_TIMEOUT='soon' is not valid") == 1
    assert len([s for s in run.spans if s.name == "training.step"]) == 2


@pytest.mark.slow
def test_sdk_variables_the_sdk_fails_on_are_named_once_and_the_telemetry_still_written(workdir):
    """A review: an unknown exporter name, or a negative queue size, made the SDK's set-up raise after the job
    started: "could not start tracing this engine" with a traceback, and no file at all, metrics included."""
    bad = {"OTEL_TRACES_EXPORTER": "deepspeed_file,bogus", "OTEL_BSP_MAX_QUEUE_SIZE": "-1",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
    run = launch(workdir, "python", "--steps", "3", env=bad).check()
    assert run.trained() == (3, 0)
    for name, value in bad.items():
        assert run.stderr.count(f"{name}={value!r} is not valid") == 1, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "could not start tracing" not in run.stderr, run.stderr[-3000:]
    assert len([s for s in run.spans if s.name == "training.step"]) == 3
    assert list(workdir.glob("telemetry/*/metrics-rank0.jsonl")), "the metrics too"


@pytest.mark.slow
def test_processes_that_do_not_train_write_nothing_and_start_no_thread(workdir):
    """Launchers and helpers inherit opentelemetry-instrument: it must cost them nothing."""
    probe = ("import sys, threading, deepspeed, torch.utils.data; "
             "print('PROBE', threading.active_count(), 'opentelemetry.sdk.trace' in sys.modules)")
    completed = subprocess.run([str(BIN / "opentelemetry-instrument"), str(BIN / "python"), "-c", probe],
                               cwd=workdir, env=clean_env(), capture_output=True, text=True, check=True)
    (probe_line,) = [line for line in completed.stdout.splitlines() if line.startswith("PROBE")]
    assert probe_line.split() == ["PROBE", "1", "False"], completed.stdout + completed.stderr
    assert list(workdir.iterdir()) == []
