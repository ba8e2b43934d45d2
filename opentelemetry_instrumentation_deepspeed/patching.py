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
