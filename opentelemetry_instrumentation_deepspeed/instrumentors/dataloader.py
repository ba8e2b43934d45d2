"""Data loading: the time the training loop is blocked on its next batch.

Every ``torch.utils.data.DataLoader`` iterator (single- and multi-process) and DeepSpeed's
own loaders (``DeepSpeedDataLoader``, ``RepeatingLoader``), which wrap one, and Accelerate's
(``DataLoaderShard``, ``DataLoaderDispatcher``, ``SkipDataLoader``), whose ``__iter__`` is a
generator: the iterator it returns is timed. Only the outermost ``__next__`` on a thread is timed,
so a loader around a DataLoader counts once, and one wait is one batch handed to the loop: the
batch Accelerate fetches ahead, or the batches rank 0 fetches to dispatch, are inside it.
A ``next()`` that ends the iteration (``StopIteration``) is the end of an epoch, not a wait, and
one made on another thread than the training thread (a background prefetcher's) is not the loop's.
One that raises anything else ends the step it fetched for with that error (opened for it, where
none was open).
Where an iterator ends with fetches no forward took, and the next fetch comes first, those fed an
evaluation loop through the bare module (which no wrapper sees): they are no step's.

Once training starts, the CPU and memory of the rank's child processes (its DataLoader workers,
and any other child) are observed at collection, summed: ``training.data.workers.*``.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Collection

import wrapt
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.metrics import Observation, get_meter

from opentelemetry_instrumentation_deepspeed import semconv
from opentelemetry_instrumentation_deepspeed.instrumentors.patching import unwrap_methods, when_imported, wrap_methods
from opentelemetry_instrumentation_deepspeed.package import _instruments_torch
from opentelemetry_instrumentation_deepspeed.recording import inputs, registry
from opentelemetry_instrumentation_deepspeed.recording.recorder import StepRecorder
from opentelemetry_instrumentation_deepspeed.runtime import session
from opentelemetry_instrumentation_deepspeed.runtime.safety import Component, observing
from opentelemetry_instrumentation_deepspeed.version import __version__

_TARGETS = (
    ("torch.utils.data.dataloader", "_BaseDataLoaderIter"),
    ("deepspeed.runtime.dataloader", "DeepSpeedDataLoader"),
    ("deepspeed.runtime.dataloader", "RepeatingLoader"),
)

# Loaders whose __iter__ is a generator: the iterator it returns is timed.
_GENERATORS = (
    ("accelerate.data_loader", "DataLoaderShard"),
    ("accelerate.data_loader", "DataLoaderDispatcher"),
    ("accelerate.data_loader", "SkipDataLoader"),
)

_nesting = threading.local()
_get_ident = threading.get_ident
# data_waited()'s fail-open guard inline in _next: the same check and report, a frame fewer per batch.
_data_waited = StepRecorder.data_waited.__wrapped__


def _next(original):
    def __next__(self):
        # registry.active() inline for one engine: a frame fewer per batch.
        recorder = registry.active() if registry._several else registry._active
        # Another thread's fetch (a background prefetcher's) does not block the loop: the loop's wait, if any, is
        # on that thread's queue, which is not seen.
        if recorder is None or recorder.thread != _get_ident() or getattr(_nesting, "inside", False):
            return original(self)
        _nesting.inside = True
        start = time.time_ns()
        try:
            batch = original(self)
        except StopIteration:
            recorder.ran_out()
            raise
        except BaseException as error:  # the dataset's exception, a worker that died: the step ends with it
            if not recorder.broken:
                recorder.data_failed(start, time.time_ns(), error)
            raise
        finally:
            _nesting.inside = False
        if not recorder.broken:
            try:
                _data_waited(recorder, start, time.time_ns())
            except Exception:  # noqa: BLE001 - ours only: the batch was fetched above
                recorder.fail(_data_waited.__qualname__)
        try:
            inputs.left_loader(recorder, batch)
        except Exception:  # noqa: BLE001 - ours only: the batch was fetched above
            inputs.failed("inputs.left_loader")
        return batch

    return __next__


_generator_next = _next(next)


class _TimedIterator(wrapt.ObjectProxy):
    """A loader's generator whose ``next()`` is a data wait; anything else goes to the generator."""

    def __iter__(self):
        return self

    def __next__(self):
        return _generator_next(self.__wrapped__)


