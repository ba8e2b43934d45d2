"""Which step recorder belongs to which engine: light enough to import in every process."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from opentelemetry_instrumentation_deepspeed.recording.state import State

if TYPE_CHECKING:
    from opentelemetry_instrumentation_deepspeed.recording.recorder import StepRecorder

# Weak: a recorder must never keep an engine, and so its model, alive.
_recorders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# The same, by id(engine), for the wrappers' lookups: a WeakKeyDictionary's get() makes a weak
# reference each call. An entry leaves when its engine is collected, before its id can be reused.
# The wrappers read _by_id, _active and _several themselves (a function here would be one more frame
# per event): _by_id is cleared, never rebound.
_by_id: dict[int, StepRecorder] = {}
_active: StepRecorder | None = None
_several = False  # more than one engine was built: the active one is looked for at each call


def recorder_for(engine) -> StepRecorder | None:
    return _by_id.get(id(engine))


def active() -> StepRecorder | None:
    """The recorder of the engine that trains now: the one with an open step, else the one built last.

    Several engines in a process (an RL actor and its reference model) are not several trainings.
    """
    if _several:
        for recorder in list(_recorders.values()):
            if recorder.state != State.IDLE:
                return recorder
    return _active


def all_recorders() -> list[StepRecorder]:
    return list(_recorders.values())


def track(engine, recorder: StepRecorder) -> None:
    global _active, _several  # noqa: PLW0603 - the process's current training engine
    _recorders[engine] = recorder
    if id(engine) not in _by_id:
        weakref.finalize(engine, _by_id.pop, id(engine), None).atexit = False  # nothing to do at exit
    _by_id[id(engine)] = recorder
    _active = recorder
    _several = len(_recorders) > 1


def forget(engine) -> None:
    global _active, _several  # noqa: PLW0603
    recorder = _recorders.pop(engine, None)
    _by_id.pop(id(engine), None)
    if recorder is not None and recorder is _active:
        _active = next(reversed(list(_recorders.values())), None)
    _several = len(_recorders) > 1


def forget_all() -> None:
    global _active, _several
    _recorders.clear()
    _by_id.clear()
    _active, _several = None, False
