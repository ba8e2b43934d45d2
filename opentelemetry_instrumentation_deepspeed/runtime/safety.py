"""Fail-open: a bug in this instrumentation never reaches the training job.

An exception inside a guarded piece is logged once, with its traceback and versions,
and that piece turns itself off for the rest of the process instead of failing again
every step.
"""

from __future__ import annotations

import functools
import inspect
import logging

_logger = logging.getLogger("opentelemetry_instrumentation_deepspeed")


class Component:
    """A piece of instrumentation that can be switched off by its own failure."""

    def __init__(self, name: str):
        self.name = name
        self.broken = False

    def fail(self, where: str) -> None:
        """Call from an ``except`` block: logs the current exception once and disables the component."""
        if self.broken:
            return
        self.broken = True
        from opentelemetry_instrumentation_deepspeed.version import __version__

        _logger.exception(
            "opentelemetry-instrumentation-deepspeed %s: %s failed in %s and is disabled for the rest of "
            "this process; training is not affected. Please report this traceback.",
            __version__, self.name, where,
        )


def fail_open(method):
    """Guard a method of a ``Component``: once it raised, every guarded method is a no-op returning None.

    A method whose parameters are all required is guarded positionally, and must be called so: on
    the training thread a ``**kwargs`` wrapper costs a dict per call, three times the call itself.
    The hottest callers (the engine, DataLoader and collective wrappers) do without the guard's frame:
    they call ``method.__wrapped__`` inside a ``try`` of their own, with the same ``broken`` check and
    the same ``fail(method.__qualname__)``.
    """
    optional = any(parameter.default is not parameter.empty or parameter.kind is not parameter.POSITIONAL_OR_KEYWORD
                   for parameter in inspect.signature(method).parameters.values())
    if optional:
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            if self.broken:
                return None
            try:
                return method(self, *args, **kwargs)
            except Exception:  # noqa: BLE001 - the point is to catch everything ours raises
                self.fail(method.__qualname__)
                return None
    else:
        @functools.wraps(method)
        def guarded(self, *args):
            if self.broken:
                return None
            try:
                return method(self, *args)
            except Exception:  # noqa: BLE001
                self.fail(method.__qualname__)
                return None

    return guarded


def observing(component: Component, callback):
    """An observable instrument's callback, fail-open: once it raised, it reports nothing.

    The SDK logs a failing callback's traceback at every collection; this logs it once and
    turns ``component`` off. It returns ``[]``, not None, which the SDK would not accept.
    """

    @functools.wraps(callback)
    def observe(options):
        if component.broken:
            return []
        try:
            return callback(options)
        except Exception:  # noqa: BLE001 - the point is to catch everything ours raises
            component.fail(getattr(callback, "__qualname__", repr(callback)))
            return []

    return observe
