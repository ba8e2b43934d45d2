"""CRASH: a job whose ranks stopped with an error, or stopped writing, while they trained.

A step ends with status ERROR where it raised (the description: the exception's type and message; the phase or
collective that raised ends in error too), where the process exited during it (an exception in the loop's own code,
outside DeepSpeed's calls) or where a signal ended it (docs/telemetry.md). The rank that failed first on its own is
the cause; the others' failures after it are its consequences: a collective that lost its peer (gloo's "Connection
closed by peer", NCCL's errors, a timeout), or the signal the launcher sends to the ranks left. A rank with no error
of its own that wrote fewer steps than the step another failed in, or no telemetry at all where the world size counts
it, left no word: it was killed (SIGKILL, the kernel's OOM killer), crashed in native code, or raised between steps,
where no step was open to carry the error. What it had not written went with it, so its last step written is where
it was at the latest.
"""

from __future__ import annotations

import re
from collections import defaultdict

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.diagnose.model import REMEDIES as MODEL_REMEDIES
from opentelemetry_instrumentation_deepspeed.diagnose.reader import Span

MEMORY_REMEDIES = MODEL_REMEDIES["memory"]

# A failure that says a peer is gone, or that the job was stopped from outside: the consequence of another's.
_LOST_PEER = re.compile(r"connection (closed|reset|refused)|closed by peer|broken pipe|timed? ?out|nccl|gloo|"
                        r"socket|peer|distbackenderror|distnetworkerror|processgroup|abort", re.IGNORECASE)
_SIGNALLED = (semconv.STATUS_TERMINATED, semconv.STATUS_INTERRUPTED)
_INTERRUPT = "KeyboardInterrupt"  # Ctrl-C reached the training thread in Python: a stop from outside too
_OUT_OF_MEMORY = re.compile(r"out of memory", re.IGNORECASE)
_PLACES = {semconv.SPAN_DATA_WAIT: "data wait", semconv.SPAN_FORWARD: "forward", semconv.SPAN_BACKWARD: "backward",
           semconv.SPAN_OPTIMIZER_STEP: "optimizer step"}
REMEDIES = {
    "raised": ["its exception, with the stack, is on the step's failed phase or collective (an exception event) and "
               "in that rank's output",
               "the other ranks' errors after it are its consequences: their collectives lost the peer"],
    "exited": ["the exception is in that rank's output (its traceback): the loop's own code raised it, outside "
               "DeepSpeed's calls"],
    "silent": ["the launcher's output: the rank's exit code (1 and a traceback: an exception between steps; -9: "
               "SIGKILL; -11: a fault in native code)",
               "the node's kernel log (dmesg, journalctl -k): the OOM killer names the process it killed (host "
               "memory: data loader workers, pinned buffers, CPU offload)",
               "the job's memory limit (cgroup, the scheduler's request)"],
    "signalled": ["the launcher's or the scheduler's log: who stopped the job (a time limit, a preemption, a stop "
                  "after another failure)"],
}


