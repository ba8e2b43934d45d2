"""Patch classes when their module is imported, not before: importing DeepSpeed takes seconds."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable

import wrapt
from opentelemetry.instrumentation.utils import unwrap

_logger = logging.getLogger(__name__)
_PROXY = getattr(wrapt, "BaseObjectProxy", wrapt.ObjectProxy)


def when_imported(module_name: str, patch: Callable[[object], None]) -> None:
    module = sys.modules.get(module_name)
    if module is not None:
        patch(module)
    else:
        wrapt.register_post_import_hook(patch, module_name)


def wrap_methods(owner: type, wrappers: dict[str, Callable]) -> None:
    """Wrap each method once; a second ``instrument()`` (or a late import hook) does not stack wrappers."""
    for name, wrapper in wrappers.items():
        current = getattr(owner, name, None)
        if current is None:
            _logger.debug("%s.%s not found; not instrumented", owner.__qualname__, name)
            continue
        if isinstance(current, _PROXY):
            continue
        wrapt.wrap_function_wrapper(owner, name, wrapper)


def unwrap_methods(owner: type | None, names: Iterable[str]) -> None:
    if owner is None:
        return
    for name in names:
        unwrap(owner, name)


class Patches:
    """Function wrappers that also replace the copies of a function bound under other names.

    ``from x import f`` and ``__all__`` re-exports keep the original function object; a wrapper
    only at its home misses those callers. ``restore()`` puts every original back.
    """

    def __init__(self):
        self.active = True
        self._proxies: dict[int, tuple[object, object]] = {}  # id(original) -> (original, proxy)
        self._applied: list[tuple[object, str, object]] = []

    def wrap(self, owner, name: str, wrapper) -> None:
        original = vars(owner).get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if original is None or isinstance(original, _PROXY) or id(original) in self._proxies:
            return
        wrapt.wrap_function_wrapper(owner, name, wrapper)
        self._proxies[id(original)] = (original, vars(owner)[name] if isinstance(owner, type) else getattr(owner, name))
        self._applied.append((owner, name, original))

    def rebind(self, objects: Iterable, attributes: Iterable[str] | None = None) -> None:
        for target in objects:
            namespace = getattr(target, "__dict__", None)
            if namespace is None:
                continue
            names = list(namespace) if attributes is None else [name for name in attributes if name in namespace]
            for name in names:
                value = namespace.get(name)
                entry = self._proxies.get(id(value))
                if entry is not None and entry[0] is value:
                    setattr(target, name, entry[1])
                    self._applied.append((target, name, value))

    def restore(self) -> None:
        self.active = False
        for owner, name, original in reversed(self._applied):
            setattr(owner, name, original)
        self._applied.clear()
        self._proxies.clear()
