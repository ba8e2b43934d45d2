"""Collective records into spans and counts, without torch.distributed: the training thread lists the
collectives of a step; the emitter counts them and keeps their spans within the span limit."""

from __future__ import annotations

import functools
import gc
import time
import warnings
import weakref

import pytest
import torch.distributed
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider

from opentelemetry_instrumentation_deepspeed import CommInstrumentor
from opentelemetry_instrumentation_deepspeed.export.emitter import span_attributes
from opentelemetry_instrumentation_deepspeed.instrumentors import comm
from opentelemetry_instrumentation_deepspeed.instrumentors.collectives import OpSpec
from opentelemetry_instrumentation_deepspeed.instrumentors.comm import CommObserver, _Group
from opentelemetry_instrumentation_deepspeed.recording import builder, inputs, registry
from opentelemetry_instrumentation_deepspeed.recording.record import Failure
from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env
from opentelemetry_instrumentation_deepspeed.runtime import watchdog
from tests.conftest import free_port
from tests.test_gpu_timing_unit import CudaTensor, all_reduce
from tests.test_steps_unit import recorder_on


class CpuTensor(CudaTensor):
    is_cuda = False


@pytest.fixture
def observed(monkeypatch):
    def observe(span_limit: str, spans: bool = True, meter=None):
        monkeypatch.setenv("OTEL_PYTHON_DEEPSPEED_COMM_SPAN_LIMIT", span_limit)
        env.reset_cache()  # the limit is read once per process: this test's, then the next test's own
        recorder, engine, exporter = recorder_on(0)
        monkeypatch.setattr(registry, "_active", recorder)
        observer = CommObserver(meter or NoOpMeterProvider().get_meter("test"), spans=spans)
        observer._groups[id(None)] = _Group("0", 2, "gloo")
        spec = OpSpec.of("all_reduce", all_reduce)

        def collective():
            observer.completed(observer.issued(spec, (CpuTensor(),), {}), None)

        return recorder, engine, exporter, collective

    yield observe
    monkeypatch.undo()
    env.reset_cache()


def one_step(recorder, engine, collective, *, in_forward: int, between: int, in_backward: int) -> None:
    forward = recorder.forward_started(engine)
    for _ in range(in_forward):
        collective()
    recorder.phase_ended(forward)
    for _ in range(between):
        collective()
    backward = recorder.backward_started(engine)
    for _ in range(in_backward):
        collective()
    recorder.phase_ended(backward)
    engine.step(recorder)


def named(spans, name):
    return [span for span in spans if span.name == name]


def test_spans_go_to_a_step_s_first_collectives_and_every_one_is_counted(observed):
    recorder, engine, exporter, collective = observed("2")
    for _ in range(2):
        one_step(recorder, engine, collective, in_forward=3, between=1, in_backward=2)
    spans = exporter.get_finished_spans()
    steps, forwards, backwards = (named(spans, name) for name in
                                  ("training.step", "training.forward", "training.backward"))
    assert [s.attributes["comm.count"] for s in steps] == [6, 6]
    assert [s.attributes["comm.spans_dropped"] for s in steps] == [4, 4]
    assert [(s.attributes["comm.count"], s.attributes["comm.spans_dropped"]) for s in forwards] == [(3, 1), (3, 1)]
    assert [(s.attributes["comm.count"], s.attributes["comm.spans_dropped"]) for s in backwards] == [(2, 2), (2, 2)]
    comm = named(spans, "comm.all_reduce")
    assert len(comm) == 4, "two per step, the limit renewed at each step"
    forward_ids = {s.context.span_id for s in forwards}
    assert all(span.parent.span_id in forward_ids for span in comm), "the first two of each step: its forward's"


def test_within_the_limit_no_span_is_dropped_and_nothing_says_so(observed):
    recorder, engine, exporter, collective = observed("64")
    one_step(recorder, engine, collective, in_forward=1, between=1, in_backward=0)
    spans = exporter.get_finished_spans()
    (step,) = named(spans, "training.step")
    (forward,) = named(spans, "training.forward")
    (backward,) = named(spans, "training.backward")
    assert step.attributes["comm.count"] == 2 and "comm.spans_dropped" not in step.attributes
    assert forward.attributes["comm.count"] == 1 and "comm.count" not in backward.attributes
    by_id = {s.context.span_id: s.name for s in spans}
    assert sorted(by_id[s.parent.span_id] for s in named(spans, "comm.all_reduce")) == [
        "training.forward", "training.step"], "the one between phases is the step's"


