"""The hang watchdog's threshold and reports, and diagnose's HANG and DESYNC findings, without a job."""

from __future__ import annotations

import functools
import gc
import json
import logging
import threading
import time
import weakref

import pytest
import torch

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.diagnose.hangs import Hangs, where
from opentelemetry_instrumentation_deepspeed.diagnose.html import render_html
from opentelemetry_instrumentation_deepspeed.diagnose.reader import Span, spans_of_request
from opentelemetry_instrumentation_deepspeed.export.emitter import emitter
from opentelemetry_instrumentation_deepspeed.runtime import lifecycle, watchdog
from tests.test_steps_unit import recorder_on, train_step


@pytest.mark.parametrize(("recent", "floor", "expected"), [
    ([], 30.0, 300.0),  # before any step closed: warm-up gets 10 floors
    ([0.05, 0.2, 0.1], 30.0, 30.0),  # fast steps: the floor
    ([0.05, 4.0, 0.1], 30.0, 40.0),  # one slow step in the window: 10 times it
    ([90.0], 30.0, 900.0),
    ([0.5], 2.0, 5.0),
])
def test_threshold_is_the_floor_or_ten_times_the_slowest_recent_step(recent, floor, expected):
    assert watchdog.threshold(recent, floor) == pytest.approx(expected)


def _check_from_another_thread(dog, now):
    # The watchdog reads the training thread's stack from its own thread.
    found = []
    thread = threading.Thread(target=lambda: found.extend(dog.check(now)))
    thread.start()
    thread.join()
    return found


def test_the_watchdog_reports_a_step_that_does_not_close_and_learns_from_those_that_do():
    recorder, engine, emitted = recorder_on(1, job="hang-job")
    dog = watchdog.Watchdog(floor=2.0)
    dog.watch(recorder, start=False)
    for _ in range(3):  # the watchdog sees each step open, then closed
        recorder.phase_ended(recorder.forward_started(engine))
        assert dog.check() == []
        recorder.phase_ended(recorder.backward_started(engine))
        engine.step(recorder)
    dog.check()
    assert len(dog._watched[0].durations) == 3  # the closed steps it saw go in the window
    assert watchdog.threshold(dog._watched[0].durations, 2.0) == 2.0

    phase = recorder.forward_started(engine)  # step 4 opens, and its forward never returns
    start = recorder.open.start
    (gauge,) = dog._observe_open(None, now=start + int(7e9))
    assert gauge.value == pytest.approx(7.0), "the open step's age"
    assert _check_from_another_thread(dog, start + int(1.9e9)) == []
    (report,) = _check_from_another_thread(dog, start + int(2.5e9))
    assert (report.number, report.phase, report.collective) == (4, semconv.PHASE_FORWARD, None)
    assert _check_from_another_thread(dog, start + int(3e9)) == [], "next report at twice the time"
    assert len(_check_from_another_thread(dog, start + int(5.5e9))) == 1
    spans = [s for s in emitted.get_finished_spans() if s.name == semconv.SPAN_HANG]
    assert len(spans) == 2
    hang = spans[0]
    assert hang.attributes[semconv.TRAINING_STEP] == 4
    assert hang.attributes[semconv.TRAINING_PHASE] == semconv.PHASE_FORWARD
    assert hang.attributes[semconv.HANG_REASON] == semconv.HANG_REASON_WATCHDOG
    assert hang.attributes[semconv.HANG_DURATION] == pytest.approx(2.5, abs=0.01)
    (event,) = hang.events
    assert event.name == semconv.EVENT_HANG_STACK
    assert "_check_from_another_thread" in event.attributes[semconv.CODE_STACKTRACE], "the training thread's stack"
    step_trace = next(s for s in emitted.get_finished_spans() if s.name == semconv.SPAN_STEP).context.trace_id
    assert hang.context.trace_id != step_trace  # step 4's trace, not step 1's
    recorder.phase_ended(phase)
    recorder.phase_ended(recorder.backward_started(engine))
    engine.step(recorder)
    assert dog.check() == []


def test_a_hang_in_a_step_run_again_after_a_rollback_is_in_that_step_s_trace():
    """The code review of the rollback rule: the first news of a rollback may be the re-run step's hang report, which
    went into the trace of the step's first run."""
    recorder, engine, emitted = recorder_on(1, job=f"rollback-{time.monotonic_ns()}")
    dog = watchdog.Watchdog(floor=2.0)
    dog.watch(recorder, start=False)
    for _ in range(4):
        train_step(recorder, engine)
    emitter().drain()
    engine.global_steps = 2  # a checkpoint of step 2 loaded
    phase = recorder.forward_started(engine)  # step 3 again, and its forward does not return yet
    (_report,) = _check_from_another_thread(dog, recorder.open.start + int(2.5e9))
    recorder.phase_ended(phase)
    recorder.phase_ended(recorder.backward_started(engine))
    engine.step(recorder)
    emitter().drain()
    spans = emitted.get_finished_spans()
    threes = [s.context.trace_id for s in spans if s.name == semconv.SPAN_STEP and s.attributes["training.step"] == 3]
    (hang,) = [s for s in spans if s.name == semconv.SPAN_HANG]
    assert len(set(threes)) == 2 and hang.context.trace_id == threes[1]


def test_an_engine_dropped_leaves_the_watch_and_its_recorder_goes(monkeypatch):
    """A sweep or an evaluation harness builds engine after engine in one process: the watchdog must not keep each
    one's recorder (its facts, an open file among them) and replay it at every look."""
    dog = watchdog.Watchdog(floor=2.0)
    monkeypatch.setattr(watchdog, "_watchdog", dog)
    monkeypatch.setattr(dog, "watch", functools.partial(dog.watch, start=False))
    kept, kept_engine, _ = recorder_on(0, job="kept")
    dropped = []
    for _ in range(5):
        recorder, engine, _ = recorder_on(0, job="dropped")
        train_step(recorder, engine)
        dropped.append(weakref.ref(recorder))
        del recorder, engine
    # Each engine's watch drops those gone before it (nothing else looks with the reports off): the last remains.
    assert len(dog._watched) == 2
    emitter().drain()  # the steps' records, and the recorders handed over at their close
    gc.collect()
    dog.check()
    assert [watched.recorder for watched in dog._watched] == [kept]
    gc.collect()
    assert [ref() for ref in dropped] == [None] * 5
    kept.phase_ended(kept.forward_started(kept_engine))
    assert dog.check() == []
    kept.phase_ended(kept.backward_started(kept_engine))
    kept_engine.step(kept)
    dog.check()
    assert len(dog._watched[0].durations) == 1, "the engine that lives is watched still"


@pytest.mark.parametrize("reported", [False, True])
def test_sigint_in_a_long_native_call_is_taken_over_only_once_reported_stuck(monkeypatch, reported):
    """Ctrl-C while the training thread is in a long native call (a large matmul, a slow save): KeyboardInterrupt comes
    as it returns, and the program's own handling (a last checkpoint) runs, as without us. Only a thread the watchdog
    reported stuck past its threshold (a collective waiting for a dead peer) has its telemetry written by the
    watchdog's thread, which then dies by the signal."""
    recorder, _engine, _ = recorder_on(0)
    dog = watchdog.Watchdog(floor=2.0)
    dog.watch(recorder, start=False)
    release = threading.Event()
    blocked = threading.Thread(target=release.wait)  # in native code, where no handler runs
    blocked.start()
    taken_over = []
    monkeypatch.setattr(lifecycle, "GRACE_SECONDS", 0.05)
    monkeypatch.setattr(lifecycle, "finish_elsewhere", lambda signum, reason, spent: taken_over.append(reason))
    monkeypatch.setattr(watchdog.signal, "getsignal", lambda _signum: watchdog.signal.default_int_handler)
    try:
        recorder.thread = blocked.ident
        if reported:
            dog._watched[0].next_report = 60.0  # a report was made for the open step, which has not moved since
        dog._signalled(watchdog.signal.SIGINT)
    finally:
        release.set()
        blocked.join()
    assert taken_over == ([lifecycle.INTERRUPTED] if reported else [])


