"""Replacing functions in place, and putting the originals back (instrumentors/patching.py)."""

from __future__ import annotations

import functools
import inspect
import types
from unittest import mock

import pytest
import wrapt

from opentelemetry_instrumentation_deepspeed.instrumentors.patching import (
    Patches,
    original_of,
    unwrap_methods,
    wrap_methods,
)


def _counting(calls: list):
    def factory(original):
        def wrapper(self, *args, **kwargs):
            calls.append(args)
            return original(self, *args, **kwargs)

        return wrapper

    return factory


class Base:
    def step(self, value: int, *, scale: float = 1.0) -> float:
        """Steps."""
        return value * scale


class Loader:
    def __init__(self):
        self.items = iter([1, 2])

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.items)


def test_a_method_is_replaced_by_a_plain_function_that_looks_like_it():
    class Engine(Base):
        def step(self, value: int, *, scale: float = 1.0) -> float:
            """Steps."""
            return value * scale * 2

    original, calls = Engine.step, []
    wrap_methods(Engine, {"step": _counting(calls)})
    replaced = vars(Engine)["step"]
    assert type(replaced) is types.FunctionType, "no proxy between the caller and the wrapper"
    assert original_of(replaced) is original and replaced.__wrapped__ is original
    assert (replaced.__name__, replaced.__qualname__, replaced.__doc__) == ("step", original.__qualname__, "Steps.")
    assert inspect.signature(Engine.step) == inspect.signature(original)
    assert Engine().step(3, scale=0.5) == 3.0 and calls == [(3,)]

    wrap_methods(Engine, {"step": _counting(calls)})  # a second instrument() does not stack
    assert original_of(vars(Engine)["step"]) is original
    Engine().step(1)
    assert len(calls) == 2

    unwrap_methods(Engine, ["step"])
    assert vars(Engine)["step"] is original
    unwrap_methods(Engine, ["step"])  # not ours any more: left alone
    assert vars(Engine)["step"] is original


def test_an_inherited_method_is_inherited_again_once_restored():
    class Engine(Base):
        pass

    calls = []
    wrap_methods(Engine, {"step": _counting(calls), "missing": _counting(calls)})
    assert original_of(vars(Engine)["step"]) is Base.step and "missing" not in vars(Engine)
    assert Engine().step(2) == 2 and Base().step(2) == 2 and calls == [(2,)], "the base class is untouched"
    unwrap_methods(Engine, ["step"])
    assert "step" not in vars(Engine) and Engine.step is Base.step

    class Copied(Base):
        step = Base.step  # its own entry, the base class's function: restored as its own

    wrap_methods(Copied, {"step": _counting(calls)})
    unwrap_methods(Copied, ["step"])
    assert vars(Copied)["step"] is Base.step


def test_what_does_not_bind_its_instance_is_left_alone():
    class Callable:
        def __call__(self, value):
            return value

    class Engine:
        helper = staticmethod(lambda value: value)
        build = classmethod(lambda cls, value: value)
        hook = Callable()  # called without the engine: a replacement function would pass it on
        mocked = mock.MagicMock(return_value=3)

    calls, names = [], ("helper", "build", "hook", "mocked")
    before = {name: vars(Engine)[name] for name in names}
    wrap_methods(Engine, dict.fromkeys(names, _counting(calls)))
    assert all(vars(Engine)[name] is before[name] for name in names)
    assert Engine().helper(1) == 1 and Engine.build(2) == 2 and Engine().hook(3) == 3 and Engine().mocked() == 3
    assert calls == []


def test_another_librarys_wrappers_are_kept():
    class Engine(Base):
        def step(self, value: int, *, scale: float = 1.0) -> float:
            return value * scale

    original, calls = Engine.step, []
    wrapt.wrap_function_wrapper(Engine, "step", lambda wrapped, _instance, args, kwargs: wrapped(*args, **kwargs) + 1)
    proxy = vars(Engine)["step"]
    wrap_methods(Engine, {"step": _counting(calls)})  # over the proxy, not through it
    assert original_of(vars(Engine)["step"]) is proxy and Engine().step(1) == 2 and calls == [(1,)]

    ours = vars(Engine)["step"]

    @functools.wraps(ours)  # copies our marker along with the rest of the replacement's __dict__
    def theirs(self, *args, **kwargs):
        return ours(self, *args, **kwargs) * 10

    Engine.step = theirs
    assert original_of(theirs) is None, "a function that wraps a replacement is not one"
    unwrap_methods(Engine, ["step"])
    assert vars(Engine)["step"] is theirs, "not ours to take away"
    Engine.step = ours
    unwrap_methods(Engine, ["step"])
    assert vars(Engine)["step"] is proxy and proxy.__wrapped__ is original


