"""How a training process's telemetry ends, whatever ends the process, and what a forked child drops.

One ordered list of stages for exit, one for a forked child; each part of the project registers
its handlers under a stage, and the order is the list's, not the order of registration:

- At exit (``atexit``, or SIGTERM when handled here) a running profiler is stopped; a step
  still open (the job raised outside DeepSpeed's calls, or was told to stop) ends with status
  ERROR and the reason, so the trace shows where the rank stopped; closed records become spans
  and metric points; spans are flushed; Prometheus gets its last scrape; the last metrics are
  collected (after the spans, so they count the spans that could not be delivered: the SDK's
  own exit handlers run in the other order, and are taken over); the logs are flushed; one line
  says what was lost.
- The exit is bounded: whatever the collector does, the stages end within
  ``OTEL_PYTHON_DEEPSPEED_EXIT_TIMEOUT`` seconds (5) of the start of exit, or of the SIGTERM. Each
  stage that waits on something outside the process (draining, the flushes, the last scrape) runs
  on a thread of its own and has until a share of that time (``_ENDS_BY``): the SDK is asked to
  give up by then, and a stage that has not ended is left behind; a flush to a collector that has
  stopped answering (``unanswered_when``) gets ``UNANSWERED_SECONDS``. The stage after each flush
  counts what it left undelivered (queued, or in an export that never returned) as lost, so the
  metrics and the summary line, which come after the last flush attempt, count every span and
  point exactly. Ctrl-C while they run (on the main thread) leaves the stages that wait on the
  world behind, as the deadline would; the quick ones, the counts and the summary, still run.
- A process forked from a rank (a DataLoader worker, by default on Linux) inherits its SDK,
  whose own at-fork hooks restart the export threads there: the child would export a frozen
  copy of the rank's cumulative metrics under the rank's resource. In a forked child the
  span id generator's own random source is re-seeded (the child would draw the parent's ids), the
  records inherited from the rank are dropped, the instrumentation goes silent, the SDK is
  stopped and the global providers are reset to the API's no-op ones; exporters (wrapped by
  ``delivery``) export nothing from another pid, and SIGTERM is left to the default.
- Before a fork, on the forking thread: a profile that thread runs ends (the child would inherit
  its session and record every operator it runs, for as long as it lives).
- SIGTERM, which elastic agents and launchers send to stop a rank, normally kills Python
  without running any of this. When nothing else handles it, a handler runs the exit stages,
  then restores the default and re-sends the signal: the process dies as it would have, by
  SIGTERM. A SIGTERM that arrives while the exit stages run (the process was exiting anyway)
  lets them end, within their bound, then kills the process. Python runs the handler only
  between bytecodes: a rank blocked in a long C call (a collective waiting for a dead peer) gets
  to it when the call returns, or is killed by the agent's SIGKILL first.
  ``OTEL_PYTHON_DEEPSPEED_SIGTERM_FLUSH=false`` leaves SIGTERM alone.
- Signals while the training thread is blocked in native code: the hang watchdog's thread
  (``watchdog.py``) reads the signal numbers the interpreter writes to its wakeup fd
  (``signal.set_wakeup_fd``, set here when nothing else set one) even then. When the handler
  above has not started ``GRACE_SECONDS`` after a SIGTERM (``COLLECTIVE_GRACE_SECONDS`` where the
  training thread waits in a collective, for a peer the launcher stops too) (or a SIGINT leaves the training thread
  where it was, in a step or between steps reported stuck past the hang threshold), that thread
  runs the same exit stages in what is left of the exit budget (it counts from the signal, grace
  period included), then the process dies by the signal (``finish_elsewhere``), with its telemetry
  out.

The exit stages run once, in the process that registered them (never in a forked child), at its
``atexit``; in a child that multiprocessing started and that trains (registered there), also at its
Process's end, which ``os._exit`` follows past ``atexit``. In a
process whose SDK the application set up, ``install`` is not called: handlers registered there
(the profiler's stop, the collectives' last GPU times) still run at exit, and the stages that
need this project's providers have none. Importing this module registers nothing, and it
imports nothing of this package but its names, its configuration and the SDK door: the parts
register their own handlers.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env

# Stages at exit (atexit, or SIGTERM when handled here), in the order they run.
STOP_PROFILER = "stop profiler"  # a running torch.profiler is stopped, nothing emitted
STOP_CLOCK = "stop clock refresh"  # the clock offset's refreshing thread asks the store no more (clock.py)
REPORT_HANGS = "report hangs"  # a signal with a step open: where the training thread is (watchdog.py)
CLOSE_OPEN_STEPS = "close open steps"  # open steps end with status ERROR and the reason
DRAIN = "drain"  # closed step records become spans and metric points
FLUSH_SPANS = "flush spans"  # tracer provider shut down (its exporter flushes)
COUNT_UNSENT_SPANS = "count unsent spans"  # spans still queued or in an unfinished export: lost
FINAL_SCRAPE = "final scrape"  # Prometheus: wait for one last scrape if configured
FLUSH_METRICS = "flush metrics"  # meter provider shut down (last collection)
COUNT_UNSENT_POINTS = "count unsent points"  # points in an unfinished export: lost
FLUSH_LOGS = "flush logs"  # logger provider shut down, when the SDK set one up
REPORT = "report"  # the one summary line of undelivered telemetry
STOP_FAULT_HANDLER = "stop fault handler"  # no native crash: its file goes (native_crash.py)
EXIT_ORDER = (STOP_PROFILER, STOP_CLOCK, REPORT_HANGS, CLOSE_OPEN_STEPS, DRAIN, FLUSH_SPANS, COUNT_UNSENT_SPANS,
              FINAL_SCRAPE, FLUSH_METRICS, COUNT_UNSENT_POINTS, FLUSH_LOGS, REPORT, STOP_FAULT_HANDLER)
# The stages that wait on the world, each on a thread of its own, and the share of the exit
# budget by which each has ended (from the start of exit). The others are quick and run on the
# exiting thread. The last quarter is left for the report and the interpreter's own exit, which
# takes seconds longer on a loaded machine than an uninstrumented process's.
_ENDS_BY = {DRAIN: 0.25, FLUSH_SPANS: 0.4, FINAL_SCRAPE: 0.45, FLUSH_METRICS: 0.7, FLUSH_LOGS: 0.75}
# A flush to a collector that does not answer (delivery.py says) gets this long: no more than a healthy one needs.
# Each rank's full share added up along a job's crash: the failing rank's exit held back the launcher's SIGTERM to
# the others, whose exit then took its share again (a review: 7.6 s, against the 5 s bound).
UNANSWERED_SECONDS = 0.5
UNANSWERED_POLL_SECONDS = 0.05  # how often a running flush looks whether its collector answers
_unanswered: dict[str, Callable[[], bool]] = {}

# Stages in a forked child (a DataLoader worker), in the order they run.
RESEED_IDS = "reseed ids"  # the id generator's own random source: else the child repeats the parent's ids
FORGET = "forget"  # drop recording state and queued records inherited from the parent
SILENCE = "silence"  # session.silent = True; SIGTERM handler back to default
STOP_SDK = "stop sdk"  # stop the inherited SDK threads, reset the global providers
FORK_ORDER = (RESEED_IDS, FORGET, SILENCE, STOP_SDK)
# Stages in this process as it forks, on the forking thread, before the fork.
END_PROFILE = "end profile"  # a torch.profiler session that thread runs ends; its step keeps what it recorded
BEFORE_FORK_ORDER = (END_PROFILE,)

EXITED = semconv.STATUS_EXITED
TERMINATED = semconv.STATUS_TERMINATED
INTERRUPTED = semconv.STATUS_INTERRUPTED
INTERRUPTED_EXIT = "a second Ctrl-C"  # what cut the exit short, in the summary line
GRACE_SECONDS = 2.0  # a signal's own handler has this long to start before another thread takes over
COLLECTIVE_GRACE_SECONDS = 0.25  # ... at a SIGTERM, when the training thread waits in a collective (watchdog.py)

_logger = logging.getLogger(__name__)
_at_exit: dict[str, list[Callable[[str], None]]] = {stage: [] for stage in EXIT_ORDER}
_in_child: dict[str, list[Callable[[], None]]] = {stage: [] for stage in FORK_ORDER}
_before_fork: dict[str, list[Callable[[], None]]] = {stage: [] for stage in BEFORE_FORK_ORDER}
_providers: tuple = (None, None, None)
_pid: int | None = None  # the process whose exit this is: set when the first exit handler registers
_fork_hooked = False
_finalized: int | None = None  # the multiprocessing child whose finalizers run the exit stages
_wired = False
_finished = threading.Lock()
_done = threading.Event()
_terminate_when_done = False  # a SIGTERM came while the stages ran: die by it once they end
_deadline = 0.0  # time.monotonic() by which the running stage must end
_extra_seconds = 0.0  # a configured wait at exit (Prometheus's last scrape) on top of the budget
cut_short: list[str] = []  # stages that had not ended by their deadline, left behind
cut_by: str | None = None  # what cut the exit short before the deadline (a KeyboardInterrupt in it)
_wakeup: int | None = None  # the fd this module set as the interpreter's wakeup fd


def at_exit(stage: str, handler: Callable[[str], None]) -> None:
    """Run ``handler(reason)`` at exit, in ``stage``; after the handlers registered under it before."""
    _at_exit[_known(stage, EXIT_ORDER)].append(handler)
    if _pid is None:
        _hook_exit()


def in_forked_child(stage: str, handler: Callable[[], None]) -> None:
    """Run ``handler()`` in every process forked from this one, in ``stage``."""
    _in_child[_known(stage, FORK_ORDER)].append(handler)
    _hook_fork()


def before_fork(stage: str, handler: Callable[[], None]) -> None:
    """Run ``handler()`` in this process as it forks, on the forking thread, in ``stage``."""
    _before_fork[_known(stage, BEFORE_FORK_ORDER)].append(handler)
    _hook_fork()


def _known(stage: str, order: tuple[str, ...]) -> str:
    if stage not in order:
        raise ValueError(f"{stage!r} is not one of the stages {order}")
    return stage


def install(tracer_provider, meter_provider) -> None:
    """Right after this project set the SDK up: take its exit handlers over, to run them in order."""
    global _providers  # noqa: PLW0603 - one SDK per process
    from opentelemetry_instrumentation_deepspeed.export import sdk

    logger_provider = sdk.logger_provider()
    _providers = (tracer_provider, meter_provider, logger_provider)
    sdk.take_over_exit_handlers(tracer_provider, meter_provider, logger_provider)
    _wire()
    _hook_exit()  # again: after anything the SDK registered, so that ours runs first
    _hook_fork()
    if (env.sigterm_flush() and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _on_sigterm)


def _wire() -> None:
    """The handlers of the providers installed, and of the SIGTERM handler: once per process."""
    global _wired  # noqa: PLW0603
    if _wired:
        return
    _wired = True
    at_exit(FLUSH_SPANS, _shut_down_tracer_provider)
    at_exit(FLUSH_METRICS, _shut_down_meter_provider)
    at_exit(FLUSH_LOGS, _shut_down_logger_provider)
    in_forked_child(SILENCE, _default_sigterm)
    in_forked_child(STOP_SDK, _stop_sdk)


@dataclasses.dataclass(frozen=True)
class ExitCall:
    """The main thread's last ``sys.exit()``: its argument, the exception being handled where it was called (Hydra,
    ``torch.multiprocessing.spawn`` and Lightning call it in an ``except`` block: the cause), as the spans would
    show it (a ``Failure``: text, no frames kept alive), and when."""

    status: object
    cause: object | None
    at: int  # time.time_ns()

    @property
    def failed(self) -> bool:
        """An exit status of failure: any but None and 0 (a string is printed, and the process exits with 1)."""
        return not (self.status is None or (isinstance(self.status, int) and self.status == 0))


_exit_calls: list[ExitCall] = []


def exit_call() -> ExitCall | None:
    return _exit_calls[-1] if _exit_calls else None


def watch_sys_exit() -> None:
    """``sys.exit(1)`` (Hydra's after an error it caught and reported, argparse's, click's) ends the process as a
    return from ``main()`` does: the exit handlers see no exception, and only its argument tells an error from the
    end of the program. It is noted on its way (on the main thread: elsewhere it ends a thread, not the process),
    and the exit goes on as it would. Once per process; ``from sys import exit`` made before it, ``exit()`` and
    ``raise SystemExit`` are not seen."""
    original = sys.exit
    if getattr(original, "_notes_exit_calls", False):
        return

    def exit(status=None):  # sys.exit's own name, as tracebacks show it
        if threading.current_thread() is threading.main_thread():
            with contextlib.suppress(Exception):  # ours: the exit goes on whatever happens here
                from opentelemetry_instrumentation_deepspeed.recording.record import Failure

                handled = sys.exc_info()[1]
                cause = Failure.of(handled) if handled is not None else None
                _exit_calls[:] = [ExitCall(status, cause, time.time_ns())]
        original(status)

    exit.__wrapped__, exit._notes_exit_calls = original, True
    sys.exit = exit


def unanswered_when(stage: str, collector_silent: Callable[[], bool]) -> None:
    """``stage``'s flush gets UNANSWERED_SECONDS more at most once ``collector_silent()``, looked at as it runs."""
    _unanswered[stage] = collector_silent


def allow_extra_exit_time(seconds: float) -> None:
    """A wait at exit the user configured (the last Prometheus scrape): the stages from it on get that much more."""
    global _extra_seconds  # noqa: PLW0603
    _extra_seconds = max(_extra_seconds, seconds)


def time_left() -> float:
    """Seconds until the running exit stage must have ended (what a flush may still wait)."""
    return max(0.0, _deadline - time.monotonic())


def finish(reason: str, spent: float = 0.0) -> None:
    """Run the exit stages, in order, with ``reason`` for open steps, within the exit budget less
    ``spent`` (seconds since the signal that ended the process, when they start late). Once, in the
    process that registered them; when a SIGTERM came meanwhile, the process then dies by it."""
    global _deadline, cut_by  # noqa: PLW0603
    if os.getpid() != _pid or not _finished.acquire(blocking=False):
        return
    try:
        started, budget = time.monotonic(), max(env.exit_timeout() - spent, 0.0)
        extra = 0.0
        for stage in EXIT_ORDER:
            try:
                if stage == FINAL_SCRAPE:
                    extra = _extra_seconds
                share = _ENDS_BY.get(stage)
                if share is None:
                    _run_exit_stage(stage, reason)
                elif cut_by is not None:
                    if _at_exit[stage]:
                        cut_short.append(stage)
                else:
                    _deadline = started + share * budget + extra
                    _run_bounded(stage, reason)
            except KeyboardInterrupt:
                # Ctrl-C again while the telemetry is flushed: whoever pressed it will not wait for the collector.
                # What waits on the world is left behind, as at the deadline; the counts and the summary line run.
                cut_by = INTERRUPTED_EXIT
                if stage in _ENDS_BY and _at_exit[stage] and stage not in cut_short:
                    cut_short.append(stage)
    finally:
        _done.set()
        if _terminate_when_done:
            _die_by(signal.SIGTERM)


def finishing() -> bool:
    """The exit stages have started (on any thread)."""
    return _finished.locked()


def finish_elsewhere(signum: int, reason: str, spent: float = 0.0) -> None:
    """From a thread other than the main one, blocked where a signal's handler cannot run: the exit
    stages, in what is left of the budget ``spent`` seconds after the signal (the grace period), then
    death by ``signum`` as its default action would have it."""
    finish(reason, spent)
    _die_by(signum)


def wake_on_signals(fd: int) -> bool:
    """Make the interpreter write each signal's number to ``fd`` (non-blocking), even while the main
    thread is blocked in native code; False where another wakeup fd is set or this is not the main thread."""
    global _wakeup  # noqa: PLW0603 - one wakeup fd per process
    if threading.current_thread() is not threading.main_thread():
        return False
    previous = signal.set_wakeup_fd(fd, warn_on_full_buffer=False)
    if previous != -1:  # someone else's (an asyncio loop): theirs stays
        signal.set_wakeup_fd(previous)
        return False
    _wakeup = fd
    in_forked_child(SILENCE, _no_wakeup)
    return True


def _no_wakeup() -> None:
    # A forked child would otherwise write its own signals into the parent's socket.
    global _wakeup  # noqa: PLW0603
    if _wakeup is not None and threading.current_thread() is threading.main_thread():
        current = signal.set_wakeup_fd(-1)
        if current != _wakeup:
            signal.set_wakeup_fd(current)
    _wakeup = None


def handles_sigterm() -> bool:
    """SIGTERM runs this module's exit stages (its handler is installed)."""
    return signal.getsignal(signal.SIGTERM) is _on_sigterm


def _silent(stage: str) -> bool:
    silent = _unanswered.get(stage)
    try:
        return silent is not None and silent()
    except Exception:  # the process is exiting: the stage gets its full share
        _logger.debug("Cannot tell whether the collector answers", exc_info=True)
        return False


def _run_bounded(stage: str, reason: str) -> None:
    global _deadline
    if not _at_exit[stage]:
        return
    worker = threading.Thread(target=_run_exit_stage, args=(stage, reason), daemon=True,
                              name=f"otel-deepspeed-exit: {stage}")
    worker.start()
    shortened = stage not in _unanswered
    while worker.is_alive() and time_left() > 0:
        # Looked at again as the flush runs: a job shorter than its first export learns only now that the collector
        # refuses (the exporter's first retry).
        worker.join(min(time_left(), UNANSWERED_POLL_SECONDS))
        if not shortened and worker.is_alive() and _silent(stage):
            shortened, _deadline = True, min(_deadline, time.monotonic() + UNANSWERED_SECONDS)
    if worker.is_alive():  # left behind: a daemon thread, which the interpreter does not wait for
        cut_short.append(stage)


def _run_exit_stage(stage: str, reason: str) -> None:
    global cut_by  # noqa: PLW0603
    for handler in list(_at_exit[stage]):
        try:
            handler(reason)
        except KeyboardInterrupt:  # in a quick stage, on the main thread: that handler is cut, the next ones run
            cut_by = INTERRUPTED_EXIT
        except Exception:  # the process is exiting: say so and go on
            _logger.warning("opentelemetry-instrumentation-deepspeed: %s failed at exit (stage %r)",
                            _name(handler), stage, exc_info=True)


def _hook_exit() -> None:
    global _pid, _finalized  # noqa: PLW0603
    _pid = os.getpid()
    # Handlers run last registered first: moved to the end, ours runs before anything registered until now.
    atexit.unregister(finish)
    atexit.register(finish, EXITED)
    # A multiprocessing child started by fork (torch's start_processes, Accelerate's notebook_launcher) ends in
    # os._exit, past atexit: its Process bootstrap runs multiprocessing's finalizers as it returns.
    multiprocessing = sys.modules.get("multiprocessing")
    if _finalized != _pid and multiprocessing is not None and multiprocessing.parent_process() is not None:
        _finalized = _pid
        sys.modules["multiprocessing.util"].Finalize(None, finish, args=(EXITED,), exitpriority=100)


def _hook_fork() -> None:
    global _fork_hooked  # noqa: PLW0603
    if not _fork_hooked and hasattr(os, "register_at_fork"):
        _fork_hooked = True
        os.register_at_fork(before=_forking, after_in_child=_forked)


def _forking() -> None:
    _run_fork_stages(BEFORE_FORK_ORDER, _before_fork, "as the process forked")


def _forked() -> None:
    _run_fork_stages(FORK_ORDER, _in_child, "in a forked child")


def _run_fork_stages(order: tuple[str, ...], handlers: dict, where: str) -> None:
    for stage in order:
        for handler in list(handlers[stage]):
            try:
                handler()
            except Exception:  # the fork, and the child, must go on whatever happens here
                _logger.debug("opentelemetry-instrumentation-deepspeed: %s failed %s (stage %r)",
                              _name(handler), where, stage, exc_info=True)


def _name(handler) -> str:
    return getattr(handler, "__qualname__", None) or repr(handler)


def interrupted_frame():
    """On the thread running SIGTERM's handler: the frame the signal interrupted, else None."""
    frame = _handler_frame(sys._getframe())
    return None if frame is None else frame.f_back


def in_sigterm_handler(frame) -> bool:
    """Whether ``frame`` (a thread's innermost) runs inside SIGTERM's handler."""
    return _handler_frame(frame) is not None


def _handler_frame(frame):
    while frame is not None and frame.f_code is not _on_sigterm.__code__:
        frame = frame.f_back
    return frame


def _on_sigterm(signum, _frame) -> None:
    global _terminate_when_done  # noqa: PLW0603
    if _finished.locked() and not _done.is_set():
        # The stages are running (the process was exiting, and this handler interrupted them):
        # they end within their bound, then the process dies by this signal.
        _terminate_when_done = True
        return
    try:
        finish(TERMINATED)
    finally:
        _die_by(signum)


def _die_by(signum) -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    # Another thread (the watchdog's, the main one blocked): signal.signal() works on the main thread
    # only, so the default action is restored in C.
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.signal.restype = ctypes.c_void_p
        libc.signal(signum, None)  # SIG_DFL
        os.kill(os.getpid(), signum)
        time.sleep(1)  # the signal is on its way
    os._exit(128 + signum)


# -- the handlers install() registers ---------------------------------------------------------------


def _shut_down_tracer_provider(_reason: str) -> None:
    if _providers[0] is not None:
        from opentelemetry_instrumentation_deepspeed.export import sdk

        # The SDK gives up a moment before the deadline, so that its exporter's shutdown ends in time.
        sdk.shut_down_tracer_provider(_providers[0], time_left() * 0.9)


def _shut_down_meter_provider(_reason: str) -> None:
    if _providers[1] is not None:
        # A reader given no time at all fails with a traceback: a few milliseconds, then it is left behind.
        _providers[1].shutdown(timeout_millis=max(time_left() * 0.9, 0.01) * 1000)


def _shut_down_logger_provider(_reason: str) -> None:
    if _providers[2] is not None:
        from opentelemetry_instrumentation_deepspeed.export import sdk

        sdk.shut_down_logger_provider(_providers[2], time_left() * 0.9)


def _default_sigterm() -> None:
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _stop_sdk() -> None:
    from opentelemetry_instrumentation_deepspeed.export import sdk

    sdk.stop_threads_in_child(*_providers)
    sdk.reset_global_providers()
