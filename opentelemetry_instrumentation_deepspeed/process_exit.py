"""How a training process's telemetry ends, whatever ends the process.

- A step still open at exit (the job raised outside DeepSpeed's calls, or was told to stop)
  ends with status ERROR and the reason, so the trace shows where the rank stopped.
- Spans are flushed before the last metrics are collected, so the final metrics count the
  spans that could not be delivered (the SDK's own exit handlers run in the other order).
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

from opentelemetry_instrumentation_deepspeed import environment_variables as env
from opentelemetry_instrumentation_deepspeed import trackers

_logger = logging.getLogger(__name__)
_providers: tuple = ()
_finished = threading.Lock()


def install(tracer_provider, meter_provider) -> None:
    """Right after the SDK is set up: take its exit handlers over, to run them in order."""
    global _providers  # noqa: PLW0603 - one SDK per process
    _providers = (tracer_provider, meter_provider)
    for provider in _providers:
        handler = getattr(provider, "_atexit_handler", None)
        if handler is not None:
            atexit.unregister(handler)
    atexit.register(finish, "the process exited during this step")
    if (env.sigterm_flush() and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _on_sigterm)


def finish(reason: str) -> None:
    """Close open steps with ``reason``, then flush traces, then metrics. Runs once."""
    if not _finished.acquire(blocking=False):
        return
    for tracker in trackers.all_trackers():
        tracker.interrupted(reason)
    for provider in _providers:
        try:
            provider.shutdown()
        except Exception:  # the process is exiting: say so and go on
            _logger.warning("opentelemetry-instrumentation-deepspeed: shutting down %r failed", provider,
                            exc_info=True)


def _on_sigterm(signum, _frame) -> None:
    try:
        finish("terminated by SIGTERM")
        from opentelemetry_instrumentation_deepspeed import delivery

        delivery.report()  # the default action below skips the exit handlers that would say it
    finally:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