def test_metrics_mode_counts_collectives_without_spans_or_drops(observed):
    recorder, engine, exporter, collective = observed("1", spans=False)
    one_step(recorder, engine, collective, in_forward=3, between=0, in_backward=0)
    spans = exporter.get_finished_spans()
    (step,) = named(spans, "training.step")
    assert step.attributes["comm.count"] == 3 and "comm.spans_dropped" not in step.attributes
    assert not named(spans, "comm.all_reduce")


@pytest.mark.parametrize("spans", [True, False])
def test_a_step_that_does_not_close_keeps_a_bounded_record_and_counts_the_rest(observed, monkeypatch, spans):
    """A loop that steps only after many micro-batches (or never: a gradient analysis, an optimizer no hook sees)
    must not grow memory: past the builder's limits, phases and collectives are counted, not kept."""
    monkeypatch.setattr(builder, "MAX_PHASES", 4)
    monkeypatch.setattr(builder, "MAX_COLLECTIVES", 5)
    reader = InMemoryMetricReader()
    recorder, engine, exporter, collective = observed("64", spans, MeterProvider([reader]).get_meter("test"))
    for _ in range(6):  # 6 forwards with a collective each, 6 backwards (a loss each), then the optimizer step
        batch = torch.ones(2, 8, dtype=torch.long)
        inputs.left_loader(recorder, batch)  # what the data loader's wrapper reads of each batch
        forward = recorder.forward_started(engine, (batch,))
        collective()
        recorder.phase_ended(forward)
        recorder.phase_ended(recorder.backward_started(engine, loss=1.5))
        open_record = recorder.open
        assert len(open_record.phases) <= 4 and len(open_record.collectives) <= 5 and len(open_record.losses) <= 2
    engine.grad_accum = 6
    engine.micro_steps = 5
    engine.step(recorder)
    spans_out = exporter.get_finished_spans()
    (step,) = named(spans_out, "training.step")
    assert step.attributes["training.step.micro_batches"] == 6
    assert step.attributes["training.step.phases_dropped"] == 12 - 4, "forwards and backwards; the optimizer's kept"
    assert len(named(spans_out, "training.optimizer.step")) == 1
    assert step.attributes["comm.count"] == 6
    assert step.attributes.get("comm.spans_dropped") == (1 if spans else None), "the sixth one, past the limit"
    assert "training.loss" not in step.attributes, "two micro-batches' losses are not the step's"
    assert "training.step.padded_tokens" not in step.attributes and "training.step.tokens" not in step.attributes
    phases = [s.name for s in spans_out if s.name in {"training.forward", "training.backward"}]
    assert phases == ["training.forward", "training.backward"] * 2
    assert len(named(spans_out, "comm.all_reduce")) == (5 if spans else 0)
    points = [point for metric in reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics
              if metric.name == "training.comm.duration" for point in metric.data.data_points]
    assert sum(point.count for point in points) == 6, "each collective measured, the sixth outside the record"


def test_the_hang_watchdog_sees_the_collective_in_flight_past_the_collectives_a_step_keeps(observed, monkeypatch):
    monkeypatch.setattr(builder, "MAX_COLLECTIVES", 2)
    recorder, engine, _, collective = observed("64")
    observer = CommObserver(NoOpMeterProvider().get_meter("test"), spans=True)
    observer._groups[id(None)] = _Group("0", 2, "gloo")
    dog = watchdog.Watchdog(floor=2.0)
    dog.watch(recorder, start=False)
    recorder.forward_started(engine)
    for _ in range(3):
        collective()
    stuck = observer.issued(OpSpec.of("all_reduce", all_reduce), (CpuTensor(),), {})  # never completes
    start = recorder.open.start
    (report,) = dog.check(start + int(30e9))
    assert report.collective is stuck and report.number == 1
    observer.completed(stuck, None)


@pytest.fixture
def one_rank(request):
    """A gloo group of one rank in this process (an earlier test's, if it made one and kept it)."""
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                             world_size=1)
        request.addfinalizer(torch.distributed.destroy_process_group)


