"""When to run ``torch.profiler`` (Kineto) over a step: started and stopped on the training thread.

A step is profiled when its number is a multiple of ``OTEL_PYTHON_DEEPSPEED_PROFILE_EVERY``, when
someone touches the trigger file (``OTEL_PYTHON_DEEPSPEED_PROFILE_TRIGGER``: each rank looks at
its modification time at every ``TRIGGER_EVERY``-th step), or when the previous step took more
than ``OTEL_PYTHON_DEEPSPEED_PROFILE_SLOW_FACTOR`` times the median of the recent unprofiled ones
(the next step is profiled, to catch a recurring cause) and profiling has cost the training thread
and the emitter's less than ``SLOW_BUDGET`` of the run's steps so far. A step whose spans will not be recorded (the
sampler drops it), or whose profile nothing would emit (the emitter or its kernel spans failed), is
not profiled: a trigger's or a slow step's request waits for the next one that is. Nor is any step
while the program runs a torch.profiler of its own: a second session would end the program's,
emptied, at our stop. The profiler runs from the step's first phase (the data wait before it is
not profiled) to its close, and is stopped whatever happens: step close, step failure, process
exit. The stopped profiler goes with the step's record; ``export.kernels`` turns its events into
spans.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import threading
import time
from collections import deque

from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env
from opentelemetry_instrumentation_deepspeed.runtime.safety import Component, fail_open

_RECENT_STEPS = 20
_BASELINE_EVERY = 5  # unprofiled steps between two medians of the recent ones
# A profile costs the training thread tens of ms here (the profiled step's records, the stop) and the emitter about
# as much again. After every slow step of a job whose slow steps recur (a loader that stalls every 6th step), it
# added 30-60% to a 2-rank job of 20 ms steps: a slow step is profiled while what profiling has cost the training
# thread (each profiled step beyond the recent median, and its stop) and the emitter's (its spans) is within this
# share of the unprofiled steps.
SLOW_BUDGET = 0.005
# Steps between two looks at the trigger file: a system call inside a step costs ~25 us. Multiples
# of the step number, so that every rank looks at the same steps and profiles the same one.
TRIGGER_EVERY = 8
MAX_WAIT = 64  # steps a request waits for a step whose profile can come to anything


class StepProfiler(Component):
    def __init__(self, every: int, trigger: str | None, top: int, slow_factor: float):
        super().__init__("kernel profiling")
        self._every, self._trigger, self.top, self._slow_factor = every, trigger, top, slow_factor
        self._trigger_seen = self._trigger_mtime()
        self._requested = False
        self._recent: deque[float] = deque(maxlen=_RECENT_STEPS)
        self._slow_above: float | None = None  # seconds: the factor times the recent median
        self._median = 0.0  # seconds: the recent median, the baseline a profiled step's cost is counted from
        self._unprofiled = 0
        self._spent = 0.0  # seconds the profiled steps and their stops cost the training thread
        self._emitted = 0.0  # CPU seconds the emitter's thread spent making the profiles spans (written there only)
        self._profile = None
        self._thread: int | None = None  # the thread that started the running profile: the session is that thread's
        self._stopped = False  # the running profile was stopped before its step closed (the profiling thread forked)
        # number -> whether a profile of that step can come to anything (its spans sampled, an emitter to make them):
        # asked only where a step is to be profiled (engine.build_recorder sets it)
        self.worth = None
        self._waited = 0  # steps the pending request has waited for one that is worth a profile
        # Kineto logs every start and stop on stderr; a user's own setting wins.
        os.environ.setdefault("KINETO_LOG_LEVEL", "99")

    def _trigger_mtime(self) -> float | None:
        # A stat of a missing file raises: an exception on top of the system call.
        if not self._trigger or not os.access(self._trigger, os.F_OK):
            return None
        try:
            return os.stat(self._trigger).st_mtime_ns
        except OSError:
            return None

    def _triggered(self) -> bool:
        if not self._trigger:
            return False
        mtime = self._trigger_mtime()
        if mtime is not None and mtime != self._trigger_seen:
            self._trigger_seen = mtime
            return True
        return False

    # step_opened and step_closed are not guarded by fail_open: the recorder, their one caller, guards them where it
    # calls them (a frame fewer each, once per step), with the same broken check and the same fail().
    def step_opened(self, number: int) -> bool:
        """Start the profiler if step ``number`` is to be profiled."""
        # The trigger first: every rank looks at it at the same steps, whatever else asked for a profile here.
        if self._trigger and number % TRIGGER_EVERY == 0 and self._triggered():
            self._requested = True
        if not ((self._every and number % self._every == 0) or self._requested) or self._profile is not None:
            return False
        torch = sys.modules["torch"]
        if torch._C._autograd._profiler_enabled():
            return False  # the program's own torch.profiler: a second session would end it, emptied, at our stop
        if self.worth is not None and not self.worth(number):
            # Its spans would not be recorded (sampled out), or nothing can emit them: a request waits, a while.
            self._waited += 1
            if self._waited >= MAX_WAIT:  # none comes (a sampler that drops every trace): not asked at every step
                self._requested, self._waited = False, 0
            return False
        self._requested, self._waited = False, 0
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = self._profile = torch.profiler.profile(activities=activities, record_shapes=True, with_flops=True)
        self._thread = threading.get_ident()
        profile.start()  # kept first: a start that fails half-way leaves a profile for fail() to stop
        return True

    def _stop(self):
        profile = self._profile
        if profile is not None:
            if not self._stopped:
                profile.stop()
            self._profile, self._stopped = None, False  # only once stopped: one that raised is left for fail()
        return profile

    @fail_open
    def before_fork(self) -> None:
        """The thread running the profile forks (a loop that restarts its DataLoader's iterator inside a step, whose
        workers a new epoch forks): the child would inherit the session and record its every operator for as long as
        it lives (150 MiB per 50,000 operators), and ending it there processes the parent's events first (70 us
        each). The profile ends here, before the fork; the step keeps what it holds. A fork from another thread
        inherits no session."""
        if self._profile is not None and not self._stopped and threading.get_ident() == self._thread:
            self._profile.stop()
            self._stopped = True

    def fail(self, where: str) -> None:
        """Turned off by its own failure: a profile it was running is stopped too (Kineto left running would cost
        every later step), as far as it still can be."""
        super().fail(where)
        started = self._profile is not None
        try:
            self._stop()
        except Exception:  # noqa: BLE001 - already failing: what stops, stops
            pass
        self._profile, self._stopped = None, False
        torch = sys.modules.get("torch")
        if started and torch is not None:
            with contextlib.suppress(Exception):  # a session left on by a start or a stop that failed part-way is ours
                if torch._C._autograd._profiler_enabled():
                    torch._C._autograd._disable_profiler()

    def emitted(self, seconds: float) -> None:
        """What making a profile spans cost the emitter's thread: as much again as the profiled step cost the training
        thread (24-43 ms a profile, in the review of 2026-12-06), on the host's CPUs and the GIL they share."""
        self._emitted += seconds

    @fail_open
    def abandon(self, _reason: str = "") -> None:
        """The step failed, or the process exits: stop the profiler, emit nothing. Only the thread that started it
        can (the hang watchdog's thread runs the exit of a rank stuck in native code: the stop would find no session
        there, and warn three times)."""
        if self._profile is None or self._stopped or threading.get_ident() == self._thread:
            self._stop()

    def step_closed(self, seconds: float):
        """The stopped profiler of a profiled step (its events are read off the training thread), else None."""
        if self._profile is not None:
            if not self._slow_factor:
                return self._stop()
            started = time.perf_counter()
            profile = self._stop()
            self._spent += max(seconds - self._median, 0.0) + (time.perf_counter() - started)
            return profile
        # A profiled step is slow by construction: only unprofiled ones make the baseline.
        if self._slow_factor:
            if self._slow_above is not None and seconds > self._slow_above:
                # A request already waiting (the trigger's, for a step that is recorded) stays, whatever the budget.
                self._requested = self._requested or (self._spent + self._emitted
                                                      <= SLOW_BUDGET * self._unprofiled * self._median)
            self._recent.append(seconds)
            self._unprofiled += 1
            # A median per step costs more inside a step than it is worth: one every few steps.
            if self._unprofiled % _BASELINE_EVERY == 0:
                self._median = statistics.median(self._recent)
                self._slow_above = self._slow_factor * self._median
        return None


def from_environment() -> StepProfiler | None:
    every, trigger, slow_factor = env.profile_every(), env.profile_trigger(), env.profile_slow_factor()
    if not every and not trigger and not slow_factor:
        return None
    return StepProfiler(every, trigger, env.profile_top(), slow_factor)
