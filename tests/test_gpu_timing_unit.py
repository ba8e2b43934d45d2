"""The CUDA-event path of collectives, with a fake at the torch.cuda boundary (the real one: scripts/gpu-check.sh)."""

from __future__ import annotations

import contextlib
import itertools

import pytest
from opentelemetry.metrics import NoOpMeterProvider

from opentelemetry_instrumentation_deepspeed.export.emitter import emitter
from opentelemetry_instrumentation_deepspeed.instrumentors.collectives import OpSpec
from opentelemetry_instrumentation_deepspeed.instrumentors.comm import CommObserver, _Group
from opentelemetry_instrumentation_deepspeed.recording import registry
from tests.test_steps_unit import recorder_on


class FakeDevices:
    """torch.cuda's current device and its guard, for a fake with one thread."""

    current = 0  # the calling thread's current device, as the fake's only thread sees it

    def current_device(self):
        return self.current

    @contextlib.contextmanager
    def device(self, index):
        previous, self.current = self.current, index
        try:
            yield
        finally:
            self.current = previous


class FakeCuda(FakeDevices):
    """torch.cuda as the observer uses it; the test plays the GPU. Blocking calls fail the test."""

    def __init__(self):
        self.idle = True
        self.events = []
        self.asked_on = []  # the thread's current device at each query and elapsed_time
        self.gpu_ms = 0.0

        cuda = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.done, self.at = False, None

            def record(self, stream=None):
                cuda.events.append(self)
                if cuda.idle:
                    self.done, self.at = True, cuda.gpu_ms

            def query(self):
                cuda.asked_on.append(cuda.current)
                return self.done

            def elapsed_time(self, other):
                assert self.done and other.done, "elapsed_time on an unfinished event blocks"
                cuda.asked_on.append(cuda.current)
                return other.at - self.at

            def synchronize(self):
                raise AssertionError("Event.synchronize blocks")

            def wait(self, stream=None):
                raise AssertionError("not needed")

        class Stream:
            def query(self):
                return cuda.idle

            def synchronize(self):
                raise AssertionError("Stream.synchronize blocks")

        self.Event = Event
        self._stream = Stream()

    def current_stream(self):
        return self._stream

    def synchronize(self):
        raise AssertionError("torch.cuda.synchronize blocks")

    def run(self, milliseconds: float):
        """The GPU executes everything queued, each event `milliseconds` after the previous."""
        for event in self.events:
            if not event.done:
                self.gpu_ms += milliseconds
                event.done, event.at = True, self.gpu_ms


class CudaTensor:
    is_cuda = True
    dtype = "torch.bfloat16"

    def element_size(self):
        return 2

    def nelement(self):
        return 1024


def all_reduce(tensor, op=None, group=None, async_op=False):
    """Signature of torch.distributed.all_reduce."""


@pytest.fixture
def setup(monkeypatch):
    recorder, engine, exporter = recorder_on(1)
    monkeypatch.setattr(registry, "_active", recorder)
    cuda = FakeCuda()
    observer = CommObserver(NoOpMeterProvider().get_meter("test"), spans=True, cuda=cuda)
    observer._groups[id(None)] = _Group("0", 2, "nccl")
    return observer, cuda, recorder, engine, exporter


def comm_spans(exporter):
    return [span for span in exporter.get_finished_spans() if span.name.startswith("comm.")]


def span_named(exporter, name):
    (span,) = [span for span in exporter.get_finished_spans() if span.name == name]
    return span


def test_gpu_times_are_resolved_later_without_blocking(setup):
    observer, cuda, recorder, engine, exporter = setup
    spec = OpSpec.of("all_reduce", all_reduce)
    backward = recorder.backward_started(engine)  # the phase that issues the gradient all-reduce
    cuda.idle = False  # the GPU is busy with backward kernels
    call = observer.issued(spec, (CudaTensor(),), {})
    observer.completed(call, None)
    recorder.phase_ended(backward)
    engine.step(recorder)  # the step closes: its record goes to the emitter
    assert comm_spans(exporter) == [], "the GPU has not run it: nothing to report yet, and no waiting"

    cuda.run(milliseconds=4.0)  # the all-reduce runs 4 ms after the previous event
    (span,) = comm_spans(exporter)  # a later drain finds it completed
    assert span.attributes["comm.timing"] == "gpu"
    assert span.attributes["comm.bytes"] == 2048 and span.attributes["comm.dtype"] == "bfloat16"
    assert span.parent.span_id == span_named(exporter, "training.backward").context.span_id
    # On the epoch clock through the origin: host time of the origin plus GPU time since it.
    origin_event, origin_host = observer._gpu._origin
    assert span.start_time == origin_host + int((call.gpu_start.at - origin_event.at) * 1e6)
    assert span.end_time - span.start_time == 4_000_000, "GPU duration, not host duration"
    assert span.attributes["comm.algbw"] == pytest.approx(2048 / 0.004)
    assert span.attributes["comm.busbw"] == pytest.approx(2048 / 0.004 * 2 * (2 - 1) / 2)


