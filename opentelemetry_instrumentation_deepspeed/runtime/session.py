"""The telemetry of one training process, started when its first DeepSpeed engine is built.

``opentelemetry-instrument`` runs in every process of a job, the launchers and helpers
included. This project's configurator therefore only records its arguments; the SDK
(providers, exporter threads, files) is set up here, once the process is known to
train and its rank and job id can be part of the resource.
"""

from __future__ import annotations

import logging
import os
import sys

from opentelemetry import metrics, trace

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env
from opentelemetry_instrumentation_deepspeed.runtime import job
from opentelemetry_instrumentation_deepspeed.runtime.job import JobIdentity

_logger = logging.getLogger(__name__)

_EXPORTER_VARIABLES = (("traces", "OTEL_TRACES_EXPORTER"), ("metrics", "OTEL_METRICS_EXPORTER"))

_deferred_sdk_arguments: dict | None = None
_identity: JobIdentity | None = None
_listeners: list = []
# True once training started with no SDK behind the API (nothing would record). Instrumentors
# given no providers of their own then remove their wrappers (``leave_if_silent``); the others,
# and a forked child's copies, only pass calls through.
silent = False


def on_start(listener) -> None:
    """Call ``listener(identity)`` once this process starts training (now, if it already has)."""
    if _identity is not None:
        _notify(listener, _identity)
    else:
        _listeners.append(listener)


def leave_if_silent(instrumentor, kwargs: dict) -> None:
    """Uninstrument ``instrumentor`` when training starts with nothing to record into.

    Pass-through wrappers still cost a few microseconds per call inside a step (~80 us per step
    on the benchmark machine); gone, they cost nothing. Providers handed to ``instrument()``
    record whatever the globals hold, so such an instrumentor stays.
    """
    if kwargs.get("tracer_provider") is not None or kwargs.get("meter_provider") is not None:
        return

    def leave(_identity):
        if silent and instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.uninstrument()

    on_start(leave)


def would_record(tracer_provider=None, meter_provider=None) -> bool:
    """Whether training that started now would record: an SDK is behind the API, or the distro set one aside for
    the start of training."""
    from opentelemetry_instrumentation_deepspeed.export import sdk

    return _deferred_sdk_arguments is not None or not sdk.api_only(tracer_provider, meter_provider)


def _notify(listener, identity: JobIdentity) -> None:
    try:
        listener(identity)
    except Exception:  # one part failing to start must not stop training or the others
        _logger.exception("opentelemetry-instrumentation-deepspeed: %r failed to start; training is not affected",
                          listener)


def defer_sdk(arguments: dict) -> None:
    """Keep the configurator's arguments until a training engine starts in this process."""
    global _deferred_sdk_arguments  # noqa: PLW0603 - one SDK per process
    _deferred_sdk_arguments = dict(arguments)


def start(resource: dict | None = None) -> JobIdentity:
    """Identify this process in its job and, when deferred, set the SDK up. Idempotent.

    Collective on first call (the job id may be agreed through the process group's store),
    which is why it runs while every rank builds its engine. ``resource``: more attributes of the
    process's resource (a pipeline rank's coordinates), used if this call sets the SDK up.
    """
    global _identity, silent  # noqa: PLW0603 - one training identity per process
    if _identity is None:
        env.check_all()
        identity = job.identify()
        from opentelemetry_instrumentation_deepspeed.export import output

        output.use_identity(identity)
        if _deferred_sdk_arguments is not None:
            _configure_sdk(identity, resource)
        _identity = identity
        from opentelemetry_instrumentation_deepspeed.export import sdk

        silent = sdk.api_only()
        while _listeners:
            _notify(_listeners.pop(0), identity)
    return _identity


def _configure_sdk(identity: JobIdentity, resource: dict | None = None) -> None:
    global _deferred_sdk_arguments
    arguments, _deferred_sdk_arguments = _deferred_sdk_arguments, None
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        _logger.debug("A tracer provider is already set; the SDK is left as the application configured it.")
        return
    from opentelemetry_instrumentation_deepspeed.export import delivery, prometheus, sdk
    from opentelemetry_instrumentation_deepspeed.runtime import lifecycle

    if prometheus.in_use():
        prometheus.assign_port(identity.local_rank)
    env.settle_sdk_variables()
    _leave_unusable_endpoints()
    delivery.install()
    try:
        sdk.initialize(arguments, identity.resource_attributes(resource))
    except Exception as error:  # noqa: BLE001 - a Prometheus port taken, an exporter that cannot be built
        traced = not isinstance(trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider))
        measured = type(metrics.get_meter_provider()).__module__.startswith("opentelemetry.sdk")
        _logger.warning("opentelemetry-instrumentation-deepspeed: the OpenTelemetry SDK's set-up failed (%s: %s); "
                        "what it set up before that is used (traces %s, metrics %s); training is not affected",
                        type(error).__name__, error, "on" if traced else "off", "on" if measured else "off")
    tracer_provider, meter_provider = trace.get_tracer_provider(), metrics.get_meter_provider()
    try:
        delivery.watch(tracer_provider, meter_provider)
    except Exception:  # only the accounting of lost telemetry is lost
        _logger.warning("opentelemetry-instrumentation-deepspeed: cannot count undelivered telemetry with this SDK",
                        exc_info=True)
    end_with_the_process()
    lifecycle.install(tracer_provider, meter_provider)
    if prometheus.in_use():
        prometheus.wait_for_final_scrape_at_exit()
    embedded = [signal for signal, name in _EXPORTER_VARIABLES if env.EMBEDDED_EXPORTER in os.environ.get(name, "")]
    if embedded:
        from opentelemetry_instrumentation_deepspeed.export import native_crash, output

        output.announce(embedded)
        if "traces" in embedded:
            native_crash.watch(identity)


