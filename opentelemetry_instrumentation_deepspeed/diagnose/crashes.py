"""CRASH: a job whose ranks stopped with an error, or stopped writing, while they trained.

A step ends with status ERROR where it raised (the description: the exception's type and message; the phase,
collective or data wait that raised ends in error too), where the process exited during it (an exception no wrapper
saw raised) or where a signal ended it; with no step open, the exit by a signal or an uncaught exception writes a last
``training.hang`` report, between steps (docs/telemetry.md). The rank that failed first on its own is the cause; the
others' failures after it are its consequences: a collective that lost its peer (gloo's "Connection closed by peer",
NCCL's "remote process exited", a communicator aborted, a timeout), or the signal the launcher sends to the ranks
left. A rank with no failure of its own that wrote fewer steps than the step another failed in, or no telemetry at
all where the world size counts it, left no word: it was killed (SIGKILL, the kernel's OOM killer), crashed in
native code, or exited without its exit handlers (os._exit). What it had not written went with it: it was at the
step the others failed in, at the latest. One that a fault in native code killed left its threads' Python stacks
(``native-crash-rank<N>.txt``, export/native_crash.py): named with the fault and where. Where a failure carries its
stack (an exception event, an exit's last report), the summary says where it raised. An out-of-memory error is the
MEMORY finding's: its error and the ranks' failures after it go to that finding's evidence.
"""

from __future__ import annotations

import re
from collections import defaultdict

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.diagnose import hangs
from opentelemetry_instrumentation_deepspeed.diagnose.model import REMEDIES as MODEL_REMEDIES
from opentelemetry_instrumentation_deepspeed.diagnose.reader import Span

MEMORY_REMEDIES = MODEL_REMEDIES["memory"]

# A failure that says a peer is gone: the consequence of another rank's. Gloo's and NCCL's words for a peer or a link
# that went away, a wait that ran out, a communicator aborted after another failure; not the library's name alone: its
# own argument, shape and dtype errors ("ProcessGroupGloo::allgather: invalid output tensor list") are a rank's own.
_LOST_PEER = re.compile(r"connection (closed|reset|refused|abort)|(closed|reset) by peer|socket closed|broken pipe|"
                        r"timed? ?out|pair closure|remote (process|server)|network error|connection was likely closed|"
                        r"failed to (recv|send)|(was|is|been) aborted|unhandled system error|no route to host|"
                        r"^(torch\.distributed\.)?dist(backend|network|store)error$", re.IGNORECASE)
_SIGNALLED = (semconv.STATUS_TERMINATED, semconv.STATUS_INTERRUPTED)
_INTERRUPT = "KeyboardInterrupt"  # Ctrl-C reached the training thread in Python: a stop from outside too
_OUT_OF_MEMORY = re.compile(r"out of memory", re.IGNORECASE)
_HOST_MEMORY = re.compile(r"\bMemoryError\b")  # Python's: the host's memory (torch.OutOfMemoryError is a device's)
_PLACES = {semconv.SPAN_DATA_WAIT: "data wait", semconv.SPAN_FORWARD: "forward", semconv.SPAN_BACKWARD: "backward",
           semconv.SPAN_OPTIMIZER_STEP: "optimizer step"}
_PHASES = {semconv.SPAN_DATA_WAIT: semconv.PHASE_DATA_WAIT, semconv.SPAN_FORWARD: semconv.PHASE_FORWARD,
           semconv.SPAN_BACKWARD: semconv.PHASE_BACKWARD, semconv.SPAN_OPTIMIZER_STEP: semconv.PHASE_OPTIMIZER_STEP}