def test_sigint_after_the_thread_moved_on_from_a_reported_stop_is_the_program_s(monkeypatch):
    """Reported stuck in a long save between steps, the thread then moves to another long native call, not reported
    (yet): a Ctrl-C there is the program's KeyboardInterrupt, not a takeover."""
    first, second = threading.Event(), threading.Event()

    def train(recorder, engine):
        train_step(recorder, engine)
        first.wait()  # a slow checkpoint, past the threshold: reported
        second.wait()  # then another long native call, just started

    thread, made = _training_thread(train)
    dog = made["dog"]
    taken_over = []
    monkeypatch.setattr(lifecycle, "GRACE_SECONDS", 0.05)
    monkeypatch.setattr(lifecycle, "finish_elsewhere", lambda signum, reason, spent: taken_over.append(reason))
    monkeypatch.setattr(watchdog.signal, "getsignal", lambda _signum: watchdog.signal.default_int_handler)
    try:
        (report,) = _looks(dog, [0, 25])
        assert report.between_steps
        first.set()
        deadline = time.monotonic() + 10
        while dog._watched[0].next_report and time.monotonic() < deadline:  # the watchdog sees it moved
            dog.check(time.time_ns() + int(26e9))
            time.sleep(0.01)
        dog._signalled(watchdog.signal.SIGINT)
    finally:
        first.set()
        second.set()
        thread.join(10)
    assert taken_over == []


def test_steps_that_close_between_two_looks_set_the_threshold_too():
    """Steps shorter than the watchdog's poll open and close between its looks: it learned nothing from them, and a
    job whose every step was short was reported at 10 floors (300 s at the default), not at the floor."""
    recorder, engine, _ = recorder_on(0, job="short-steps")
    dog = watchdog.Watchdog(floor=2.0)
    dog.watch(recorder, start=False)
    for _ in range(5):
        train_step(recorder, engine)  # no look while it runs
    emitter().drain()
    assert list(dog._watched[0].durations) == [], "it saw none open"
    recorder.forward_started(engine)
    start = recorder.open.start
    (report,) = _check_from_another_thread(dog, start + int(2.5e9))
    assert report.number == 6 and report.threshold == 2.0


def test_a_failed_step_does_not_count_as_a_step_time():
    recorder, engine, _ = recorder_on(0, job="failed-step")
    dog = watchdog.Watchdog(floor=1.0)
    dog.watch(recorder, start=False)
    phase = recorder.forward_started(engine)
    dog.check()
    recorder.phase_failed(phase, RuntimeError("boom"))
    train_step(recorder, engine)
    dog.check()
    assert list(dog._watched[0].durations) == []


def test_the_watchdog_adds_nothing_to_the_training_thread():
    # Its only link to a step is the recorder's open record: no per-step call, no field written for it.
    recorder, engine, _ = recorder_on(0, job="no-cost")
    calls = []
    dog = watchdog.Watchdog(floor=1.0)
    dog.watch(recorder, start=False)

    def count(frame, event, _arg):
        if event == "call" and frame.f_code.co_filename == watchdog.__file__:
            calls.append(frame.f_code.co_name)

    import sys

    sys.setprofile(count)
    try:
        for _ in range(5):
            train_step(recorder, engine)
    finally:
        sys.setprofile(None)
    assert calls == []


# -- diagnose ---------------------------------------------------------------------------------------

STACK_RANK1 = """  File "/app/train.py", line 261, in main
    loss = engine(**batch)
  File "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1778, in _wrapped_call_impl
    return self._call_impl(*args, **kwargs)
  File "/app/train.py", line 138, in forward
    block_forever()
  File "/app/train.py", line 152, in block_forever
    time.sleep(3600)
"""
STACK_RANK0 = """  File "/app/train.py", line 263, in main
    engine.backward(loss)
  File "/venv/site-packages/opentelemetry_instrumentation_deepspeed/instrumentors/comm.py", line 268, in wrapper
    return wrapped(*args, **kwargs)
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252, in all_reduce
    work.wait()
"""


def _span(name, rank, start, end, trace="t8", **attributes):
    return Span(name, trace, f"s{rank}{name}{start}", "", int(start * 1e9), int(end * 1e9), "job", rank, attributes)


def _steps(hangs, rank, last, collectives=()):
    for number in range(1, last + 1):
        hangs.add(_span(semconv.SPAN_STEP, rank, number, number + 0.5, trace=f"t{number}",
                        **{semconv.TRAINING_STEP: number}))
    for sequence, op, size, dtype in collectives:
        hangs.add(_span("comm." + op, rank, 1, 1.1, **{semconv.COMM_OP: op, semconv.COMM_SEQUENCE: sequence,
                                                      semconv.COMM_GROUP_NAME: "1", semconv.COMM_BYTES: size,
                                                      semconv.COMM_DTYPE: dtype}))


def _report(rank, *, step=8, phase="forward", stack="", duration=40.0, collective=None, sequences=()):
    attributes = {semconv.TRAINING_STEP: step, semconv.TRAINING_PHASE: phase, semconv.HANG_DURATION: duration,
                  semconv.HANG_THRESHOLD: 30.0, semconv.HANG_REASON: semconv.HANG_REASON_WATCHDOG,
                  semconv.CODE_STACKTRACE: stack, semconv.HANG_COMM_SEQUENCES: tuple(sequences)}
    if collective:
        attributes.update({semconv.COMM_OP: collective[0], semconv.COMM_GROUP_NAME: "1",
                           semconv.COMM_SEQUENCE: collective[1], semconv.COMM_BYTES: 540160,
                           semconv.COMM_DTYPE: "float32", semconv.HANG_COMM_DURATION: duration - 0.1})
    return _span(semconv.SPAN_HANG, rank, 100, 100 + duration, **attributes)


def test_hang_names_the_rank_that_stopped_and_the_one_that_waits_for_it():
    hangs = Hangs()
    for rank in (0, 1):
        _steps(hangs, rank, 7, [(48, "all_reduce", 540160, "float32")])
    hangs.add(_report(1, stack=STACK_RANK1, sequences=["1:48"]))
    hangs.add(_report(0, phase="backward", stack=STACK_RANK0, collective=("all_reduce", 49), sequences=["1:49"]))
    (finding,) = hangs.findings("job")
    assert finding["layer"] == "HANG" and finding["rank"] == 1 and finding["step"] == 8
    assert finding["summary"].startswith("rank 1 stopped in forward of step 8 at train.py:152 in block_forever")
    assert "rank 0 waits for rank 1 in all_reduce (group 1, sequence 49" in finding["summary"]
    assert finding["cost_seconds"] == 40.0 and finding["trace_ids"] == ["t8"] and finding["phase"] == "forward"
    assert set(finding) == {"layer", "summary", "evidence", "remedies", "rank", "step", "cost_seconds", "confidence",
                            "trace_ids", "stacks", "phase"}
    # The whole stacks, the stopped rank's first, for the HTML report.
    assert [(s["rank"], s["stopped"], s["stack"]) for s in finding["stacks"]] == [(1, True, STACK_RANK1),
                                                                                 (0, False, STACK_RANK0)]
    assert finding["stacks"][0]["where"].startswith("train.py:152 in block_forever")


def test_point_to_point_calls_do_not_count_as_the_group_s_collectives():
    """Ranks 0 and 1 exchange tensors (numbered per peer, up to 59); rank 2 does not. Rank 1 stops, with no report
    of its own, before all-reduce 49, in which ranks 0 and 2 wait: its sends and receives reached no collective of
    the group."""
    hangs = Hangs()
    for rank in (0, 1, 2):
        p2p = [(sequence, "send" if rank == 0 else "recv", 64, "float32") for sequence in range(60)] if rank < 2 else []
        _steps(hangs, rank, 7, [(48, "all_reduce", 540160, "float32"), *p2p])
    for rank in (0, 2):
        hangs.add(_report(rank, phase="backward", collective=("all_reduce", 49), sequences=["1:49"]))
    (finding,) = hangs.findings("job")
    assert finding["rank"] == 1
    assert finding["summary"].startswith("rank 1 stopped in step 8 before collective (group: sequence) 1: 49")


