"""The hang watchdog: a thread that notices a step that does not close, and says where the rank is.

The training thread does nothing for it. Every poll (at most a second) the watchdog's own thread
reads each recorder's open record (``recording/record.py``: set-once or append-only fields), and
the steps it sees close give it their durations, as do the steps the emitter writes (those that
open and close between two looks). A step open longer than ``threshold`` (the larger of
``OTEL_PYTHON_DEEPSPEED_HANG_TIMEOUT`` and ``FACTOR`` times the slowest of the last ``WINDOW``
steps closed; ``FIRST_STEP_FACTOR`` times the floor before one closed) is reported:
a ``HangReport`` (the step, its open phase and since when, the collective in flight, the last
sequence issued per group, the training thread's Python stack from ``sys._current_frames``) goes
to the emitter, which writes it as a ``training.hang`` span, and the tracer provider is flushed
while the training thread stays blocked. The report is repeated at 2, 4, 8... times the threshold,
so a live job's files always say for how long.

With no step open (before the first, or between two: in the data loader, in the program's own code
after ``engine.step()``), the training thread can block too. There the watchdog looks at where the
thread is: its stack (code and line of each frame) at each poll, and the last step the emitter
wrote. A stack that does not change, with no step written, for longer than the same threshold is
reported the same way, as the next step's (``training.hang.between_steps``), with the phase
``data.wait`` when the thread is inside a data loader's ``next``, and the collective in flight when
it waits in one issued outside any step (a barrier of the program's own). A thread that makes progress
(an evaluation loop, a checkpoint being written in Python) changes its stack from poll to poll; one
blocked in a single native call for that long (a collective, a lock, a very long write) does not.

A signal that arrives while the training thread is blocked in native code (a collective waiting
for a peer that will never come) does not run its Python handler. The interpreter still writes its
number to the wakeup fd this thread reads (``lifecycle.wake_on_signals``): after
``lifecycle.GRACE_SECONDS`` without the handler starting, this thread runs the lifecycle's exit
stages (a last report with the stack first) and the process dies by the signal. With the reports off
(``OTEL_PYTHON_DEEPSPEED_HANG_TIMEOUT=0``) the thread reads the signals only. Never the device:
nothing here synchronizes or touches a tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from collections import deque

from opentelemetry.metrics import Observation

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.recording.record import HangReport
from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env
from opentelemetry_instrumentation_deepspeed.runtime import lifecycle
from opentelemetry_instrumentation_deepspeed.runtime.safety import Component, fail_open, observing

_logger = logging.getLogger(__name__)

FACTOR = 10.0  # a step this many times the slowest recent one is not slow, it is stuck
FIRST_STEP_FACTOR = 10.0  # before any step closed (warm-up, first collectives), this many times the floor
WINDOW = 64  # closed steps whose durations set the threshold
MAX_POLL = 1.0  # seconds between two looks at the open records
STACK_LIMIT = 64  # innermost frames kept of the training thread's stack
FLUSH_MILLIS = 5000
# Seconds a look waits for a drain running elsewhere (the watchdog must come back to its signals).
DRAIN_WAIT = 1.0
SIGNALS_ONLY_POLL = 60.0  # hang reports off: the thread wakes for a signal, else rarely


def threshold(recent: list[float] | deque, floor: float) -> float:
    """Seconds a step may stay open before it is reported: the larger of ``floor`` and ``FACTOR`` times
    the slowest of ``recent`` closed steps; ``FIRST_STEP_FACTOR`` times ``floor`` while none closed."""
    if not recent:
        return floor * FIRST_STEP_FACTOR
    return max(floor, FACTOR * max(recent))


class _Watched:
    """The watchdog's view of one recorder."""

    __slots__ = ("durations", "engine", "idle_since", "last", "next_report", "recorder", "reported", "where")

    def __init__(self, recorder, engine=None):
        self.recorder = recorder
        # Its engine, weakly: once it is gone the entry leaves (a sweep or an evaluation harness builds engine
        # after engine, each recorder holding its facts, a file descriptor among them). None: watched for good.
        self.engine = None if engine is None else weakref.ref(engine)
        self.last = None  # the open record at the previous look
        self.durations: deque = deque(maxlen=WINDOW)
        self.next_report = 0.0  # open (or idle) seconds at which to report (again)
        # No step open: since when the training thread has been where it is (``where``: code and line
        # of each frame of its stack), the same at every look since, with no step written meanwhile.
        self.idle_since: int | None = None
        self.where = None
        self.reported: HangReport | None = None  # the last report made with no step open, until the thread moves

    @property
    def thread(self) -> int:
        """The training thread: the one that built the engine, until one opens its steps (``StepRecorder.thread``)."""
        return self.recorder.thread