class Crashes:
    """Collects the failed steps, where in them each raised, and the steps each rank closed."""

    def __init__(self):
        self._failed: dict[tuple[str, int], list] = defaultdict(list)  # (job, rank) -> [(end, number, trace, error)]
        self._places: dict[tuple[str, int, str], list] = defaultdict(list)  # (job, rank, trace) -> [(end, place)]
        self._closed: dict[tuple[str, int], int] = {}  # (job, rank) -> the last step number that closed
        self._memory: set = set()  # (job, rank, trace) of a failed step an OOM ended (the MEMORY finding's)
        self.world: dict[str, int] = {}
        self.ranks: dict[str, set] = defaultdict(set)

    def add(self, span: Span) -> None:
        self.ranks[span.job].add(span.rank)
        if span.name == semconv.SPAN_STEP:
            attributes = span.attributes
            number = attributes.get(semconv.TRAINING_STEP, 0)
            if (world := attributes.get(semconv.TRAINING_WORLD_SIZE)) is not None:
                self.world[span.job] = max(self.world.get(span.job, 0), world)
            if span.error is None:
                key = (span.job, span.rank)
                self._closed[key] = max(self._closed.get(key, 0), number)
                return
            self._failed[span.job, span.rank].append((span.end, number, span.trace_id, span.error))
            if attributes.get(semconv.TRAINING_MEMORY_OOM):
                self._memory.add((span.job, span.rank, span.trace_id))
        elif span.error is not None and span.name not in (semconv.SPAN_GLOBAL_STEP, semconv.SPAN_HANG):
            place = _PLACES.get(span.name) or span.name.removeprefix(semconv.SPAN_COMM_PREFIX)
            self._places[span.job, span.rank, span.trace_id].append((span.end, place))

    def findings(self, job: str) -> list[dict]:
        # A failure the rank went on from (a caught exception, the step retried with its number) ended no run.
        first = {rank: min(failures) for (failed_job, rank), failures in self._failed.items()
                 if failed_job == job and self._closed.get((job, rank), 0) < min(failures)[1]}
        if not first:
            return []  # a rank with no telemetry in a job where none failed: files left out (``missing``)
        world = self.world.get(job, 0)
        absent = self.missing(job)
        latest_failed = max(failure[1] for failure in first.values())
        silent = absent + sorted(rank for rank in self.ranks[job] - set(first)
                                 if self._closed.get((job, rank), 0) < latest_failed)
        own = sorted((failure, rank) for rank, failure in first.items()
                     if not _stopped(failure[3]) and not _LOST_PEER.search(failure[3]))
        if own:
            (_end, number, trace_id, error), rank = own[0]
            if (job, rank, trace_id) in self._memory:
                return []  # an out-of-memory error: the MEMORY finding names it, with the allocator's figures
            where = self._where(job, rank, trace_id)
            if error.startswith(semconv.STATUS_EXITED):
                raised = error[len(semconv.STATUS_EXITED):].removeprefix(": ")
                summary = f"rank {rank} exited during step {number}{_in(where)}" + (
                    f", by an exception in the loop's own code (outside DeepSpeed's calls): {_short(raised, 400)}"
                    if raised else ": an exception in the loop's own code, outside DeepSpeed's calls")
                kind = "exited"
            else:
                summary = (f"rank {rank} failed {_in_step(where, number)}: "
                           f"{_short(error, 400) or 'an error with no message'}")
                kind = "raised"
            causes, culprit = [rank], rank
        elif silent:
            culprit = silent[0]
            last = self._closed.get((job, culprit))
            number = (last or 0) + 1
            said = (f"rank {culprit} wrote no telemetry" if last is None and culprit in absent else
                    f"rank {culprit} stopped after step {last}, the last it wrote")
            summary = (f"{said}, with no error of its own in its telemetry: it was killed (SIGKILL, the kernel's OOM "
                       "killer), crashed in native code, or raised between steps, where no step was open to carry the "
                       "error" + (f" (the world size is {world})" if culprit in absent else ""))
            kind, causes, trace_id = "silent", silent, None
        else:
            (_end, number, trace_id, error), rank = min((failure, rank) for rank, failure in first.items())
            where = self._where(job, rank, trace_id)
            if len(first) == len(self.ranks[job]) and all(_stopped(f[3]) for f in first.values()):
                summary = f"every rank was stopped in step {number}: {error}"
                kind, causes, culprit = "signalled", sorted(first), None
            elif _stopped(error):
                summary = (f"rank {rank} was stopped {_in_step(where, number)} ({error}), before any rank failed "
                           "on its own")
                kind, causes, culprit = "signalled", [rank], rank
            else:
                summary = (f"rank {rank} failed first {_in_step(where, number)}: {_short(error)}, which says "
                           "another rank was gone, though none failed on its own before it")
                kind, causes, culprit = "raised", [rank], rank
        after = [f"rank {other} {_in_step(self._where(job, other, failure[2]), failure[1])}: {_short(failure[3])}"
                 for other, failure in sorted(first.items()) if other not in causes]
        if after:
            summary += "; after it: " + "; ".join(after)
        evidence = [f"rank {rank}: last step closed {self._closed.get((job, rank), 'none')}"
                    + (f"; failed in step {first[rank][1]}: {_short(first[rank][3], 400)}" if rank in first
                       else "; no failure")
                    for rank in sorted(self.ranks[job])]
        evidence += [f"rank {rank}: no telemetry in the input (world size {world})" for rank in absent]
        trace_ids = [trace_id] if trace_id else sorted({failure[2] for failure in first.values()})[:3]
        remedies = REMEDIES[kind]
        if kind == "raised" and _OUT_OF_MEMORY.search(summary.partition("; after it")[0]):
            remedies = [*remedies[:1], *MEMORY_REMEDIES]  # an allocator's error raised as a plain RuntimeError
        return [{"layer": "CRASH", "kind": kind, "rank": culprit, "step": number, "summary": summary,
                 "evidence": evidence, "remedies": remedies, "cost_seconds": None,
                 "confidence": 0.95 if kind in ("raised", "exited") else 0.8, "trace_ids": trace_ids}]

    def missing(self, job: str) -> list[int]:
        """The ranks the world size counts that have no span in the input."""
        world = self.world.get(job, 0)
        return sorted(set(range(world)) - self.ranks[job])

    def _where(self, job: str, rank: int, trace_id: str) -> str | None:
        """The innermost span that failed in the step: the first to end (a collective ends before its phase)."""
        places = self._places.get((job, rank, trace_id))
        return min(places)[1] if places else None


_SOURCE = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|cu|h|hpp):\d+\] ")  # gloo's and NCCL's "[.../pair.cc:553] "


def _stopped(error: str) -> bool:
    """Stopped from outside: a signal, or Ctrl-C as a KeyboardInterrupt."""
    return error in _SIGNALLED or error.startswith(_INTERRUPT)


def _short(error: str, limit: int = 160) -> str:
    """An error in one line of at most ``limit`` characters, without the source file a native library names."""
    text = " ".join(_SOURCE.sub("", error).split())
    return text if len(text) <= limit else text[:limit - 4].rstrip() + " ..."


def _in(where: str | None) -> str:
    return f" in {where}" if where else ""


def _in_step(where: str | None, number: int) -> str:
    return f"in {where} of step {number}" if where else f"in step {number}"
