"""CRASH: which rank failed first on its own, and what the others' failures after it were (diagnose/crashes.py)."""

from __future__ import annotations

import json
import os

import pytest

from opentelemetry_instrumentation_deepspeed.diagnose.analysis import Analysis
from opentelemetry_instrumentation_deepspeed.diagnose.reader import Span

SECOND = 10**9
LOST = "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [::1]:3"


def step(rank, number, error=None, world=2, oom=None):
    attributes = {"training.step": number, "training.world_size": world}
    if oom:
        attributes["training.memory.oom"] = oom
    return Span("training.step", f"trace{number:03d}", f"s{rank}-{number}", "", number * SECOND,
                number * SECOND + SECOND // 2 + rank, "job", rank, attributes, error)


def phase(rank, number, name, error):
    return Span(name, f"trace{number:03d}", f"p{rank}-{number}", f"s{rank}-{number}", number * SECOND + 1,
                number * SECOND + SECOND // 4 + rank, "job", rank, {}, error)


def report(spans):
    analysis = Analysis()
    analysis.add(spans)
    return analysis.result("job")


def healthy(ranks=(0, 1), steps=range(1, 7), world=2):
    return [step(rank, number, world=world) for rank in ranks for number in steps]


def test_the_rank_that_raised_first_is_named_and_the_others_errors_are_its_consequences():
    spans = [*healthy(), step(1, 7, "RuntimeError: bad shape"), phase(1, 7, "training.forward", "RuntimeError: x"),
             step(0, 7, LOST), phase(0, 7, "comm.all_reduce", LOST)]
    verdict = report(spans)["verdict"]
    assert (verdict["layer"], verdict["kind"], verdict["rank"], verdict["step"]) == ("CRASH", "raised", 1, 7)
    assert verdict["summary"] == ("rank 1 failed in forward of step 7: RuntimeError: bad shape; after it: rank 0 in "
                                  "all_reduce of step 7: RuntimeError: Connection closed by peer [::1]:3")


def test_a_failed_step_is_not_timed_with_the_others():
    spans = [*healthy(), step(1, 7, "RuntimeError: bad shape"), step(0, 7, LOST)]
    spans[-1] = Span(*[getattr(spans[-1], f) for f in ("name", "trace_id", "span_id", "parent_id", "start")],
                     7 * SECOND + 60 * SECOND, "job", 0, spans[-1].attributes, LOST)  # blocked a minute
    result = report(spans)
    assert result["ranks"][0]["steps"] == 6 and result["ranks"][0]["step_seconds"]["max"] < 1


@pytest.mark.parametrize(("ranks", "last", "said"), [
    ((0,), None, "rank 1 wrote no telemetry"),
    ((0, 1), 6, "rank 1 stopped after step 6, the last it wrote"),
    # Its last batch of spans went with it (os._exit, SIGKILL): the others lost it at step 7.
    ((0, 1), 3, "rank 1 stopped by step 7, where the others lost it (its telemetry ends at step 3"),
])
def test_a_rank_with_no_error_that_wrote_less_or_nothing_died_without_a_word(ranks, last, said):
    spans = [s for s in healthy(ranks) if not (s.rank == 1 and s.attributes["training.step"] > (last or 0))]
    spans.append(step(0, 7, LOST))
    verdict = report(spans)["verdict"]
    assert (verdict["layer"], verdict["kind"], verdict["rank"]) == ("CRASH", "silent", 1)
    assert "os._exit" in verdict["summary"]
    assert verdict["summary"].startswith(said) and "no failure of its own in its telemetry" in verdict["summary"]
    assert verdict["step"] == 7, "at the latest, the step the others failed in (what it wrote last lags)"


def test_every_rank_stopped_by_sigterm_is_said_so_and_the_loops_own_exception_is_told_apart():
    verdict = report([*healthy(), step(0, 7, "terminated by SIGTERM"), step(1, 7, "terminated by SIGTERM")])["verdict"]
    assert (verdict["layer"], verdict["kind"], verdict["rank"]) == ("CRASH", "signalled", None)
    assert verdict["summary"] == "every rank was stopped in step 7: terminated by SIGTERM"
    exited = "the process exited during this step: AssertionError: loss is nan"
    verdict = report([*healthy(), step(0, 7, exited), step(1, 7, LOST)])["verdict"]
    assert (verdict["kind"], verdict["rank"]) == ("exited", 0)
    assert verdict["summary"].startswith("rank 0 exited during step 7, by an exception no wrapper saw raised: "
                                         "AssertionError: loss is nan")


def exit_report(rank, number, reason, error=None, phase=None):
    attributes = {"training.step": number, "training.hang.reason": reason, "training.hang.between_steps": True,
                  "training.hang.threshold": 30.0}
    if phase:
        attributes["training.phase"] = phase
    return Span("training.hang", f"trace{number:03d}", f"h{rank}-{number}", "", number * SECOND,
                number * SECOND + SECOND // 10, "job", rank, attributes, error or f"{reason}: in no step")


def test_the_exits_last_report_between_steps_names_where_and_by_what_and_is_no_hang():
    """A review: a Trainer callback that raised after step 6, and a SIGTERM in the data loader, left no failed step:
    the crashed job read NONE, the stopped one DATA LOADING."""
    raised = exit_report(0, 7, "the process exited between steps",
                         "the process exited between steps: ValueError: callback failed")
    result = report([*healthy(), raised, step(1, 7, LOST)])
    verdict = result["verdict"]
    assert (verdict["layer"], verdict["kind"], verdict["rank"], verdict["step"]) == ("CRASH", "exited", 0, 7)
    assert verdict["summary"].startswith("rank 0 exited between steps, after step 6, by an exception no wrapper saw "
                                         "raised: ValueError: callback failed")
    stopped = [exit_report(rank, 7, "terminated by SIGTERM", phase="data.wait") for rank in (0, 1)]
    verdict = report([*healthy(), *stopped])["verdict"]
    assert (verdict["layer"], verdict["kind"], verdict["rank"]) == ("CRASH", "signalled", None)
    assert verdict["summary"] == "every rank was stopped in the data loader, after step 6: terminated by SIGTERM"


def test_an_out_of_memory_error_is_the_memory_findings_and_a_healthy_job_has_none():
    result = report([*healthy(), step(1, 7, "OutOfMemoryError: CUDA out of memory", oom="forward"), step(0, 7, LOST)])
    assert result["verdict"]["layer"] == "MEMORY" and not [f for f in result["findings"] if f["layer"] == "CRASH"]
    assert result["findings"][0] is result["verdict"], "the verdict heads the findings (a review: a DATA LOADING did)"
    assert not [f for f in report(healthy())["findings"] if f["layer"] == "CRASH"]


def test_a_failure_the_rank_went_on_from_is_no_crash():
    """A caught exception, its step retried with the same number (an OOM caught and the batch halved)."""
    spans = [*healthy(), step(0, 7, "RuntimeError: transient"), step(0, 7), step(1, 7), step(0, 8), step(1, 8)]
    assert not [f for f in report(spans)["findings"] if f["layer"] == "CRASH"]


def test_ctrl_c_is_a_stop_from_outside_not_a_rank_that_failed():
    verdict = report([*healthy(), step(0, 7, "KeyboardInterrupt: "), step(1, 7, "KeyboardInterrupt: ")])["verdict"]
    assert (verdict["kind"], verdict["rank"]) == ("signalled", None)


GLOO_ARGUMENT = "RuntimeError: ProcessGroupGloo::allgather: invalid output tensor list (expected length 2, got 1)"


def test_a_communication_librarys_own_argument_error_is_a_ranks_own_failure_not_a_lost_peer():
    """Gloo's and NCCL's names in an error do not make it a lost peer: a wrong argument is the rank's own."""
    spans = [*healthy(), step(1, 7, GLOO_ARGUMENT), phase(1, 7, "comm.all_gather", GLOO_ARGUMENT), step(0, 7, LOST)]
    verdict = report(spans)["verdict"]
    assert (verdict["layer"], verdict["kind"], verdict["rank"], verdict["step"]) == ("CRASH", "raised", 1, 7)
    assert verdict["summary"].startswith(f"rank 1 failed in all_gather of step 7: {GLOO_ARGUMENT}; after it: rank 0")
    assert "another rank was gone" not in verdict["summary"]


@pytest.mark.parametrize("ranks", [(0, 1), (0, 1, 2)])
def test_the_same_error_on_every_rank_is_each_ranks_own(ranks):
    """Every rank runs the same code: the same error in the same step on all of them is no rank's consequence."""
    spans = [*healthy(ranks, world=len(ranks)),
             *(step(rank, 7, GLOO_ARGUMENT.replace("got 1", f"got {rank + 1}"), world=len(ranks)) for rank in ranks)]
    verdict = report(spans)["verdict"]
    assert (verdict["layer"], verdict["kind"], verdict["rank"], verdict["step"]) == ("CRASH", "raised", None, 7)
    assert verdict["summary"].startswith(
        "every rank failed the same way, each on its own; first rank 0 failed in step 7: ")
    assert "after it" not in verdict["summary"]


def test_the_same_error_on_some_ranks_names_them_and_the_others_are_consequences():
    spans = [*healthy((0, 1, 2), world=3), step(1, 7, GLOO_ARGUMENT, world=3), step(2, 7, GLOO_ARGUMENT, world=3),
             step(0, 7, LOST, world=3)]
    verdict = report(spans)["verdict"]
    assert (verdict["kind"], verdict["rank"]) == ("raised", 1)
    assert verdict["summary"].startswith(
        "ranks 1, 2 failed the same way, each on its own; first rank 1 failed in step 7")
    assert verdict["summary"].endswith("after it: rank 0 in step 7: RuntimeError: Connection closed by peer [::1]:3")


@pytest.mark.parametrize("lost", [
    "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:577] Socket closed [127.0.0.1]:4{r}117",
    "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:600] Read error [127.0.0.1]:4{r}117: "
    "Software caused connection abort",
    "DistBackendError",  # OTEL_PYTHON_DEEPSPEED_EXCEPTION_DETAIL=type: an NCCL error of any kind
    "DistBackendError: [{r}] is setting up NCCL communicator and retrieving ncclUniqueId from [0] via c10d key-value "
    "store by key '0', but store->get('0') got error: Failed to recv, got 0 bytes. Connection was likely closed. Did "
    "the remote server shutdown or crash?",
    "RuntimeError: ranks ran out of patience {r}",  # words no pattern knows, the same on both survivors
    LOST,
])
def test_the_survivors_of_a_killed_rank_are_its_consequences(lost):
    """Rank 2 is killed after step 6 with no word; ranks 0 and 1 fail in step 7 on the lost peer, in whatever words."""
    spans = [*healthy((0, 1, 2), world=3), step(0, 7, lost.format(r=0), world=3),
             step(1, 7, lost.format(r=1), world=3)]
    verdict = report(spans)["verdict"]
    assert (verdict["kind"], verdict["rank"]) == ("silent", 2), verdict["summary"]


def test_of_ranks_failing_the_same_way_the_first_to_fail_is_named():
    spans = [*healthy((0, 1, 2), world=3), step(2, 7, GLOO_ARGUMENT, world=3), step(0, 7, LOST, world=3)]
    later = step(1, 7, GLOO_ARGUMENT, world=3)
    spans.append(Span(*[getattr(later, f) for f in ("name", "trace_id", "span_id", "parent_id", "start")],
                      later.end + 10, "job", 1, later.attributes, GLOO_ARGUMENT))
    verdict = report(spans)["verdict"]
    assert verdict["rank"] == 2 and "first rank 2 failed" in verdict["summary"], verdict["summary"]


def test_a_type_alone_is_no_sign_of_the_same_error():
    """Under OTEL_PYTHON_DEEPSPEED_EXCEPTION_DETAIL=type a step's error is its type alone: rank 0's own RuntimeError in
    its forward and rank 1's lost peer in its all-reduce read the same, and must not be "every rank failed the same
    way"."""
    spans = [*healthy(), step(0, 7, "RuntimeError"), phase(0, 7, "training.forward", "RuntimeError"),
             step(1, 7, "RuntimeError"), phase(1, 7, "comm.all_reduce", "RuntimeError")]
    verdict = report(spans)["verdict"]
    assert (verdict["kind"], verdict["rank"]) == ("raised", 0), verdict["summary"]
    assert verdict["summary"] == ("rank 0 failed in forward of step 7: RuntimeError; after it: rank 1 in all_reduce "
                                  "of step 7: RuntimeError")


def test_two_ranks_different_errors_in_one_step_are_each_ones_own():
    spans = [*healthy(), step(0, 7, "ValueError: bad batch shape"), step(1, 7, GLOO_ARGUMENT)]
    verdict = report(spans)["verdict"]
    assert verdict["rank"] == 0 and verdict["summary"] == (
        f"rank 0 failed in step 7: ValueError: bad batch shape; also on its own: rank 1 in step 7: {GLOO_ARGUMENT}")


def test_the_same_error_in_different_places_is_not_every_ranks_own():
    spans = [*healthy(), step(0, 7, "RuntimeError: boom"), phase(0, 7, "training.forward", "RuntimeError: boom"),
             step(1, 7, "RuntimeError: boom"), phase(1, 7, "training.backward", "RuntimeError: boom")]
    assert "the same way" not in report(spans)["verdict"]["summary"]


SIGTERM = "terminated by SIGTERM"


def test_a_rank_stopped_first_is_the_cause_where_the_others_lost_it_before_their_own_stop():
    """A review: SIGTERM to rank 1 alone (a preemption); rank 0's all-reduce lost it, then the launcher stopped rank 0
    too. Both steps ended by SIGTERM read "every rank was stopped in forward of step 7", rank 0 being in backward."""
    spans = [*healthy(), step(1, 7, SIGTERM), phase(1, 7, "training.forward", SIGTERM),
             step(0, 7, SIGTERM), phase(0, 7, "comm.all_reduce", LOST), phase(0, 7, "training.backward", LOST)]
    result = report(spans)
    verdict = result["verdict"]
    assert (verdict["layer"], verdict["kind"], verdict["rank"], verdict["step"], verdict["phase"]) == (
        "CRASH", "signalled", 1, 7, "forward")
    assert verdict["summary"] == (f"rank 1 was stopped in forward of step 7 ({SIGTERM}), before any rank failed on its "
                                  f"own; after it: rank 0 in all_reduce of step 7: {SIGTERM}")


def test_every_rank_stopped_in_different_places_is_said_rank_by_rank():
    spans = [*healthy(), step(1, 7, SIGTERM), phase(1, 7, "training.forward", SIGTERM),
             step(0, 7, SIGTERM), phase(0, 7, "training.backward", SIGTERM)]
    verdict = report(spans)["verdict"]
    assert (verdict["kind"], verdict["rank"], verdict["phase"]) == ("signalled", None, None)
    assert verdict["summary"] == (f"every rank was stopped: rank 0 in backward of step 7 ({SIGTERM}); rank 1 in "
                                  f"forward of step 7 ({SIGTERM})")


@pytest.mark.parametrize("error", ["TimeoutError: timed out reading shard from object storage",
                                   "ConnectionResetError: connection reset by peer while fetching a sample"])
def test_a_data_loaders_error_is_the_ranks_own_whatever_its_words(error):
    """A review: a loader's read that timed out read as "which says another rank was gone", pointing at a peer."""
    spans = [*healthy(), step(1, 7, error), phase(1, 7, "training.data.wait", error), step(0, 7, LOST),
             phase(0, 7, "comm.all_reduce", LOST)]
    verdict = report(spans)["verdict"]
    assert (verdict["kind"], verdict["rank"], verdict["phase"]) == ("raised", 1, "data.wait")
    assert verdict["summary"].startswith(f"rank 1 failed in data wait of step 7: {error}; after it: rank 0")


def test_an_out_of_memory_errors_finding_says_the_error_and_the_other_ranks_after_it():
    """A review: the MEMORY verdict gave neither the allocator's message nor rank 1's failure after it."""
    error = "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    spans = [*healthy(), step(0, 7, error, oom="forward"), phase(0, 7, "training.forward", error),
             step(1, 7, LOST), phase(1, 7, "comm.all_reduce", LOST)]
    verdict = report(spans)["verdict"]
    assert (verdict["layer"], verdict["rank"], verdict["step"]) == ("MEMORY", 0, 7)
    assert verdict["evidence"][:2] == [error, "after it: rank 1 in all_reduce of step 7: RuntimeError: Connection "
                                              "closed by peer [::1]:3"]


def test_the_hosts_memory_error_is_a_crash_with_the_hosts_remedies_and_a_between_steps_failure_says_so():
    spans = [*healthy(), step(0, 7, "MemoryError: "), phase(0, 7, "training.forward", "MemoryError: "),
             exit_report(1, 7, SIGTERM)]
    verdict = report(spans)["verdict"]
    assert (verdict["kind"], verdict["rank"], verdict["phase"]) == ("raised", 0, "forward")
    assert "process.memory.usage" in verdict["remedies"][1]
    assert f"rank 1: last step closed 6; failed between steps, after step 6: {SIGTERM}" in verdict["evidence"]


FAULTHANDLER = """Fatal Python error: Segmentation fault

Thread 0x00007fa8d44d86c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 982 in run

Current thread 0x00007fa8d5056b80 (most recent call first):
  File "/venv/lib/python3.11/site-packages/myext/ops.py", line 40 in fused_attention
  File "/home/me/model.py", line 12 in forward
  File "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1773 in _call_impl

Extension modules: numpy.core._multiarray_umath, torch._C (total: 2)"""


def native_report(spans, crashes):
    analysis = Analysis()
    analysis.add(spans)
    for rank, text in crashes.items():
        analysis.add_native_crash("job", rank, text, 7 * SECOND + SECOND // 3)
    return analysis.result("job")


def test_a_fault_in_native_code_is_named_with_the_frames_faulthandler_wrote():
    spans = [*healthy(), step(0, 7, LOST), phase(0, 7, "comm.all_reduce", LOST)]
    verdict = native_report(spans, {1: FAULTHANDLER})["verdict"]
    assert (verdict["layer"], verdict["kind"], verdict["rank"], verdict["step"]) == ("CRASH", "native", 1, 7)
    assert verdict["summary"] == ("rank 1 crashed in native code (Segmentation fault) in step 7, at ops.py:40 in "
                                  "fused_attention, called from model.py:12 in forward; after it: rank 0 in all_reduce "
                                  "of step 7: RuntimeError: Connection closed by peer [::1]:3")
    assert verdict["evidence"][-1].endswith("ops.py:40 in fused_attention <- model.py:12 in forward <- module.py:1773 "
                                            "in _call_impl")


def test_a_single_process_that_crashed_in_native_code_before_its_first_export_has_its_verdict():
    verdict = native_report([], {0: FAULTHANDLER})["verdict"]
    assert (verdict["layer"], verdict["kind"], verdict["rank"]) == ("CRASH", "native", 0)
    assert verdict["summary"].startswith("rank 0 crashed in native code (Segmentation fault) before it exported any "
                                         "step, at ops.py:40 in fused_attention")


def test_only_crash_files_with_a_crash_are_read(tmp_path):
    from opentelemetry_instrumentation_deepspeed.diagnose.reader import native_crashes

    job = tmp_path / "telemetry" / "job-1"
    job.mkdir(parents=True)
    header = '{"job": "job-1", "rank": %d, "pid": 7}\n'
    (job / "native-crash-rank0.txt").write_text(header % 0)  # exited before it could remove it: no crash
    (job / "native-crash-rank1.txt").write_text(header % 1 + FAULTHANDLER)
    (job / "native-crash-rank2.txt").write_text("not ours\n" + FAULTHANDLER)
    assert [(job_id, rank, text) for job_id, rank, text, _at in native_crashes([str(tmp_path)])] == [
        ("job-1", 1, FAULTHANDLER)]


ABORTED = """Fatal Python error: Aborted

Thread 0x00007f0000000002 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2800 in all_reduce
  File "/home/me/train.py", line 40 in step
"""


def test_a_survivors_abort_by_nccls_watchdog_is_a_consequence_not_the_cause():
    """A code review: NCCL's watchdog aborts (SIGABRT) a rank whose collective lost its peer; that rank's faulthandler
    stack was read as its own native crash, and the SIGKILLed rank was not named."""
    spans = [span for span in healthy() if not (span.rank == 1 and span.attributes["training.step"] > 4)]
    verdict = native_report(spans, {0: ABORTED})["verdict"]
    assert (verdict["kind"], verdict["rank"]) == ("silent", 1), verdict["summary"]
    assert "after it: rank 0 in step 7: crashed in native code: Aborted" in verdict["summary"]
    raised = [*healthy(), step(1, 7, "RuntimeError: bad batch"), phase(1, 7, "training.forward", "RuntimeError: x")]
    verdict = native_report(raised, {0: ABORTED})["verdict"]
    assert (verdict["kind"], verdict["rank"]) == ("raised", 1) and "also on its own" not in verdict["summary"]
    assert "after it: rank 0" in verdict["summary"]


def test_a_status_that_reads_like_a_native_crash_is_no_native_crash():
    spans = [*healthy(), step(1, 7, "crashed in native code: x"), phase(1, 7, "training.forward", "crashed in x")]
    verdict = report(spans)["verdict"]
    assert (verdict["kind"], verdict["rank"]) == ("raised", 1), verdict


def test_a_single_process_s_native_crash_after_the_steps_it_wrote_is_said_so_not_placed_in_the_next():
    """A code review: "in step 7" stated as fact, though a killed rank loses its last second of spans."""
    verdict = native_report(healthy(ranks=(0,), world=1), {0: FAULTHANDLER})["verdict"]
    assert verdict["summary"].startswith("rank 0 crashed in native code (Segmentation fault) after step 6, the last it "
                                         "wrote, at ops.py:40 in fused_attention"), verdict["summary"]


def test_a_fault_in_a_thread_without_python_frames_gives_the_main_threads_stack():
    text = ("Fatal Python error: Segmentation fault\n\nThread 0x2 (most recent call first):\n"
            '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n\n'
            "Thread 0x1 (most recent call first):\n"
            '  File "/home/me/model.py", line ??? in forward\n'
            '  File "/home/me/train.py", line 12 in <module>\n')
    verdict = native_report(healthy(ranks=(0,), world=1), {0: text})["verdict"]
    assert verdict["summary"].endswith("at model.py:0 in forward, called from train.py:12 in <module>"), verdict


def test_a_job_that_left_only_a_crash_file_is_diagnosed_by_default_and_a_crash_file_given_by_name(tmp_path, capsys,
                                                                                                  monkeypatch):
    """A code review: with no path, a job whose single process crashed before its first export was passed over for an
    older one; a crash file named on the command line was read as malformed spans."""
    from opentelemetry_instrumentation_deepspeed.diagnose import cli

    older, crashed = tmp_path / "telemetry" / "older", tmp_path / "telemetry" / "crashed"
    older.mkdir(parents=True)
    (older / "traces-rank0.jsonl").write_text("{}\n")
    crashed.mkdir()
    (crashed / "native-crash-rank0.txt").write_text('{"job": "crashed", "rank": 0, "pid": 7}\n' + FAULTHANDLER)
    os.utime(older, (1, 1))  # written first
    monkeypatch.chdir(tmp_path)
    for argv in (["diagnose", "--json"], ["diagnose", "--json", str(crashed / "native-crash-rank0.txt")]):
        assert cli.main(argv) == 0
        report = json.loads(capsys.readouterr().out)
        assert (report["verdict"]["layer"], report["verdict"]["kind"]) == ("CRASH", "native"), report["verdict"]
        assert report["input"]["native_crashes"] == 1 and report["input"]["bad_lines"] == 0