class Watchdog(Component):
    def __init__(self, floor: float):
        super().__init__("hang watchdog")
        self.floor = floor
        self.reporting = floor > 0  # else the signals only
        self.poll = min(MAX_POLL, floor / 4) if self.reporting else SIGNALS_ONLY_POLL
        self._watched: list[_Watched] = []
        self._thread: threading.Thread | None = None
        self._started = False  # the thread was started, or could not be (signals only, no wakeup fd)
        self._signals: socket.socket | None = None
        self._meters: list = []
        self.reports = 0
        self._flushing: threading.Thread | None = None
        # (when, the exit's reason, {thread: (its stack, whether in a data loader)}) as a stopping signal arrived
        # (``_snapshot``); None once the program went on from it (a Ctrl-C it caught)
        self._at_signal: tuple | None = None

    # -- the training thread, once per engine -------------------------------------------------------

    @fail_open
    def watch(self, recorder, meter=None, start: bool = True, engine=None) -> None:
        """``start``: the thread and the signals (False: tests call ``check`` themselves); ``engine``: the one
        ``recorder`` records, whose end ends the watch."""
        self._prune()  # a sweep building engine after engine: the dropped ones go (signals only, nothing else looks)
        if start and self._thread is None and not self._started:
            self._started = True
            self._listen_for_signals()
            if self.reporting or self._signals is not None:
                if self.reporting:
                    lifecycle.at_exit(lifecycle.REPORT_HANGS, self._at_exit)
                lifecycle.in_forked_child(lifecycle.FORGET, self._forget)
                self._thread = threading.Thread(target=self._run, daemon=True, name="otel-deepspeed-watchdog")
                self._thread.start()
        if start and self._thread is None:
            return  # signals only, and another wakeup fd is set: nothing would read the recorder
        self._watched.append(_Watched(recorder, engine))
        if meter is not None and not any(known is meter for known in self._meters):
            self._meters.append(meter)
            meter.create_observable_gauge(
                semconv.METRIC_STEP_OPEN_DURATION, [observing(self, self._observe_open)], unit="s",
                description="How long the step open now on this rank has been running; with no step open, how "
                            "long the training thread has stood still with no step written")

    def _prune(self) -> None:
        """The entries of engines gone, in place (the training thread may append a new engine's meanwhile); from this
        thread and the training thread's watch(): one may have removed an entry the other found."""
        for gone in [w for w in self._watched if w.engine is not None and w.engine() is None]:
            with contextlib.suppress(ValueError):
                self._watched.remove(gone)

    def _listen_for_signals(self) -> None:
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        try:
            if lifecycle.wake_on_signals(writer.fileno()):
                self._signals, self._writer = reader, writer  # the writer must stay open
                return
        except (ValueError, OSError):
            pass
        reader.close()
        writer.close()

    def _forget(self) -> None:
        self._watched.clear()
        self._thread = None
        self._started = False

    # -- the watchdog's thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self.broken:
                signals = self._wait(self.poll)
                if self.reporting:
                    self.check()
                else:
                    self._prune()
                for signum in signals:
                    self._signalled(signum)
        except Exception:  # noqa: BLE001 - ours: said once, the watching stops (a review: the thread died with Python's
            self.fail("Watchdog._run")  # own "Exception in thread" message, and nothing turned off)

    def _wait(self, seconds: float) -> bytes:
        if self._signals is None:
            time.sleep(seconds)
            return b""
        try:
            readable, _, _ = select.select([self._signals], [], [], seconds)
            return self._signals.recv(64) if readable else b""
        except (BlockingIOError, InterruptedError):
            return b""
        except OSError:
            self._signals = None
            return b""

    @fail_open
    def check(self, now: int | None = None) -> list[HangReport]:
        """One look at every open record: durations of the steps seen closing, and reports of those stuck."""
        now = time.time_ns() if now is None else now
        reports = []
        self._prune()
        for watched in list(self._watched):
            record = watched.recorder.open
            last = watched.last
            if record is not last:
                if last is not None and last.end is not None and last.failure is None:
                    watched.durations.append((last.end - last.start) / 1e9)
                watched.last = record
                watched.next_report = 0.0
                watched.idle_since = watched.where = None
                reports += _resumed(watched, now)  # a step opened or closed: the thread went on
            if record is None:
                reports += self._between_steps(watched, now)
                continue
            limit = self._threshold(watched)
            open_seconds = (now - record.start) / 1e9
            if open_seconds > max(limit, watched.next_report):
                watched.next_report = 2 * max(open_seconds, limit)
                reports.append(self._report(watched, record, now, semconv.HANG_REASON_WATCHDOG, limit))
        if reports:
            self._send(reports)
        return reports

    def _threshold(self, watched: _Watched) -> float:
        """``threshold`` of the steps this thread saw close and of those the emitter wrote: a step that opens and
        closes between two looks (steps shorter than the poll) is the emitter's only, and without it the threshold
        stayed at ``FIRST_STEP_FACTOR`` floors (300 s at the default) however many such steps closed."""
        written = getattr(watched.recorder.facts, "slowest_recent", None)
        return threshold(watched.durations if written is None else [*watched.durations, written], self.floor)

    def _between_steps(self, watched: _Watched, now: int) -> list[HangReport]:
        """No step open: a report when the training thread has stayed where it is, with no step
        written, for longer than the threshold; a ``resumed`` one when it moves on after that."""
        facts = watched.recorder.facts
        # Engines that share the thread (a second engine for evaluation): one that has a step open, or
        # closed one since, is the thread's progress; the open step is watched as such.
        sharing = [w for w in self._watched if w.thread == watched.thread]
        if watched.reported is not None:
            from opentelemetry_instrumentation_deepspeed.export.emitter import emitter

            # A step written since the report is the news that it went on (a drain running elsewhere, slowed by
            # its exports, may be late with it: this look does not wait for it, the next one sees it).
            emitter().drain(timeout=DRAIN_WAIT)
        resumed = [] if watched.idle_since is None else _stepped_since(watched, sharing, now)
        frame = sys._current_frames().get(watched.thread)
        if frame is None:
            watched.where = None
            return resumed
        if any(w.recorder.open is not None for w in sharing):
            watched.where = None
            return resumed + _resumed(watched, now)  # another engine of the thread stepping: progress
        where = _frame_key(frame)
        if where != watched.where:
            # Not progress by itself: a signal's handler, or an exception unwinding the stack, moves it too. SIGTERM's
            # handler, run over where the thread stood, is no place of its own: the last report at the signal runs
            # from when the thread stopped there. idle_since first: the metric reader's thread reads the two without
            # a lock.
            if watched.where is None or not lifecycle.in_sigterm_handler(frame):
                watched.idle_since, watched.where, watched.next_report = now, where, 0.0
            return resumed
        limit = self._threshold(watched)
        if (now - watched.idle_since) / 1e9 <= max(limit, watched.next_report):
            return resumed
        from opentelemetry_instrumentation_deepspeed.export.emitter import emitter

        # Steps closed since the emitter's last round, if any, are progress: no report before they are known (False:
        # a drain running elsewhere has them; None: the emitter is off, and nothing will know them).
        known = emitter().drain(timeout=DRAIN_WAIT) is not False
        if known:
            resumed += _stepped_since(watched, sharing, now)
        if not known or (now - watched.idle_since) / 1e9 <= max(limit, watched.next_report):
            return resumed
        idle = (now - watched.idle_since) / 1e9
        watched.next_report = 2 * max(idle, limit)
        number = max(getattr(facts, "last_written", 0), watched.last.number if watched.last is not None else 0) + 1
        phase = semconv.PHASE_DATA_WAIT if _in_data_loader(frame) else None
        collective = _comm("in_flight_between_steps", None)  # a barrier, an evaluation's all-reduce
        watched.reported = HangReport(facts, number, watched.idle_since, now, semconv.HANG_REASON_WATCHDOG, limit,
                                      phase, None, None, collective, _comm("last_sequences", {}),
                                      _stopped_at(watched.thread)[0], between_steps=True)
        return [*resumed, watched.reported]

    def _report(self, watched: _Watched, record, now: int, reason: str, limit: float, *,
                at_signal: dict | None = None) -> HangReport:
        phase = record.phase
        latest = record.latest_dropped  # issued past the collectives a step keeps: after all of those
        collective = latest if latest is not None and latest.end is None else next(
            (c for c in reversed(list(record.collectives)) if c.end is None), None)
        return HangReport(record.facts, record.number, record.start, now, reason, limit,
                          None if phase is None else phase.name, None if phase is None else phase.micro_step,
                          None if phase is None else phase.start, collective, _comm("last_sequences", {}),
                          _stopped_at(watched.thread, at_signal)[0])

    def _send(self, reports: list[HangReport]) -> None:
        from opentelemetry_instrumentation_deepspeed.export import hangs
        from opentelemetry_instrumentation_deepspeed.export.emitter import emitter

        sink = emitter()
        for report in reports:
            sink.submit(report)
            self.reports += 1
        sink.drain(blocking=False)  # a drain running elsewhere (slowed by its exports) writes them
        providers = {id(r.facts.writer.provider): r.facts.writer.provider for r in reports}.values()
        self._flush([provider for provider in providers if hasattr(provider, "force_flush")])
        for report in reports:
            where = hangs.where_text(report)
            if report.reason == semconv.HANG_REASON_RESUMED:
                _logger.warning("opentelemetry-instrumentation-deepspeed: the training thread moved on after %s s "
                                "in %s", _seconds((report.at - report.step_start) / 1e9), where)
                continue
            if report.collective is not None:
                where += (f", in {report.collective.route.span_name} (sequence {report.collective.sequence}) for "
                          f"{_seconds((report.at - report.collective.start) / 1e9)} s")
            _logger.warning("opentelemetry-instrumentation-deepspeed: no step progress for %s s (threshold %s s): "
                            "the training thread is in %s; its stack is in the training.hang span",
                            _seconds((report.at - report.step_start) / 1e9), _seconds(report.threshold), where)

    def _flush(self, providers: list) -> None:
        """The reports' providers flushed, on a thread of their own, waited for ``FLUSH_MILLIS`` at most: the SDK's
        batch processor exports everything it holds whatever its timeout says, while a signal that came meanwhile
        (a launcher stopping the stuck job) waits for this thread. A flush still running takes the new reports."""
        if self._flushing is not None and self._flushing.is_alive():
            return

        def flush():
            for provider in providers:
                try:
                    provider.force_flush(FLUSH_MILLIS)
                except Exception:  # the SDK's: the reports stay in its queue
                    _logger.debug("flushing the hang reports failed", exc_info=True)

        self._flushing = threading.Thread(target=flush, daemon=True, name="otel-deepspeed-watchdog-flush")
        self._flushing.start()
        self._flushing.join(FLUSH_MILLIS / 1000)

    def _signalled(self, signum: int) -> None:
        """A signal arrived; if its handler cannot run (the training thread is blocked in native code),
        this thread does the exit work and the process dies by the signal."""
        if signum == signal.SIGTERM and lifecycle.handles_sigterm():
            reason = lifecycle.TERMINATED
        elif signum == signal.SIGINT and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            reason = lifecycle.INTERRUPTED
        else:
            return
        self._at_signal = (time.monotonic(), reason, self._snapshot())
        before = self._positions()
        arrived = time.monotonic()
        # A thread waiting in a collective at a SIGTERM waits for a peer the launcher is stopping too (it stops the
        # ranks one after another, each once the one before has exited): its handler would not start, and each such
        # rank's grace would add to the job's exit.
        grace = (lifecycle.COLLECTIVE_GRACE_SECONDS if signum == signal.SIGTERM and self._in_collectives()
                 else lifecycle.GRACE_SECONDS)
        deadline = arrived + grace
        while time.monotonic() < deadline:
            if lifecycle.finishing():
                return
            time.sleep(0.05)
        if lifecycle.finishing() or not any(before):
            return
        if signum == signal.SIGINT and (self._positions() != before or not self._stuck()):
            # The training thread moved (KeyboardInterrupt reached it), or it is in a long native call it has not
            # been reported stuck in (a large matmul, a slow save): KeyboardInterrupt comes as the call returns,
            # and the program's own handling (a last checkpoint) runs, as without us; it may go on training.
            self._at_signal = None
            return
        # SIGTERM: its handler did not start within the grace period; the default action is death anyway.
        _logger.warning("opentelemetry-instrumentation-deepspeed: %s while the training thread is blocked; "
                        "writing the telemetry from the watchdog's thread", signal.Signals(signum).name)
        lifecycle.finish_elsewhere(signum, reason, spent=time.monotonic() - arrived)  # the budget runs from the signal

    def _signal_stacks(self, reason: str) -> dict | None:
        """The stacks taken as the signal that stops the process now arrived: of the same signal, and recent (its
        handler starts at once, or the watchdog takes over after ``GRACE_SECONDS``); else None, the stacks of now."""
        taken = self._at_signal
        if taken is None or taken[1] != reason or time.monotonic() - taken[0] > 2 * lifecycle.GRACE_SECONDS:
            return None
        return taken[2]

    def _snapshot(self) -> dict[int, tuple[str, bool]]:
        """Each watched thread's stack as a stopping signal arrives, taken here while the thread may still be where
        the signal found it. By the time its handler runs there the thread may have moved: blocked in a collective
        whose peer the same signal stopped, it wakes to the peer's closed socket, and the handler runs inside torch's
        handling of that error (its stack showed c10d_logger's, not the wait). A thread already in the handler has
        moved: none is taken."""
        frames = sys._current_frames()
        found = {}
        for watched in list(self._watched):
            frame = frames.get(watched.thread)
            if frame is not None and not lifecycle.in_sigterm_handler(frame):
                found[watched.thread] = ("".join(traceback.format_stack(frame, STACK_LIMIT)), _in_data_loader(frame))
        return found

    def _stuck(self) -> bool:
        """Whether a watched thread has been reported stuck (past its threshold) and has not moved since: a report
        sets its next time, which a step opening or closing, or the thread moving between steps, sets back to 0."""
        return any(watched.next_report > 0 for watched in list(self._watched))

    def _in_collectives(self) -> bool:
        """Whether every watched thread waits in a synchronous collective now (in its open step, or between steps).
        An async one in flight does not count: not waited for yet (ZeRO's overlapped reduce-scatters, prefetched
        all-gathers), the thread computes meanwhile, maybe in a long native call whose end the handler waits for; one
        the thread waits on gets the usual grace too (that its wait() runs is not recorded)."""
        between = _comm("in_flight_between_steps", None)
        for watched in list(self._watched):
            record = watched.recorder.open
            calls = ([between] if between is not None else []) if record is None else [
                *list(record.collectives), *([record.latest_dropped] if record.latest_dropped is not None else [])]
            if not any(call.end is None and not call.is_async for call in calls):
                return False
        return bool(self._watched)

    def _positions(self) -> list:
        """Where each watched thread is (its innermost frame and instruction; None once it ended), step
        open or not: blocked in a collective of its own between steps (an evaluation's, a barrier before
        a checkpoint), a rank's handler cannot run either."""
        frames = sys._current_frames()
        found = []
        for watched in list(self._watched):
            frame = frames.get(watched.thread)
            found.append(None if frame is None else (id(frame), frame.f_lasti))
        return found

    # -- any thread ---------------------------------------------------------------------------------

    def _at_exit(self, reason: str) -> None:
        """Stopped by a signal with a step open: where the training thread was, before the step is closed.
        Stopped by a signal or an uncaught exception with no step open (in the data loader, in an evaluation, a
        checkpoint, a callback): a last report, between steps, says where and by what; with no step open nothing
        else would (a step open at an exception's exit is closed with it). Exiting on its own after a report with
        no step open (a last checkpoint longer than the threshold): the thread was not stuck, and a ``resumed``
        report says so."""
        if self.broken:
            return
        from opentelemetry_instrumentation_deepspeed.export.emitter import emitter

        now = time.time_ns()
        error = getattr(sys, "last_value", None) if reason == lifecycle.EXITED else None
        between = True
        if isinstance(error, KeyboardInterrupt):
            # Ctrl-C in the training thread's Python code: a step open still (the loop's own code) is reported as at
            # a signal. With none, the stack it unwound says nothing of where the thread stood, and the step it was
            # in, if any, ended with it.
            reason, error, between = lifecycle.INTERRUPTED, None, False
        elif reason == lifecycle.EXITED and error is None:  # on its own
            for watched in list(self._watched):
                for report in _resumed(watched, now, exiting=True):
                    emitter().submit(report)
            return
        if reason not in (lifecycle.TERMINATED, lifecycle.INTERRUPTED, lifecycle.EXITED):
            return
        # Where the signal found the threads; not after a Ctrl-C that reached Python (a KeyboardInterrupt unwound it).
        at_signal = self._signal_stacks(reason) if between and error is None else None
        threads = set()
        for watched in list(self._watched):
            record = watched.recorder.open
            if record is not None:
                threads.add(watched.thread)
                if error is None:
                    emitter().submit(self._report(watched, record, now, reason, self._threshold(watched),
                                                  at_signal=at_signal))
        if not between or (error is not None and _through_a_step(error)):
            return  # an exception that ended a step on its way out: that step says so
        for watched in list(self._watched):
            if watched.thread not in threads:  # one report per thread: engines may share one
                threads.add(watched.thread)
                emitter().submit(self._exit_between_steps(watched, now, reason, error, at_signal))

    def _exit_between_steps(self, watched: _Watched, now: int, reason: str, error,
                            at_signal: dict | None = None) -> HangReport:
        from opentelemetry_instrumentation_deepspeed.recording.record import Failure

        facts = watched.recorder.facts
        number = watched.recorder.next_number() or max(
            getattr(facts, "last_written", 0), watched.last.number if watched.last is not None else 0) + 1
        if error is None:  # a signal: the thread's stack where it stopped
            stacks, in_loader = _stopped_at(watched.thread, at_signal)
            description = None
        else:  # an exception: its traceback, where the stack stood when it was raised
            failure = Failure.of(error)
            stacks = [(watched.thread, "", failure.stacktrace)] if failure.stacktrace else []
            traceback_ = error.__traceback__
            while traceback_ is not None and traceback_.tb_next is not None:
                traceback_ = traceback_.tb_next
            in_loader = traceback_ is not None and _in_data_loader(traceback_.tb_frame)
            reason, description = semconv.STATUS_EXITED_BETWEEN, failure.description
        phase = semconv.PHASE_DATA_WAIT if in_loader else None
        # idle_since may be later than now: this thread's looks go on while the exit runs elsewhere.
        start = min(watched.idle_since, now) if watched.idle_since is not None else now
        return HangReport(facts, number, start, now, reason, self._threshold(watched), phase, None, None,
                          _comm("in_flight_between_steps", None), _comm("last_sequences", {}), stacks,
                          between_steps=True, error=description)

    def _observe_open(self, _options, now: int | None = None):
        """How long this rank has made no step progress: its open step's age; with no step open, how long
        the training thread has stood where it is with no step written (a rank blocked in its data
        loader waits for the next step), as the between-steps reports count it; 0 while it moves."""
        now = time.time_ns() if now is None else now
        since = []
        for watched in list(self._watched):
            record = watched.recorder.open
            if record is not None:
                since.append(record.start)
            elif watched.where is not None and watched.idle_since is not None:
                since.append(watched.idle_since)
        return [Observation(max((max(0, now - start) / 1e9 for start in since), default=0.0))]


