"""Collective communication: every collective, once, as a ``comm.<op>`` span and in the metrics.

Two layers issue collectives: ``deepspeed.comm`` (every op DeepSpeed's ``timed_op`` wraps) and
``torch.distributed`` (what a program, or DeepSpeed underneath, calls). Both are wrapped, and a
thread-local guard lets only the outermost wrapper observe a call, so a ZeRO-3 reduce-scatter
that passes through ``deepspeed.comm``, ``TorchBackend`` and two ``torch.distributed`` functions
counts once. The same function objects re-exported elsewhere (``deepspeed.comm``,
``torch.distributed``, modules that imported them by name) are rebound to the same wrapper.

Each call becomes a ``Collective`` record: of the open step, under the phase that issued it (or
the step between phases), or on its own outside steps (metrics only). Synchronous calls are timed
on the host; ``async_op=True`` calls run from issue to ``wait()`` on their work handle, to the first
``is_completed()`` that returns True, or to the completion of its ``get_future()`` (how a DDP
communication hook waits). On CUDA tensors, CUDA events recorded around the call (and at its
completion) give the GPU-side interval instead, read by the emitter once they completed
(``gpu_timing``).

Two more shapes of call: the collectives queued in a block of torch's ``_coalescing_manager`` are one
collective, run at the block's end (``_Coalescing``); torch's functional collectives (DTensor, tensor
parallelism) run from their call to the wait for their result (``wait_tensor``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import time
import weakref
from collections.abc import Collection
from dataclasses import dataclass, field

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.metrics import Observation, get_meter

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.export import sdk
from opentelemetry_instrumentation_deepspeed.export.emitter import emitter
from opentelemetry_instrumentation_deepspeed.export.histograms import TimedHistogram
from opentelemetry_instrumentation_deepspeed.instrumentors import cuda_graphs
from opentelemetry_instrumentation_deepspeed.instrumentors.collectives import (
    DEEPSPEED_OPS,
    FUNCTIONAL_OPS,
    TORCH_OPS,
    OpSpec,
    algorithm_bytes,
    bus_factor,
)
from opentelemetry_instrumentation_deepspeed.instrumentors.patching import Patches, when_imported
from opentelemetry_instrumentation_deepspeed.package import _instruments_torch
from opentelemetry_instrumentation_deepspeed.recording import registry
from opentelemetry_instrumentation_deepspeed.recording.record import Collective, Failure
from opentelemetry_instrumentation_deepspeed.runtime import environment_variables as env
from opentelemetry_instrumentation_deepspeed.runtime import session
from opentelemetry_instrumentation_deepspeed.runtime.safety import Component, fail_open, observing
from opentelemetry_instrumentation_deepspeed.version import __version__

_logger = logging.getLogger(__name__)

_DURATION_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0, 30.0, 60.0)

_DEFAULT_GROUP_NAME = "0"  # torch names the default process group "0"

_guard = threading.local()
MAX_PENDING_TENSORS = 4096  # functional collectives' results awaiting their wait; past it the oldest are let go
# Ops that torch queues in a coalescing block without a device (distributed_c10d, torch 2.13): by name, as both layers
# name them
_QUEUED_IN_BLOCKS = frozenset({"all_reduce", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
                               "reduce_scatter_single"})
_observers: weakref.WeakSet = weakref.WeakSet()  # read by the hang watchdog (last_sequences)


@dataclass
class _Group:
    name: str
    size: int
    backend: str
    sequence: int = 0  # collectives issued on it so far (point-to-point calls apart)
    routes: dict = field(default_factory=dict)  # id(OpSpec) -> _Route
    # (direction, peer's global rank) -> point-to-point calls so far: a rank's k-th send to a peer and that peer's k-th
    # receive from it carry the same number, and the ranks that take no part keep the group's count in step.
    p2p: dict = field(default_factory=dict)


@dataclass
class _Route:
    """What one op on one group always records: built at its first call, not at every call."""

    span_name: str
    metric_attributes: dict
    span_attributes: dict
    size_factor: int  # algorithm bytes per byte of this rank's data
    bus_factor: float
    totals: list  # [bytes, bus bytes], observed as counters
    duration: TimedHistogram


class CommObserver(Component):
    """Turns collective calls into ``Collective`` records: of the open step, or on their own outside steps."""

    def __init__(self, meter, spans: bool, cuda=None):
        super().__init__("collective tracing")
        self._spans = spans
        self.explicit = False  # set by the instrumentor: providers were handed to instrument()
        self._cuda = cuda  # torch.cuda, looked up at the first CUDA tensor; a fake in tests
        # id(group object) -> what it is. Not the objects: a group the program destroys must go, with its threads and
        # sockets; its entries leave as it is collected, before its id can be reused (``_forget``).
        self._groups: dict[int, _Group] = {}
        self._dtypes: dict[object, str] = {}
        # Async work handles until their wait(); weak, so a handle dropped unwaited takes its entry along.
        self._pending_async: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._polled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ended by is_completed(), until wait()
        # Functional collectives waiting for their results' wait_tensor: by the storage's address, as c10d's own
        # registry of their works keys them (a view of the result waits for the same work).
        self._pending_tensors: dict[int, Collective] = {}
        # Wraps Work.wait, once, at the first async collective (set by the instrumentor): a synchronous
        # collective waits for its own work inside torch, and a wrapper there would pass every such wait
        # through for nothing (two per ZeRO-2 step).
        self.follow_waits = None
        self._gpu = None
        self._gpu_step: object = -1  # the step whose start was last considered for an anchor
        self._emitter = emitter()
        self.between_steps: Collective | None = None  # the last issued outside any step (hang reports)
        _observers.add(self)
        self._sdk_seen = False  # an SDK instrument is behind the histograms (once true, for good)
        self._emitter.watch_collections(meter)
        self._duration = TimedHistogram(meter.create_histogram(
            semconv.METRIC_COMM_DURATION, unit="s", description="Duration of collective operations",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
        ))
        # Byte totals are summed by the emitter and observed at collection.
        self._totals: dict[tuple, list] = {}  # (op, backend, group size) -> [bytes, bus bytes, attributes]
        meter.create_observable_counter(
            semconv.METRIC_COMM_SIZE, callbacks=[self._observe_sizes(0)], unit="By",
            description="Bytes this rank contributed to collective operations",
        )
        meter.create_observable_counter(
            semconv.METRIC_COMM_BUS_SIZE, callbacks=[self._observe_sizes(1)], unit="By",
            description="Algorithm bytes times the bus factor: divided by the duration sum, the bus bandwidth",
        )

    # -- wrapper entry points ------------------------------------------------------------------

    @fail_open
    def issued(self, spec: OpSpec, args, kwargs) -> Collective | None:
        group, data_bytes, tensor, is_async = spec.read(args, kwargs)
        # The usual case inline (a group and a dtype seen before, one engine): a collective is the
        # most frequent call of a step, and each function call costs about as much as its body.
        group = self._groups.get(id(group)) or self._group(group)
        if group is None:
            return None
        route = group.routes.get(id(spec)) or self._route(spec, group)
        dtype = "" if tensor is None else self._dtypes.get(tensor.dtype) or self._dtype(tensor)
        if spec.p2p is not None:
            peer = spec.peer(args, kwargs) if spec.peer_name is not None else None
            key = (spec.p2p, peer)
            sequence = group.p2p.get(key, 0)
            group.p2p[key] = sequence + 1
        else:
            sequence = group.sequence
            group.sequence = sequence + 1
        call = Collective(route, sequence, data_bytes, dtype, is_async, time.time_ns(), self._spans)
        if spec.p2p is not None:
            call.peer = peer
        # registry.active() inline for one engine: a frame fewer per collective.
        recorder = registry.active() if registry._several else registry._active
        if recorder is not None:
            recorder.comm_issued(call)
        if not call.in_step:
            self.between_steps = call  # a rank blocked in it with no step open waits for a peer here
        if tensor is not None and getattr(tensor, "is_cuda", False):
            call.timeline = self._timeline(recorder)
            call.gpu_start = call.timeline.event()
        return call

    @fail_open
    def completed(self, call: Collective | None, result) -> None:
        if call is None:
            return
        if not call.is_async:
            self._finish(call)
            return
        works = [work for work in (result if isinstance(result, (list, tuple)) else [result]) if work is not None]
        if not works:
            self._finish(call)
            return
        if self.follow_waits is not None:  # before the handles reach the caller, who may wait on them at once
            self.follow_waits()
        for work in works:
            try:
                self._pending_async[work] = call
            except TypeError:  # a handle type without weak references: it cannot be followed to wait()
                self._finish(call)
                return
        call.remaining = len(works)

    @fail_open
    def failed(self, call: Collective | None, error: BaseException) -> None:
        if call is not None:
            call.failure = Failure.of(error)
            self._finish(call)

    @fail_open
    def waited(self, work) -> None:
        call = self._pending_async.pop(work, None)
        if call is not None:
            self._one_done(call)

    @fail_open
    def wait_failed(self, work, error: BaseException) -> None:
        """``wait()`` raised (a timeout, an aborted communicator): the collective ends with the error; one that
        ``is_completed()`` ended already takes the error (while its step is open, the step's span shows it)."""
        call = self._pending_async.pop(work, None)
        if call is not None:
            call.failure = Failure.of(error)
            self._finish(call)
            return
        call = self._polled.pop(work, None)
        if call is not None:
            call.failure = Failure.of(error)

    @fail_open
    def polled(self, work) -> None:
        """``is_completed()`` returned True: the handle's end, on the host's clock (the current stream does not wait
        for the collective there, so an event recorded now would lie behind whatever the stream queued). It says the
        same of a failed collective: a ``wait()`` that raises later still gives it its error."""
        call = self._pending_async.pop(work, None)
        if call is not None:
            self._polled[work] = call
            self._one_done(call, on_stream=False)

    @fail_open
    def future_done(self, work, error) -> None:
        """The handle's future completed, on whichever thread completed it (a backend's): the end, or its error; and
        nothing that could wait or export there."""
        call = self._pending_async.pop(work, None)
        if call is None:
            return
        if error is not None:
            call.failure = Failure.of(error)
            self._finish(call, drain=False)
            return
        self._one_done(call, drain=False)

    def _one_done(self, call: Collective, on_stream: bool = True, drain: bool = True) -> None:
        """One of the call's handles (or result tensors) completed: the call ends with the last of them."""
        call.remaining -= 1
        if call.remaining == 0:
            self._finish(call, on_stream, drain)

    def _finish(self, call: Collective, on_stream: bool = True, drain: bool = True) -> None:
        """``on_stream``: the current stream waits for the collective here (after the call, its ``wait()``, or in its
        future's callbacks), so its end event can be recorded; ``drain`` False: a thread that must not export."""
        if on_stream and call.gpu_start is not None and call.failure is None:
            call.gpu_end = call.timeline.event()
        call.end = time.time_ns()  # last: the emitter takes a set end as complete
        # Outside any step: its metrics only; none before the SDK is set up (the engine's own
        # start-up broadcasts), as the API would drop them.
        if call.in_step is False and self._sdk_behind():  # None: kept for the next step (StepRecorder.comm_issued)
            self._emitter.submit(call, drain)

    def _sdk_behind(self) -> bool:
        if not self._sdk_seen:
            self._sdk_seen = not sdk.instrument_is_unset(self._duration.histogram)
        return self._sdk_seen

    # -- what never changes per (op, group) ------------------------------------------------------

    def _route(self, spec: OpSpec, group: _Group) -> _Route:
        metric_attributes = {semconv.COMM_OP: spec.name, semconv.COMM_BACKEND: group.backend,
                             semconv.COMM_GROUP_SIZE: group.size}
        span_attributes = dict(metric_attributes)
        if group.name != _DEFAULT_GROUP_NAME:
            span_attributes[semconv.COMM_GROUP_NAME] = group.name
        key = (spec.name, group.backend, group.size)
        totals = self._totals.get(key)
        if totals is None:
            totals = self._totals[key] = [0, 0, metric_attributes]
        route = _Route(semconv.SPAN_COMM_PREFIX + spec.name, metric_attributes, span_attributes,
                       algorithm_bytes(spec.kind, 1, group.size), bus_factor(spec.kind, group.size), totals,
                       self._duration)
        group.routes[id(spec)] = route
        return route

    def restart_totals(self) -> None:
        # Zeroed in place: the routes hold these lists.
        for totals in self._totals.values():
            totals[0] = totals[1] = 0

    def _observe_sizes(self, index: int):
        # An op none of whose calls was counted yet has no series: the engine's start-up broadcasts, made before the
        # SDK was set up, would read as a broadcast total of 0 bytes.
        def observe(_options):
            return [Observation(totals[index], totals[2]) for totals in list(self._totals.values()) if totals[index]]

        return observing(self, observe)

    def _group(self, group) -> _Group | None:
        """What ``group`` is; None where torch cannot say: a call before the process group exists, or on a group
        this rank is not a member of (torch returns from it at once). Such a call is not observed, and not cached:
        the default group comes later."""
        found = self._groups.get(id(group))
        if found is None:
            dist = sys.modules["torch.distributed"]
            try:
                pg = group if group is None or isinstance(group, dist.ProcessGroup) else _process_group(group)
                pg = pg if pg is not None else dist.distributed_c10d._get_default_group()
                # group=None and the default group object are one group: one sequence of collectives.
                found = self._groups.get(id(pg))
                if found is None:
                    name = getattr(pg, "group_name", None) or dist.distributed_c10d._get_process_group_name(pg)
                    found = _Group(str(name), dist.get_world_size(pg), str(dist.get_backend(pg)))
                    self._groups[id(pg)] = found
                    weakref.finalize(pg, self._forget, found).atexit = False
            except (ValueError, RuntimeError, TypeError):  # torch's words (distributed_c10d, torch 2.x)
                return None
            if group is None or group is pg:  # not a functional collective's (mesh, dim) made for the call
                self._groups[id(group)] = found
        return found

    @fail_open
    def functional_returned(self, call: Collective, result) -> None:
        """A functional collective returned: it completes where the tensors it returned are waited for (``wait_tensor``,
        which their first use calls); returned waited already (while tracing, or a gather that needed its data), at
        once."""
        pending = [getattr(item, "elem", None) for item in (result if isinstance(result, (list, tuple)) else [result])
                   if type(item).__name__ == "AsyncCollectiveTensor"]
        keys = [tensor.untyped_storage().data_ptr() for tensor in pending if tensor is not None and tensor.numel()]
        if not keys:
            self._finish(call, drain=False)
            return
        call.remaining = len(keys)  # first: another thread (autograd's) may wait for them as they go in
        waiting = self._pending_tensors
        for key in keys:
            waiting[key] = call
        while len(waiting) > MAX_PENDING_TENSORS:  # results dropped unwaited: the oldest go
            with contextlib.suppress(StopIteration, KeyError, RuntimeError):  # another thread's wait took one
                waiting.pop(next(iter(waiting)))

    @fail_open
    def tensor_waited(self, tensor) -> None:
        """``wait_tensor`` on a functional collective's result (or a view of it: the same storage), on any thread: an
        autograd thread's wait must not export there."""
        call = self._pending_tensors.pop(tensor.untyped_storage().data_ptr(), None) if tensor.numel() else None
        if call is not None:
            self._one_done(call, drain=False)

    def _forget(self, gone: _Group) -> None:
        """A group was collected: its entries go, the default group's alias (``group=None``) among them."""
        for key, group in list(self._groups.items()):
            if group is gone:
                self._groups.pop(key, None)

    def _dtype(self, tensor) -> str:
        if tensor is None:
            return ""
        dtype = tensor.dtype
        name = self._dtypes.get(dtype)
        if name is None:
            name = self._dtypes[dtype] = str(dtype).removeprefix("torch.")
        return name

    def _timeline(self, recorder):
        from opentelemetry_instrumentation_deepspeed.recording.gpu_timing import GpuTimeline

        if self._gpu is None:
            cuda_graphs.follow("comm")
            self._gpu = GpuTimeline(self._cuda or sys.modules["torch"].cuda)
        step = None if recorder is None else recorder.step_number()
        if step != self._gpu_step:  # the first CUDA collective of a step renews the origin if it can
            self._gpu_step = step
            self._gpu.anchor_if_idle()
        return self._gpu


def last_sequences() -> dict[str, int]:
    """Group name -> the last sequence number this process issued on it (any thread: for hang reports)."""
    found = {}
    for observer in list(_observers):
        for group in list(observer._groups.values()):
            if group.sequence:
                found[group.name] = max(found.get(group.name, -1), group.sequence - 1)
    return found


def in_flight_between_steps() -> Collective | None:
    """The latest collective issued outside any step, while it has not completed (any thread: for hang
    reports made with no step open)."""
    calls = [observer.between_steps for observer in list(_observers)]
    return max((call for call in calls if call is not None and call.end is None), key=lambda call: call.start,
               default=None)


# The fail-open guards of issued() and completed(), inline in the wrapper below: the same checks and
# the same report, without the guard's frame (two per collective, the most frequent call of a step).
_issue = CommObserver.issued.__wrapped__
_complete = CommObserver.completed.__wrapped__
_finish = CommObserver._finish


def _collective_wrapper(observer: CommObserver, spec: OpSpec, original, complete=_complete):
    """``complete(observer, call, result)``: an async call's completion is followed from its result (its work
    handles; a functional collective's result tensors)."""
    def wrapper(*args, **kwargs):
        inside = getattr(_guard, "inside", False)
        if inside:  # inside another observed call (True), or a coalescing block's
            return original(*args, **kwargs) if inside is True else inside.call(spec, original, wrapper, args, kwargs)
        if session.silent and not observer.explicit:
            return original(*args, **kwargs)
        call = None
        if not observer.broken:
            try:
                call = _issue(observer, spec, args, kwargs)
            except Exception:  # noqa: BLE001 - ours only: the user's call below is outside this try
                observer.fail(_issue.__qualname__)
        _guard.inside = True
        try:
            result = original(*args, **kwargs)
        except BaseException as error:
            observer.failed(call, error)
            raise
        finally:
            _guard.inside = False
        if call is not None and not observer.broken:
            try:
                if call.is_async:
                    complete(observer, call, result)
                else:  # all that completed() would do with it: a frame fewer for the usual call
                    _finish(observer, call)
            except Exception:  # noqa: BLE001 - ours only
                observer.fail(complete.__qualname__)
        return result

    return wrapper


class _Coalescing:
    """A ``with _coalescing_manager(group, device, async_ops):`` block of torch's (Megatron-style bucketed
    reduce-scatters and all-gathers). The calls torch queues in it (all-reduces, all-gathers into a tensor and
    reduce-scatters of a tensor on the block's group; with ``device``, every call on that group) only queue their
    tensors; the block's end runs them as one (``allreduce_coalesced`` and the like). They are one collective: a
    sequence number, the bytes they sum, named for the first; from the block's end to its completion (the end itself,
    or the wait on ``cm.works``). Any other call in the block runs at once and is observed as anywhere else.

    While the block is open the thread's guard holds it (and it the block it is nested in, if any), so the collective
    wrappers, whose usual path checks the guard already, hand it their calls."""

    __slots__ = ("_async", "_bytes", "_calls", "_device", "_group", "_manager", "_observer", "_outer", "_pg", "_spec",
                 "_tensor", "_works")

    def __init__(self, observer: CommObserver, manager, args, kwargs):
        self._observer, self._manager = observer, manager
        self._group = args[0] if args else kwargs.get("group")
        self._device = (args[1] if len(args) > 1 else kwargs.get("device")) is not None
        self._async = bool(args[2] if len(args) > 2 else kwargs.get("async_ops", False))
        self._spec: OpSpec | None = None
        self._bytes = self._calls = 0
        self._tensor = None  # the first call's data: its dtype
        self._works = self._pg = None
        self._outer = False  # what the guard held before: False, or the block this one is nested in

    def __enter__(self):
        self._works = self._manager.__enter__()  # torch's _CoalescingManager: the block's work, when async
        self._pg = self._group or sys.modules["torch.distributed"].distributed_c10d._get_default_group()
        self._outer, _guard.inside = getattr(_guard, "inside", False), self
        return self._works

    def call(self, spec: OpSpec, original, observed, args, kwargs):
        """A collective called in the block (or in blocks nested in it): queued by the block of its group, else run
        at once through ``observed``, the usual wrapper."""
        block = self
        try:
            while isinstance(block, _Coalescing) and not block._queues(spec, args, kwargs):
                block = block._outer
        except Exception:  # noqa: BLE001 - ours only: the call below goes on, unobserved
            self._observer.fail(_Coalescing.call.__qualname__)
            block = None
        if isinstance(block, _Coalescing):
            return block._member(spec, original, args, kwargs)
        _guard.inside = block is None  # None: unobserved
        try:
            return (original if block is None else observed)(*args, **kwargs)
        finally:
            _guard.inside = self

    def _queues(self, spec: OpSpec, args, kwargs) -> bool:
        if spec.functional:  # its own op, which no block queues
            return False
        group = args[spec.group_index] if spec.group_index < len(args) else kwargs.get("group")
        if group is None:
            group = sys.modules["torch.distributed"].distributed_c10d._get_default_group()
        return group is self._pg and (self._device or spec.name in _QUEUED_IN_BLOCKS)

    def _member(self, spec: OpSpec, original, args, kwargs):
        inside, _guard.inside = _guard.inside, True  # deepspeed.comm's op calling torch's: one call
        try:
            result = original(*args, **kwargs)
        finally:
            _guard.inside = inside
        if not self._observer.broken:
            try:
                _group, data_bytes, tensor, _async = spec.read(args, kwargs)
                if self._spec is None:
                    self._spec, self._tensor = spec, tensor
                self._bytes += data_bytes
                self._calls += 1
            except Exception:  # noqa: BLE001 - ours only
                self._observer.fail(_Coalescing._member.__qualname__)
        return result

    def __exit__(self, kind, error, traceback):
        observer, spec, call = self._observer, self._spec, None
        if kind is None and spec is not None and not observer.broken:
            try:
                data = {} if spec.data_name is None else {spec.data_name: self._tensor}
                call = _issue(observer, spec, (), {**data, "group": self._group, "async_op": self._async})
                if call is not None:
                    call.bytes, call.coalesced = self._bytes, self._calls
            except Exception:  # noqa: BLE001 - ours only
                observer.fail(_issue.__qualname__)
        self._tensor = None  # not the program's tensor past its block
        _guard.inside = True
        try:
            suppressed = self._manager.__exit__(kind, error, traceback)
        except BaseException as failure:
            observer.failed(call, failure)
            raise
        finally:
            _guard.inside = self._outer
        if call is not None and not observer.broken:
            try:
                _complete(observer, call, list(getattr(self._works, "works", ())) if call.is_async else None)
            except Exception:  # noqa: BLE001 - ours only
                observer.fail(_complete.__qualname__)
        return suppressed


def _coalescing_wrapper(observer: CommObserver, original):
    def wrapper(*args, **kwargs):
        if (session.silent and not observer.explicit) or getattr(_guard, "inside", False) is True or observer.broken:
            return original(*args, **kwargs)  # inside an observed call (batch_isend_irecv's own block): part of it
        return _Coalescing(observer, original(*args, **kwargs), args, kwargs)

    return wrapper


def _functional_wrapper(observer: CommObserver, spec: OpSpec, tracing, original):
    """A functional collective: issued here, completed at the wait for its result. Not while torch traces it (compile,
    fake tensors): nothing of ours goes into a graph."""
    observed = _collective_wrapper(observer, spec, original, CommObserver.functional_returned.__wrapped__)

    def wrapper(*args, **kwargs):
        return original(*args, **kwargs) if tracing() else observed(*args, **kwargs)

    return wrapper


def _wait_tensor_wrapper(observer: CommObserver, tracing, original):
    def wrapper(tensor, *args, **kwargs):
        result = original(tensor, *args, **kwargs)
        if observer._pending_tensors and not tracing():  # a fake tensor has no storage to read
            observer.tensor_waited(tensor)
        return result

    return wrapper


def _wait_wrapper(observer: CommObserver, original):
    def wrapper(self, *args, **kwargs):
        try:
            result = original(self, *args, **kwargs)
        except BaseException as error:
            if observer._pending_async or observer._polled:
                observer.wait_failed(self, error)
            raise
        if observer._pending_async:
            observer.waited(self)
        return result

    return wrapper


def _is_completed_wrapper(observer: CommObserver, original):
    def wrapper(self, *args, **kwargs):
        done = original(self, *args, **kwargs)
        if done and observer._pending_async:
            observer.polled(self)
        return done

    return wrapper


def _get_future_wrapper(observer: CommObserver, original):
    def wrapper(self, *args, **kwargs):
        future = original(self, *args, **kwargs)
        if observer._pending_async and self in observer._pending_async:
            # Run where the future completes (a backend's thread, or here if it has): on CUDA, on streams that wait
            # for the collective, so the end event recorded there lies after it.
            future.add_done_callback(functools.partial(_future_done, observer, self))
        return future

    return wrapper


def _future_done(observer: CommObserver, work, future) -> None:
    try:
        future.value()  # raises what the collective raised; the value is not kept
    except Exception as error:  # noqa: BLE001 - the collective's own error, which the future's waiter sees
        observer.future_done(work, error)
        return
    observer.future_done(work, None)


class CommInstrumentor(BaseInstrumentor):
    """Every collective of ``deepspeed.comm`` and ``torch.distributed``, observed once.

    ``OTEL_PYTHON_DEEPSPEED_COMM``: ``spans`` (default) records spans, up to
    ``OTEL_PYTHON_DEEPSPEED_COMM_SPAN_LIMIT`` per step, and metrics; ``metrics`` only metrics and
    per-phase counts; ``off`` nothing.
    """

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments_torch

    def _instrument(self, **kwargs):
        mode = env.comm_mode()
        self._patches = Patches()
        if mode == "off":
            return
        meter = get_meter(semconv.COMM_SCOPE_NAME, __version__, kwargs.get("meter_provider"))
        observer = CommObserver(meter, spans=mode == "spans")
        # Providers handed to instrument() record even when the API's globals have no SDK behind them.
        observer.explicit = kwargs.get("tracer_provider") is not None or kwargs.get("meter_provider") is not None
        # The SDK starts with the first engine, after the engine's own start-up broadcasts: their
        # durations went nowhere, so their bytes must not count either (bandwidth = bytes / time).
        session.on_start(lambda _identity: observer.restart_totals())
        session.leave_if_silent(self, kwargs)
        self._observer = observer
        patches = self._patches

        def wrap_ops(module, names, package: str) -> None:
            for name in names:
                function = getattr(module, name, None)
                if function is not None:
                    spec = OpSpec.of(name, function)
                    patches.wrap(module, name, functools.partial(_collective_wrapper, observer, spec))
            # One scan of the package's modules for the copies of every wrapped op, not one per op.
            patches.rebind(_loaded(package))

        waits_lock = threading.Lock()

        def follow_waits(c10d):
            with waits_lock:  # two threads' first async collectives must not stack two wrappers
                if patches.active:
                    # A handle completes at its wait(), at the first is_completed() that says so, or when its future
                    # does (a DDP communication hook hands the future to the reducer, which waits for it in C++).
                    patches.wrap(c10d.Work, "wait", functools.partial(_wait_wrapper, observer))
                    patches.wrap(c10d.Work, "is_completed", functools.partial(_is_completed_wrapper, observer))
                    patches.wrap(c10d.Work, "get_future", functools.partial(_get_future_wrapper, observer))
                observer.follow_waits = None

        def patch_torch(c10d):
            if patches.active:
                patches.wrap(c10d, "_coalescing_manager", functools.partial(_coalescing_wrapper, observer))
                wrap_ops(c10d, TORCH_OPS, "torch.distributed")
                observer.follow_waits = lambda: follow_waits(c10d)

        def patch_deepspeed(comm):
            if patches.active:
                wrap_ops(comm, DEEPSPEED_OPS, "deepspeed")
                _rebind_cached_backend_functions(comm, patches)

        def rebind_late_imports(_module):
            # Modules of deepspeed imported while deepspeed.comm was loading hold the originals.
            if patches.active:
                patches.rebind(_loaded("deepspeed"))

        def patch_functional(funcol):
            if patches.active:
                # funcol's own test (compile, fake tensors, proxies); torch.compiler's where it has none
                tracing = getattr(funcol, "_are_we_tracing", None) or sys.modules["torch"].compiler.is_compiling
                for name in FUNCTIONAL_OPS:
                    function = getattr(funcol, name, None)
                    if function is not None:
                        spec = OpSpec.of_functional(name, function)
                        patches.wrap(funcol, name, functools.partial(_functional_wrapper, observer, spec, tracing))
                patches.wrap(funcol, "wait_tensor", functools.partial(_wait_tensor_wrapper, observer, tracing))
                patches.rebind(_loaded("torch.distributed"))

        when_imported("torch.distributed.distributed_c10d", patch_torch)
        when_imported("torch.distributed._functional_collectives", patch_functional)
        when_imported("deepspeed.comm.comm", patch_deepspeed)
        when_imported("deepspeed", rebind_late_imports)

    def _uninstrument(self, **kwargs):
        self._patches.restore(_loaded("torch.distributed") + _loaded("deepspeed"))
        cuda_graphs.leave("comm")
        observer = getattr(self, "_observer", None)
        if observer is not None:  # copies of the ops bound after patching, which restore() cannot see, pass calls on
            observer.broken = True


def _process_group(group):
    """The process group a functional collective's ``group`` names: a device mesh (and a dimension), a group's name, a
    list of ranks."""
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed import distributed_c10d

    # A list of ranks is resolved as torch resolves it, without its deprecation warning (torch's own call warns the
    # user). Not by silencing it: leaving catch_warnings() resets what every once-only warning of the process has
    # shown, and this runs at each functional collective (FSDP2's clip_grad_norm_): they repeated at every step.
    resolved = (distributed_c10d._resolve_group_name_by_ranks_and_tag(group, "") if isinstance(group, list)
                else funcol._resolve_group(group))
    return distributed_c10d._resolve_process_group(resolved) if isinstance(resolved, str) else resolved


def _loaded(prefix: str) -> list:
    return [module for name, module in list(sys.modules.items())
            if module is not None and (name == prefix or name.startswith(prefix + "."))]


def _rebind_cached_backend_functions(comm, patches: Patches) -> None:
    """TorchBackend keeps ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` from its construction."""
    backend = getattr(comm, "cdb", None)
    if backend is not None:
        patches.rebind([backend], attributes=("all_gather_function", "reduce_scatter_function"))