def test_a_group_the_program_destroys_is_not_kept_alive(one_rank):
    """Its threads and sockets go with it: 30 groups made, used and destroyed kept 150 open files and 91 threads."""
    observer = CommObserver(NoOpMeterProvider().get_meter("test"), spans=False)
    spec = OpSpec.of("all_reduce", all_reduce)
    group = torch.distributed.new_group([0])
    observer.completed(observer.issued(spec, (CpuTensor(),), {"group": group}), None)
    observer.completed(observer.issued(spec, (CpuTensor(),), {}), None)  # the default group, as group=None
    assert len(observer._groups) == 3
    gone = weakref.ref(group)
    torch.distributed.destroy_process_group(group)
    del group
    gc.collect()
    assert gone() is None and len(observer._groups) == 2, "the default group stays, as itself and as None"


@pytest.mark.parametrize("how", ["future", "is_completed", "wait"])
def test_an_async_collective_completes_however_its_handle_is_waited_for(one_rank, how):
    """A DDP communication hook waits on the handle's future (in the reducer's C++), a loop may poll is_completed():
    left open, such a collective was in no metric and stood "in flight" in every later hang report."""
    instrumentor = CommInstrumentor()
    instrumentor.instrument(tracer_provider=TracerProvider())
    try:
        work = torch.distributed.all_reduce(torch.ones(4), async_op=True)
        (call,) = list(instrumentor._observer._pending_async.values())
        if how == "future":
            work.get_future().wait()
        elif how == "is_completed":
            while not work.is_completed():
                time.sleep(0.001)
        else:
            work.wait()
        deadline = time.monotonic() + 10
        while call.end is None and time.monotonic() < deadline:  # gloo's thread completes the future
            time.sleep(0.001)
        assert call.end is not None and call.failure is None
        assert instrumentor._observer.between_steps is call, "what a hang report between steps reads: completed"
    finally:
        instrumentor.uninstrument()


class _Work:
    """An async handle as the observer follows it."""


def test_a_handle_that_is_completed_then_fails_its_wait_keeps_the_error_and_host_times():
    """is_completed() says True of a failed collective too (a gloo timeout): the wait() after it raises, and the
    collective keeps that error. It is timed on the host: the current stream does not wait for the collective there,
    so an end event recorded then would lie behind whatever the stream had queued."""
    observer = CommObserver(NoOpMeterProvider().get_meter("test"), spans=False)
    observer._groups[id(None)] = _Group("0", 2, "gloo")
    call = observer.issued(OpSpec.of("all_reduce", all_reduce), (CpuTensor(),), {"async_op": True})
    call.gpu_start, call.timeline = "an event", None  # as on CUDA: an end event would be recorded on the timeline
    work = _Work()
    observer.completed(call, work)
    observer.polled(work)
    assert call.end is not None and call.gpu_end is None and not observer.broken
    observer.wait_failed(work, RuntimeError("Timed out waiting 2000ms for recv operation to complete"))
    assert call.failure is not None and call.failure.type == "RuntimeError"


def test_point_to_point_calls_are_numbered_per_peer_apart_from_the_group_s_collectives():
    """Ranks that take no part in a send keep the group's count: (group, sequence) still names one collective; a
    rank's k-th send to a peer and the peer's k-th receive from it carry one number, however the two interleave them
    (a pipeline's 1F1B sends activations one way and gradients the other)."""
    observer = CommObserver(NoOpMeterProvider().get_meter("test"), spans=False)
    observer._groups[id(None)] = _Group("0", 3, "gloo")
    send, recv = OpSpec.of("send", torch.distributed.send), OpSpec.of("recv", torch.distributed.recv)
    reduce = OpSpec.of("all_reduce", all_reduce)
    issued = [observer.issued(send, (CpuTensor(), 1), {}), observer.issued(recv, (CpuTensor(),), {"src": 1}),
              observer.issued(send, (CpuTensor(),), {"dst": 2}), observer.issued(reduce, (CpuTensor(),), {}),
              observer.issued(recv, (CpuTensor(), 1), {})]
    assert [(call.sequence, call.peer) for call in issued] == [(0, 1), (0, 1), (0, 2), (0, None), (1, 1)]
    assert observer._groups[id(None)].sequence == 1, "what a hang report's last sequences read: one collective"