def _stepped_since(watched: _Watched, sharing: list, now: int) -> list[HangReport]:
    """A step that closed after the thread seemed to stop: it moved (the same stack is the same loop
    line again), and has been where it is since that step's end at most."""
    last_end = max(getattr(w.recorder.facts, "last_end", 0) for w in sharing)
    if last_end <= watched.idle_since:
        return []
    watched.idle_since, watched.next_report = last_end, 0.0
    return _resumed(watched, now)


def _resumed(watched: _Watched, now: int, exiting: bool = False) -> list[HangReport]:
    """The thread made progress after a report with no step open (a step opened or closed, or the
    process exits on its own): the same report, ``resumed`` now. Not while the exit stages run for
    another reason (a signal): where the thread stopped stays the last word."""
    report = watched.reported
    if report is None or (lifecycle.finishing() and not exiting):
        return []
    watched.reported = None
    return [dataclasses.replace(report, at=now, reason=semconv.HANG_REASON_RESUMED, stacks=[])]


_OURS = "opentelemetry_instrumentation_deepspeed"
# The wrappers that end a step with the exception going through them (a phase, a fetch, a plain loop's hooks).
_STEP_WRAPPERS = tuple(os.path.join("instrumentors", name)
                       for name in ("engine.py", "dataloader.py", "torch_loop.py", "pipeline.py"))