def test_async_gpu_interval_ends_at_wait_and_flush_never_blocks(setup):
    observer, cuda, recorder, engine, exporter = setup
    spec = OpSpec.of("all_reduce", all_reduce)
    recorder.forward_started(engine)
    cuda.idle = False

    class Work:
        pass

    work = Work()
    call = observer.issued(spec, (CudaTensor(),), {"async_op": True})
    observer.completed(call, work)
    observer.waited(work)  # the end event is recorded at wait(), after the stream waits for the collective
    recorder.interrupted("the process exited during this step")
    assert comm_spans(exporter) == []
    emitter().drain(final=True)  # at exit, with the GPU still busy: host times, no waiting
    (span,) = comm_spans(exporter)
    assert "comm.timing" not in span.attributes, "host timing"
    assert span.attributes["comm.async"] is True


def test_pending_gpu_intervals_are_bounded(setup, monkeypatch):
    from opentelemetry_instrumentation_deepspeed.export import emitter as emitting

    monkeypatch.setattr(emitting, "MAX_PENDING", 8)
    observer, cuda, recorder, engine, exporter = setup
    spec = OpSpec.of("all_reduce", all_reduce)
    forward = recorder.forward_started(engine)
    cuda.idle = False
    for _ in range(20):
        observer.completed(observer.issued(spec, (CudaTensor(),), {}), None)
    recorder.phase_ended(forward)
    dropped = emitter().dropped
    engine.step(recorder)
    spans = comm_spans(exporter)
    assert len(spans) == 12, "the oldest, beyond the bound, are reported with host times"
    assert all("comm.timing" not in span.attributes for span in spans)
    assert emitter().dropped - dropped == 12


def test_phases_get_gpu_intervals_as_children_without_blocking():
    cuda = FakeCuda()
    recorder, engine, exporter = recorder_on(1, cuda=cuda)
    cuda.idle = False  # kernels queue up behind the host
    forward = recorder.forward_started(engine)
    recorder.phase_ended(forward)
    backward = recorder.backward_started(engine)
    recorder.phase_ended(backward)
    assert not [s for s in exporter.get_finished_spans() if s.name.endswith(".gpu")], "nothing has run on the GPU"
    cuda.run(milliseconds=3.0)
    engine.step(recorder)
    gpu = {s.name: s for s in exporter.get_finished_spans() if s.name.endswith(".gpu")}
    assert set(gpu) == {"training.forward.gpu", "training.backward.gpu"}
    assert gpu["training.forward.gpu"].parent.span_id == span_named(exporter, "training.forward").context.span_id
    assert gpu["training.backward.gpu"].end_time - gpu["training.backward.gpu"].start_time == 3_000_000


def test_a_wait_that_raises_ends_its_collective_with_the_error(setup):
    observer, _cuda, recorder, engine, exporter = setup
    spec = OpSpec.of("all_reduce", all_reduce)

    class HostTensor(CudaTensor):
        is_cuda = False

    class Work:
        pass

    forward = recorder.forward_started(engine)
    work = Work()
    observer.completed(observer.issued(spec, (HostTensor(),), {"async_op": True}), work)
    observer.wait_failed(work, RuntimeError("NCCL watchdog timeout"))
    recorder.phase_ended(forward)
    recorder.phase_ended(recorder.backward_started(engine))
    engine.step(recorder)
    (span,) = comm_spans(exporter)
    assert span.status.status_code.name == "ERROR" and "NCCL watchdog timeout" in span.status.description
    assert span.events[0].name == "exception" and span.attributes["comm.async"] is True


