"""HANG and DESYNC: ranks that stopped, who waits for them in which collective, and collectives
whose ranks disagree on what they are.

A rank's hang watchdog writes ``training.hang`` spans while its step does not close (and one more
when a signal stops it): the open step and phase, the collective in flight, the last sequence
number it issued per group, and its training thread's stack. Read from a live job's files:

- a rank in a collective waits for those that never issued that (group, sequence): the last
  sequence each rank reached (from its hang report, else from its collective spans) says who is
  missing; a rank with a report and no collective in flight stopped where its stack says;
- every reporting rank in the same collective, none missing: the collective itself does not
  complete (the network, the communication library);
- a (group, sequence) that carries another op, size or dtype on some rank is a DESYNC: the ranks
  do not run the same collective (a rank-dependent branch, a mis-sized or mis-typed tensor),
  which corrupts the result or hangs.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.diagnose.findings import MIN_COST_SHARE
from opentelemetry_instrumentation_deepspeed.diagnose.reader import Span

_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<function>.+)$')
_OURS = "opentelemetry_instrumentation_deepspeed"
_LIBRARIES = ("site-packages", "dist-packages", "/lib/python")
MAX_MISMATCHES = 100  # DESYNC evidence kept
STACK_FRAMES = 6  # innermost frames shown per rank
# Point-to-point calls pair different ops (send with recv), and are numbered per peer (files written before that,
# with the group's collectives, on some ranks only): they are not joined by the group's sequence.
_P2P = semconv.P2P_OPS
# Ops whose per-rank sizes may legitimately differ (uneven splits, objects, lists).
_SIZE_MAY_DIFFER = frozenset({"all_to_all_single", "all_to_all", "all_gather", "all_gather_object",
                              "broadcast_object_list", "all_gather_coalesced", "reduce_scatter"})

REMEDIES = {
    "HANG": ["dump the stopped rank's stacks live (py-spy dump --pid PID) and look at the code named above",
             "a collective issued on some ranks only (a rank-dependent branch, uneven data at the end of an epoch)",
             "NCCL: NCCL_DEBUG=INFO, TORCH_NCCL_ASYNC_ERROR_HANDLING=1 and a process-group timeout, so a hang "
             "becomes an error; TORCH_DISTRIBUTED_DEBUG=DETAIL checks collectives' shapes"],
    "STALL": ["the stacks beside the finding: where each rank was during the stall (its watchdog's last report there)",
              "a rank's own pause (a checkpoint, a synchronous evaluation or upload, a lock, garbage collection) "
              "makes the others wait in their next collective: move it off the critical path or make it async"],
    "HANG_COMM": ["the collective does not complete on any rank: check the network (NCCL_DEBUG=INFO, "
                  "InfiniBand/RoCE counters, NVLink) and the communicator's health"],
    "DESYNC": ["find the code that issues this collective with a rank-dependent tensor (dtype, shape) or op",
               "TORCH_DISTRIBUTED_DEBUG=DETAIL makes torch check every collective's shape and dtype across ranks"],
}


def frames(stack: str) -> list[tuple[str, int, str, str]]:
    """(path, line, function, code) of a formatted Python stack, innermost first."""
    found = []
    lines = stack.splitlines()
    for index, text in enumerate(lines):
        match = _FRAME.match(text)
        if match:
            code = lines[index + 1].strip() if index + 1 < len(lines) and not _FRAME.match(lines[index + 1]) else ""
            found.append((match["path"], int(match["line"]), match["function"], code))
    return found[::-1]


def where(stack: str) -> str:
    """The innermost frame that is not this instrumentation, and the innermost of the program's own code."""
    return place(frames(stack))


def place(innermost_first: list[tuple[str, int, str, str]]) -> str:
    """``where`` of frames already read (innermost first)."""
    found = [frame for frame in innermost_first if _OURS not in frame[0]]
    if not found:
        return ""
    text = [frame_text(found[0])]
    own = next((frame for frame in found[1:] if not any(part in frame[0] for part in _LIBRARIES)), None)
    if own is not None:
        text.append(f"called from {frame_text(own)}")
    return ", ".join(text)


