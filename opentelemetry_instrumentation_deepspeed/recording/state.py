"""The states of one engine's step and what each event does in each: one table, as torch.profiler's
``action_map`` is one table.

    IDLE ──(first event of a step)──> OPEN ──forward/backward/optimizer──> <phase> ──end──> OPEN
    OPTIMIZER ──end──> IDLE (the step closes)      any state ──failure / interrupt──> IDLE
    IDLE ──a fetch that raised──> IDLE (a step opened and failed: the one the fetch was for)

A pipeline's ``train_batch()`` runs its whole step inside one call: it opens the step (BATCH),
its optimizer phase ends like any phase (back to OPEN: the loss is still reduced after it), and
its return closes the step (BATCH_END).

A phase that starts while another runs (an engine forward inside a forward) is not a phase of its
own. A direct ``loss.backward()`` opens DIRECT_BACKWARD at DeepSpeed's backward prologue and ends
at its epilogue; an epilogue never reached (the user caught an exception and went on) is closed,
as interrupted, by the next phase. Events that find nothing to act on (a stale end, a failure with
no open step) do nothing.
"""

from __future__ import annotations


# Plain strings, not enum members: a transition is a dict lookup on the training thread, and a
# string's hash is cached where an Enum member's is computed in Python at every lookup.
class State:
    IDLE = "idle"  # no open step: data waits are kept for the next one
    OPEN = "open"  # a step is open, between phases
    FORWARD = "forward"
    BACKWARD = "backward"
    DIRECT_BACKWARD = "direct backward"
    OPTIMIZER = "optimizer"


class Event:
    DATA_WAIT = "data wait"
    EVALUATION = "evaluation forward"  # the waits kept so far fed it, not a step
    FORWARD = "forward"
    BACKWARD = "backward"
    DIRECT_BACKWARD = "direct backward"
    OPTIMIZER = "optimizer step"  # engine.step() on a gradient-accumulation boundary
    PHASE_END = "phase end"
    DIRECT_BACKWARD_END = "direct backward end"
    OPTIMIZER_END = "optimizer step end"
    PHASE_FAILED = "phase failed"
    DATA_FAILED = "data wait failed"  # the loader raised (the dataset's exception, a worker that died)
    DIRECT_BACKWARD_FAILED = "direct backward failed"
    INTERRUPT = "interrupt"  # the process goes away with the step open
    BATCH = "pipeline batch"  # PipelineEngine.train_batch() starts: a whole step in one call
    BATCH_END = "pipeline batch end"  # ... and returns


# Actions, run in order. Their implementations are the recorder's methods of the same name.
KEEP_WAIT = "keep_wait"  # a wait before any step: kept, the most recent ones only
ADD_WAIT = "add_wait"  # a wait inside the open step
DROP_WAITS = "drop_waits"
OPEN_STEP = "open_step"
START_PHASE = "start_phase"
END_PHASE = "end_phase"
FAIL_PHASE = "fail_phase"
INTERRUPT_PHASE = "interrupt_phase"  # the running phase ends as interrupted
CLOSE_STEP = "close_step"
FAIL_STEP = "fail_step"

STATES = tuple(value for name, value in vars(State).items() if not name.startswith("_"))
EVENTS = tuple(value for name, value in vars(Event).items() if not name.startswith("_"))

_PHASE_OF = {Event.FORWARD: State.FORWARD, Event.BACKWARD: State.BACKWARD,
             Event.DIRECT_BACKWARD: State.DIRECT_BACKWARD, Event.OPTIMIZER: State.OPTIMIZER}
_STARTS = tuple(_PHASE_OF)
_PHASES = (State.FORWARD, State.BACKWARD, State.DIRECT_BACKWARD, State.OPTIMIZER)


def _table() -> dict[tuple[State, Event], tuple[State | None, tuple[str, ...]]]:
    """(state, event) -> (next state, actions). A next state of None: the state does not change."""
    table: dict = {}
    for state in STATES:
        for event in EVENTS:
            table[state, event] = (None, ())  # nothing to act on

    table[State.IDLE, Event.DATA_WAIT] = (None, (KEEP_WAIT,))
    for state in STATES:
        table[state, Event.EVALUATION] = (None, (DROP_WAITS,))
    for event in _STARTS:
        table[State.IDLE, event] = (_PHASE_OF[event], (OPEN_STEP, START_PHASE))
        table[State.OPEN, event] = (_PHASE_OF[event], (START_PHASE,))
        # The direct backward never reached its epilogue: it ends, interrupted, where the next phase starts.
        table[State.DIRECT_BACKWARD, event] = (_PHASE_OF[event], (INTERRUPT_PHASE, START_PHASE))
    # A fetch that raised ends the step it was for: opened for it where none was (the step the loop would have run).
    table[State.IDLE, Event.DATA_FAILED] = (State.IDLE, (OPEN_STEP, FAIL_STEP))
    for state in (State.OPEN, *_PHASES):
        table[state, Event.DATA_WAIT] = (None, (ADD_WAIT,))
        table[state, Event.PHASE_FAILED] = (State.IDLE, (FAIL_PHASE, FAIL_STEP))
        table[state, Event.DATA_FAILED] = (State.IDLE, (FAIL_PHASE, FAIL_STEP))
        table[state, Event.INTERRUPT] = (State.IDLE, (INTERRUPT_PHASE, FAIL_STEP))
    table[State.FORWARD, Event.PHASE_END] = (State.OPEN, (END_PHASE,))
    table[State.BACKWARD, Event.PHASE_END] = (State.OPEN, (END_PHASE,))
    table[State.DIRECT_BACKWARD, Event.DIRECT_BACKWARD_END] = (State.OPEN, (END_PHASE,))
    # A caught failure inside a direct backward still ends its step: the retry opens a new one.
    table[State.DIRECT_BACKWARD, Event.DIRECT_BACKWARD_FAILED] = (State.IDLE, (FAIL_PHASE, FAIL_STEP))
    table[State.OPTIMIZER, Event.OPTIMIZER_END] = (State.IDLE, (END_PHASE, CLOSE_STEP))
    # A pipeline's step: train_batch() opens and closes it; its optimizer step is a phase among others.
    table[State.IDLE, Event.BATCH] = (State.OPEN, (OPEN_STEP,))
    table[State.OPTIMIZER, Event.PHASE_END] = (State.OPEN, (END_PHASE,))
    table[State.OPEN, Event.BATCH_END] = (State.IDLE, (CLOSE_STEP,))
    return table


TRANSITIONS = _table()
