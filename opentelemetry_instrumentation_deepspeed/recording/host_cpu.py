"""The host's CPUs during a step: how busy the host was, and how much of it this process used.

A step that takes longer because other processes took the host's CPUs looks, by its times alone,
like a device that got slower. What tells them apart is the CPU time of the others: the host's busy
time (``/proc/stat``) less what the job's own processes used (``os.times()`` here; ``diagnose``
subtracts every rank of the job on the same host). A device that got slower leaves it unchanged; a
neighbour's job raises it, and saturates the host.

Reading them costs two system calls, so the training thread never does: the emitter's thread
samples them as it writes a step that ended after its last sample (so once per drain, every half
second, while steps close), and a step gets the figures interpolated between the samples around
its start and its end: the averages over the half second or so around it. A sustained change, what
``diagnose`` compares, shows in full. Where ``/proc/stat`` cannot be read (not Linux) there are no
figures.

Who is busy is not yet who is slowed: a neighbour may take CPUs this job leaves idle while it waits
(a sleeping loader, a slower device). The training thread's own run-queue delay, the time it was
ready to run but had no CPU (``/proc/self/task/<tid>/schedstat``, second field), measures the cost
to this job directly, as a share of the step. The thread that builds the engine is taken as the one
that trains it, as the hang watchdog takes it. That figure is read as steps close, not interpolated:
a neighbour's burst of a few steps is what it must place. The file stays open (``thread_stat``), and
the recorder reads it as a step closes with one ``pread`` (0.46 us in a warm loop, the kernel
formats three numbers; 8 to 15 us inside real steps, a cold system call), keeping the bytes; the
emitter parses them against the read before (``waited``). On a quiet host (its phases unread, below)
a close reads it only ``QUIET_READS_EVERY`` after the last read: a step that closed unread takes the
share of the read after it, which spans it too, where that read came within ``COVERED_WITHIN``
(``covering``; the emitter holds it to a later drain until that read is queued), else the samples'
figure. While the thread waits for a CPU (``phase_reads``), every close reads it, and the recorder
reads it too as each phase starts and ends (``wait_share``): where in the step the thread waited,
which tells a rank that sleeps in its forward (a slower device) from one whose forward waited for a
CPU. On a quiet host those reads would say 0 at a cost of several microseconds a step, and no phase
waits more than its step, so they stop once ``PHASE_READS_HOLD`` reads in a row showed waits under
``PHASE_READS_FROM`` of their time. Where the file is missing (a kernel without
``CONFIG_SCHED_INFO``) those figures alone are off.

The training thread is not the only one a busy host delays: a collective on CPU runs on the
communication library's own threads (gloo's), which wake for each transfer and may then wait for
a CPU too, on every rank alike, so the transfer itself looks slower. The emitter's samples also
sum the run-queue delays of the process's native threads, those Python does not run (gloo's,
NCCL's, intra-op workers; the interpreter's threads, ours among them, are left out), over every
``/proc/self/task`` entry, keeping the last figure of a thread that ended. Summed, threads waiting
at once each count: an upper bound of the delay they caused, interpolated to the step.
"""

from __future__ import annotations

import math
import os
import threading
import time
import weakref
from collections import deque

TASKS = "/proc/self/task"
KEEP = 32  # samples kept: 16 s of drains, more than a queued record can lag behind
_TICK = 1e9 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 1e7  # /proc/stat's unit, in ns
# A read whose share (the time since the read before) the thread waited for a CPU this much or more has the next steps'
# phases read, and every step's close, until PHASE_READS_HOLD reads in a row stay under it. A quarter of the share by
# which diagnose's late-rank rule weighs a phase: the step's wait, which it takes for an unread phase's, then moves no
# verdict.
PHASE_READS_FROM = 0.05
PHASE_READS_HOLD = 50
# While the phases are not read (a quiet host), a step's close reads the schedstat only this long after the last read.
QUIET_READS_EVERY = 50_000_000  # ns
# A read covers the steps that closed unread at most this long before it (it comes within QUIET_READS_EVERY and a
# step): a later one, after a pause (a checkpoint, an evaluation), would lend them the pause's wait.
COVERED_WITHIN = 200_000_000  # ns