def test_a_peer_named_by_its_rank_in_the_group_is_numbered_as_its_global_rank(monkeypatch):
    """torch's send(group_dst=) and recv(group_src=) name the other end by its rank in the call's group: such calls had
    no peer, and a rank's sends to two peers shared one count."""
    observer = CommObserver(NoOpMeterProvider().get_meter("test"), spans=False)
    group = object()  # ranks 2 and 3 of the world: group rank 1 is global rank 3
    observer._groups[id(group)] = _Group("1", 2, "gloo")
    monkeypatch.setattr(torch.distributed, "get_global_rank", lambda of, rank: {0: 2, 1: 3}[rank] if of is group
                        else pytest.fail("the call's own group"))
    send, recv = OpSpec.of("send", torch.distributed.send), OpSpec.of("recv", torch.distributed.recv)
    issued = [observer.issued(send, (CpuTensor(),), {"group": group, "group_dst": 1}),
              observer.issued(send, (CpuTensor(),), {"group": group, "dst": 3}),
              observer.issued(recv, (CpuTensor(),), {"group": group, "group_src": 0}),
              observer.issued(recv, (CpuTensor(), None, group, 0, 1), {})]
    assert [(call.sequence, call.peer) for call in issued] == [(0, 3), (1, 3), (0, 2), (0, 3)]
    assert not observer.broken


def test_a_call_on_a_group_torch_cannot_name_is_not_observed_and_later_calls_are():
    """A rank outside a group calls its collectives too (torch returns at once); a probe may call one before the
    process group exists. Neither may turn collective tracing off for the training that follows."""
    observer = CommObserver(NoOpMeterProvider().get_meter("test"), spans=True)
    spec = OpSpec.of("all_reduce", all_reduce)
    outside = torch.distributed.GroupMember.NON_GROUP_MEMBER
    assert observer.issued(spec, (CpuTensor(),), {"group": outside}) is None
    assert not observer.broken
    observer._groups[id(None)] = _Group("0", 2, "gloo")  # the default group, once it exists
    call = observer.issued(spec, (CpuTensor(),), {})
    assert call is not None and call.sequence == 0 and not observer.broken


def _warn_once_here():
    warnings.warn("shown once", UserWarning, stacklevel=1)


def test_resolving_a_functional_collective_s_group_leaves_the_warnings_shown_once_shown_once(one_rank):
    """FSDP2's clip_grad_norm_ runs functional collectives at every step: each resolution reset what the process's
    once-only warnings had shown (a catch_warnings() block, left), and torch's repeated at every step."""
    from opentelemetry_instrumentation_deepspeed.instrumentors.comm import _process_group

    default = torch.distributed.distributed_c10d._get_default_group()
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        for group in (default.group_name, [0]):
            _warn_once_here()
            assert _process_group(group) is default
        _warn_once_here()
    assert [str(warning.message) for warning in shown] == ["shown once"]


def test_an_object_collective_of_torch_is_one_collective_of_its_own_name(one_rank):
    """torch pickles the objects into tensors and moves them with two tensor collectives (their sizes, their bytes):
    all_gather_object was two all_gathers, broadcast_object_list two broadcasts, scatter_object_list a broadcast and
    two scatters; deepspeed.comm's were one call each."""
    instrumentor = CommInstrumentor()
    instrumentor.instrument(tracer_provider=TracerProvider())
    observer = instrumentor._observer
    try:
        dist = torch.distributed
        dist.barrier()
        seen = [(observer.between_steps.route.span_name, observer.between_steps.sequence)]
        gathered = [None]
        dist.all_gather_object(gathered, {"loss": 1.5})
        seen.append((observer.between_steps.route.span_name, observer.between_steps.sequence))
        objects = [{"seed": 7}]
        dist.broadcast_object_list(objects, src=0)
        seen.append((observer.between_steps.route.span_name, observer.between_steps.sequence))
        dist.gather_object("rank 0", [None], dst=0)
        seen.append((observer.between_steps.route.span_name, observer.between_steps.sequence))
        received = [None]
        dist.scatter_object_list(received, ["shard 0"], src=0)
        seen.append((observer.between_steps.route.span_name, observer.between_steps.sequence))
        assert gathered == [{"loss": 1.5}] and received == ["shard 0"], "the program's results are its own"
        first = seen[0][1]
        assert seen == [("comm.barrier", first), ("comm.all_gather_object", first + 1),
                        ("comm.broadcast_object_list", first + 2), ("comm.gather_object", first + 3),
                        ("comm.scatter_object_list", first + 4)]
        assert observer.between_steps.end is not None and not observer.broken
    finally:
        instrumentor.uninstrument()


