"""Data loading: the time the training loop is blocked on its next batch.

Every ``torch.utils.data.DataLoader`` iterator (single- and multi-process) and DeepSpeed's
own loaders (``DeepSpeedDataLoader``, ``RepeatingLoader``), which wrap one. Only the outermost
``__next__`` on a thread is timed, so a DeepSpeed loader around a DataLoader counts once.
A ``next()`` that ends the iteration (``StopIteration``) is the end of an epoch, not a wait.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Collection

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from opentelemetry_instrumentation_deepspeed import trackers
from opentelemetry_instrumentation_deepspeed.package import _instruments_torch
from opentelemetry_instrumentation_deepspeed.patching import unwrap_methods, when_imported, wrap_methods

_TARGETS = (
    ("torch.utils.data.dataloader", "_BaseDataLoaderIter"),
    ("deepspeed.runtime.dataloader", "DeepSpeedDataLoader"),
    ("deepspeed.runtime.dataloader", "RepeatingLoader"),
)

_nesting = threading.local()


def _next(wrapped, instance, args, kwargs):
    tracker = trackers.active()
    if tracker is None or getattr(_nesting, "inside", False):
        return wrapped(*args, **kwargs)
    _nesting.inside = True
    start = time.time_ns()
    try:
        batch = wrapped(*args, **kwargs)
    finally:
        _nesting.inside = False
    tracker.data_waited(start, time.time_ns())
    return batch


class DataLoaderInstrumentor(BaseInstrumentor):
    """Records ``training.data.wait`` spans into the step of the engine that trains."""

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments_torch

    def _instrument(self, **kwargs):
        self._patching = True
        for module_name, class_name in _TARGETS:
            def patch(module, class_name=class_name):
                if self._patching:
                    wrap_methods(getattr(module, class_name), {"__next__": _next})

            when_imported(module_name, patch)

    def _uninstrument(self, **kwargs):
        self._patching = False
        for module_name, class_name in _TARGETS:
            unwrap_methods(getattr(sys.modules.get(module_name), class_name, None), ["__next__"])