def _iter(original):
    def __iter__(self):
        return _TimedIterator(original(self))

    return __iter__


class WorkerProcesses:
    """The rank's child processes, read from /proc by psutil: never waits on or reaps them."""

    def __init__(self):
        import psutil

        self._psutil = psutil
        self._self = psutil.Process()
        self._known: dict[int, object] = {}  # pid -> psutil.Process, whose CPU deltas it keeps
        self._listed_at = 0.0
        self.active = True

    def _children(self) -> list:
        """The children, listed once per collection (the three instruments share one /proc scan)."""
        if not self.active:
            return []
        now = time.monotonic()
        if now - self._listed_at > 0.5:
            self._listed_at = now
            children = [self._known.get(child.pid, child) for child in self._self.children()]
            self._known = {child.pid: child for child in children}
        return list(self._known.values())

    def count(self, _options):
        return [Observation(len(self._children()))] if self.active else []

    def cpu(self, _options):
        total = 0.0
        for child in self._children():
            try:
                total += child.cpu_percent(None) / 100
            except self._psutil.Error:
                pass
        return [Observation(total)] if self.active else []

    def memory(self, _options):
        total = 0
        for child in self._children():
            try:
                total += child.memory_info().rss
            except self._psutil.Error:
                pass
        return [Observation(total)] if self.active else []

    def register(self, meter) -> None:
        component = Component("DataLoader worker metrics")
        meter.create_observable_up_down_counter(semconv.METRIC_WORKERS, [observing(component, self.count)],
                                                unit="{process}",
                                                description="Child processes of the rank (DataLoader workers)")
        meter.create_observable_gauge(semconv.METRIC_WORKERS_CPU, [observing(component, self.cpu)], unit="1",
                                      description="CPU used by the rank's child processes since the last "
                                                  "collection, in CPUs (1 = one core busy)")
        meter.create_observable_up_down_counter(semconv.METRIC_WORKERS_MEMORY, [observing(component, self.memory)],
                                                unit="By",
                                                description="Resident memory of the rank's child processes")


class DataLoaderInstrumentor(BaseInstrumentor):
    """Records ``training.data.wait`` spans into the step of the engine that trains."""

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments_torch

    def _instrument(self, **kwargs):
        self._patching = True
        meter_provider = kwargs.get("meter_provider")
        # This instrument()'s: one uninstrumented before training started leaves its listener behind.
        generation = self._generation = object()

        def started(_identity):
            if self._patching and self._generation is generation:
                self._workers = WorkerProcesses()
                self._workers.register(get_meter(semconv.SCOPE_NAME, __version__,
                                                 meter_provider))

        session.on_start(started)
        session.leave_if_silent(self, kwargs)
        for module_name, class_name in _TARGETS:
            def patch(module, class_name=class_name):
                if self._patching:
                    wrap_methods(getattr(module, class_name), {"__next__": _next})

            when_imported(module_name, patch)
        for module_name, class_name in _GENERATORS:
            def patch_iter(module, class_name=class_name):
                owner = getattr(module, class_name, None)  # absent from an older or newer Accelerate
                if self._patching and owner is not None:
                    wrap_methods(owner, {"__iter__": _iter})

            when_imported(module_name, patch_iter)

    def _uninstrument(self, **kwargs):
        self._patching = False
        if getattr(self, "_workers", None) is not None:
            self._workers.active = False
        for module_name, class_name in _TARGETS:
            unwrap_methods(getattr(sys.modules.get(module_name), class_name, None), ["__next__"])
        for module_name, class_name in _GENERATORS:
            unwrap_methods(getattr(sys.modules.get(module_name), class_name, None), ["__iter__"])