def test_times_keep_their_precision_when_the_stream_never_idles():
    """elapsed_time is a float32 of milliseconds: measured from the first origin of a busy day, every interval
    would read in steps of 8 ms."""
    import struct

    from opentelemetry_instrumentation_deepspeed.recording.gpu_timing import GpuTimeline

    def float32(value):
        return struct.unpack("f", struct.pack("f", value))[0]

    cuda = FakeCuda()
    real_elapsed = cuda.Event.elapsed_time
    cuda.Event.elapsed_time = lambda self, other: float32(real_elapsed(self, other))
    timeline = GpuTimeline(cuda)
    timeline.anchor_if_idle()  # idle once, at the start
    cuda.idle = False
    interval_ms, hours = 0.1234, 24
    widths, starts = [], []
    for _hour in range(hours):
        start, end = timeline.event(), timeline.event()
        cuda.run(interval_ms)  # start at +0.1234 ms, end 0.1234 ms later
        times = timeline.times(start, end)
        widths.append((times[1] - times[0]) / 1e6)
        starts.append(times[0])
        for _ in range(60):  # the GPU busy for an hour, read every minute
            marker = timeline.event()
            cuda.run(60_000.0)
            timeline.times(marker, marker)
    assert all(abs(width - interval_ms) < 1e-3 for width in widths), widths
    hour_ns = 3600e9 + 2 * interval_ms * 1e6
    assert all(abs(later - earlier - hour_ns) < 1e3 for earlier, later in itertools.pairwise(starts)), "no drift"


def test_events_are_asked_about_on_the_engine_s_device_from_any_thread():
    """A thread of ours starts on device 0: asking there would create a CUDA context on GPU 0 for a rank on GPU 1."""
    from opentelemetry_instrumentation_deepspeed.recording.gpu_timing import GpuTimeline

    cuda = FakeCuda()
    cuda.current = 1  # DeepSpeed's set_device(local_rank), on the training thread that builds the engine
    timeline = GpuTimeline(cuda)
    timeline.anchor_if_idle()
    start, end = timeline.event(), timeline.event()
    cuda.current = 0  # the emitter's thread
    assert timeline.times(start, end) is not None
    assert cuda.asked_on and set(cuda.asked_on) == {1}
    assert cuda.current == 0, "the thread's own device after"


def test_no_thread_of_ours_asks_the_device_anything_while_a_cuda_graph_is_captured(monkeypatch):
    """torch's default capture mode refuses (and invalidates the graph on) any thread's query meanwhile."""
    import types

    from opentelemetry_instrumentation_deepspeed.instrumentors import cuda_graphs
    from opentelemetry_instrumentation_deepspeed.recording.gpu_timing import Captures, GpuTimeline

    class CUDAGraph:  # torch.cuda.graphs.CUDAGraph, as far as captures go
        def capture_begin(self, pool=None, capture_error_mode="global"):
            self.capturing = True

        def capture_end(self):
            self.capturing = False

    graphs = types.SimpleNamespace(CUDAGraph=CUDAGraph)
    monkeypatch.setattr(cuda_graphs, "_followers", set())  # other tests' engines follow torch's own
    cuda = FakeCuda()
    timeline = GpuTimeline(cuda)
    timeline.anchor_if_idle()
    cuda.idle = False
    start, end = timeline.event(), timeline.event()
    cuda.run(1.0)
    cuda_graphs.follow("test", graphs)
    try:
        graph = CUDAGraph()
        graph.capture_begin()
        asked, recorded = len(cuda.asked_on), len(cuda.events)
        assert timeline.times(start, end) is None, "asked again once the capture ended"
        assert timeline.event() is None, "an interval begun in a capture has no GPU times"
        timeline.anchor_if_idle()
        assert (len(cuda.asked_on), len(cuda.events)) == (asked, recorded), "nothing asked or recorded"
        graph.capture_end()
        assert Captures.running == 0
        assert timeline.times(start, end) is not None
        graph.capture_begin()
        graph.capture_end()
        assert Captures.running == 0
    finally:
        cuda_graphs.leave("test", graphs)
    assert "_opentelemetry_original" not in vars(CUDAGraph.capture_begin), "left as it was"
    # Two followers: the first to leave leaves the count on; the last, in the middle of a capture, resets it.
    cuda_graphs.follow("engine", graphs)
    cuda_graphs.follow("comm", graphs)
    graph.capture_begin()
    cuda_graphs.leave("engine", graphs)
    assert Captures.running == 1 and "_opentelemetry_original" in vars(CUDAGraph.capture_begin)
    cuda_graphs.leave("comm", graphs)
    graph.capture_end()
    assert Captures.running == 0 and "_opentelemetry_original" not in vars(CUDAGraph.capture_begin)


def test_a_runtime_that_cannot_name_the_device_leaves_gpu_times_on():
    from opentelemetry_instrumentation_deepspeed.recording.gpu_timing import GpuTimeline

    cuda = FakeCuda()
    cuda.current_device = lambda: (_ for _ in ()).throw(RuntimeError("CUDA driver error"))
    timeline = GpuTimeline(cuda)
    timeline.anchor_if_idle()
    start, end = timeline.event(), timeline.event()
    assert timeline.device is None and timeline.times(start, end) is not None