class HostCpu:
    """Cumulative CPU times of the host and of this process, sampled by the emitter's thread."""

    __slots__ = ("__weakref__", "_ended", "_last_read", "_native", "_on", "_phase_reads_left", "_samples", "_thread",
                 "covering", "cpus", "phase_reads", "thread_stat")

    def __init__(self):
        self._on = True
        self.cpus = os.cpu_count() or 1  # /proc/stat's "cpu" line sums them all
        # Whether the recorder reads the schedstat at each phase too: from the start, until the steps show a quiet host.
        self.phase_reads = True
        self._phase_reads_left = PHASE_READS_HOLD
        self._thread: str | None = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        # For the recorder's read as each step closes (os.pread on the training thread); the read before the
        # step the emitter writes next is kept here, on the emitter's side: (time.time_ns(), bytes).
        self._last_read: tuple[int, bytes] | None = None
        # The next read after unread steps, (time.time_ns(), bytes), found queued by the emitter: its share is theirs.
        self.covering: tuple[int, bytes] | None = None
        try:
            self.thread_stat: int | None = os.open(self._thread, os.O_RDONLY)
            weakref.finalize(self, os.close, self.thread_stat).atexit = False
            self._last_read = (time.time_ns(), os.pread(self.thread_stat, 64, 0))
        except OSError:
            self.thread_stat = None
        # The native threads' run-queue delays at the last sample (tid -> ns), and those of threads that ended since.
        self._native: dict[str, float] | None = {}
        self._ended = 0.0
        # (time.time_ns(), host busy, host idle, process, the training thread's run-queue delay, the native
        # threads'): ns; a delay is NaN once unreadable, which every difference and interpolation carries through
        # to "not measured".
        self._samples: deque = deque(maxlen=KEEP)
        self.sample()

    def sample(self) -> None:
        """One reading, now; after a failed read the figures stay off."""
        if not self._on:
            return
        try:
            with open("/proc/stat", "rb") as stat:
                fields = [int(value) for value in stat.readline().split()[1:9]]
            times = os.times()
        except (OSError, ValueError):
            self._on = False
            self._samples.clear()
            return
        user, nice, system, idle, iowait, irq, softirq, steal = fields + [0] * (8 - len(fields))
        busy = (user + nice + system + irq + softirq + steal) * _TICK
        self._samples.append((time.time_ns(), busy, (idle + iowait) * _TICK,
                              (times.user + times.system) * 1e9, self._waited(), self._native_waited()))

    def _waited(self) -> float:
        if self._thread is not None:
            try:
                with open(self._thread, "rb") as schedstat:
                    return _run_queue_delay(schedstat.read())
            except (OSError, ValueError, IndexError):
                self._thread = None  # another kernel, or the thread has ended: this figure stays off
        return math.nan

    def _native_waited(self) -> float:
        """The run-queue delays of the native threads, summed: each one's so far, and the last seen of those that
        ended (NaN where ``/proc/self/task`` cannot be listed)."""
        if self._native is None:
            return math.nan
        try:
            tids = os.listdir(TASKS)
        except OSError:
            self._native = None
            return math.nan
        interpreted = {str(thread.native_id) for thread in threading.enumerate()}
        now: dict[str, float] = {}
        for tid in tids:
            if tid in interpreted:
                continue
            try:
                with open(f"{TASKS}/{tid}/schedstat", "rb") as schedstat:
                    now[tid] = _run_queue_delay(schedstat.read())
            except (OSError, ValueError, IndexError):
                continue  # ended since the listing, or no schedstat: its last figure stays counted below
        for tid, delay in self._native.items():
            if tid not in now:
                self._ended += delay
        self._native = now
        return self._ended + sum(now.values())

    def waited(self, read: bytes | None, end: int) -> float | None:
        """The share of the time since the last read the training thread waited for a CPU, from ``read``, the
        bytes the recorder read at ``end`` (records come in the order their steps closed); None without a read
        before or now, or unreadable. A step closed unread (a quiet host's short steps) takes the share of the read
        after it (``covering``), which spans it too; None where that read is not known (a failed step, also unread,
        takes it only where it is). A read also decides whether the next steps' phases are read (``phase_reads``)."""
        if read is None:
            return self.covered(end)
        last, self._last_read, self.covering = self._last_read, (end, read), None
        share = None if last is None else wait_share(last[1], read, end - last[0])
        if share is None or share >= PHASE_READS_FROM:
            self._phase_reads_left = PHASE_READS_HOLD
        elif self._phase_reads_left:
            self._phase_reads_left -= 1
        self.phase_reads = self._phase_reads_left > 0
        return share

    def covered(self, end: int) -> float | None:
        """The share of the ``covering`` read, for a step that closed unread at ``end`` before it; None where that
        read is not known (yet), or came more than ``COVERED_WITHIN`` after it."""
        covering, last = self.covering, self._last_read
        if covering is None or not 0 < covering[0] - end <= COVERED_WITHIN or last is None:
            return None
        return wait_share(last[1], covering[1], covering[0] - last[0])

    def may_be_covered(self, end: int) -> bool:
        """Whether a read made from now on could still cover a step that closed unread at ``end``."""
        return time.time_ns() - end < COVERED_WITHIN

    def over(self, start: int, end: int) -> tuple[float, float, float, float | None, float | None] | None:
        """CPUs in use on average between ``start`` and ``end`` (``time.time_ns()``): (host busy, host idle, this
        process, the share of the interval the training thread waited for a CPU, and the native threads' waits
        summed as a share of it, each None where unmeasured); None when the samples do not reach back to
        ``start`` or the interval is empty."""
        samples = self._samples
        if samples and samples[-1][0] < end:
            self.sample()
        if len(samples) < 2 or start < samples[0][0] or end <= start:
            return None
        _t, busy, idle, process, waited, native = _at(samples, start)
        _t, busy_end, idle_end, process_end, waited_end, native_end = _at(samples, end)
        seconds = end - start
        waiting = (waited_end - waited) / seconds
        natives = (native_end - native) / seconds
        busy, idle = max(busy_end - busy, 0.0) / seconds, max(idle_end - idle, 0.0) / seconds
        # /proc/stat counts in clock ticks, which a short interval's ends cut unevenly: 2.09 CPUs busy of 2 in the
        # emitted files. Kept within the CPUs the host has, in the same proportion.
        if busy + idle > self.cpus:
            busy, idle = busy * self.cpus / (busy + idle), idle * self.cpus / (busy + idle)
        return (busy, idle, max(process_end - process, 0.0) / seconds,
                None if math.isnan(waiting) else max(waiting, 0.0), None if math.isnan(natives) else max(natives, 0.0))