_STEP_WRAPPERS_OF_STOP_ITERATION = tuple(path for path in _STEP_WRAPPERS if not path.endswith("dataloader.py"))


def _through_a_step(error: BaseException) -> bool:
    """Whether ``error`` went through a wrapper that ended its step with it: its traceback passes one. A loader's
    ``StopIteration`` ends no step (it is an epoch's end): out of the loop, the exit is the report's to tell (a
    review: an exhausted loader's, out of main(), read "killed by the OOM killer")."""
    wrappers = _STEP_WRAPPERS_OF_STOP_ITERATION if isinstance(error, StopIteration) else _STEP_WRAPPERS
    traceback_ = error.__traceback__
    while traceback_ is not None:
        path = traceback_.tb_frame.f_code.co_filename
        if _OURS in path and path.endswith(wrappers):
            return True
        traceback_ = traceback_.tb_next
    return False


def _frame_key(frame) -> tuple:
    """Where a thread is, as code and line of each frame: equal at two looks when it has not moved."""
    key = []
    while frame is not None and len(key) < STACK_LIMIT:
        key.append((id(frame.f_code), frame.f_lineno))
        frame = frame.f_back
    return tuple(key)


_TORCH_LOADER = os.path.join("torch", "utils", "data", "dataloader.py")
_OUR_LOADER = os.path.join("instrumentors", "dataloader.py")