def test_a_rank_waiting_in_recv_names_the_peer_that_stopped_without_a_report():
    """A pipeline: rank 0 waits in a recv from rank 1, which stopped with no report of its own (dead, or not yet
    past its threshold). Sends and receives are numbered per peer: no collective of the group names rank 1."""
    hangs = Hangs()
    _steps(hangs, 0, 7, [(10, "send", 64, "float32"), (11, "recv", 64, "float32")])
    _steps(hangs, 1, 7, [(10, "recv", 64, "float32"), (11, "send", 64, "float32")])
    report = _report(0, phase="forward", collective=("recv", 12))
    report.attributes[semconv.COMM_PEER_RANK] = 1
    hangs.add(report)
    (finding,) = hangs.findings("job")
    assert finding["rank"] == 1 and finding["summary"].startswith("rank 1 stopped in step 8, with no hang report")
    assert "rank 0 waits for rank 1 in recv (group 1, sequence 12, 540160 bytes, peer rank 1)" in finding["summary"]


def test_the_html_report_shows_a_hangs_stacks_escaped():
    hangs = Hangs()
    for rank in (0, 1):
        _steps(hangs, rank, 7, [(48, "all_reduce", 540160, "float32")])
    hostile = STACK_RANK1.replace("time.sleep(3600)", "time.sleep(3600)  # <script>alert(1)</script> & more")
    hangs.add(_report(1, stack=hostile, sequences=["1:48"]))
    hangs.add(_report(0, phase="backward", stack=STACK_RANK0, collective=("all_reduce", 49), sequences=["1:49"]))
    (finding,) = hangs.findings("job")
    page = render_html({"verdict": finding, "findings": [finding], "job_id": "job", "job": {}})
    assert "<script" not in page and "&lt;script&gt;alert(1)&lt;/script&gt; &amp; more" in page
    assert page.index("rank 1 (stopped): train.py:152 in block_forever") < page.index("rank 0 (waiting)")
    assert 'line 3252, in all_reduce\n    work.wait()' in page, "rank 0's whole stack, as it was written"


def test_a_rank_that_stopped_between_steps_is_named_with_the_step_it_did_not_start():
    hangs = Hangs()
    for rank in (0, 1):
        _steps(hangs, rank, 7, [(48, "all_reduce", 540160, "float32")])
    report = _report(1, phase=semconv.PHASE_DATA_WAIT, stack=STACK_RANK1, sequences=["1:48"])
    # As the reader takes it from a file: the flag is an OTLP bool.
    (read,) = spans_of_request({"resourceSpans": [{"resource": {"attributes": [
        {"key": "training.rank", "value": {"intValue": "1"}},
        {"key": "training.job.id", "value": {"stringValue": "job"}}]},
        "scopeSpans": [{"spans": [{"name": report.name, "traceId": "t8", "spanId": "s1", "startTimeUnixNano": "1",
                                   "endTimeUnixNano": "2", "attributes": [
                                       {"key": semconv.HANG_BETWEEN_STEPS, "value": {"boolValue": True}}]}]}]}]})
    assert read.attributes[semconv.HANG_BETWEEN_STEPS] is True
    hangs.add(_span(semconv.SPAN_HANG, 1, 100, 140, **report.attributes, **read.attributes))
    hangs.add(_report(0, phase="backward", stack=STACK_RANK0, collective=("all_reduce", 49), sequences=["1:49"]))
    (finding,) = hangs.findings("job")
    assert finding["rank"] == 1 and finding["step"] == 8
    assert finding["summary"].startswith("rank 1 stopped in the data loader (data wait) before step 8, no step open "
                                         "at train.py:152 in block_forever"), finding["summary"]


@pytest.mark.parametrize(("stopped_at", "waiting_at"), [((8, "forward", False), (8, "backward", False)),
                                                       ((9, None, True), (9, "backward", False)),
                                                       ((9, "data.wait", True), (9, "backward", False))])
def test_with_the_gradient_all_reduce_untraced_the_rank_further_on_in_its_backward_waits(stopped_at, waiting_at):
    """DDP: the reducer's all-reduce has no span, so the rank waiting in it reports no collective. Both ranks read as
    stopped, the one waiting named first."""
    hangs = Hangs()
    for rank in (0, 1):
        _steps(hangs, rank, 7, [])
    for rank, (step, phase, between) in ((1, stopped_at), (0, waiting_at)):
        report = _report(rank, step=step, phase=phase, stack=STACK_RANK1 if rank == 1 else STACK_RANK0)
        if between:
            report.attributes[semconv.HANG_BETWEEN_STEPS] = True
        hangs.add(report)
    (finding,) = hangs.findings("job")
    assert finding["rank"] == 1, finding["summary"]
    assert f"rank 0 waits for rank 1 in backward of step {waiting_at[0]}, in a collective not traced" in \
        finding["summary"]


def test_a_rank_without_a_report_is_named_by_the_sequence_it_never_reached():
    hangs = Hangs()
    for rank in (0, 1, 2):
        _steps(hangs, rank, 7, [(48, "all_reduce", 540160, "float32")])
    for rank in (0, 1):
        hangs.add(_report(rank, phase="backward", stack=STACK_RANK0, collective=("all_reduce", 49)))
    (finding,) = hangs.findings("job")
    assert finding["rank"] == 2 and finding["step"] == 8
    assert "rank 2 stopped in step 8 before collective (group: sequence) 1: 49" in finding["summary"]


def test_a_rank_with_no_telemetry_at_all_is_the_one_stopped_not_the_collective():
    """Frozen (SIGSTOP) before its first export: the world size counts it, the input has nothing of it."""
    hangs = Hangs()
    _steps(hangs, 0, 7, [(48, "all_reduce", 540160, "float32")])
    hangs.add(_report(0, phase="backward", stack=STACK_RANK0, collective=("all_reduce", 49)))
    assert "none is missing" in hangs.findings("job")[0]["summary"], "without the world size, no rank is missing"
    (finding,) = hangs.findings("job", silent=[1])
    assert finding["rank"] == 1 and finding["step"] == 8
    assert finding["summary"].startswith("rank 1 stopped in step 8 before collective (group: sequence) 1: 49, with "
                                         "no telemetry at all in the input")


def test_a_rank_whose_telemetry_lags_is_placed_where_its_peers_wait_for_it():
    """Frozen at step 120 with its last batch of spans exported at step 100: it went through collective 265 with its
    peer, who waits in 266 in step 120."""
    hangs = Hangs()
    _steps(hangs, 0, 100, [(227, "all_reduce", 540160, "float32")])
    _steps(hangs, 1, 119, [(265, "all_reduce", 540160, "float32")])
    hangs.add(_report(1, step=120, phase="backward", collective=("all_reduce", 266)))
    (finding,) = hangs.findings("job")
    assert finding["rank"] == 0 and finding["step"] == 120
    assert finding["summary"].startswith("rank 0 stopped in step 120 (where its peers wait for it; its own telemetry "
                                         "ends at step 100) before collective (group: sequence) 1: 266")


def test_a_stall_the_job_went_on_from_is_named_with_its_rank_step_and_cost():
    """Rank 1 paused 10 s in step 8 (reported twice by its watchdog), rank 0 waited for it; both went on to step 12."""
    hangs = Hangs()
    for rank in (0, 1):
        _steps(hangs, rank, 12, [(60, "all_reduce", 540160, "float32")])
    hangs.add(_span(semconv.SPAN_STEP, 1, 20, 30.5, trace="t8", **{semconv.TRAINING_STEP: 8}))  # the stalled step
    for duration in (3.6, 7.4):
        hangs.add(_report(1, stack=STACK_RANK1, duration=duration))
        hangs.add(_report(0, phase="backward", collective=("all_reduce", 49), duration=duration))
    assert hangs.findings("job") == [], "no hang: both went on"
    (stall,) = hangs.stalls("job")
    assert (stall["layer"], stall["rank"], stall["step"]) == ("STALL", 1, 8)
    assert stall["summary"].startswith("step 8 stalled 10.0 s, past the watchdog's threshold, then went on: rank 1 "
                                       "stopped in forward of step 8 at train.py:152 in block_forever")
    assert stall["cost_seconds"] == pytest.approx(10.0)
    hangs = Hangs()  # rank 1 frozen (SIGSTOP, then SIGCONT): no report of its own, rank 0 waited for it
    for rank in (0, 1):
        _steps(hangs, rank, 12, [(60, "all_reduce", 540160, "float32")])
    hangs.add(_report(0, phase="backward", collective=("all_reduce", 49), duration=7.4))
    (stall,) = hangs.stalls("job")
    assert stall["rank"] == 1 and "rank 1 stopped in step 8 before collective (group: sequence) 1: 49" in \
        stall["summary"]


