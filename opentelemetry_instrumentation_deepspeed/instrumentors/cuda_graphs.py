"""CUDA graph captures, counted: while one runs, no thread of ours asks the device anything.

torch's ``torch.cuda.graph`` (DeepSpeed's hybrid engine and inference engine, ``make_graphed_callables``, a loop's
own) captures in its "global" mode by default: an event or stream query from any other thread meanwhile is refused
and invalidates the graph being captured. Every capture goes through ``CUDAGraph.capture_begin`` and
``capture_end``; ``recording.gpu_timing.Captures`` counts those under way.
"""

from __future__ import annotations

import sys

from opentelemetry_instrumentation_deepspeed.instrumentors.patching import unwrap_methods, wrap_methods
from opentelemetry_instrumentation_deepspeed.recording.gpu_timing import Captures

_MODULE = "torch.cuda.graphs"
_METHODS = ("capture_begin", "capture_end")


def _capture_begin(begin):
    def wrapper(self, *args, **kwargs):
        with Captures.lock:  # after any query under way
            Captures.running += 1
        try:
            return begin(self, *args, **kwargs)
        except BaseException:
            _ended()
            raise

    return wrapper


def _capture_end(end):
    def wrapper(self, *args, **kwargs):
        try:
            return end(self, *args, **kwargs)
        finally:
            _ended()

    return wrapper


def _ended() -> None:
    with Captures.lock:
        Captures.running = max(0, Captures.running - 1)


_followers: set[str] = set()  # the instrumentors whose GPU timelines need the count


def follow(follower: str, module=None) -> None:
    """Count the captures of ``module``'s ``CUDAGraph`` (torch's) for ``follower``, once its GPU timeline starts."""
    graphs = module or sys.modules.get(_MODULE)
    graph = getattr(graphs, "CUDAGraph", None)
    if graph is not None:
        _followers.add(follower)
        wrap_methods(graph, {"capture_begin": _capture_begin, "capture_end": _capture_end})


def leave(follower: str, module=None) -> None:
    """``follower`` no longer needs the count; the last to leave puts the originals back (the count at 0: a capture
    under way then would otherwise hold it above for good)."""
    _followers.discard(follower)
    if _followers:
        return
    unwrap_methods(getattr(module or sys.modules.get(_MODULE), "CUDAGraph", None), _METHODS)
    with Captures.lock:
        Captures.running = 0