def _in_data_loader(frame) -> bool:
    """Inside a data loader's ``next``: torch's, or any loader this instrumentation times."""
    while frame is not None:
        path = frame.f_code.co_filename
        if path.endswith(_TORCH_LOADER) or (path.endswith(_OUR_LOADER) and frame.f_code.co_name == "_next"):
            return True
        frame = frame.f_back
    return False


def _comm(function: str, default):
    """What the collectives' instrumentation knows (``last_sequences``, ``in_flight_between_steps``), if it runs."""
    comm = sys.modules.get("opentelemetry_instrumentation_deepspeed.instrumentors.comm")
    if comm is None:
        return default
    with contextlib.suppress(Exception):
        return getattr(comm, function)()
    return default


def _stopped_at(thread: int, at_signal: dict | None = None) -> tuple[list, bool]:
    """([(thread, its name, its stack)], whether it is in a data loader's next): as the stopping signal found it, where
    ``at_signal`` holds it (``Watchdog._snapshot``), else now."""
    if at_signal and thread in at_signal:
        stack, in_loader = at_signal[thread]
    else:
        if thread == threading.get_ident():
            # The signal's handler runs the exit stages on the training thread itself: its stack below them.
            frame = lifecycle.interrupted_frame()
        else:
            frame = sys._current_frames().get(thread)  # the documented way to see another thread
        if frame is None:
            return [], False
        stack, in_loader = "".join(traceback.format_stack(frame, STACK_LIMIT)), _in_data_loader(frame)
    names = {t.ident: t.name for t in threading.enumerate()}
    return [(thread, names.get(thread, ""), stack)], in_loader


_watchdog: Watchdog | None = None


def watch(recorder, meter=None, engine=None) -> None:
    """Watch ``recorder``'s steps, while ``engine`` lives (call on the thread that trains, when it is built).

    With ``OTEL_PYTHON_DEEPSPEED_HANG_TIMEOUT=0`` no step is reported, but the thread still reads the signals: the
    lifecycle's SIGTERM handler, which cannot run while the training thread is blocked in native code, would otherwise
    hold the rank's death until the call returns (never, for a collective waiting on a dead peer)."""
    global _watchdog  # noqa: PLW0603 - one per process
    floor = env.hang_timeout()
    if _watchdog is None:
        _watchdog = Watchdog(floor)
    _watchdog.watch(recorder, meter if _watchdog.reporting else None, engine=engine)


def _seconds(seconds: float) -> str:
    """Whole seconds, as the usual thresholds read; two digits below 10 s (a threshold of 0.001 s read "0 s")."""
    return f"{seconds:.0f}" if seconds >= 10 else f"{seconds:.2g}"