def frame_text(frame) -> str:
    path, line, function, code = frame
    return f"{path.rsplit('/', 1)[-1]}:{line} in {function}" + (f" ({code})" if code else "")


class Hangs:
    """What the spans say about hangs and desyncs, gathered span by span."""

    def __init__(self):
        self._reports: dict[tuple[str, int], list[Span]] = defaultdict(list)
        self._last_step: dict[tuple[str, int], int] = {}
        self._reached: dict[tuple[str, str, int], int] = {}  # (job, group, rank) -> last sequence seen
        # (job, group, sequence) -> (signature, rank, trace id, step) of its first call seen
        self._signatures: dict[tuple[str, str, int], tuple] = {}
        self._mismatches: dict[str, list] = defaultdict(list)
        self._p2p: set = set()  # (job, group) that carried point-to-point calls
        self._trace_steps: dict[str, int] = {}
        self._step_seconds: dict[tuple[str, int], list[float]] = defaultdict(list)  # (job, step) -> each rank's
        self._extent: dict[str, list[int]] = {}  # job -> [first step's start, last step's end]: the run
        self.ranks: dict[str, set] = defaultdict(set)

    def add(self, span: Span) -> None:
        name, attributes = span.name, span.attributes
        if name == semconv.SPAN_STEP:
            key = (span.job, span.rank)
            number = attributes.get(semconv.TRAINING_STEP, 0)
            self._last_step[key] = max(self._last_step.get(key, 0), number)
            self._trace_steps[span.trace_id] = number
            self._step_seconds[span.job, number].append(span.seconds)
            extent = self._extent.setdefault(span.job, [span.start, span.end])
            extent[0], extent[1] = min(extent[0], span.start), max(extent[1], span.end)
            self.ranks[span.job].add(span.rank)
        elif name == semconv.SPAN_HANG:
            # The exit's last report with no step open, made before the threshold: where a rank that went on
            # stopped (crashes.py's), not a hang; one past it is the hang's last word.
            if not (attributes.get(semconv.HANG_BETWEEN_STEPS)
                    and attributes.get(semconv.HANG_REASON) in semconv.HANG_EXIT_REASONS
                    and span.seconds < (attributes.get(semconv.HANG_THRESHOLD) or 0)):
                self._reports[(span.job, span.rank)].append(span)
            self.ranks[span.job].add(span.rank)
            for item in attributes.get(semconv.HANG_COMM_SEQUENCES) or ():
                group, _, sequence = str(item).rpartition(":")
                if group and sequence.isdigit():
                    self._reach(span.job, group, span.rank, int(sequence))
            if attributes.get(semconv.COMM_SEQUENCE) is not None:
                self._collective(span)
        elif name.startswith(semconv.SPAN_COMM_PREFIX) and attributes.get(semconv.COMM_SEQUENCE) is not None:
            self._collective(span)

    def _reach(self, job: str, group: str, rank: int, sequence: int) -> None:
        key = (job, group, rank)
        if sequence > self._reached.get(key, -1):
            self._reached[key] = sequence

    def _collective(self, span: Span) -> None:
        attributes = span.attributes
        group, sequence = attributes.get(semconv.COMM_GROUP_NAME, "0"), attributes[semconv.COMM_SEQUENCE]
        op = attributes.get(semconv.COMM_OP) or span.name.removeprefix(semconv.SPAN_COMM_PREFIX)
        if op in _P2P:
            self._p2p.add((span.job, group))
            return
        self._reach(span.job, group, span.rank, sequence)
        size = None if op in _SIZE_MAY_DIFFER else attributes.get(semconv.COMM_BYTES)
        signature = (op, size, attributes.get(semconv.COMM_DTYPE))
        key = (span.job, group, sequence)
        seen = self._signatures.get(key)
        # The step: a hang report's own (its step never closed, so no step span names its trace).
        this = (signature, span.rank, span.trace_id, attributes.get(semconv.TRAINING_STEP))
        if seen is None:
            self._signatures[key] = this
        elif seen[0] != signature and len(self._mismatches[span.job]) < MAX_MISMATCHES and not any(
                m[:2] == (group, sequence) and m[3][1] == span.rank for m in self._mismatches[span.job]):
            self._mismatches[span.job].append((group, sequence, seen, this))  # once per rank (its reports repeat it)

    # -- findings -----------------------------------------------------------------------------------

    def findings(self, job: str, silent: list[int] = ()) -> list[dict]:
        """``silent``: the ranks the world size counts that have no telemetry in the input (stopped before their
        first export, or their files left out)."""
        return [*self._hang(job, silent), *self._desync(job)]

    def _stuck(self, job: str) -> dict[int, Span]:
        """Rank -> its last hang report, for the ranks stuck still."""
        latest = {}
        for (report_job, rank), reports in self._reports.items():
            if report_job != job:
                continue
            report = max(reports, key=lambda s: s.end)
            if report.attributes.get(semconv.HANG_REASON) == semconv.HANG_REASON_RESUMED:
                continue  # its thread moved on after the last report: it was slow there, not stuck
            # What the watchdog held against its threshold: the span's extent, from the step's start (or from when
            # the thread stopped, between steps) to the report. Not training.hang.duration, which counts from the
            # open phase's start: a rank waiting in backward reports it short of the threshold by its forward.
            stalled = (report.end - report.start) / 1e9
            threshold = report.attributes.get(semconv.HANG_THRESHOLD) or 0
            number = report.attributes.get(semconv.TRAINING_STEP, 0)
            # Past the threshold, in a step this rank never went beyond.
            if stalled >= threshold and self._last_step.get((job, rank), 0) <= number:
                latest[rank] = report
        return latest

    def stalls(self, job: str) -> list[dict]:
        """STALL: the costliest past hang, a step in which ranks reported no progress past the watchdog's threshold
        and which they went beyond; explained as a hang is, from each rank's longest report in that step."""
        # The job's first step (a job resumed from a checkpoint: not 1).
        first = min((number for step_job, number in self._step_seconds if step_job == job), default=None)
        episodes: dict[int, dict[int, list[Span]]] = defaultdict(lambda: defaultdict(list))  # step -> rank -> reports
        for (report_job, rank), reports in self._reports.items():
            if report_job != job or first is None:
                continue
            for report in reports:
                attributes = report.attributes
                number = attributes.get(semconv.TRAINING_STEP, 0)
                if (attributes.get(semconv.HANG_REASON) == semconv.HANG_REASON_RESUMED or number <= first
                        or self._last_step.get((job, rank), 0) <= number):
                    # Made as its thread moved on; the job's first step, which pays for warm-up (a slow first
                    # all-gather is no stall); or the rank never went beyond it (a hang, if any).
                    continue
                episodes[number][rank].append(report)
        chosen = {}
        for number, reported in episodes.items():
            # Every rank in the loop's own code before the step (a checkpoint's save; its reports carry the step's
            # number): its choice, no one waits. What follows in the step (a rank's stall there) stands on its own.
            own = {rank: [r for r in reports if r.attributes.get(semconv.HANG_BETWEEN_STEPS)
                          and r.attributes.get(semconv.COMM_SEQUENCE) is None] for rank, reports in reported.items()}
            everyone = {rank for rank, reports in own.items() if reports} >= self.ranks[job]
            latest = {rank: max(kept, key=lambda r: r.end - r.start) for rank, reports in reported.items()
                      if (kept := [r for r in reports if not (everyone and r in own[rank])])}
            if latest:
                chosen[number] = latest
        if not chosen:
            return []
        number, latest = max(chosen.items(), key=lambda item: max(
            r.attributes.get(semconv.HANG_DURATION) or 0 for r in item[1].values()))
        # Where every rank that reported waits in a collective, those with no report there were not running (frozen,
        # with their watchdog's thread); else they may have waited under their own threshold.
        waiting_only = all(r.attributes.get(semconv.COMM_SEQUENCE) is not None for r in latest.values())
        (found,) = self._explained(job, latest, sorted(self.ranks[job] - set(latest)) if waiting_only else [], number)
        # What it cost: the step's excess over the usual step, where its span says more than the last report (made
        # a threshold's multiple into the stall); a stall between steps is outside any step span.
        usual = statistics.median(max(seconds) for (step_job, _n), seconds in self._step_seconds.items()
                                  if step_job == job)
        lost = found["cost_seconds"] = max(found["cost_seconds"] or 0.0,
                                           max(self._step_seconds.get((job, number), [0.0])) - usual)
        start, end = self._extent[job]
        if lost < MIN_COST_SHARE * (end - start) / 1e9:  # the run, the loop's time between steps included
            return []  # a watchdog set to a hair's breadth reports steps that cost the run nothing
        steps = sorted(set(chosen) - {number})
        others = f" ({len(steps)} other such step(s): {steps[:5]})" if steps else ""
        found.update(layer="STALL", summary=f"step {number} stalled {lost:.1f} s, past the watchdog's "
                     f"threshold, then went on{others}: {found['summary']}", remedies=REMEDIES["STALL"])
        return [found]

    def _hang(self, job: str, silent: list[int] = ()) -> list[dict]:
        latest = self._stuck(job)
        return self._explained(job, latest, silent) if latest else []

    def _explained(self, job: str, latest: dict[int, Span], silent: list[int], stall: int | None = None) -> list[dict]:
        """The finding of the ranks' hang reports ``latest`` (one per rank that reported): who stopped, where, and who
        waits for it in which collective. ``silent``: ranks known not to have reached any collective waited in;
        ``stall``: the step of a past hang, which the ranks went beyond (not where their telemetry ends)."""
        ranks = sorted(self.ranks[job] | set(latest) | set(silent))
        waiting = {rank: r for rank, r in latest.items() if r.attributes.get(semconv.COMM_SEQUENCE) is not None}
        missing: dict[int, set] = defaultdict(set)  # stopped rank -> collectives it never reached
        for rank, report in waiting.items():
            if report.attributes.get(semconv.COMM_OP) in _P2P:
                # It waits for its peer, not for the group: a peer with no report of its own is the one stopped.
                peer = report.attributes.get(semconv.COMM_PEER_RANK)
                if peer is not None and peer != rank and peer not in latest:
                    missing.setdefault(peer, set())  # named stopped, with no collective of the group to name
                continue
            group = report.attributes.get(semconv.COMM_GROUP_NAME, "0")
            sequence = report.attributes[semconv.COMM_SEQUENCE]
            for other in ranks:
                if other != rank and (other in silent or self._reached.get((job, group, other), -1) < sequence):
                    missing[other].add((group, sequence))
        untraced = _waiting_untraced({rank: latest[rank] for rank in set(latest) - set(waiting)})
        stopped = sorted(set(missing) | (set(latest) - set(waiting) - set(untraced)))
        evidence = [self._rank_line(job, rank, latest.get(rank), waiting, missing) for rank in ranks]
        lost = max(r.attributes.get(semconv.HANG_DURATION) or 0 for r in latest.values())
        step = min(r.attributes.get(semconv.TRAINING_STEP, 0) for r in latest.values())
        trace_ids = sorted({r.trace_id for r in latest.values()})
        reported_all = set(latest) >= set(ranks)
        if len(stopped) > 1 and set(stopped) <= set(waiting):
            # Each stopped rank waits in a collective another stopped rank has not reached: they wait for each
            # other, each in a different collective. No rank stopped on its own; their orders of collectives differ.
            crossed = "; ".join(f"rank {rank} in {_collective_text(waiting[rank])}{_during(waiting[rank])}"
                                + (f" at {at}" if (at := where(waiting[rank].attributes.get(semconv.CODE_STACKTRACE)
                                                               or "")) else "")
                                + f", which {self._not_reached_text(job, waiting[rank], stopped, rank)}"
                                for rank in stopped)
            summary = (f"{_plural(stopped)} wait for each other, each in a collective the other has not reached: "
                       f"{crossed}. The ranks issue their collectives in different orders (one issued on some ranks "
                       "only, or in a rank-dependent order)")
            found = _finding("HANG", summary, evidence, REMEDIES["HANG"], None, step, lost,
                             0.9 if reported_all else 0.7, trace_ids)
            return [_with_stacks(found, latest, ())]  # none stopped on its own: each waits
        if stopped:
            culprits = "; ".join(self._stopped_text(job, rank, latest.get(rank), missing.get(rank), waiting, stall)
                                 for rank in stopped)
            waits = "; ".join([f"rank {rank} waits for {_plural(sorted(r for r in stopped if r != rank))} in "
                               f"{_collective_text(report)}{_during(report)}"
                               for rank, report in sorted(waiting.items()) if any(r != rank for r in stopped)]
                              + [f"rank {rank} waits for {_plural(stopped)} {_place(report.attributes)}, in a "
                                 "collective not traced (DDP's gradient all-reduce)"
                                 for rank, report in sorted(untraced.items())])
            summary = f"{culprits}" + (f"; {waits}" if waits else "")
            if len(stopped) == 1 and stopped[0] not in latest and stall is None:
                step = self._step_of(job, stopped[0], missing.get(stopped[0]), waiting) or step
            found = _finding("HANG", summary, evidence, REMEDIES["HANG"], stopped[0] if len(stopped) == 1 else None,
                             step, lost, 0.9 if reported_all else 0.7, trace_ids)
            if len(stopped) == 1 and stopped[0] in latest:  # where it stopped, as the summary says (--json's readers)
                report = latest[stopped[0]].attributes
                phase = report.get(semconv.TRAINING_PHASE)
                found["phase"] = "between_steps" if report.get(semconv.HANG_BETWEEN_STEPS) and not phase else phase
            return [_with_stacks(found, latest, stopped)]
        signatures = {(r.attributes.get(semconv.COMM_OP), r.attributes.get(semconv.COMM_BYTES),
                       r.attributes.get(semconv.COMM_DTYPE)) for r in waiting.values()}
        if len(signatures) > 1:
            # Every rank is in a collective of the same sequence, but not the same collective: one issued on some
            # ranks only met another rank's next one (FSDP2: a rank's extra all-reduce against the others' all-gather).
            each = "; ".join(f"rank {rank} in {_collective_text(report)}{_during(report)}"
                             for rank, report in sorted(waiting.items()))
            summary = (f"the ranks wait in different collectives at the same point: {each}. The ranks issued different "
                       "collectives there: a rank-dependent branch or order (one issued on some ranks only, or another "
                       "op in its place)")
            found = _finding("HANG", summary, evidence, [*REMEDIES["DESYNC"], *REMEDIES["HANG"][1:2]], None, step,
                             lost, 0.9 if reported_all else 0.7, trace_ids)
            return [_with_stacks(found, latest, ())]
        report = next(iter(waiting.values()))
        summary = (f"every rank waits in {_collective_text(report)} and none is missing: the collective itself does "
                   "not complete")
        found = _finding("HANG", summary, evidence, REMEDIES["HANG_COMM"], None, step, lost,
                         0.8 if reported_all else 0.5, trace_ids)
        return [_with_stacks(found, latest, ())]

    def _not_reached_text(self, job: str, report: Span, stopped: list[int], rank: int) -> str:
        group = report.attributes.get(semconv.COMM_GROUP_NAME, "0")
        sequence = report.attributes[semconv.COMM_SEQUENCE]
        behind = [other for other in stopped if other != rank and self._reached.get((job, group, other), -1) < sequence]
        last = [f"rank {other}'s last on group {group}: "
                + (str(self._reached[job, group, other]) if (job, group, other) in self._reached else "none")
                for other in behind]
        return f"{_plural(behind)} {'has' if len(behind) == 1 else 'have'} not reached ({', '.join(last)})"

    def _step_of(self, job: str, rank: int, never: set | None, waiting: dict) -> int | None:
        """The step a rank with no hang report stopped in: the latest of the peers waiting for it in a collective it
        never reached (it went through the one before with them), else the one after its last step span. Its own
        spans lag: they are exported in batches, and a frozen or killed rank's last batch never left."""
        peers = [report.attributes.get(semconv.TRAINING_STEP) for report in waiting.values()
                 if (report.attributes.get(semconv.COMM_GROUP_NAME, "0"),
                     report.attributes.get(semconv.COMM_SEQUENCE)) in (never or ())]
        last = self._last_step.get((job, rank))
        known = [step for step in peers if step] + ([last + 1] if last is not None else [])
        return max(known) if known else None

    def _stopped_text(self, job: str, rank: int, report: Span | None, never: set | None, waiting: dict,  # noqa: PLR0917
                      stall: int | None = None) -> str:
        if report is None:
            reached = ", ".join(f"{group}: {sequence}" for group, sequence in sorted(never or ()))
            step, last = stall or self._step_of(job, rank, never, waiting), self._last_step.get((job, rank))
            in_step = f" in step {step}" if step is not None else ""
            if stall is None and last is not None and step is not None and step > last + 1:
                in_step += f" (where its peers wait for it; its own telemetry ends at step {last})"
            before = (f" before {'collective' if len(never) == 1 else 'collectives'} (group: sequence) {reached}"
                      if never else "")  # none: a peer a send or recv waits for
            if stall is not None:
                return (f"rank {rank} stopped{in_step}{before}, with no report of its own there: frozen (SIGSTOP, a "
                        "debugger) or in native code its watchdog's thread could not report from")
            if rank not in self.ranks[job]:
                return (f"rank {rank} stopped{in_step}{before}, with no telemetry at all in the input: frozen or hung "
                        "before its first export (SIGSTOP, a debugger, a hang in native code), dead with nothing "
                        "written, or its files left out")
            return (f"rank {rank} stopped{in_step}{before}, with no hang report of its own: frozen (SIGSTOP, a "
                    "debugger), hung in native code or dead (its watchdog's thread could not report), not yet past "
                    "its threshold, or its watchdog off")
        text = f"rank {rank} stopped {_place(report.attributes)}"
        attributes = report.attributes
        if attributes.get(semconv.COMM_SEQUENCE) is not None:
            text += f", itself in {_collective_text(report)}"
        at = where(attributes.get(semconv.CODE_STACKTRACE) or "")
        return text + (f" at {at}" if at else "")

    def _rank_line(self, job: str, rank: int, report: Span | None, waiting: dict, missing: dict) -> str:
        reached = ", ".join(f"group {group}: {sequence}" for (j, group, r), sequence in sorted(self._reached.items())
                            if j == job and r == rank)
        last = self._last_step.get((job, rank))
        head = f"rank {rank}: last step span {last if last is not None else 'none'}; last sequence reached " \
               f"{reached or 'none'}"
        if report is None:
            return head + "; no hang report"
        attributes = report.attributes
        text = (f"{head}; {attributes.get(semconv.HANG_REASON)} for {attributes.get(semconv.HANG_DURATION, 0):.0f} s "
                f"{_place(attributes)}")
        if rank in waiting:
            text += f", in {_collective_text(report)}"
        frames_text = " <- ".join([frame_text(f) for f in frames(attributes.get(semconv.CODE_STACKTRACE) or "")
                                   if _OURS not in f[0]][:STACK_FRAMES])
        return text + (f"; stack (innermost first): {frames_text}" if frames_text else "")

    def _step_of_call(self, *calls: tuple) -> int | None:
        """The step of a collective seen as ``calls`` (signature, rank, trace, step): its step span's, or a report's."""
        for _signature, _rank, trace_id, step in calls:
            if trace_id in self._trace_steps:
                return self._trace_steps[trace_id]
            if step:
                return step
        return None

    def _desync(self, job: str) -> list[dict]:
        mismatches = [m for m in self._mismatches.get(job, ()) if (job, m[0]) not in self._p2p]
        if not mismatches:
            return []
        evidence = []
        for group, sequence, first, other in mismatches[:10]:
            evidence.append(f"group {group}, sequence {sequence} (step {self._step_of_call(first, other) or '?'}): "
                            f"rank {first[1]} {_signature_text(first[0])}, rank {other[1]} "
                            f"{_signature_text(other[0])}")
        group, sequence, first, other = mismatches[0]
        step = self._step_of_call(first, other)
        differs = [name for name, a, b in zip(("op", "size", "dtype"), first[0], other[0], strict=True) if a != b]
        summary = (f"collective {sequence} of group {group} (step {step if step is not None else '?'}) differs in "
                   f"{' and '.join(differs)} across ranks: rank {first[1]} {_signature_text(first[0])}, rank "
                   f"{other[1]} {_signature_text(other[0])}" +
                   (f"; {len(mismatches) - 1} more such collective(s)" if len(mismatches) > 1 else ""))
        return [_finding("DESYNC", summary, evidence, REMEDIES["DESYNC"], other[1], step, None, 0.95,
                         sorted({first[2], other[2]}))]