def wait_share(first: bytes | None, last: bytes | None, nanoseconds: int) -> float | None:
    """The share of ``nanoseconds`` a thread waited for a CPU between two reads of its schedstat; None where a
    read is missing or unreadable, or the interval empty."""
    if first is None or last is None or nanoseconds <= 0:
        return None
    try:
        return max(_run_queue_delay(last) - _run_queue_delay(first), 0.0) / nanoseconds
    except (ValueError, IndexError):
        return None


def _run_queue_delay(schedstat: bytes) -> float:
    """schedstat's second field: ns the thread spent ready to run, waiting for a CPU."""
    return float(schedstat.split()[1])


def _at(samples: deque, when: int) -> tuple:
    """The cumulative figures at ``when``, linear between the samples around it (the last one's beyond it).
    Searched from the newest: a step is written within a drain or two of its end. (Plain arithmetic, no
    generators: this runs once per step on the emitter's thread.)"""
    last = samples[-1]
    if when >= last[0]:
        return last
    index = len(samples) - 1
    while index > 0 and samples[index - 1][0] > when:
        index -= 1
    (t0, busy0, idle0, process0, waited0, native0) = samples[index - 1]
    (t1, busy1, idle1, process1, waited1, native1) = samples[index]
    share = (when - t0) / (t1 - t0) if t1 > t0 else 1.0
    return (when, busy0 + (busy1 - busy0) * share, idle0 + (idle1 - idle0) * share,
            process0 + (process1 - process0) * share, waited0 + (waited1 - waited0) * share,
            native0 + (native1 - native0) * share)
