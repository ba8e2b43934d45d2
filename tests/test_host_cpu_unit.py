"""The host's CPUs during a step (recording/host_cpu.py): read off the training thread, interpolated to the step."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import pytest

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.recording import host_cpu
from opentelemetry_instrumentation_deepspeed.recording.host_cpu import HostCpu

S = 1_000_000_000


def with_samples(*samples) -> HostCpu:
    cpu = HostCpu()
    cpu.cpus = 2
    cpu._samples.clear()
    cpu._samples.extend(samples)
    return cpu


def spinners() -> list[subprocess.Popen]:
    """Two spinning processes per CPU: whatever the machine's other load, every thread here waits for a CPU."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * os.cpu_count())]


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.kill()
        process.wait()


@contextlib.contextmanager
def crowded():
    processes = spinners()
    try:
        time.sleep(0.2)
        yield
    finally:
        stop(processes)


def test_a_step_gets_the_rates_of_the_samples_around_it():
    # Busy 1.5 CPUs and this process 0.5 in the first second, then 2.0 and 0.25 (a neighbour came), and the
    # training thread waited 0.1 s, then 0.6 s, for a CPU, and the native threads 0.2 s, then 1.2 s.
    cpu = with_samples((10 * S, 0, 0, 0, 0, 0), (11 * S, 1.5 * S, 0.5 * S, 0.5 * S, 0.1 * S, 0.2 * S),
                       (12 * S, 3.5 * S, 0.5 * S, 0.75 * S, 0.7 * S, 1.4 * S))
    assert cpu.over(10 * S + S // 4, 10 * S + S // 2) == pytest.approx((1.5, 0.5, 0.5, 0.1, 0.2))
    assert cpu.over(11 * S + S // 10, 11 * S + S // 5) == pytest.approx((2.0, 0.0, 0.25, 0.6, 1.2))
    # Across a sample, the two rates weighted by the time on each side.
    assert cpu.over(10 * S + S // 2, 11 * S + S // 2) == pytest.approx((1.75, 0.25, 0.375, 0.35, 0.7))


def test_a_host_is_never_busier_than_its_cpus():
    """The audit of the emitted files: 372 of 2,920 steps on a 2-CPU host read more than 2 CPUs busy (up to 2.093):
    /proc/stat's ticks cut an interval's ends unevenly."""
    cpu = with_samples((10 * S, 0, 0, 0, 0, 0), (11 * S, 2.09 * S, 0.11 * S, 0.5 * S, 0, 0))
    busy, idle, *_ = cpu.over(10 * S, 11 * S)
    assert busy + idle == pytest.approx(2.0) and busy / idle == pytest.approx(2.09 / 0.11)


def test_a_step_ending_after_the_last_sample_takes_a_new_one():
    cpu = HostCpu()
    start = time.time_ns()
    sum(range(200_000))  # this process uses some CPU
    figures = cpu.over(start, time.time_ns())
    assert figures is not None and len(cpu._samples) == 2
    busy, idle, process, waiting, natives = figures
    assert busy >= 0 and idle >= 0 and process >= 0 and 0 <= waiting <= 1 and natives >= 0


def test_no_figures_before_the_first_sample_or_without_proc_stat(monkeypatch):
    cpu = with_samples((10 * S, 0, 0, 0, 0, 0), (11 * S, S, 0, 0, 0, 0))
    assert cpu.over(9 * S, 10 * S + 1) is None  # the samples do not reach back to its start
    assert cpu.over(10 * S + 5, 10 * S + 5) is None  # an empty interval

    def no_proc(*_args, **_kwargs):
        raise FileNotFoundError("/proc/stat")

    monkeypatch.setattr(host_cpu, "open", no_proc, raising=False)
    cpu = HostCpu()
    assert cpu.over(time.time_ns() - S, time.time_ns()) is None
    cpu.sample()  # stays off, quietly
    assert not cpu._samples


def test_without_the_threads_schedstat_only_the_wait_is_off(monkeypatch):
    cpu = HostCpu()
    monkeypatch.setattr(cpu, "_thread", "/proc/self/task/0/no-such-file")
    start = time.time_ns()
    cpu.sample()
    sum(range(100_000))
    busy, _idle, process, waiting, natives = cpu.over(start, time.time_ns())
    assert waiting is None and busy >= 0 and process >= 0 and natives is not None
    assert cpu._thread is None  # not read again


def test_a_thread_kept_from_its_cpu_shows_its_wait():
    cpu = HostCpu()
    with crowded():
        start = time.time_ns()
        cpu.sample()
        deadline = time.perf_counter() + 0.5
        while time.perf_counter() < deadline:
            pass
        waiting = cpu.over(start, time.time_ns())[3]
    assert waiting > 0.3


def test_native_threads_kept_from_a_cpu_show_their_waits():
    # torch's intra-op threads are native: Python does not run them. Beside two spinners per CPU they wait.
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    matrix = torch.randn(384, 384)
    cpu = HostCpu()
    try:
        with crowded():
            start = time.time_ns()
            cpu.sample()
            deadline = time.perf_counter() + 0.5
            while time.perf_counter() < deadline:
                matrix @ matrix
            natives = cpu.over(start, time.time_ns())[4]
    finally:
        torch.set_num_threads(threads)
    assert natives > 0.1


def test_the_native_threads_waits_leave_out_pythons_and_keep_those_of_ended_threads(tmp_path, monkeypatch):
    import threading

    def thread(tid, waited_ns):
        (tmp_path / str(tid)).mkdir(exist_ok=True)
        (tmp_path / str(tid) / "schedstat").write_text(f"1000 {waited_ns} 7\n")

    monkeypatch.setattr(host_cpu, "TASKS", str(tmp_path))
    thread(threading.get_native_id(), 9 * S)  # an interpreted thread: the training thread's is read on its own
    thread(101, 100)
    thread(102, 50)
    cpu = HostCpu()
    assert cpu._native_waited() == 150
    thread(101, 400)
    (tmp_path / "102" / "schedstat").unlink()  # ended: its 50 ns stay counted
    (tmp_path / "102").rmdir()
    thread(103, 20)  # new since
    assert cpu._native_waited() == 470
    monkeypatch.setattr(host_cpu, "TASKS", str(tmp_path / "gone"))
    assert cpu._native_waited() != cpu._native_waited()  # NaN: off, and stays off
    assert cpu._native is None


class Facts:
    """The emitter's StepFacts as the recorder reads it: the HostCpu made on the training thread."""

    def __init__(self):
        self.host_cpu = HostCpu()


def steps_recorded(facts, work) -> list:
    from opentelemetry_instrumentation_deepspeed.recording.recorder import StepRecorder
    from tests.test_state_machine import Records, micro_batch
    from tests.test_steps_unit import Engine

    records, engine = Records(), Engine(1)
    recorder = StepRecorder(engine, facts, records.submit)
    for do in work:
        do()
        micro_batch(recorder, engine)
    return records


def test_each_step_reads_the_training_threads_wait_as_it_closes():
    # A step that spins beside two spinners per CPU waits for a CPU; the steps that sleep do not.
    def spin():
        deadline = time.perf_counter() + 0.4
        while time.perf_counter() < deadline:
            pass

    def sleep():
        time.sleep(0.2)

    facts = Facts()
    crowd: list = []

    def crowd_then_spin():
        crowd.extend(spinners())
        time.sleep(0.2)
        spin()

    def free_then_sleep():
        stop(crowd)
        crowd.clear()
        sleep()

    try:
        records = steps_recorded(facts, [sleep, crowd_then_spin, free_then_sleep, sleep])
    finally:
        stop(crowd)
    waits = [facts.host_cpu.waited(record.schedstat, record.end) for record in records]
    assert waits[1] > 0.2, waits  # its own step's, not an average over the half second around it
    assert waits[3] < 0.05, waits  # the spinners gone a step before, nothing of theirs left in it


def test_the_wait_per_step_is_schedstats_second_field_over_the_time_between_reads():
    # schedstat: ns on a CPU, ns waiting for one, timeslices.
    cpu = HostCpu()
    cpu._last_read = (10 * S, b"5 100 3\n")
    assert cpu.waited(b"900 400000100 4\n", 11 * S) == pytest.approx(0.4)
    assert cpu.waited(None, 12 * S) is None  # not read: the emitter takes the samples' figure
    cpu._last_read = (10 * S, b"5\n")
    assert cpu.waited(b"9\n", 11 * S) is None  # an older format: off, not wrong


def test_on_a_quiet_host_a_close_reads_only_once_the_interval_since_the_last_read_passed(monkeypatch):
    # A read inside real steps is a cold system call (8-15 us): short steps on a quiet host share one.
    from opentelemetry_instrumentation_deepspeed.recording import recorder

    facts = Facts()
    facts.host_cpu.phase_reads = False  # a quiet host
    monkeypatch.setattr(recorder, "QUIET_READS_EVERY", 10**12)  # the steps below close long before it passes

    def interval_passed():
        monkeypatch.setattr(recorder, "QUIET_READS_EVERY", 0)

    records = steps_recorded(facts, [lambda: None, lambda: None, lambda: None, interval_passed])
    assert [record.schedstat is not None for record in records] == [True, False, False, True]
    waits = [facts.host_cpu.waited(record.schedstat, record.end) for record in records]
    assert waits[1] is None and waits[2] is None  # no read after them known: the emitter looks for it in its queue
    assert waits[3] is not None and facts.host_cpu._last_read[0] == records[3].end  # since step 0's read

    # A host that makes the thread wait reads every close again (with its phases), however short the steps.
    monkeypatch.setattr(recorder, "QUIET_READS_EVERY", 10**12)
    facts.host_cpu.phase_reads = True
    records = steps_recorded(facts, [lambda: None, lambda: None])
    assert all(record.schedstat is not None for record in records)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the host's figures are Linux's")
def test_a_step_closed_unread_takes_the_share_of_the_read_after_it(tmp_path, monkeypatch):
    # Not the samples' half-second average: a neighbour's arrival would spread over the steps before it.
    from opentelemetry_instrumentation_deepspeed.recording import recorder as recording
    from tests.test_steps_unit import recorder_on, train_step

    recorder, engine, spans = recorder_on(0)
    host = recorder.facts.host_cpu
    host.phase_reads, host._phase_reads_left = False, 0  # a quiet host
    schedstat = os.open(tmp_path / "schedstat", os.O_RDWR | os.O_CREAT)  # the thread's, as the test writes it
    recorder._thread_stat = schedstat
    # The read before the first one, as the file will say: a background drain of step 1 finds no wait there, not
    # one against the real thread's figure that could turn every close's reads on before step 2.
    host._last_read = (time.time_ns(), b"5 1000000 1\n")
    monkeypatch.setattr(host_cpu, "COVERED_WITHIN", 10**15)  # however slow this machine, the drain waits for it

    def step_spans() -> dict:
        return {s.attributes[semconv.TRAINING_STEP]: s.attributes for s in spans.get_finished_spans()
                if s.name == semconv.SPAN_STEP}

    try:
        os.pwrite(schedstat, b"5 1000000 1\n", 0)
        monkeypatch.setattr(recording, "QUIET_READS_EVERY", 10**12)
        for _ in range(3):  # the first is read (none before it), the next two close unread
            train_step(recorder, engine)
        assert sorted(step_spans()) == [1]  # 2 and 3 wait for the read after them
        time.sleep(0.05)
        os.pwrite(schedstat, b"9 11000000 2\n", 0)  # 10 ms of waiting for a CPU since the first read
        monkeypatch.setattr(recording, "QUIET_READS_EVERY", 0)
        train_step(recorder, engine)
        emitted = step_spans()
        share = emitted[4][semconv.TRAINING_STEP_THREAD_CPU_WAIT]
        assert 0 < share <= 0.2
        assert emitted[2][semconv.TRAINING_STEP_THREAD_CPU_WAIT] == share
        assert emitted[3][semconv.TRAINING_STEP_THREAD_CPU_WAIT] == share

        # A flush, or a metric collection, waits for no read, but takes one already queued.
        host.phase_reads, host._phase_reads_left = False, 0  # quiet again (that read's share turned them on)
        monkeypatch.setattr(recording, "QUIET_READS_EVERY", 10**12)
        for _ in range(2):
            train_step(recorder, engine)  # 5 and 6, unread
        time.sleep(0.05)
        os.pwrite(schedstat, b"9 21000000 3\n", 0)  # 10 ms more
        monkeypatch.setattr(recording, "QUIET_READS_EVERY", 0)
        train_step(recorder, engine)  # 7, read
        recorder.facts.writer.provider.force_flush()
        emitted = step_spans()
        share = emitted[7][semconv.TRAINING_STEP_THREAD_CPU_WAIT]
        assert 0 < share <= 0.2 and emitted[5][semconv.TRAINING_STEP_THREAD_CPU_WAIT] == share
        host.phase_reads, host._phase_reads_left = False, 0
        monkeypatch.setattr(recording, "QUIET_READS_EVERY", 10**12)
        train_step(recorder, engine)  # 8, unread, no read after it yet
        recorder.facts.writer.provider.force_flush()
        assert 8 in step_spans()

        # No read can cover it any longer (the training stopped, the file became unreadable): written at once, with
        # the samples' figure.
        monkeypatch.setattr(host_cpu, "COVERED_WITHIN", 0)
        train_step(recorder, engine)
        assert 9 in step_spans()
    finally:
        os.close(schedstat)


def test_a_read_covers_only_the_steps_that_closed_unread_shortly_before_it():
    cpu = HostCpu()
    cpu._last_read = (10 * S, b"0 0 0\n")
    cpu.covering = (11 * S, b"0 100000000 0\n")  # 0.1 s of waiting in the second since the last read
    assert cpu.covered(11 * S - host_cpu.COVERED_WITHIN // 2) == pytest.approx(0.1)
    assert cpu.covered(11 * S - 2 * host_cpu.COVERED_WITHIN) is None  # a pause between: its wait is not the step's
    assert cpu.covered(11 * S) is None  # a read covers the steps before it only
    assert cpu.waited(b"0 100000000 0\n", 11 * S) == pytest.approx(0.1)
    assert cpu.covering is None  # the read itself: what it covered is written


def test_an_unreadable_schedstat_leaves_the_steps_without_reads(tmp_path):
    facts = Facts()
    unreadable = os.open(tmp_path, os.O_RDONLY)  # a directory: every pread fails, as a closed file's would
    facts.host_cpu.thread_stat = unreadable
    try:
        records = steps_recorded(facts, [lambda: None, lambda: None])
    finally:
        os.close(unreadable)
    assert [record.schedstat for record in records] == [None, None]  # the steps go on, unread
    assert facts.host_cpu.thread_stat is None  # and the emitter waits for no read after them


def test_each_phase_reads_the_training_threads_wait_at_its_start_and_end():
    # The forward spins beside two spinners per CPU: it waits for a CPU. The backward sleeps beside them (a
    # device's wait, a straggler's sleep), long enough that waking into the crowd is a small share of it: it does
    # not wait, though the step as a whole did.
    from opentelemetry_instrumentation_deepspeed.recording.recorder import StepRecorder
    from tests.test_state_machine import Input, Records
    from tests.test_steps_unit import Engine

    def spin():
        deadline = time.perf_counter() + 0.3
        while time.perf_counter() < deadline:
            pass

    facts, records, engine = Facts(), Records(), Engine(1)
    recorder = StepRecorder(engine, facts, records.submit)
    with crowded():
        phase = recorder.forward_started(engine, (Input(),), {})
        spin()
        recorder.phase_ended(phase)
        phase = recorder.backward_started(engine)
        time.sleep(0.5)
        recorder.phase_ended(phase)
        engine.step(recorder)
    [record] = records
    forward, backward, optimizer = record.phases
    waits = [host_cpu.wait_share(phase.schedstat_start, phase.schedstat_end, phase.end - phase.start)
             for phase in record.phases]
    assert waits[0] > 0.2 and waits[1] < 0.05, waits
    assert waits[2] is not None
    assert record.schedstat is optimizer.schedstat_end  # the step's close takes the optimizer step's end read
    assert (forward.name, backward.name) == ("forward", "backward")


def test_a_phase_wait_needs_both_reads():
    assert host_cpu.wait_share(b"5 100 3\n", b"9 200000100 4\n", 10**9) == pytest.approx(0.2)
    assert host_cpu.wait_share(None, b"9 200 4\n", 10**9) is None
    assert host_cpu.wait_share(b"5 100 3\n", b"9 200 4\n", 0) is None
    assert host_cpu.wait_share(b"5\n", b"9\n", 10**9) is None  # an older format: off, not wrong


def test_the_phases_are_read_while_the_training_thread_waits_for_a_cpu():
    cpu = HostCpu()
    cpu._last_read, waited, now = (0, b"0 0 0\n"), 0, 0

    def step(share: float, seconds: float = 0.02) -> bool:
        nonlocal waited, now
        now += int(seconds * S)
        waited += int(share * seconds * S)
        assert cpu.waited(f"0 {waited} 0\n".encode(), now) == pytest.approx(share, abs=1e-6)
        return cpu.phase_reads

    assert cpu.phase_reads  # from the start, before any step says the host is quiet
    # A quiet host: the phases stop being read once PHASE_READS_HOLD steps in a row waited under the share.
    assert all(step(0.01) for _ in range(host_cpu.PHASE_READS_HOLD - 1))
    assert not step(0.01)
    assert not any(step(0.049) for _ in range(100))
    # A neighbour arrives: read from the first step that waited, for PHASE_READS_HOLD steps after the last one.
    assert step(0.3)
    assert all(step(0.0) for _ in range(host_cpu.PHASE_READS_HOLD - 1))
    assert not step(0.0)
    assert cpu.waited(None, now + S) is None and not cpu.phase_reads  # an unread step changes nothing
    cpu._last_read = (now, b"5\n")
    assert cpu.waited(b"9\n", now + S) is None and cpu.phase_reads  # unreadable: read, rather than miss a wait


def test_unread_phases_leave_the_step_its_own_read():
    facts = Facts()
    facts.host_cpu.phase_reads = False
    [record] = steps_recorded(facts, [lambda: None])
    assert all(phase.schedstat_start is None and phase.schedstat_end is None for phase in record.phases)
    assert record.schedstat is not None and facts.host_cpu.waited(record.schedstat, record.end) is not None