def _with_stacks(finding: dict, latest: dict, stopped) -> dict:
    """Each reporting rank's whole stack beside the finding (the HTML report shows them), stopped ranks first."""
    finding["stacks"] = [{"rank": rank, "stopped": rank in stopped, "where": where(stack), "stack": stack}
                         for rank, report in sorted(latest.items(), key=lambda item: (item[0] not in stopped, item[0]))
                         if (stack := report.attributes.get(semconv.CODE_STACKTRACE) or "")]
    return finding


_PHASE_ORDER = {semconv.PHASE_DATA_WAIT: 0, semconv.PHASE_FORWARD: 1, semconv.PHASE_BACKWARD: 2,
                semconv.PHASE_OPTIMIZER_STEP: 3}


def _position(attributes: dict) -> tuple[int, float]:
    """How far a rank got: its step, then its phase in it (between steps, before the step's first phase)."""
    phase = attributes.get(semconv.TRAINING_PHASE)
    order = _PHASE_ORDER.get(phase, 0.5) if phase or not attributes.get(semconv.HANG_BETWEEN_STEPS) else -1
    return attributes.get(semconv.TRAINING_STEP, 0), order


def _waiting_untraced(unexplained: dict[int, Span]) -> dict[int, Span]:
    """Of the stuck ranks with no collective in flight, those waiting for another in a collective no span shows: DDP
    all-reduces the gradients in its reducer's C++, inside the backward, so a rank that reached its backward waits
    there for a rank further behind (in its forward, its data loader, between steps), which stopped."""
    if len(unexplained) < 2:
        return {}
    positions = {rank: _position(report.attributes) for rank, report in unexplained.items()}
    behind = min(positions.values())
    return {rank: report for rank, report in unexplained.items() if positions[rank] > behind
            and report.attributes.get(semconv.TRAINING_PHASE) == semconv.PHASE_BACKWARD
            and not report.attributes.get(semconv.HANG_BETWEEN_STEPS)}