def _leave_unusable_endpoints() -> None:
    """A signal whose OTLP endpoint is not a URL goes to the embedded default instead, said once.

    The OTLP exporters take such an endpoint for a collector that is down: every batch is retried
    until its timeout and lost, and the variable is never named."""
    unusable: dict[tuple[str, str, str], list[str]] = {}  # (variable, value, why) -> its signals
    for signal, variable in (*_EXPORTER_VARIABLES, ("logs", "OTEL_LOGS_EXPORTER")):
        names = env.exporters(signal)
        problem = env.unusable_otlp_endpoint(signal) if "otlp" in names else None
        if problem is None:
            continue
        instead = "none" if signal == "logs" else env.EMBEDDED_EXPORTER
        os.environ[variable] = ",".join(dict.fromkeys(instead if name == "otlp" else name for name in names))
        unusable.setdefault(problem, []).append(signal)
    for (variable, value, why), signals in unusable.items():
        written = [signal for signal in signals if signal != "logs"]
        where = (f"the {' and '.join(written)} of this process go to the embedded default "
                 f"({env.EMBEDDED_EXPORTER}: OTLP JSON lines under {env.output_dir()}/) instead" if written else "")
        logs = "logs are not exported" if "logs" in signals else ""
        _logger.warning("%s=%r cannot be used (%s): %s.", variable, value, why, "; ".join(filter(None, (where, logs))))


_ends_with_the_process = False


def end_with_the_process() -> None:
    """What this process's training telemetry ends with, and what its forked children drop (once per
    process): called when the first step recorder is built, whoever set the SDK up."""
    global _ends_with_the_process  # noqa: PLW0603
    if _ends_with_the_process:
        return
    _ends_with_the_process = True
    from opentelemetry_instrumentation_deepspeed.export.emitter import emitter
    from opentelemetry_instrumentation_deepspeed.recording import registry
    from opentelemetry_instrumentation_deepspeed.runtime import lifecycle

    lifecycle.at_exit(lifecycle.STOP_PROFILER, _stop_profilers)
    lifecycle.at_exit(lifecycle.CLOSE_OPEN_STEPS, _close_open_steps)
    lifecycle.watch_sys_exit()  # what tells an unfinished step from a failed one at a normal exit
    lifecycle.at_exit(lifecycle.DRAIN, lambda _reason: emitter().drain(final=True))
    lifecycle.before_fork(lifecycle.END_PROFILE, _end_profiles)
    lifecycle.in_forked_child(lifecycle.FORGET, registry.forget_all)
    lifecycle.in_forked_child(lifecycle.FORGET, lambda: emitter().forget())
    lifecycle.in_forked_child(lifecycle.SILENCE, _go_silent)


def _stop_profilers(_reason: str) -> None:
    from opentelemetry_instrumentation_deepspeed.recording import registry

    for recorder in registry.all_recorders():
        if recorder.profiler is not None:
            recorder.profiler.abandon()


def _end_profiles() -> None:
    from opentelemetry_instrumentation_deepspeed.recording import registry

    for recorder in registry.all_recorders():
        if recorder.profiler is not None:
            recorder.profiler.before_fork()


def _close_open_steps(reason: str) -> None:
    from opentelemetry_instrumentation_deepspeed.recording import registry
    from opentelemetry_instrumentation_deepspeed.recording.record import Failure
    from opentelemetry_instrumentation_deepspeed.runtime import lifecycle

    # An uncaught exception from the loop's own code (outside DeepSpeed's calls, which end their step themselves):
    # the interpreter has set it aside for the exit, and the step it left open says what it was.
    error = getattr(sys, "last_value", None) if reason == lifecycle.EXITED else None
    exit_call = lifecycle.exit_call() if reason == lifecycle.EXITED and error is None else None
    for recorder in registry.all_recorders():
        if reason != lifecycle.EXITED or error is not None:
            cause = None if error is None else Failure.of(error)
            recorder.interrupted(reason if cause is None else f"{reason}: {cause.description}", cause=cause)
            continue
        try:
            record = recorder.open
        except Exception:  # noqa: BLE001 - a recorder that cannot replay its log: the step is closed all the same
            record = None
        if exit_call is None or not exit_call.failed or (record is not None and exit_call.at < record.start):
            # Ended normally (a sys.exit(1) the program caught before this step, then went on, is no word on it):
            # what the step holds ran after the last optimizer step (an epoch's leftover micro-batches, a GAN's last
            # generator update), not a crash.
            recorder.interrupted(semconv.STATUS_UNFINISHED, unfinished=True)
        else:  # sys.exit() with a failure status: the program's own word for a failure, and its cause if it had one
            cause = exit_call.cause if exit_call.cause is not None else Failure.of(SystemExit(exit_call.status))
            recorder.interrupted(f"{reason}: {cause.description}", cause=cause)


def _go_silent() -> None:
    global silent  # noqa: PLW0603 - a forked child does not train
    silent = True


def reset() -> None:
    """Forget this process's identity (tests build several jobs in one process)."""
    global _identity, silent
    _identity, silent = None, False
    from opentelemetry_instrumentation_deepspeed.export import output

    output.reset()
