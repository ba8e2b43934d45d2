"""examples/train.py with bugs planted in this project's own code, for the fail-open tests.

``RELIABILITY_FAULT=module:name:N`` makes ``name`` of ``module`` (a function, or ``Class.method``)
raise ``RuntimeError`` on its N-th call, as a bug of ours would; ``N+``: on that call and every
later one. Several faults are separated by commas. What calls the planted function, and the guard
around it, is this project's code, unchanged. Without the variable, this is the example as is.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))

import train as example  # examples/train.py, found through the path above

INJECTED = "injected fault"


def plant(spec: str) -> None:
    module_name, name, when = spec.split(":")
    owner = importlib.import_module(module_name)
    *path, attribute = name.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, attribute)
    first, every_later = int(when.rstrip("+")), when.endswith("+")
    calls = 0

    def faulty(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == first or (every_later and calls > first):
            raise RuntimeError(f"{INJECTED} in {name}, call {calls}")
        return original(*args, **kwargs)

    setattr(owner, attribute, faulty)


if __name__ == "__main__":
    for fault in filter(None, os.environ.get("RELIABILITY_FAULT", "").split(",")):
        plant(fault)
    example.main(sys.argv[1:])
    example.end_process_group()