def test_the_collectives_of_a_coalescing_block_are_one_collective_at_its_end(one_rank):
    """Inside torch's _coalescing_manager the calls only queue their tensors; the block's end runs them as one. They
    were recorded as finished calls that never ran (0.01-0.05 ms each), and the transfer itself was not seen."""
    from opentelemetry_instrumentation_deepspeed.export.emitter import span_attributes

    instrumentor = CommInstrumentor()
    instrumentor.instrument(tracer_provider=TracerProvider())
    observer = instrumentor._observer
    try:
        from torch.distributed.distributed_c10d import _coalescing_manager  # the replacement, as a program imports it

        dist = torch.distributed
        dist.all_reduce(torch.ones(1))
        first = observer.between_steps
        with _coalescing_manager():
            dist.all_reduce(torch.ones(4))
            dist.all_reduce(torch.ones(8))
            assert observer.between_steps is first, "queued, not run"
        block = observer.between_steps
        assert (block.route.span_name, block.coalesced, block.bytes, block.sequence) == ("comm.all_reduce", 2, 48,
                                                                                         first.sequence + 1)
        assert block.end is not None and not block.is_async
        assert span_attributes(block, 1.0, False)["comm.coalesced"] == 2

        with _coalescing_manager(async_ops=True) as works:
            dist.all_reduce(torch.ones(4))
            dist.all_reduce(torch.ones(4))
        pending = observer.between_steps
        assert pending.is_async and pending.coalesced == 2 and pending.sequence == block.sequence + 1
        works.wait()
        assert pending.end is not None and pending.failure is None, "ended at the wait for the block's work"

        with pytest.raises(ZeroDivisionError), _coalescing_manager():
            dist.all_reduce(torch.ones(4))
            raise ZeroDivisionError  # the program's own error: no collective ran
        assert observer.between_steps is pending
        dist.all_reduce(torch.ones(2))
        after = observer.between_steps
        assert (after.coalesced, after.bytes, after.sequence) == (0, 8, pending.sequence + 1), "observed again"
        assert not observer.broken
    finally:
        instrumentor.uninstrument()


def test_in_a_coalescing_block_what_torch_runs_at_once_is_observed_at_once(one_rank, monkeypatch):
    """torch queues only all-reduces, all-gathers and reduce-scatters of a tensor on the block's group: a broadcast in
    the block, or a call on another group, runs at once. They were counted into the block (its name, its bytes), and a
    block nested in another on a second group was folded into the outer one."""
    instrumentor = CommInstrumentor()
    instrumentor.instrument(tracer_provider=TracerProvider())
    observer = instrumentor._observer
    finished = []

    def finish(observer, call, *args, **kwargs):  # the wrapper's own path and completed()'s
        finished.append(call)
        CommObserver._finish(observer, call, *args, **kwargs)

    monkeypatch.setattr(comm, "_finish", finish)
    monkeypatch.setattr(observer, "_finish", functools.partial(finish, observer))
    try:
        from torch.distributed.distributed_c10d import _coalescing_manager

        dist = torch.distributed
        other = dist.new_group([0])
        with _coalescing_manager():
            dist.broadcast(torch.ones(1000), 0)
            dist.all_reduce(torch.ones(4))
            with _coalescing_manager(other):
                dist.all_reduce(torch.ones(2), group=other)
                dist.all_reduce(torch.ones(2), group=other)
            dist.all_reduce(torch.ones(8))
        described = [(call.route.span_name, call.route.span_attributes.get("comm.group.name", "0"), call.bytes,
                      call.coalesced) for call in finished]
        other_name = dist.distributed_c10d._get_process_group_name(other)
        assert described == [("comm.broadcast", "0", 4000, 0), ("comm.all_reduce", other_name, 16, 2),
                             ("comm.all_reduce", "0", 48, 2)]
        assert [call.sequence for call in finished] == [0, 0, 1]
        dist.destroy_process_group(other)
    finally:
        instrumentor.uninstrument()


