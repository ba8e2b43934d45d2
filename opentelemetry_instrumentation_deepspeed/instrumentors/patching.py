"""Patch classes when their module is imported, not before: importing DeepSpeed takes seconds.

A wrapper factory takes the original function and returns the plain function put in its place,
which calls the original itself; ``restore`` puts the original back. Not wrapt's proxies: inside
real ZeRO-2 steps, a proxy's dispatch (the bound proxy made at each lookup, the C call into the
wrapper, the wrapper's ``wrapped(*args, **kwargs)``) costs 3 to 4 us per call more than a plain
function, 35-39 us per step over the ten calls a step makes through them (``benchmarks/dispatch.py``;
``benchmarks/README.md``, 2026-12-06, third sitting). wrapt still tells when a module is imported.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import types
from collections.abc import Callable, Iterable

import wrapt

_logger = logging.getLogger(__name__)
# What a replacement carries: the function it replaced. Not __wrapped__ alone, which DeepSpeed's own decorators set
# too; and where a library's functools.wraps around a replacement copies it, its __wrapped__ is the replacement.
_ORIGINAL = "_opentelemetry_original"
_INHERITED = "_opentelemetry_inherited"  # the class had no method of its own by that name: restoring deletes it


def when_imported(module_name: str, patch: Callable[[object], None]) -> None:
    """``patch(module)`` now if it is imported, else as soon as it is. A patch that fails leaves its module as it is:
    the user's import (it may run inside torch's own) goes on."""
    def guarded(module) -> None:
        try:
            patch(module)
        except Exception:
            _logger.exception("opentelemetry-instrumentation-deepspeed could not instrument %s; training is not "
                              "affected", module_name)

    module = sys.modules.get(module_name)
    if module is not None:
        guarded(module)
    else:
        wrapt.register_post_import_hook(guarded, module_name)


# What torch.compile must not trace: the bookkeeping our wrappers do around a call (clocks, thread ids, records) is
# not traceable. Traced, torch.compile(engine) warned of each builtin it met there and broke its graph at them anyway;
# skipped, that code runs as plain Python outside the graph, and dynamo compiles the wrapped call itself, as it would
# without us (the same warnings as an uninstrumented run). The wrappers that step aside while torch traces them stay
# traceable, so that a graph torch.compile(fullgraph=True) lets nothing break holds them: the collectives'
# (instrumentors.comm: a functional collective) and a plain loop's (instrumentors.torch_loop: a module's hooks).
_NOT_TRACED = ("recording", "export", "runtime", "instrumentors.engine", "instrumentors.dataloader",
               "instrumentors.pipeline")
_kept_out = False


def keep_out_of_compiled_graphs() -> None:
    """Once dynamo's rules are loaded (by torch.compile, or before), our modules above are among the files it skips."""
    global _kept_out  # noqa: PLW0603 - once per process
    if not _kept_out:
        _kept_out = True
        when_imported("torch._dynamo.trace_rules", _skip_ours)


def _skip_ours(trace_rules) -> None:
    add = getattr(trace_rules, "add", None)  # torch 2.x's; another torch traces them as before
    if add is not None:
        package = __name__.rpartition(".instrumentors.")[0]
        for name in _NOT_TRACED:
            add(f"{package}.{name}")


def original_of(value):
    """The function ``value`` replaced, if it is one of our replacements (not through another library's proxy
    around one); else None."""
    if type(value) is not types.FunctionType:
        return None
    original = vars(value).get(_ORIGINAL)
    return original if original is not None and vars(value).get("__wrapped__") is original else None


def _binds(value) -> bool:
    """A class attribute that passes its instance on as the first argument, as a replacement function does: a
    function, or a method of a compiled class. Anything else (a static method, a callable object) is left alone."""
    return callable(value) and hasattr(type(value), "__get__") and not isinstance(value, (staticmethod, classmethod))


def replacement(original, factory: Callable):
    """``factory(original)``, named as ``original``: ``inspect.signature`` follows its ``__wrapped__``."""
    function = factory(original)
    functools.update_wrapper(function, original)
    setattr(function, _ORIGINAL, original)
    return function


def _install(owner, name: str, original, factory: Callable):
    """``owner.name = replacement(original, factory)``, unless ``original`` is one of ours (a second
    ``instrument()``, a late import hook: replacements do not stack) or a class attribute that does not bind its
    instance. The replacement, or None."""
    if original_of(original) is not None:
        return None
    if isinstance(owner, type) and not _binds(original):
        _logger.debug("%s.%s is not a method; not instrumented", owner.__qualname__, name)
        return None
    function = replacement(original, factory)
    if isinstance(owner, type) and name not in vars(owner):
        setattr(function, _INHERITED, True)
    setattr(owner, name, function)
    return function


def wrap_methods(owner: type, factories: dict[str, Callable]) -> None:
    """Replace each method once, its own or inherited."""
    for name, factory in factories.items():
        current = inspect.getattr_static(owner, name, None)
        if current is None:
            _logger.debug("%s.%s not found; not instrumented", owner.__qualname__, name)
        else:
            _install(owner, name, current, factory)


def unwrap_methods(owner: type | None, names: Iterable[str]) -> None:
    if owner is None:
        return
    for name in names:
        current = vars(owner).get(name)
        original = original_of(current)
        if original is None:
            continue
        # One step, so that another thread calling the method meanwhile finds the replacement or the original, never
        # the base class's (an inherited method is inherited again, its base class's function being the original).
        if vars(current).get(_INHERITED):
            delattr(owner, name)
        else:
            setattr(owner, name, original)


class Patches:
    """Replacements that also take the place of the copies of a function bound under other names.

    ``from x import f`` and ``__all__`` re-exports keep the original function object; a replacement
    only at its home misses those callers. ``restore()`` puts every original back.
    """

    def __init__(self):
        self.active = True
        self._replacements: dict[int, tuple[object, object]] = {}  # id(original) -> (original, replacement)
        self._applied: list[tuple[object, str, object]] = []

    def wrap(self, owner, name: str, factory: Callable) -> None:
        original = vars(owner).get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if original is None or id(original) in self._replacements:
            return
        function = _install(owner, name, original, factory)
        if function is not None:
            self._replacements[id(original)] = (original, function)
            self._applied.append((owner, name, original))

    def rebind(self, objects: Iterable, attributes: Iterable[str] | None = None) -> None:
        for target in objects:
            namespace = getattr(target, "__dict__", None)
            if namespace is None:
                continue
            names = list(namespace) if attributes is None else [name for name in attributes if name in namespace]
            for name in names:
                value = namespace.get(name)
                # A copy of an earlier instrument()'s replacement, bound where restore() could not see it (a module
                # or object that took it while instrumented), passes calls to its disabled observer: it is replaced
                # too, and restored to the original.
                original = original_of(value) or value
                entry = self._replacements.get(id(original))
                if entry is not None and entry[0] is original and value is not entry[1]:
                    setattr(target, name, entry[1])
                    self._applied.append((target, name, original))

    def restore(self, objects: Iterable = ()) -> None:
        """Every original back, also where ``objects`` took a replacement after it was made (torch.distributed's
        ``from .distributed_c10d import *`` runs after the patch of c10d)."""
        self.active = False
        replacements = {id(entry[1]): entry[0] for entry in self._replacements.values()}
        for target in objects:
            namespace = getattr(target, "__dict__", None) or {}
            for name, value in list(namespace.items()):
                original = replacements.get(id(value))
                if original is not None and original_of(value) is original:
                    setattr(target, name, original)
        for owner, name, original in reversed(self._applied):
            setattr(owner, name, original)
        self._applied.clear()
        self._replacements.clear()