def test_a_stall_names_only_the_rank_that_stopped_where_a_waiter_stayed_under_its_threshold():
    """3 ranks: rank 1 pauses (its report), rank 0 waits (its report), rank 2 waited too, under its own threshold."""
    hangs = Hangs()
    for rank in (0, 1, 2):
        _steps(hangs, rank, 12, [(60, "all_reduce", 540160, "float32")])
    hangs.add(_report(1, stack=STACK_RANK1, duration=7.4))
    hangs.add(_report(0, phase="backward", collective=("all_reduce", 49), duration=7.4))
    (stall,) = hangs.stalls("job")
    assert stall["rank"] == 1 and "rank 2" not in stall["summary"].partition("; rank 0 waits")[0]
    assert "rank 0 waits for rank 1 in all_reduce" in stall["summary"]


def test_every_rank_s_own_work_between_steps_is_no_stall_and_a_resumed_job_s_first_step_neither():
    hangs = Hangs()
    for rank in (0, 1):
        _steps(hangs, rank, 12)
        report = _report(rank, step=9, phase=None, duration=120.0)  # a checkpoint's save on every rank
        report.attributes[semconv.HANG_BETWEEN_STEPS] = True
        hangs.add(report)
    assert hangs.stalls("job") == []
    hangs = Hangs()  # resumed at step 5001: its first all-gather is warm-up
    for rank in (0, 1):
        for number in range(5001, 5013):
            hangs.add(_span(semconv.SPAN_STEP, rank, number, number + 0.5, trace=f"t{number}",
                            **{semconv.TRAINING_STEP: number}))
    hangs.add(_report(1, step=5001, stack=STACK_RANK1, duration=400.0))
    hangs.add(_report(0, step=5001, phase="backward", collective=("all_reduce", 3), duration=400.0))
    assert hangs.stalls("job") == []
    hangs.add(_report(1, step=5008, stack=STACK_RANK1, duration=40.0))
    (stall,) = hangs.stalls("job")
    assert stall["step"] == 5008


def test_a_checkpoint_before_a_step_does_not_hide_a_stall_in_it():
    """Every rank saves for 120 s before step 9 (a report between steps, numbered 9); in step 9 rank 1 stalls 40 s."""
    hangs = Hangs()
    for rank in (0, 1):
        _steps(hangs, rank, 12)
        report = _report(rank, step=9, phase=None, duration=120.0)
        report.attributes[semconv.HANG_BETWEEN_STEPS] = True
        hangs.add(report)
    hangs.add(_report(1, step=9, stack=STACK_RANK1, duration=40.0))
    hangs.add(_report(0, step=9, phase="backward", collective=("all_reduce", 30), duration=40.0))
    (stall,) = hangs.stalls("job")
    assert (stall["rank"], stall["step"]) == (1, 9) and "between steps" not in stall["summary"]


def test_a_rank_s_stall_between_steps_is_named_with_the_step_its_peer_waits_in():
    """Rank 1 pauses in its loop after step 8 (its report: between steps, before step 9); rank 0 waits in step 9."""
    hangs = Hangs()
    for rank in (0, 1):
        _steps(hangs, rank, 12)
    paused = _report(1, step=9, phase=None, stack=STACK_RANK1, duration=40.0)
    paused.attributes[semconv.HANG_BETWEEN_STEPS] = True
    hangs.add(paused)
    hangs.add(_report(0, step=9, phase="backward", collective=("all_reduce", 30), duration=41.0))  # reported later
    (stall,) = hangs.stalls("job")
    assert (stall["rank"], stall["step"]) == (1, 9)
    assert "rank 1 stopped between steps (no step open, before step 9)" in stall["summary"]


def test_a_stall_is_weighed_against_the_run_with_its_time_between_steps():
    """Steps of 0.5 s every 10 s: a 3 s stall is 6% of the steps' time, not 5% of the run's."""
    hangs = Hangs()
    for rank in (0, 1):
        for number in range(1, 21):
            hangs.add(_span(semconv.SPAN_STEP, rank, 10 * number, 10 * number + 0.5, trace=f"t{number}",
                            **{semconv.TRAINING_STEP: number}))
    hangs.add(_report(1, step=8, stack=STACK_RANK1, duration=3.0))
    hangs.add(_report(0, step=8, phase="backward", collective=("all_reduce", 30), duration=3.0))
    assert hangs.stalls("job") == []


def test_ranks_waiting_for_each_other_in_different_collectives_are_named_as_crossed():
    """Rank 1 alone all-reduces on the default group (a rank-dependent branch); rank 0 goes on to the next collective
    of DeepSpeed's group. Each waits in a collective the other has not reached: the verdict read "rank 0 stopped ...
    rank 1 stopped ...", as if each were the other's cause, with no word of the order."""
    hangs = Hangs()
    for rank in (0, 1):
        _steps(hangs, rank, 7, [(48, "all_reduce", 540160, "float32")])
    hangs.add(_report(0, phase="optimizer", stack=STACK_RANK0, collective=("all_reduce", 49), sequences=["1:49"]))
    extra = _report(1, phase=None, collective=("all_reduce", 0), sequences=["0:0", "1:48"])
    extra.attributes[semconv.COMM_GROUP_NAME] = "0"
    hangs.add(extra)
    (finding,) = hangs.findings("job")
    assert finding["rank"] is None and finding["summary"].startswith("ranks 0, 1 wait for each other")
    assert "rank 0 in all_reduce (group 1, sequence 49" in finding["summary"]
    assert "which rank 1 has not reached (rank 1's last on group 1: 48)" in finding["summary"]
    assert "which rank 0 has not reached (rank 0's last on group 0: none)" in finding["summary"]
    assert "different orders" in finding["summary"]
    assert not any(stack["stopped"] for stack in finding["stacks"]), "none stopped on its own: each waits"


def test_ranks_in_different_collectives_of_the_same_sequence_are_not_one_collective_that_does_not_complete():
    """FSDP2: rank 1 alone all-reduces in its forward; rank 0 goes on to FSDP's all-gather, the same sequence on the
    group. The verdict read "every rank waits in all_gather_single ... the collective itself does not complete", with
    the network's remedies."""
    hangs = Hangs()
    for rank in (0, 1):
        _steps(hangs, rank, 7, [(209, "all_gather_single", 25408, "float32")])
    gather = _report(0, collective=("all_gather_single", 210))
    reduce = _report(1, collective=("all_reduce", 210))
    reduce.attributes[semconv.COMM_BYTES] = 20
    hangs.add(gather)
    hangs.add(reduce)
    finding = hangs.findings("job")[0]
    assert finding["summary"].startswith("the ranks wait in different collectives at the same point: rank 0 in "
                                         "all_gather_single (group 1, sequence 210, 540160 bytes"), finding["summary"]
    assert "rank 1 in all_reduce (group 1, sequence 210, 20 bytes" in finding["summary"]
    assert not any("network" in remedy for remedy in finding["remedies"])


def test_every_rank_in_the_same_collective_is_a_collective_that_does_not_complete():
    hangs = Hangs()
    for rank in (0, 1):
        _steps(hangs, rank, 7)
        hangs.add(_report(rank, phase="backward", collective=("all_reduce", 49), sequences=["1:49"]))
    (finding,) = hangs.findings("job")
    assert finding["rank"] is None and "none is missing" in finding["summary"]


def test_a_rank_that_moved_on_after_a_report_with_no_step_open_is_no_hang():
    # A last checkpoint written for longer than the threshold, after step 7: reported, then resumed.
    hangs = Hangs()
    for rank in (0, 1):
        _steps(hangs, rank, 7)
    report = _report(1, phase=None, duration=40.0)
    hangs.add(report)
    assert [f["rank"] for f in hangs.findings("job")] == [1], "while it lasts, it is a hang"
    hangs.add(_span(semconv.SPAN_HANG, 1, 100, 190, **{**report.attributes,
                                                        semconv.HANG_REASON: semconv.HANG_REASON_RESUMED,
                                                        semconv.HANG_DURATION: 90.0}))
    assert hangs.findings("job") == []


def test_a_report_below_its_threshold_or_of_a_step_that_went_on_is_no_hang():
    hangs = Hangs()
    _steps(hangs, 0, 9)  # the slow step 8 closed, and step 9 after it
    hangs.add(_report(0))
    _steps(hangs, 1, 7)
    hangs.add(_report(1, duration=3.0))  # stopped at exit, before the threshold
    assert hangs.findings("job") == []


