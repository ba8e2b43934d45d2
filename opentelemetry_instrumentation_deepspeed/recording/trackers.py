"""Which step tracker belongs to which engine: light enough to import in every process.

The trackers themselves (``steps``) need the SDK, imported only once an engine is built.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry_instrumentation_deepspeed.recording.steps import StepTracker

# Weak: a tracker must never keep an engine, and so its model, alive.
_trackers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_active: StepTracker | None = None


def tracker_for(engine) -> StepTracker | None:
    return _trackers.get(engine)


def active() -> StepTracker | None:
    """The tracker of the engine that trains now: the one with an open step, else the one built last.

    Several engines in a process (an RL actor and its reference model) are not several trainings.
    """
    if len(_trackers) > 1:
        for tracker in list(_trackers.values()):
            if tracker.step_number() is not None:
                return tracker
    return _active


def all_trackers() -> list[StepTracker]:
    return list(_trackers.values())


def track(engine, tracker: StepTracker) -> None:
    global _active  # noqa: PLW0603 - the process's current training engine
    _trackers[engine] = tracker
    _active = tracker


def forget_all() -> None:
    global _active  # noqa: PLW0603
    _trackers.clear()
    _active = None
