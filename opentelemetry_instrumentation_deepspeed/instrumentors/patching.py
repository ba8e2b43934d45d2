"""Patch classes when their module is imported, not before: importing DeepSpeed takes seconds.

A wrapper factory takes the original function and returns the plain function put in its place,
which calls the original itself; ``restore`` puts the original back. Not wrapt's proxies: inside
real ZeRO-2 steps, a proxy's dispatch (the bound proxy made at each lookup, the C call into the
wrapper, the wrapper's ``wrapped(*args, **kwargs)``) costs 3 to 4 us per call where a plain
function costs about 1, some 30 us per step over the ten calls a step makes through them
(``benchmarks/README.md``, 2026-12-06, third sitting). wrapt still tells when a module is imported.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Callable, Iterable

import wrapt

_logger = logging.getLogger(__name__)
# What a replacement carries: the function it replaced. Not __wrapped__, which DeepSpeed's own decorators set too.
_ORIGINAL = "_opentelemetry_original"


def when_imported(module_name: str, patch: Callable[[object], None]) -> None:
    module = sys.modules.get(module_name)
    if module is not None:
        patch(module)
    else:
        wrapt.register_post_import_hook(patch, module_name)


def original_of(value):
    """The function ``value`` replaced, if it is one of our replacements; else None."""
    return getattr(value, _ORIGINAL, None) if callable(value) else None


def replacement(original, factory: Callable):
    """``factory(original)``, named as ``original``: ``inspect.signature`` follows its ``__wrapped__``."""
    function = factory(original)
    functools.update_wrapper(function, original)
    setattr(function, _ORIGINAL, original)
    return function


def wrap_methods(owner: type, factories: dict[str, Callable]) -> None:
    """Replace each method once (its own or inherited); a second ``instrument()`` (or a late import hook) does not
    stack replacements."""
    for name, factory in factories.items():
        current = inspect.getattr_static(owner, name, None)
        if current is None:
            _logger.debug("%s.%s not found; not instrumented", owner.__qualname__, name)
            continue
        if original_of(current) is None:
            setattr(owner, name, replacement(current, factory))


def unwrap_methods(owner: type | None, names: Iterable[str]) -> None:
    if owner is None:
        return
    for name in names:
        original = original_of(vars(owner).get(name))
        if original is not None:
            _put_back(owner, name, original)


def _put_back(owner, name: str, original) -> None:
    """``original`` where ``name`` was replaced: an inherited method is inherited again, not copied down."""
    if isinstance(owner, type):
        delattr(owner, name)
        if inspect.getattr_static(owner, name, None) is original:
            return
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
        if original is None or original_of(original) is not None or id(original) in self._replacements:
            return
        function = replacement(original, factory)
        setattr(owner, name, function)
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
                entry = self._replacements.get(id(value))
                if entry is not None and entry[0] is value:
                    setattr(target, name, entry[1])
                    self._applied.append((target, name, value))

    def restore(self) -> None:
        self.active = False
        for owner, name, original in reversed(self._applied):
            setattr(owner, name, original)
        self._applied.clear()
        self._replacements.clear()