def test_a_report_counts_by_how_long_its_step_is_open_not_its_phase():
    # Rank 0 waits in backward: its watchdog reported as the step passed 30 s open, 29 s into the backward.
    hangs = Hangs()
    for rank in (0, 1):
        _steps(hangs, rank, 7, [(48, "all_reduce", 540160, "float32")])
    hangs.add(_report(1, stack=STACK_RANK1, sequences=["1:48"]))
    waiting = _report(0, phase="backward", duration=29.0, collective=("all_reduce", 49), sequences=["1:49"])
    hangs.add(_span(semconv.SPAN_HANG, 0, 100, 130.5, **waiting.attributes))
    (finding,) = hangs.findings("job")
    assert "rank 0 waits for rank 1 in all_reduce" in finding["summary"], finding["summary"]


def test_desync_names_the_collective_and_what_differs():
    hangs = Hangs()
    _steps(hangs, 0, 7, [(10, "all_reduce", 16, "float32"), (11, "all_reduce", 64, "float32")])
    _steps(hangs, 1, 7, [(10, "all_reduce", 16, "int32"), (11, "all_reduce", 64, "float32")])
    (finding,) = hangs.findings("job")
    assert finding["layer"] == "DESYNC"
    assert "collective 10 of group 1" in finding["summary"] and "differs in dtype" in finding["summary"]
    assert "rank 0 all_reduce of 16 bytes float32, rank 1 all_reduce of 16 bytes int32" in finding["summary"]


def test_a_desync_seen_in_repeated_hang_reports_is_one_collective_with_the_reports_step():
    """Rank 0 waits in all_gather 308 where rank 1 waits in all_reduce 308, each reported three times, in step 8,
    which never closed: no step span names its trace."""
    hangs = Hangs()
    for rank in (0, 1):
        _steps(hangs, rank, 7, [(307, "all_reduce", 16, "float32")])
    for duration in (40.0, 80.0, 160.0):
        hangs.add(_report(0, phase=None, collective=("all_gather", 308), duration=duration))
        hangs.add(_report(1, phase=None, collective=("all_reduce", 308), duration=duration))
    hang, desync = hangs.findings("job")
    assert "different collectives at the same point" in hang["summary"]
    assert desync["layer"] == "DESYNC" and desync["step"] == 8 and "more such" not in desync["summary"]
    assert desync["summary"].startswith("collective 308 of group 1 (step 8) differs in op")
    assert len(desync["evidence"]) == 1


@pytest.mark.parametrize(("rank0", "rank1"), [
    ((5, "send", 16, "float32"), (5, "recv", 16, "float32")),  # point-to-point pairs
    ((5, "all_to_all_single", 16, "float32"), (5, "all_to_all_single", 32, "float32")),  # uneven splits
    ((5, "all_reduce", 16, "float32"), (5, "all_reduce", 16, "float32")),
])
def test_no_desync_where_ranks_legitimately_differ(rank0, rank1):
    hangs = Hangs()
    _steps(hangs, 0, 3, [rank0])
    _steps(hangs, 1, 3, [rank1])
    assert hangs.findings("job") == []


def test_where_skips_the_instrumentation_and_names_the_programs_own_frame():
    assert where(STACK_RANK1) == ("train.py:152 in block_forever (time.sleep(3600)), called from train.py:138 in "
                                  "forward (block_forever())")
    assert where(STACK_RANK0) == "distributed_c10d.py:3252 in all_reduce (work.wait()), called from train.py:263 " \
                                 "in main (engine.backward(loss))"


def _request(offset=None, events=()):
    resource = [{"key": "training.job.id", "value": {"stringValue": "job"}},
                {"key": "training.rank", "value": {"intValue": "1"}}]
    if offset is not None:
        resource.append({"key": semconv.TRAINING_CLOCK_OFFSET, "value": {"intValue": str(offset)}})
    span = {"name": semconv.SPAN_HANG, "traceId": "ab", "spanId": "cd", "startTimeUnixNano": "5000000000",
            "endTimeUnixNano": "7000000000", "events": list(events),
            "attributes": [{"key": semconv.HANG_COMM_SEQUENCES,
                            "value": {"arrayValue": {"values": [{"stringValue": "1:48"}]}}}]}
    return json.loads(json.dumps({"resourceSpans": [{"resource": {"attributes": resource},
                                                     "scopeSpans": [{"spans": [span]}]}]}))


def test_the_reader_moves_a_rank_onto_rank_0s_clock_and_keeps_the_hang_stack():
    stack = {"name": semconv.EVENT_HANG_STACK, "timeUnixNano": "7000000000",
             "attributes": [{"key": semconv.CODE_STACKTRACE, "value": {"stringValue": STACK_RANK1}}]}
    (span,) = spans_of_request(_request(offset=1_500_000_000, events=[stack]))
    assert (span.start, span.end) == (3_500_000_000, 5_500_000_000)
    assert span.attributes[semconv.CODE_STACKTRACE] == STACK_RANK1
    assert span.attributes[semconv.HANG_COMM_SEQUENCES] == ("1:48",)
    (span,) = spans_of_request(_request())
    assert (span.start, span.end) == (5_000_000_000, 7_000_000_000)
    (span,) = spans_of_request(_request(offset=10**15))  # no clock is off by 11 days: left as it is
    assert span.start == 5_000_000_000


def test_the_watchdog_thread_reports_within_its_poll_interval():
    recorder, engine, emitted = recorder_on(0, job="live")
    dog = watchdog.Watchdog(floor=0.05)
    dog.watch(recorder, start=False)
    dog._thread = threading.Thread(target=dog._run, daemon=True)  # without the signal wiring
    recorder.forward_started(engine)
    opened = time.monotonic()
    dog._thread.start()
    while not dog.reports and time.monotonic() - opened < 10:
        time.sleep(0.01)
    dog.broken = True  # stops its loop
    # Threshold: 10 floors before any step closed (0.5 s), then at most one poll (0.0125 s) and the flush.
    # What the bound fails is a report that waits for the step to close or for exit (never, here: the
    # loop gives up at 10 s); 1.5 s over the threshold is a loaded machine's wake-up slack, many times over.
    assert dog.reports and time.monotonic() - opened < 2
    assert any(s.name == semconv.SPAN_HANG for s in emitted.get_finished_spans())


def test_clock_residuals_come_from_collectives_that_end_together():
    from opentelemetry_instrumentation_deepspeed.diagnose.clocks import Clocks

    clocks = Clocks()
    for sequence in range(9):
        for rank, late in ((0, 0.0), (1, 0.003)):
            clocks.add(_span("comm.all_reduce", rank, 10 + sequence, 10.5 + sequence + late,
                             **{semconv.COMM_OP: "all_reduce", semconv.COMM_SEQUENCE: sequence}))
        # Broadcasts and async calls do not end together: not used.
        clocks.add(_span("comm.broadcast", 1, 30, 31, **{semconv.COMM_OP: "broadcast", semconv.COMM_SEQUENCE: 99}))
    (rank, residual), = clocks.residuals("job").items()
    assert rank == 1 and residual["collectives"] == 9
    assert residual["residual_seconds"] == pytest.approx(0.003, abs=1e-6)


class _BlockingTokens(torch.utils.data.Dataset):
    """Items that take ``pause`` seconds each; item ``block_at`` waits for ``release``."""

    def __init__(self, block_at=None, pause=0.0):
        self.block_at, self.pause, self.release = block_at, pause, threading.Event()

    def __len__(self):
        return 10**6

    def __getitem__(self, index):
        if index == self.block_at:
            self.release.wait()
        time.sleep(self.pause)
        return torch.zeros(2)


def _training_thread(target, floor=2.0, idle_engines=0):
    """``target(recorder, engine)`` on a thread of its own, the one the watchdog watches (it builds the engine);
    ``idle_engines`` more engines built there never step."""
    ready, made = threading.Event(), {}

    def run():
        made["recorder"], made["engine"], made["emitted"] = recorder_on(1, job=f"between-{time.monotonic_ns()}")
        made["recorder"].profiler = None  # torch.profiler, on a slow step, off the main thread: not what is tested
        made["dog"] = dog = watchdog.Watchdog(floor=floor)
        dog.watch(made["recorder"], start=False)
        for number in range(idle_engines):
            dog.watch(recorder_on(0, job=f"idle-{number}-{time.monotonic_ns()}")[0], start=False)
        ready.set()
        target(made["recorder"], made["engine"])

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(10)
    return thread, made