def test_a_replaced_dunder_is_what_next_calls():
    class Iterator(Loader):
        pass

    calls = []

    def factory(original):
        def __next__(self):
            calls.append(self)
            return original(self)

        return __next__

    wrap_methods(Iterator, {"__next__": factory})
    loader = Iterator()
    assert list(loader) == [1, 2] and len(calls) == 3, "two items and the StopIteration"
    unwrap_methods(Iterator, ["__next__"])
    assert list(Iterator()) == [1, 2] and len(calls) == 3


def test_patches_follow_copies_bound_elsewhere_and_put_everything_back():
    def all_reduce(tensor, group=None):
        return ("reduced", tensor, group)

    home, copy, other = (types.ModuleType(name) for name in ("home", "copy", "other"))
    home.all_reduce = copy.all_reduce = all_reduce
    other.all_reduce = lambda tensor: tensor  # another function of the same name: not ours to replace
    seen = []

    def factory(original):
        def wrapper(*args, **kwargs):
            seen.append(args)
            return original(*args, **kwargs)

        return wrapper

    patches = Patches()
    patches.wrap(home, "all_reduce", factory)
    patches.wrap(home, "all_reduce", factory)  # once
    patches.rebind([copy, other])
    assert copy.all_reduce is home.all_reduce and original_of(home.all_reduce) is all_reduce
    assert copy.all_reduce(1, group=2) == ("reduced", 1, 2) and seen == [(1,)]
    assert original_of(other.all_reduce) is None

    patches.restore()
    assert home.all_reduce is all_reduce and copy.all_reduce is all_reduce and not patches.active


def test_a_second_instrument_takes_over_the_copies_the_first_left_behind():
    """A copy bound while instrumented (TorchBackend's cached all_gather_function) keeps the first replacement after
    restore(); instrumenting again must put the new replacement there, or its calls reach a disabled observer."""
    def all_gather(tensor):
        return tensor

    home, late = types.ModuleType("home"), types.ModuleType("late")
    home.all_gather = all_gather
    seen = []

    def factory(tag):
        def make(original):
            def wrapper(*args):
                seen.append(tag)
                return original(*args)

            return wrapper

        return make

    first = Patches()
    first.wrap(home, "all_gather", factory("first"))
    late.all_gather = home.all_gather  # bound while instrumented
    first.restore()
    assert home.all_gather is all_gather and original_of(late.all_gather) is all_gather

    second = Patches()
    second.wrap(home, "all_gather", factory("second"))
    second.rebind([late])
    assert late.all_gather is home.all_gather and late.all_gather(1) == 1 and seen == ["second"]
    second.restore()
    assert late.all_gather is all_gather, "restored to the original, not to the first replacement"


def test_a_patch_that_fails_leaves_the_users_import_going_on(tmp_path, monkeypatch, caplog):
    """A patch runs inside the user's import (of torch, which imports DDP's module itself): its failure must not
    fail that import."""
    import sys

    from opentelemetry_instrumentation_deepspeed.instrumentors.patching import when_imported

    (tmp_path / "a_module_of_theirs.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def failing_patch(_module):
        raise AttributeError("partially initialized module 'torch' has no attribute 'compiler'")

    when_imported("a_module_of_theirs", failing_patch)
    try:
        import a_module_of_theirs
    finally:
        sys.modules.pop("a_module_of_theirs", None)
    assert a_module_of_theirs.VALUE == 7
    assert "could not instrument a_module_of_theirs" in caplog.text


@pytest.mark.slow  # importing torch._dynamo takes 5 s
def test_torch_compile_skips_our_bookkeeping_and_traces_the_wrappers_that_step_aside():
    """torch.compile(engine) traced our engine wrapper's clocks and thread ids, warned of each builtin there and broke
    its graph at them. Skipped, that code runs outside the graph as plain Python; the collectives' and a plain loop's
    wrappers, which step aside while torch traces them, stay traceable (a fullgraph=True graph holds them)."""
    from torch._dynamo import trace_rules

    from opentelemetry_instrumentation_deepspeed.export import emitter
    from opentelemetry_instrumentation_deepspeed.instrumentors import comm, engine, torch_loop
    from opentelemetry_instrumentation_deepspeed.instrumentors.patching import keep_out_of_compiled_graphs
    from opentelemetry_instrumentation_deepspeed.recording import recorder
    from opentelemetry_instrumentation_deepspeed.runtime import session

    keep_out_of_compiled_graphs()
    assert all(trace_rules.check_file(module.__file__).skipped for module in (engine, recorder, emitter, session))
    assert not any(trace_rules.check_file(module.__file__).skipped for module in (comm, torch_loop))