_IN_THE_LOADER = "in the data loader"
REMEDIES = {
    "raised": ["its exception, with the stack, is on the step's failed phase, collective or data wait (an exception "
               "event) and in that rank's output",
               "the other ranks' errors after it are its consequences: their collectives lost the peer"],
    "exited": ["the exception's traceback is in that rank's output (and on its last training.hang report, between "
               "steps): raised where no wrapper of the instrumentation saw it (the loop's own code, a callback, an "
               "optimizer hook)"],
    "silent": ["the launcher's output: the rank's exit code (-9: SIGKILL; -11 or -6: a fault in native code; 0 or "
               "another without a signal: a hard exit, os._exit, in the program or a library)",
               "the node's kernel log (dmesg, journalctl -k): the OOM killer names the process it killed (host "
               "memory: data loader workers, pinned buffers, CPU offload)",
               "the job's memory limit (cgroup, the scheduler's request)"],
    "host memory": ["the rank's resident memory before it (process.memory.usage): what grew (data loader workers and "
                    "their prefetched batches, pinned buffers, ZeRO's CPU offload, tensors a loop keeps across steps)",
                    "the job's memory limit (cgroup, the scheduler's request)"],
    "signalled": ["the launcher's or the scheduler's log: who stopped the job (a time limit, a preemption, a stop "
                  "after another failure)"],
    "native": ["its stack in the evidence: the innermost frame calls the library that crashed (a custom CUDA or C++ "
               "extension, a communication library, a tokenizer, a data decoder); the program's frame below it says "
               "with what", "again with CUDA_LAUNCH_BLOCKING=1 (a CUDA fault then names its kernel), or under "
               "compute-sanitizer or gdb"],
}