def _looks(dog, seconds):
    """The watchdog's looks at these offsets (seconds) from now, each from the same line."""
    start, found = time.time_ns(), []
    for offset in seconds:
        time.sleep(0.05)  # the training thread gets where it goes
        found += dog.check(start + int(offset * 1e9))
    return found


def test_a_rank_blocked_in_the_data_loader_between_steps_is_reported_with_its_stack():
    dataset = _BlockingTokens(block_at=2)  # batch size 1: step 3's batch never comes
    loader = iter(torch.utils.data.DataLoader(dataset, batch_size=1))

    def train(recorder, engine):
        for _ in range(3):
            next(loader)
            train_step(recorder, engine)

    thread, made = _training_thread(train)
    dog = made["dog"]
    try:
        # Below the threshold: the floor (2 s) once the emitter has written the two short steps, 10 floors before.
        assert _looks(dog, [0, 1]) == [], "below the threshold"
        # No step open, but no progress either: the gauge the no-progress alert reads grows all the same.
        idle_since = dog._watched[0].idle_since
        (gauge,) = dog._observe_open(None, now=idle_since + int(10e9))
        assert gauge.value == pytest.approx(10.0)
        (report,) = _looks(dog, [25])
        assert report.between_steps and report.phase == semconv.PHASE_DATA_WAIT and report.number == 3
        assert report.collective is None and "__getitem__" in report.stacks[0][2]
        assert _looks(dog, [30]) == [], "next report at twice the time"
        (span,) = [s for s in made["emitted"].get_finished_spans() if s.name == semconv.SPAN_HANG]
        assert span.attributes[semconv.HANG_BETWEEN_STEPS] is True
        assert span.attributes[semconv.TRAINING_STEP] == 3
        assert span.attributes[semconv.HANG_DURATION] == pytest.approx(25, abs=1)
        assert "data.wait, before step 3" in span.status.description
    finally:
        dataset.release.set()
        thread.join(10)
    # The batch came after all: the thread went on (and ended), which closes the report.
    (resumed,) = _looks(dog, [60, 90])
    (gauge,) = dog._observe_open(None, now=idle_since + int(90e9))
    assert gauge.value == 0.0, "the thread moved on: no stall to count"
    assert resumed.reason == semconv.HANG_REASON_RESUMED and resumed.number == 3 and resumed.between_steps
    spans = [s for s in made["emitted"].get_finished_spans() if s.name == semconv.SPAN_HANG]
    assert [s.attributes[semconv.HANG_REASON] for s in spans] == [semconv.HANG_REASON_WATCHDOG,
                                                                  semconv.HANG_REASON_RESUMED]
    assert spans[1].status.is_unset and spans[1].events == () and spans[1].start_time == spans[0].start_time
    assert _looks(dog, [120, 150]) == [], "the thread ended: nothing to watch"


def test_a_rank_blocked_in_its_own_code_after_a_step_is_reported_between_steps():
    release = threading.Event()

    def train(recorder, engine):
        train_step(recorder, engine)
        release.wait()  # the program's own code after engine.step()

    thread, made = _training_thread(train)
    try:
        (report,) = _looks(made["dog"], [0, 25])
        assert report.between_steps and report.phase is None and report.number == 2
        assert "release.wait()" in report.stacks[0][2]
        # The process exits on its own from there (say, a last checkpoint that took long): no hang.
        made["dog"]._at_exit(lifecycle.EXITED)
        emitter().drain()
        reasons = [s.attributes[semconv.HANG_REASON] for s in made["emitted"].get_finished_spans()
                   if s.name == semconv.SPAN_HANG]
        assert reasons == [semconv.HANG_REASON_WATCHDOG, semconv.HANG_REASON_RESUMED]
    finally:
        release.set()
        thread.join(10)


@pytest.mark.parametrize("how", ["signal", "uncaught exception"])
def test_a_rank_stopped_by_a_signal_or_an_exception_keeps_where_it_stopped(monkeypatch, how):
    # Killed while stuck with no step open: the exit moves the thread (a handler, an unwinding
    # exception), and may even close a step: none of that is the thread going on by itself.
    release = threading.Event()

    def train(recorder, engine):
        train_step(recorder, engine)
        release.wait()
        if how == "signal":
            train_step(recorder, engine)  # the exit stages close the open step

    thread, made = _training_thread(train)
    dog = made["dog"]
    try:
        assert len(_looks(dog, [0, 25])) == 1
        if how == "signal":
            monkeypatch.setattr(lifecycle, "finishing", lambda: True)  # the exit stages have started
            release.set()
            thread.join(10)
            assert _looks(dog, [30, 60]) == []
            dog._at_exit(lifecycle.TERMINATED)
        else:
            monkeypatch.setattr("sys.last_value", KeyboardInterrupt(), raising=False)
            dog._at_exit(lifecycle.EXITED)
        emitter().drain()
        reasons = [s.attributes[semconv.HANG_REASON] for s in made["emitted"].get_finished_spans()
                   if s.name == semconv.SPAN_HANG]
        # No "resumed": a signal's last report, between steps, says where it stood; a Ctrl-C's KeyboardInterrupt
        # unwound the stack, which says nothing more.
        assert reasons == [semconv.HANG_REASON_WATCHDOG] + ([lifecycle.TERMINATED] if how == "signal" else [])
    finally:
        release.set()
        thread.join(10)


def test_a_sigterm_s_last_report_between_steps_runs_from_where_the_thread_stopped(monkeypatch):
    """The audit of the emitted files: a rank stuck between steps for 2 s read "terminated by SIGTERM ... for 0 s"
    at the signal, the handler's frames on its stack having counted as a new place to stand."""
    release, handling, stop = threading.Event(), threading.Event(), threading.Event()

    def on_sigterm():  # SIGTERM's handler, run on the thread over where it stood
        handling.set()
        stop.wait()

    def train(recorder, engine):
        train_step(recorder, engine)
        release.wait()
        on_sigterm()

    def in_handler(frame):
        while frame is not None and frame.f_code is not on_sigterm.__code__:
            frame = frame.f_back
        return frame is not None

    monkeypatch.setattr(lifecycle, "in_sigterm_handler", in_handler)
    thread, made = _training_thread(train)
    dog = made["dog"]
    try:
        (report,) = _looks(dog, [0, 25])
        release.set()
        assert handling.wait(10)
        assert _looks(dog, [30]) == []
        monkeypatch.setattr(lifecycle, "finishing", lambda: True)  # the exit stages have started
        dog._at_exit(lifecycle.TERMINATED)
        emitter().drain()
        (last,) = [s for s in made["emitted"].get_finished_spans()
                   if s.name == semconv.SPAN_HANG and s.attributes[semconv.HANG_REASON] == lifecycle.TERMINATED]
        assert last.start_time == report.step_start
        assert (last.end_time - last.start_time) / 1e9 > 0.1
    finally:
        release.set()
        stop.set()
        thread.join(10)


def test_an_exception_with_no_step_open_leaves_a_last_report_with_its_traceback(monkeypatch):
    """A review: a Trainer callback that raised after step 3 left no trace at all (no step was open), and the
    crashed job read NONE."""
    release, stepped = threading.Event(), threading.Event()

    def train(recorder, engine):
        train_step(recorder, engine)
        stepped.set()
        release.wait()

    thread, made = _training_thread(train)
    try:
        assert stepped.wait(10)
        try:
            raise ValueError("callback failed")
        except ValueError as error:
            monkeypatch.setattr("sys.last_value", error, raising=False)
        # The watchdog's own look, on its thread, may set where the thread stood since after the exit began (a
        # review: the report then ended before it started, and diagnose skipped its whole line of spans).
        made["dog"]._watched[0].idle_since = time.time_ns() + 10**9
        made["dog"]._at_exit(lifecycle.EXITED)
        emitter().drain()
        (report,) = [s for s in made["emitted"].get_finished_spans() if s.name == semconv.SPAN_HANG]
        assert report.attributes[semconv.HANG_REASON] == semconv.STATUS_EXITED_BETWEEN
        assert report.attributes[semconv.HANG_BETWEEN_STEPS] and report.attributes[semconv.TRAINING_STEP] == 2
        assert report.status.description == "the process exited between steps: ValueError: callback failed"
        assert report.start_time <= report.end_time
        (event,) = report.events
        assert 'raise ValueError("callback failed")' in event.attributes[semconv.CODE_STACKTRACE]
    finally:
        release.set()
        thread.join(10)


