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

from opentelemetry_instrumentation_deepspeed.export import sdk, spans
from opentelemetry_instrumentation_deepspeed.recording import trackers
from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env

_logger = logging.getLogger(__name__)
_providers: tuple = ()
_finished = threading.Lock()
_pid = os.getpid()


def install(tracer_provider, meter_provider) -> None:
    """Right after the SDK is set up: take its exit handlers over, to run them in order."""
    global _providers, _pid  # one SDK per process
    _providers, _pid = (tracer_provider, meter_provider), os.getpid()
    sdk.take_over_exit_handlers(*_providers)
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
    for tracker in trackers.all_trackers():
        tracker.interrupted(reason)
    try:
        spans.hand_over()  # spans that ended outside a step's close (a GPU interval resolved late)
    except Exception:  # the process is exiting: say so and go on
        _logger.warning("opentelemetry-instrumentation-deepspeed: handing the last spans over failed", exc_info=True)
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
        trackers.forget_all()
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sdk.stop_threads_in_child(*_providers)
        sdk.reset_global_providers()
    except Exception:  # a child must start whatever happens here
        _logger.debug("opentelemetry-instrumentation-deepspeed: quieting a forked child failed", exc_info=True)