class Crashes:
    """Collects the failures (failed steps, and the exits' last reports between steps), where in its step each
    raised, and the steps each rank closed."""

    def __init__(self):
        # (job, rank) -> [(end, step number, trace id, error, where or None)]
        self._failed: dict[tuple[str, int], list] = defaultdict(list)
        # (job, rank, trace) -> [(end, place, error)] of the spans that failed in the step
        self._places: dict[tuple[str, int, str], list] = defaultdict(list)
        self._phases: dict[tuple[str, int, str], str] = {}  # (job, rank, trace) -> the phase that failed (its name)
        # (job, rank, trace) -> (end, the stack where it raised) of the first failed span that carries one
        self._stacks: dict[tuple[str, int, str], tuple[int, str]] = {}
        self._closed: dict[tuple[str, int], int] = {}  # (job, rank) -> the last step number that closed
        self._closed_end: dict[tuple[str, int], int] = {}  # (job, rank) -> when its last closed step ended
        self._memory: set = set()  # (job, rank, trace) of a failed step an OOM ended (the MEMORY finding's)
        self.world: dict[str, int] = {}
        # (job, rank, step) -> what the MEMORY finding of an OOM that ended the run adds: its error, the others after it
        self.memory_evidence: dict[tuple[str, int, int], list[str]] = {}
        self._native: dict[tuple[str, int], tuple[str, int]] = {}  # (job, rank) -> (faulthandler's words, when)
        self._native_when: dict[tuple[str, int], str] = {}  # (job, rank) -> where its step was, in words
        self.ranks: dict[str, set] = defaultdict(set)

    def add(self, span: Span) -> None:
        self.ranks[span.job].add(span.rank)
        attributes = span.attributes
        if span.name == semconv.SPAN_STEP:
            number = attributes.get(semconv.TRAINING_STEP, 0)
            if (world := attributes.get(semconv.TRAINING_WORLD_SIZE)) is not None:
                self.world[span.job] = max(self.world.get(span.job, 0), world)
            if span.error is None:
                key = (span.job, span.rank)
                self._closed[key] = max(self._closed.get(key, 0), number)
                self._closed_end[key] = max(self._closed_end.get(key, 0), span.end)
                return
            self._failed[span.job, span.rank].append((span.end, number, span.trace_id, span.error, None))
            self._stack(span)  # the process's exit ended it by an exception: its stack (a failed phase's ends first)
            if attributes.get(semconv.TRAINING_MEMORY_OOM):
                self._memory.add((span.job, span.rank, span.trace_id))
        elif span.name == semconv.SPAN_HANG:
            reason = attributes.get(semconv.HANG_REASON)
            if attributes.get(semconv.HANG_BETWEEN_STEPS) and reason in semconv.HANG_EXIT_REASONS:  # its last word
                where = (_IN_THE_LOADER if attributes.get(semconv.TRAINING_PHASE) == semconv.PHASE_DATA_WAIT
                         else "between steps")
                error = reason if reason in _SIGNALLED else (span.error or reason)
                self._failed[span.job, span.rank].append((span.end, attributes.get(semconv.TRAINING_STEP, 0),
                                                          span.trace_id, error, where))
                self._stack(span)
        elif span.error is not None and span.name != semconv.SPAN_GLOBAL_STEP:
            place = _PLACES.get(span.name) or span.name.removeprefix(semconv.SPAN_COMM_PREFIX)
            self._places[span.job, span.rank, span.trace_id].append((span.end, place, span.error))
            if span.name in _PHASES:
                self._phases[span.job, span.rank, span.trace_id] = _PHASES[span.name]
            self._stack(span)

    def _stack(self, span: Span) -> None:
        stack = span.attributes.get(semconv.CODE_STACKTRACE)
        key = (span.job, span.rank, span.trace_id)
        if stack and (key not in self._stacks or span.end < self._stacks[key][0]):
            self._stacks[key] = (span.end, stack)

    def native(self, job: str, rank: int, text: str, at: int) -> None:
        """A fault in native code killed ``rank`` at ``at`` (ns): ``text`` is what faulthandler wrote."""
        self._native[job, rank] = (text, at)

    def missing(self, job: str) -> list[int]:
        """The ranks the world size counts that have no span in the input."""
        world = self.world.get(job, 0)
        return sorted(set(range(world)) - self.ranks[job])

    def findings(self, job: str) -> list[dict]:
        first = self._final_failures(job)
        if not first:
            return []  # a rank with no telemetry in a job where none failed: files left out (``missing``)
        found = self._cause(job, first)
        if found is None:
            return []
        kind, culprit, causes, number, trace_id, summary = found
        # The others' failures: a lost peer or a stop is a consequence; an error of another kind is a failure of its
        # own too (two ranks' different bugs in one step), not one the first caused.
        also, after = [], []
        for other, failure in sorted(first.items()):
            if other not in causes:
                said = f"rank {other} {self._in_step(job, other, failure)}: {_short(failure[3])}"
                # Its type alone says nothing either way (exception detail "type"): taken as a consequence.
                lost = (_stopped(failure[3]) or self._lost_peer(job, other, failure) or kind == "silent"
                        or not _described(failure[3]) or self._consequence_abort(job, other, failure, first, []))
                (after if lost else also).append(said)
        if kind == "memory":  # the MEMORY finding names it, with the allocator's figures: these words are added there
            self.memory_evidence[job, causes[0], number] = [
                summary, *(["also on its own: " + "; ".join(also)] if also else []),
                *(["after it: " + "; ".join(after)] if after else [])]
            return []
        if also:
            summary += "; also on its own: " + "; ".join(also)
        if after:
            summary += "; after it: " + "; ".join(after)
        evidence = [f"rank {rank}: last step closed {self._closed.get((job, rank), 'none')}"
                    + (f"; failed {self._in_step(job, rank, first[rank])}: {_short(first[rank][3], 400)}"
                       if rank in first else "; no failure")
                    for rank in sorted(self.ranks[job])]
        evidence += [f"rank {rank}: no telemetry in the input (world size {self.world[job]})"
                     for rank in self.missing(job)]
        if kind == "native":
            evidence += _native_evidence(self._native[job, causes[0]][0])
        remedies = REMEDIES[kind]
        own = summary.partition("; after it")[0]
        if kind == "raised" and _OUT_OF_MEMORY.search(own):
            remedies = [*remedies[:1], *MEMORY_REMEDIES]  # an allocator's error raised as a plain RuntimeError
        elif kind in ("raised", "exited") and _HOST_MEMORY.search(own):
            remedies = [*remedies[:1], *REMEDIES["host memory"]]
        trace_ids = [trace_id] if trace_id else sorted({failure[2] for failure in first.values()} - {""})[:3]
        phase = None
        if culprit is not None and culprit in first:
            failure = first[culprit]
            phase = (semconv.PHASE_DATA_WAIT if failure[4] == _IN_THE_LOADER else
                     self._phases.get((job, culprit, failure[2])) if failure[4] is None else None)
        return [{"layer": "CRASH", "kind": kind, "rank": culprit, "step": number, "phase": phase, "summary": summary,
                 "evidence": evidence, "remedies": remedies, "cost_seconds": None,
                 "confidence": 0.95 if kind in ("raised", "exited") else 0.8, "trace_ids": trace_ids}]

    def _final_failures(self, job: str) -> dict[int, tuple]:
        """Each rank's first failure after the last step it closed: one it went on from (a caught exception, the
        step retried with its number) ended no run."""
        first = {}
        for (failed_job, rank), failures in self._failed.items():
            if failed_job != job:
                continue
            closed = self._closed.get((job, rank), 0)
            final = [failure for failure in failures if failure[1] > closed]
            if final:
                first[rank] = min(final)
        for (native_job, rank), (text, written) in self._native.items():
            if native_job == job:
                # Where it was: after the last step it wrote (what it had not exported went with it); by the step the
                # others failed in, at the latest.
                closed = self._closed.get((job, rank), 0)
                others = [failure[1] for other, failure in first.items() if other != rank]
                number = min(others) if others and min(others) > closed else closed + 1
                wrote = f"its telemetry ends at step {closed}" if closed else "it exported no step"
                self._native_when[job, rank] = (
                    (f"in step {number}" if number == closed + 1 and rank in self.ranks[job] else
                     f"by step {number}, where the others lost it ({wrote})") if others else
                    f"after step {closed}, the last it wrote" if closed else "before it exported any step")
                # The file's time, where a copy did not reset it: no earlier than the last step the rank closed.
                failure = (max(written, self._closed_end.get((job, rank), 0)), number, _NATIVE_TRACE,
                           f"{_NATIVE}: {_native_signal(text)}", None)
                first[rank] = min(first.get(rank, failure), failure)
        return first

    def _is_native(self, job: str, rank: int, failure: tuple) -> bool:
        return failure[2] == _NATIVE_TRACE and (job, rank) in self._native

    def _consequence_abort(self, job: str, rank: int, failure: tuple, first: dict[int, tuple], silent: list) -> bool:
        """A native abort (SIGABRT) after another rank failed or went silent by then: NCCL's watchdog aborts the
        ranks whose collective lost its peer (a review: such a survivor was named the cause of a SIGKILLed rank's
        death)."""
        if not self._is_native(job, rank, failure) or _native_signal(self._native[job, rank][0]) != "Aborted":
            return False
        return bool(silent) or any(other != rank and not self._is_native(job, other, theirs) and
                                   theirs[1] <= failure[1] for other, theirs in first.items())

    def _cause(self, job: str, first: dict[int, tuple]) -> tuple | None:
        """(kind, rank named or None, the ranks it covers, step, its trace, summary); kind "memory": an OOM's."""
        latest_failed = max(failure[1] for failure in first.values())
        silent = self.missing(job) + sorted(rank for rank in self.ranks[job] - set(first)
                                            if self._closed.get((job, rank), 0) < latest_failed)
        own = sorted((failure, rank) for rank, failure in first.items()
                     if not _stopped(failure[3]) and not self._lost_peer(job, rank, failure)
                     and not self._consequence_abort(job, rank, failure, first, silent))
        if own:
            found = self._alike(job, own, self._own(job, *own[0]))
            # The same error on several ranks beside one that went silent: theirs are its consequences, in words the
            # lost-peer pattern does not know (or under OTEL_PYTHON_DEEPSPEED_EXCEPTION_DETAIL=type, no words at all).
            if found is None or not (silent and len(found[2]) > 1):
                return found
        if silent:
            culprit, last = silent[0], self._closed.get((job, silent[0]))
            # Where it was at the latest: the step the others failed in (what it wrote last lags, unflushed).
            number = min(failure[1] for failure in first.values())
            said = (f"rank {culprit} wrote no telemetry (the world size is {self.world[job]})" if last is None else
                    f"rank {culprit} stopped by step {number}, where the others lost it (its telemetry ends at step "
                    f"{last}: what it had not exported yet was lost with it)" if number > last + 1 else
                    f"rank {culprit} stopped after step {last}, the last it wrote")
            summary = (f"{said}, with no failure of its own in its telemetry: it was killed (SIGKILL, the kernel's "
                       "OOM killer), crashed in native code, or exited without its exit handlers (os._exit)")
            return "silent", culprit, silent, number, None, summary
        # Every rank stopped from outside: the whole job's stop, unless some lost a peer before theirs (the launcher
        # stops the ranks left after one was stopped): then the others, stopped first, are the cause.
        if len(first) == len(self.ranks[job]) and all(_stopped(f[3]) for f in first.values()):
            first_stopped = {rank: failure for rank, failure in first.items() if not self._lost_before_stop(job, rank,
                                                                                                            failure)}
            if len(first_stopped) == len(first) or not first_stopped:
                return ("signalled", None, sorted(first), min(first.values())[1], min(first.values())[2],
                        self._every_rank_stopped(job, first))
            first = first_stopped
        failure, rank = min((failure, rank) for rank, failure in first.items())
        _end, number, trace_id, error, _where = failure
        if _stopped(error):
            return ("signalled", rank, [rank], number, trace_id,
                    f"rank {rank} was stopped {self._in_step(job, rank, failure)} ({error}), before any rank failed "
                    "on its own")
        return ("raised", rank, [rank], number, trace_id,
                f"rank {rank} failed first {self._in_step(job, rank, failure)}: {_short(error)}, which says another "
                "rank was gone, though none failed on its own before it")

    def _every_rank_stopped(self, job: str, first: dict[int, tuple]) -> str:
        said = {rank: (self._in_step(job, rank, failure), failure[3]) for rank, failure in sorted(first.items())}
        if len(set(said.values())) == 1:
            place, error = next(iter(said.values()))
            return f"every rank was stopped {place}: {error}"
        return "every rank was stopped: " + "; ".join(f"rank {rank} {place} ({error})"
                                                      for rank, (place, error) in said.items())

    def _lost_peer(self, job: str, rank: int, failure: tuple) -> bool:
        """A failure in words that say a peer is gone; not in the data loader, whose errors are the rank's own (a
        shard's read from object storage that timed out, its connection reset)."""
        _end, _number, trace_id, error, where = failure
        if where == _IN_THE_LOADER or (where is None and self._phases.get((job, rank, trace_id)) ==
                                       semconv.PHASE_DATA_WAIT):
            return False
        return _LOST_PEER.search(error) is not None

    def _lost_before_stop(self, job: str, rank: int, failure: tuple) -> bool:
        """Something in the step the rank was stopped in had lost a peer before (a collective's)."""
        return any(error is not None and _LOST_PEER.search(error) and end <= failure[0]
                   for end, _place, error in self._places.get((job, rank, failure[2]), ()))

    def _alike(self, job: str, own: list, found: tuple | None) -> tuple | None:
        """``found``, the first own failure's cause; the same error in the same step on other ranks too is each rank's
        own (every rank runs the same code on the same kind of input: a wrong argument, a bad shape), not the first
        one's consequence."""
        if found is None:
            return None
        (_end, number, trace_id, error, where), rank = own[0]
        if not _described(error):
            return found  # its type alone (OTEL_PYTHON_DEEPSPEED_EXCEPTION_DETAIL=type): no sign of the same error
        place = where or self._where(job, rank, trace_id)
        alike = sorted(other for failure, other in own if failure[1] == number and _same_error(failure[3], error)
                       and (failure[4] or self._where(job, other, failure[2])) == place)
        if len(alike) < 2:
            return found
        kind, culprit, _causes, number, trace_id, summary = found
        everyone = len(alike) == len(self.ranks[job]) + len(self.missing(job))
        who = "every rank" if everyone else "ranks " + ", ".join(map(str, alike))
        return (kind, None if everyone else culprit, alike, number, trace_id,
                f"{who} failed the same way, each on its own; first {summary}")

    def _own(self, job: str, failure: tuple, rank: int) -> tuple:
        """The first failure of a rank's own: raised in its step, an exception that ended the process, an OOM (its
        MEMORY finding's), or a fault in native code."""
        _end, number, trace_id, error, where = failure
        if self._is_native(job, rank, failure):
            at = hangs.place(_native_frames(self._native[job, rank][0]))
            return "native", rank, [rank], number, trace_id, (
                f"rank {rank} {error.replace(': ', ' (', 1)}) {self._native_when[job, rank]}" + (f", at {at}" if at
                                                                                                   else ""))
        if (job, rank, trace_id) in self._memory:
            return "memory", rank, [rank], number, trace_id, _short(error, 400)
        if error.startswith((semconv.STATUS_EXITED, semconv.STATUS_EXITED_BETWEEN)):
            raised = error.partition(": ")[2]
            inside = self._where(job, rank, trace_id)
            place = (self._in_step(job, rank, failure) if where else
                     f"during step {number}" + (f" in {inside}" if inside else ""))
            summary = f"rank {rank} exited {place}{self._at(job, rank, trace_id)}, " + (
                f"by an exception no wrapper saw raised: {_short(raised, 400)}" if raised else
                "where no wrapper saw an exception raised")
            return "exited", rank, [rank], number, trace_id, summary
        summary = (f"rank {rank} failed {self._in_step(job, rank, failure)}{self._at(job, rank, trace_id)}: "
                   f"{_short(error, 400) or 'an error with no message'}")
        return "raised", rank, [rank], number, trace_id, summary

    def _at(self, job: str, rank: int, trace_id: str) -> str:
        """", at <the frame that raised>, called from <the program's>" where the failure carries its stack."""
        stack = self._stacks.get((job, rank, trace_id))
        at = hangs.where(stack[1]) if stack else ""
        return f", at {at}" if at else ""

    def _in_step(self, job: str, rank: int, failure: tuple) -> str:
        _end, number, trace_id, _error, where = failure
        if where is not None:  # an exit's report, with no step open
            return f"{where}, after step {number - 1}"
        place = self._where(job, rank, trace_id)
        return f"in {place} of step {number}" if place else f"in step {number}"

    def _where(self, job: str, rank: int, trace_id: str) -> str | None:
        """The innermost span that failed in the step: the first to end (a collective ends before its phase)."""
        places = self._places.get((job, rank, trace_id))
        return min(places, key=lambda place: place[0])[1] if places else None