def test_an_exception_that_ended_a_step_on_its_way_out_leaves_no_report_between_steps(monkeypatch):
    """A review: an out-of-memory error in a backward ended its step, then the exit wrote "the process exited between
    steps" too."""
    from opentelemetry_instrumentation_deepspeed.instrumentors import engine as engine_wrappers

    thread, made = _training_thread(lambda recorder, engine: None)
    thread.join(10)

    def forward(self):
        raise RuntimeError("out of memory")

    try:
        engine_wrappers._forward(forward)(made["engine"])  # the engine's forward, through its wrapper
    except RuntimeError as error:
        monkeypatch.setattr("sys.last_value", error, raising=False)
    made["dog"]._at_exit(lifecycle.EXITED)
    emitter().drain()
    assert [s for s in made["emitted"].get_finished_spans() if s.name == semconv.SPAN_HANG] == []


def test_an_exhausted_loader_s_stop_iteration_out_of_the_loop_is_reported_between_steps(monkeypatch):
    """A review: a loop that asked its exhausted loader for one more batch ended with a StopIteration out of main();
    the loader's wrapper passed it on (an epoch's end ends no step) and the exit took it for a step's own: no report,
    and diagnose read "killed (SIGKILL, the kernel's OOM killer) or crashed in native code"."""
    from opentelemetry_instrumentation_deepspeed.instrumentors import dataloader

    def train(recorder, engine):
        train_step(recorder, engine)
        try:
            dataloader._next(lambda _self: next(iter([])))(None)  # the loader's next(), through its wrapper
        except StopIteration as error:
            monkeypatch.setattr("sys.last_value", error, raising=False)

    thread, made = _training_thread(train)
    thread.join(10)
    made["dog"]._at_exit(lifecycle.EXITED)
    emitter().drain()
    (report,) = [s for s in made["emitted"].get_finished_spans() if s.name == semconv.SPAN_HANG]
    assert report.attributes[semconv.HANG_REASON] == semconv.STATUS_EXITED_BETWEEN
    assert report.status.description == "the process exited between steps: StopIteration"


def test_a_stop_iteration_through_a_pipeline_s_train_batch_ended_its_step():
    """A pipeline's train_batch() ends its step with whatever it raised, its data iterator's end too: the exit must
    not report it again between steps (a code review: the loader's frame had covered it, until a StopIteration
    through the loader alone was no longer a step's)."""
    from opentelemetry_instrumentation_deepspeed.instrumentors import dataloader, pipeline

    def batches(_engine):
        return dataloader._next(lambda _self: next(iter([])))(None)

    with pytest.raises(StopIteration) as through_train_batch:
        pipeline.train_batch(batches)(object())  # no recorder: the wrapper passes the call on, its frame is there
    assert watchdog._through_a_step(through_train_batch.value)
    with pytest.raises(StopIteration) as through_the_loader:
        batches(None)
    assert not watchdog._through_a_step(through_the_loader.value)


@pytest.mark.slow  # 2 s each, its looks a second apart: the unit lane stays under its minute
@pytest.mark.parametrize("engines", [1, 2])
def test_steps_written_between_looks_are_progress_even_where_the_stack_looks_the_same(engines):
    # engines=2: a second engine built on the same thread (evaluation's) never steps: the first's steps
    # are the thread's progress all the same.
    dataset, stop = _BlockingTokens(pause=0.002), threading.Event()
    loader = iter(torch.utils.data.DataLoader(dataset, batch_size=1))

    def train(recorder, engine):
        while not stop.is_set():
            next(loader)  # mostly asleep on the same line: a look often finds the same stack
            train_step(recorder, engine)

    # Threshold: 2 s before a step closed, then the floor, 0.2 s (the steps take a few ms): four looks apart. A
    # floor of one look's 0.05 s reported a real 51 ms standstill of the training thread (the host's, or the GIL held
    # by a drain) in about 1 run in 7, before this session's changes as after.
    thread, made = _training_thread(train, floor=0.2, idle_engines=engines - 1)
    try:
        # Real time: 40 looks, 0.05 s apart, none with a step open.
        found = []
        for _ in range(40):
            time.sleep(0.05)
            found += made["dog"].check()
    finally:
        stop.set()
        thread.join(10)
    assert found == [] and made["recorder"].facts.last_written > 50


def test_the_clock_refresher_measures_again_off_the_training_thread_and_cleans_the_store():
    from datetime import timedelta

    from torch.distributed import TCPStore

    from opentelemetry_instrumentation_deepspeed.runtime import clock

    server = TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, 2, False, timeout=timedelta(seconds=10))
    readings = []
    answering = clock.Refresher(server, "job", 0, 2, interval=0.2)
    asking = clock.Refresher(client, "job", 1, 2, interval=0.2)
    asking.send = readings.append
    deadline = time.monotonic() + 10
    while len(readings) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    answering.stop()
    asking.stop()
    assert len(readings) >= 3 and asking.latest == readings[-1]
    for offset, error, sent, received in readings:  # one clock on both sides: the offset is within its error
        assert abs(offset) <= error + 1_000_000 and sent <= received
    assert answering.latest is None, "rank 0 only answers"
    round_1 = "opentelemetry-instrumentation-deepspeed/clock/job/1/"  # its pings' log and answers: removed
    assert not [key for key in server.list_keys() if key.startswith(round_1)]


def test_the_reader_follows_a_drifting_clock_from_its_sync_spans():
    from opentelemetry_instrumentation_deepspeed.diagnose.reader import Drift

    drift = Drift()
    drift.add(10_000_000_000, 2_000_000_000)
    assert drift.at(5_000_000_000) == drift.at(20_000_000_000) == 2_000_000_000  # one reading: held
    drift.add(20_000_000_000, 2_100_000_000)  # 10 ms per second
    assert drift.at(25_000_000_000) == 2_150_000_000  # carried forward at that rate
    assert drift.at(15_000_000_000) == 2_050_000_000  # between the two: on the line
    assert drift.at(1_000_000_000) == 2_000_000_000  # before both: the earlier one
    drift.add(19_000_000_000, 0)  # read out of order: ignored
    assert drift.at(25_000_000_000) == 2_150_000_000

    def line(name, start, end, **attributes):
        values = [{"key": k, "value": {"intValue": str(v)}} for k, v in attributes.items()]
        return {"resourceSpans": [{"resource": {"attributes": [
            {"key": "training.rank", "value": {"intValue": "1"}},
            {"key": "training.job.id", "value": {"stringValue": "job"}},
            {"key": "training.clock.offset", "value": {"intValue": "1000000000"}}]},
            "scopeSpans": [{"spans": [{"name": name, "traceId": "t", "spanId": "s", "startTimeUnixNano": str(start),
                                       "endTimeUnixNano": str(end), "attributes": values}]}]}]}

    clocks = {}
    (step,) = spans_of_request(line("training.step", 5_000_000_000, 6_000_000_000), clocks)
    assert step.start == 4_000_000_000, "the start estimate until a refresh is read"
    for at, offset in ((10_000_000_000, 2_000_000_000), (20_000_000_000, 2_100_000_000)):
        list(spans_of_request(line(semconv.SPAN_CLOCK_SYNC, at - 1000, at,
                                   **{semconv.TRAINING_CLOCK_OFFSET: offset}), clocks))
    (step,) = spans_of_request(line("training.step", 25_000_000_000, 26_000_000_000), clocks)
    assert (step.start, step.end) == (25_000_000_000 - 2_150_000_000, 26_000_000_000 - 2_150_000_000)