@pytest.mark.slow  # the functional collectives' first import takes 3 s
def test_a_functional_collective_completes_where_its_result_is_waited_for(one_rank, monkeypatch):
    """DTensor's redistributions, tensor parallelism and norms over DTensors run torch's functional collectives: they
    went unseen. Each is issued at its call and completes where its result is first used (its wait_tensor)."""
    instrumentor = CommInstrumentor()
    instrumentor.instrument(tracer_provider=TracerProvider())
    observer = instrumentor._observer
    try:
        import torch.distributed._functional_collectives as funcol

        world = torch.distributed.group.WORLD
        result = funcol.all_reduce(torch.ones(100), "sum", world)
        call = observer.between_steps
        assert (call.route.span_name, call.bytes, call.is_async, call.end) == ("comm.all_reduce", 400, True, None)
        view = result[10:]  # a view waits for the same work
        assert call.end is None
        assert float((view + 1).sum()) == 180.0
        assert call.end is not None and call.failure is None and not observer._pending_tensors

        gathered = funcol.all_gather_tensor(torch.ones(2, 3), 1, world)  # gathered on dim 1: waited inside
        assert observer.between_steps.route.span_name == "comm.all_gather_single"
        assert observer.between_steps.end is not None and gathered.shape == (2, 3)
        assert observer.between_steps.sequence == call.sequence + 1

        monkeypatch.setattr(comm, "MAX_PENDING_TENSORS", 2)
        dropped = [funcol.all_reduce(torch.ones(4), "sum", world) for _ in range(3)]  # never used
        assert len(observer._pending_tensors) == 2, "results dropped unwaited are let go, the oldest first"
        from torch._subclasses.fake_tensor import FakeTensorMode

        with warnings.catch_warnings(record=True) as warned, FakeTensorMode():  # traced: none of our code runs
            warnings.simplefilter("always")
            funcol.all_reduce(torch.ones(8), "sum", world)
        assert [str(w.message) for w in warned if "comm.py" in w.filename] == [] and len(observer._pending_tensors) == 2
        for late in dropped:  # c10d warns at exit of results never waited for
            late.wait()
        assert not observer._pending_tensors
        assert not observer.broken
    finally:
        instrumentor.uninstrument()


def test_an_op_none_of_whose_calls_was_counted_has_no_size_series():
    """The engine's start-up broadcasts come before the SDK is set up and are not counted: no broadcast total of 0
    bytes beside the all-reduces' real one."""
    reader = InMemoryMetricReader()
    observer = CommObserver(MeterProvider([reader]).get_meter("test"), spans=False)
    group = observer._groups[id(None)] = _Group("0", 2, "gloo")
    observer._route(OpSpec.of("broadcast", torch.distributed.broadcast), group)
    observer._route(OpSpec.of("all_reduce", all_reduce), group).totals[:2] = [4096, 4096]
    sizes = {(metric.name, point.attributes["comm.op"]): point.value
             for metric in reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics
             if metric.name in {"training.comm.size", "training.comm.bus.size"} for point in metric.data.data_points}
    assert sizes == {("training.comm.size", "all_reduce"): 4096, ("training.comm.bus.size", "all_reduce"): 4096}


def test_a_collective_that_failed_has_no_bandwidth():
    """A review: the survivor's all-reduce that lost its peer carried a bus bandwidth (21 MB/s) as if the transfer had
    completed, and diagnose's bandwidth table counted it."""
    observer = CommObserver(NoOpMeterProvider().get_meter("test"), spans=False)
    observer._groups[id(None)] = _Group("0", 2, "gloo")
    done, lost = (observer.issued(OpSpec.of("all_reduce", all_reduce), (CpuTensor(),), {}) for _ in range(2))
    lost.failure = Failure.of(RuntimeError("Connection closed by peer"))
    assert span_attributes(done, 0.001, on_gpu=False)["comm.busbw"] > 0
    attributes = span_attributes(lost, 30.0, on_gpu=False)
    assert "comm.algbw" not in attributes and "comm.busbw" not in attributes and attributes["comm.bytes"] > 0


def test_a_collective_that_failed_adds_no_bytes_but_its_time():
    """A code review: the spans of a failed collective lost their bandwidth, and the byte counters kept its bytes."""
    from opentelemetry_instrumentation_deepspeed.export.emitter import emitter

    reader = InMemoryMetricReader()
    observer = CommObserver(MeterProvider([reader]).get_meter("test"), spans=False)
    observer._groups[id(None)] = _Group("0", 2, "gloo")
    spec = OpSpec.of("all_reduce", all_reduce)
    done, lost = observer.issued(spec, (CpuTensor(),), {}), observer.issued(spec, (CpuTensor(),), {})
    observer.completed(done, None)
    observer.failed(lost, RuntimeError("Connection closed by peer"))
    emitter().drain()
    points = {metric.name: list(metric.data.data_points)
              for metric in reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics}
    assert [point.value for point in points["training.comm.size"]] == [done.bytes]
    assert [point.count for point in points["training.comm.duration"]] == [2]