_NUMBERS = re.compile(r"\d+")
_NATIVE = "crashed in native code"
_NATIVE_TRACE = ""  # a native crash's failure has no trace: no span says where it was
_FATAL = "Fatal Python error: "
_NATIVE_FRAME = re.compile(r'^\s*File "(?P<path>[^"]*)", line (?P<line>\d+|\?+) in (?P<function>.+)$')  # faulthandler's


def _native_signal(text: str) -> str:
    """faulthandler's name of the fault: "Segmentation fault", "Aborted", "Floating point exception", ..."""
    return next((line[len(_FATAL):].strip() for line in text.splitlines() if line.startswith(_FATAL)),
                "a fatal signal")


def _native_frames(text: str) -> list[tuple[str, int, str, str]]:
    """(path, line, function, "") of the crashing thread's Python stack as faulthandler wrote it, innermost first; where
    the fault was in a thread without Python frames (a communication library's, the CUDA runtime's), of the last
    thread it lists: the main one, the first started."""
    lines = text.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith(("Current thread", "Thread "))]
    start = next((i for i in heads if lines[i].startswith("Current thread")), heads[-1] if heads else None)
    found = []
    for line in lines[start + 1:] if start is not None else ():
        match = _NATIVE_FRAME.match(line)
        if match is None:
            break
        found.append((match["path"], int(match["line"]) if match["line"].isdigit() else 0, match["function"], ""))
    return found


def _native_evidence(text: str) -> list[str]:
    found = _native_frames(text)
    return ["its Python stack as it crashed (faulthandler, innermost first): "
            + " <- ".join(hangs.frame_text(frame) for frame in found[:8]) + (" ..." if len(found) > 8 else "")
            ] if found else []


def _described(error: str) -> bool:
    """An error with its message, not its type alone."""
    return ": " in error


def _same_error(one: str, other: str) -> bool:
    """The same error, but for the numbers in it (a rank, an address, a size that differ by rank)."""
    return _NUMBERS.sub("#", _SOURCE.sub("", one)) == _NUMBERS.sub("#", _SOURCE.sub("", other))


def _stopped(error: str) -> bool:
    """Stopped from outside: a signal, or Ctrl-C as a KeyboardInterrupt."""
    return error in _SIGNALLED or error.startswith(_INTERRUPT)


_SOURCE = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|cu|h|hpp):\d+\] ")  # gloo's and NCCL's "[.../pair.cc:553] "


def _short(error: str, limit: int = 160) -> str:
    """An error in one line of at most ``limit`` characters, without the source file a native library names."""
    text = " ".join(_SOURCE.sub("", error).split())
    return text if len(text) <= limit else text[:limit - 4].rstrip() + " ..."