def test_a_flush_that_does_not_return_holds_the_watchdog_for_its_bound_at_most(monkeypatch):
    """The SDK's batch processor exports all it holds whatever force_flush's timeout says: at a collector that does
    not answer, the watchdog must still come back to its signals."""
    recorder, engine, _ = recorder_on(0, job="stuck-flush")
    released, flushes = threading.Event(), []

    def stuck_flush(_timeout_millis=None):
        flushes.append(threading.current_thread().name)
        released.wait(30)
        return True

    monkeypatch.setattr(recorder.facts.writer.provider, "force_flush", stuck_flush)
    monkeypatch.setattr(watchdog, "FLUSH_MILLIS", 100)
    dog = watchdog.Watchdog(floor=1.0)
    dog.watch(recorder, start=False)
    recorder.forward_started(engine)
    start = recorder.open.start
    try:
        assert len(_check_from_another_thread(dog, start + int(20e9))) == 1, "reported, and back"
        assert len(_check_from_another_thread(dog, start + int(60e9))) == 1, "back again"
        assert flushes == ["otel-deepspeed-watchdog-flush"], "the stuck flush takes the second report too"
    finally:
        released.set()


def test_a_look_between_steps_waits_for_a_slow_drain_elsewhere_a_second_at_most(monkeypatch):
    """A drain running on another thread (the emitter's, slowed by a span processor that exports as spans end)
    must not hold the watchdog, which reads the signals between its looks. Not knowing whether steps closed
    meanwhile, it makes no report in that look."""
    release = threading.Event()

    def train(recorder, engine):
        train_step(recorder, engine)
        release.wait(30)

    thread, made = _training_thread(train)
    dog, sink = made["dog"], emitter()
    inside, go = threading.Event(), threading.Event()
    real = sink._drain

    def slow_drain(final, read_waits):
        inside.set()
        go.wait(30)
        return real(final, read_waits)

    try:
        assert len(_looks(dog, [0, 25])) == 1, "a report between steps"
        monkeypatch.setattr(watchdog, "DRAIN_WAIT", 0.1)
        monkeypatch.setattr(sink, "_drain", slow_drain)
        elsewhere = threading.Thread(target=sink.drain, daemon=True)
        elsewhere.start()
        assert inside.wait(10)
        monkeypatch.setattr(sink, "_drain", real)
        found = []
        looking = threading.Thread(target=lambda: found.extend(dog.check(time.time_ns() + int(200e9))), daemon=True)
        looking.start()
        looking.join(10)  # two drains' waits, and the look's own work
        assert not looking.is_alive(), "the look came back while the drain elsewhere ran"
        assert found == [], "no new report while steps closed meanwhile would be unknown"
    finally:
        go.set()
        release.set()
        thread.join(10)


@pytest.mark.parametrize("step_open", [True, False])
def test_a_signals_report_has_the_stack_where_the_signal_found_the_thread(monkeypatch, step_open):
    """A rank blocked in a collective when SIGTERM came wakes to its peer's closed socket (the same signal stopped the
    peer), and the handler then runs inside torch's handling of that error: its stack showed c10d_logger's
    _get_msg_dict, not the wait. The watchdog's thread takes the stack as the signal arrives."""
    blocked, errored, release = threading.Event(), threading.Event(), threading.Event()

    def wait_for_the_peer():
        blocked.set()
        errored.wait()

    def handle_the_error():
        release.wait()

    def train(recorder, engine):
        train_step(recorder, engine)
        if step_open:
            recorder.forward_started(engine)
        wait_for_the_peer()
        handle_the_error()

    thread, made = _training_thread(train)
    dog = made["dog"]
    monkeypatch.setattr(lifecycle, "handles_sigterm", lambda: True)
    monkeypatch.setattr(lifecycle, "finishing", lambda: True)  # the handler runs at once: no takeover
    try:
        blocked.wait(10)
        dog._signalled(watchdog.signal.SIGTERM)
        errored.set()  # the peer is gone: the thread moves on, into the error's handling
        time.sleep(0.1)
        dog._at_exit(lifecycle.TERMINATED)
        emitter().drain()
        (report,) = [s for s in made["emitted"].get_finished_spans() if s.name == semconv.SPAN_HANG]
        (event,) = report.events
        stack = event.attributes["code.stacktrace"]
        assert "in wait_for_the_peer" in stack and "handle_the_error" not in stack, stack
        assert report.attributes[semconv.HANG_REASON] == lifecycle.TERMINATED
    finally:
        errored.set()
        release.set()
        thread.join(10)


def test_a_ctrl_c_the_program_went_on_from_leaves_no_stack_for_a_later_signal(monkeypatch):
    """A Ctrl-C in a long native call is the program's (it may catch it and train on); a SIGTERM later, whose handler
    runs before the watchdog's thread reads it, must not report the stack the Ctrl-C found."""
    first, moved, release = threading.Event(), threading.Event(), threading.Event()

    def long_native_call():
        first.wait()

    def where_sigterm_finds_it():
        moved.set()
        release.wait()

    def train(recorder, engine):
        train_step(recorder, engine)
        recorder.forward_started(engine)
        long_native_call()
        where_sigterm_finds_it()

    thread, made = _training_thread(train)
    dog = made["dog"]
    monkeypatch.setattr(watchdog.signal, "getsignal", lambda _signum: watchdog.signal.default_int_handler)
    monkeypatch.setattr(lifecycle, "GRACE_SECONDS", 0.2)
    monkeypatch.setattr(lifecycle, "handles_sigterm", lambda: True)
    try:
        time.sleep(0.2)
        dog._signalled(watchdog.signal.SIGINT)  # not reported stuck: the program's KeyboardInterrupt
        first.set()
        moved.wait(5)
        time.sleep(0.1)
        dog._at_exit(lifecycle.TERMINATED)
        emitter().drain()
        (report,) = [s for s in made["emitted"].get_finished_spans() if s.name == semconv.SPAN_HANG]
        stack = report.events[0].attributes["code.stacktrace"]
        assert "where_sigterm_finds_it" in stack and "long_native_call" not in stack, stack
    finally:
        first.set()
        release.set()
        thread.join(10)


def test_a_fault_in_the_watchdog_s_own_loop_is_said_once_and_the_watching_stops(monkeypatch, caplog):
    dog = watchdog.Watchdog(floor=2.0)

    def broken(_seconds):
        raise RuntimeError("a fault of ours")

    monkeypatch.setattr(dog, "_wait", broken)
    with caplog.at_level(logging.ERROR):
        dog._run()  # returns: on its thread, an exception would end it with Python's own message
    assert dog.broken
    assert sum("hang watchdog failed in Watchdog._run" in record.getMessage() for record in caplog.records) == 1, \
        caplog.text


@pytest.mark.parametrize(("collective", "in_collective"), [("sync", True), (None, False), ("async", False)])
def test_a_sigterm_in_a_collective_is_taken_over_after_the_short_grace(monkeypatch, collective, in_collective):
    """The launcher stops ranks one after another, each once the one before exited: a rank waiting in a collective
    for a peer it stops too would hold every later one for the whole grace. An async collective not waited for is
    no wait (the thread computes meanwhile)."""
    from types import SimpleNamespace

    from opentelemetry_instrumentation_deepspeed.recording.record import Collective

    blocked, release = threading.Event(), threading.Event()

    def train(recorder, engine):
        train_step(recorder, engine)
        recorder.forward_started(engine)
        if collective:
            recorder.comm_issued(Collective(SimpleNamespace(span_name="comm.all_reduce"), 5, 64, "float32",
                                            collective == "async", time.time_ns()))
        blocked.set()
        release.wait()

    thread, made = _training_thread(train)
    taken = []
    monkeypatch.setattr(lifecycle, "handles_sigterm", lambda: True)
    monkeypatch.setattr(lifecycle, "finishing", lambda: False)
    monkeypatch.setattr(lifecycle, "finish_elsewhere", lambda signum, reason, spent: taken.append(reason))
    # Whichever grace applies is short here; the other would outlast the test.
    monkeypatch.setattr(lifecycle, "GRACE_SECONDS", 600.0 if in_collective else 0.05)
    monkeypatch.setattr(lifecycle, "COLLECTIVE_GRACE_SECONDS", 0.05 if in_collective else 600.0)
    try:
        blocked.wait(10)
        signalled = threading.Thread(target=made["dog"]._signalled, args=(watchdog.signal.SIGTERM,), daemon=True)
        signalled.start()
        signalled.join(20)
        assert not signalled.is_alive() and taken == [lifecycle.TERMINATED]
    finally:
        release.set()
        thread.join(10)
