"""How a training process's telemetry ends, whatever ends the process.

- A step still open at exit (the job raised outside DeepSpeed's calls, or was told to stop)
  ends with status ERROR and the reason, so the trace shows where the rank stopped.
- Spans are flushed before the last metrics are collected, so the final metrics count the
  spans that could not be delivered (the SDK's own exit handlers run in the other order).
- A process forked from a rank (a DataLoader worker, by default on Linux) inherits its SDK,
  whose own at-fork hooks restart the export threads there: the child would export a frozen
  copy of the rank's cumulative metrics under the rank's resource. In a forked child the SDK is
  stopped, the global providers are reset to the API's no-op ones, exporters (wrapped by
  ``delivery``) export nothing from another pid, and SIGTERM is left to the default.
- SIGTERM, which elastic agents and launchers send to stop a rank, normally kills Python
  without running any of this. When nothing else handles it, a handler runs the above, then
  restores the default and re-sends the signal: the process dies as it would have, by SIGTERM.
  Python runs the handler only between bytecodes: a rank blocked in a long C call (a
  collective waiting for a dead peer) gets to it when the call returns, or is killed by the
  agent's SIGKILL first. ``OTEL_PYTHON_DEEPSPEED_SIGTERM_FLUSH=false`` leaves SIGTERM alone.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading

from opentelemetry_instrumentation_deepspeed.export.emitter import emitter
from opentelemetry_instrumentation_deepspeed.recording import registry
from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env

_logger = logging.getLogger(__name__)
_providers: tuple = ()
_finished = threading.Lock()
_pid = os.getpid()


def install(tracer_provider, meter_provider) -> None:
    """Right after the SDK is set up: take its exit handlers over, to run them in order."""
    global _providers, _pid  # one SDK per process
    _providers, _pid = (tracer_provider, meter_provider), os.getpid()
    for provider in _providers:
        handler = getattr(provider, "_atexit_handler", None)
        if handler is not None:
            atexit.unregister(handler)
    atexit.register(finish, "the process exited during this step")
    if hasattr(os, "register_at_fork"):
        # After the SDK's own hooks, which run first: they registered when its objects were built.
        os.register_at_fork(after_in_child=_forked)
    if (env.sigterm_flush() and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _on_sigterm)


def finish(reason: str) -> None:
    """Close open steps with ``reason``, then flush traces, then metrics. Runs once, in the rank only."""
    if os.getpid() != _pid or not _finished.acquire(blocking=False):
        return
    for recorder in registry.all_recorders():
        if recorder.profiler is not None:
            recorder.profiler.abandon()
        recorder.interrupted(reason)
    emitter().drain(final=True)
    for provider in _providers:
        try:
            provider.shutdown()
        except Exception:  # the process is exiting: say so and go on
            _logger.warning("opentelemetry-instrumentation-deepspeed: shutting down %r failed", provider,
                            exc_info=True)


def _on_sigterm(signum, _frame) -> None:
    try:
        finish("terminated by SIGTERM")
        from opentelemetry_instrumentation_deepspeed.export import delivery

        delivery.report()  # the default action below skips the exit handlers that would say it
    finally:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _forked() -> None:
    try:
        from opentelemetry_instrumentation_deepspeed.runtime import session

        session.silent = True
        registry.forget_all()
        emitter().forget()
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        tracer_provider, meter_provider = _providers
        threads = []
        for processor in getattr(getattr(tracer_provider, "_active_span_processor", None), "_span_processors", ()):
            batch = getattr(processor, "_batch_processor", None)
            if batch is not None:
                batch._shutdown = True
                batch._worker_awaken.set()
                threads.append(getattr(batch, "_worker_thread", None))
        for reader in getattr(meter_provider, "_metric_readers", None) or ():
            stop = getattr(reader, "_shutdown_event", None)
            if stop is not None:
                # Its last collection would take locks a parent's thread may have held at fork.
                reader.collect = _nothing
                stop.set()
                threads.append(getattr(reader, "_daemon_thread", None))
        # They end at once: their last export is dropped (wrong pid).
        for thread in threads:
            if thread is not None and thread.is_alive():
                thread.join(timeout=1.0)
        _reset_global_providers()
    except Exception:  # a child must start whatever happens here
        _logger.debug("opentelemetry-instrumentation-deepspeed: quieting a forked child failed", exc_info=True)


def _nothing(*_args, **_kwargs) -> None:
    return None


def _reset_global_providers() -> None:
    """The API's globals back to their unset state: the child's spans and measurements are no-ops."""
    from opentelemetry import trace
    from opentelemetry.metrics import _internal as metrics_api
    from opentelemetry.util._once import Once

    trace._TRACER_PROVIDER = None
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    metrics_api._METER_PROVIDER = None
    metrics_api._METER_PROVIDER_SET_ONCE = Once()