def _place(attributes: dict) -> str:
    """Where a hang report's rank is: in a phase of the open step, or between steps (the next one's number)."""
    phase, number = attributes.get(semconv.TRAINING_PHASE), attributes.get(semconv.TRAINING_STEP)
    if attributes.get(semconv.HANG_BETWEEN_STEPS):
        if phase == semconv.PHASE_DATA_WAIT:
            return f"in the data loader (data wait) before step {number}, no step open"
        return f"between steps (no step open, before step {number})"
    return f"in {phase} of step {number}" if phase else f"in step {number}, between phases"


def _during(report: Span) -> str:
    phase = report.attributes.get(semconv.TRAINING_PHASE)
    if report.attributes.get(semconv.HANG_BETWEEN_STEPS):
        return f", {phase} before the step" if phase else ", between steps"
    return f", during {phase}" if phase else ", between phases"


def _plural(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(rank) for rank in ranks)


def _collective_text(report: Span) -> str:
    attributes = report.attributes
    seconds = attributes.get(semconv.HANG_COMM_DURATION)
    peer = attributes.get(semconv.COMM_PEER_RANK)
    return (f"{attributes.get(semconv.COMM_OP)} (group {attributes.get(semconv.COMM_GROUP_NAME, '0')}, sequence "
            f"{attributes.get(semconv.COMM_SEQUENCE)}, {attributes.get(semconv.COMM_BYTES)} bytes"
            + (f", peer rank {peer}" if peer is not None else "") + ")"
            + (f" for {seconds:.0f} s" if seconds is not None else ""))


def _signature_text(signature: tuple) -> str:
    op, size, dtype = signature
    return op + (f" of {size} bytes" if size is not None else "") + (f" {dtype}" if dtype else "")


def _finding(layer, summary, evidence, remedies, rank, step, cost, confidence, trace_ids) -> dict:  # noqa: PLR0917
    return {"layer": layer, "summary": summary, "evidence": evidence, "remedies": remedies, "rank": rank,
            "step": step, "cost_seconds": cost, "confidence": confidence, "trace_ids": trace_ids}
