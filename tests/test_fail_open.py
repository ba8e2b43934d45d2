"""Fail-open guards: a raising method turns its component off once; hot guards are positional."""

from __future__ import annotations

import ast
import inspect
import logging
from pathlib import Path

import pytest

import opentelemetry_instrumentation_deepspeed as package
from opentelemetry_instrumentation_deepspeed.runtime.safety import Component, fail_open


class Piece(Component):
    def __init__(self):
        super().__init__("test piece")
        self.calls = 0

    @fail_open
    def required(self, value):
        self.calls += 1
        if value == "raise":
            raise ValueError("bug")
        return value

    @fail_open
    def optional(self, value, scale=2):
        return value * scale


def test_a_raising_method_is_logged_once_and_turns_every_guard_off(caplog):
    piece = Piece()
    assert piece.required(3) == 3 and piece.optional(2, scale=5) == 10
    with caplog.at_level(logging.ERROR):
        assert piece.required("raise") is None
        assert piece.required("raise") is None
    assert piece.broken and piece.calls == 2
    assert piece.required(4) is None and piece.optional(1) is None and piece.calls == 2
    assert sum("test piece failed in Piece.required" in record.getMessage() for record in caplog.records) == 1


def test_a_guard_keeps_the_methods_name_and_signature():
    assert Piece.required.__name__ == "required"
    assert list(inspect.signature(Piece.optional).parameters) == ["self", "value", "scale"]


def test_positional_guards_are_never_called_with_keywords():
    """A keyword argument to a positionally guarded method would raise at the call, in the training job."""
    sources = [(path, ast.parse(path.read_text())) for path in Path(package.__file__).parent.rglob("*.py")]
    positional = set()
    for _path, tree in sources:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(
                    getattr(decorator, "id", None) == "fail_open" for decorator in node.decorator_list):
                arguments = node.args
                if not (arguments.defaults or arguments.kwonlyargs or arguments.vararg or arguments.kwarg):
                    positional.add(node.name)
    assert {"data_waited", "phase_ended", "issued", "completed", "optimizer_step_ended"} <= positional
    offenders = [f"{path.name}:{node.lineno} {node.func.attr}"
                 for path, tree in sources for node in ast.walk(tree)
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                 and node.func.attr in positional and node.keywords]
    assert offenders == []


def test_a_positional_guard_fails_open_on_a_wrong_count_but_not_on_a_keyword():
    piece = Piece()
    assert piece.required(1, 2) is None and piece.broken  # inside the guard: caught, the piece turns off
    # What the scan above prevents: a keyword fails at the call itself, outside the guard.
    with pytest.raises(TypeError):
        Piece().required(value=1)
