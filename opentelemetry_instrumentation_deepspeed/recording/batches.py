"""What a forward's batch holds, read on the training thread from its shape and dtype, never its data."""

from __future__ import annotations

import math

from opentelemetry_instrumentation_deepspeed.runtime.safety import Component

_reading = Component("batch shape reading")


def batch_shape(args, kwargs) -> tuple[int | None, int | None]:
    """(samples, tokens) of a forward's batch, from its token ids if it has any.

    Token ids: the ``input_ids`` keyword, an ``input_ids`` entry of a dict argument, or else the
    first positional tensor of an integer dtype. A list or tuple first argument may be a batch passed whole
    (Lightning's ``(inputs, targets)``): its inputs are read, where ``_inputs_of`` tells it from a list of samples.
    Tokens are its element count, padding included (counting a mask would need the device); samples its first
    dimension. A nested tensor is not counted; an argument of a kind not foreseen (an object whose attributes raise)
    turns this reading off, not the step's.
    """
    if _reading.broken:
        return None, None
    ids = None
    try:
        ids = kwargs.get("input_ids")
        if ids is None and args:
            first = args[0]
            if type(first) in _SEQUENCES:
                first = _inputs_of(first)
            ids = first.get("input_ids") if isinstance(first, dict) else first
        shape = getattr(ids, "shape", None)
        if not shape or not hasattr(ids, "is_floating_point"):  # a torch tensor, not an array or a list
            return None, None
        dtype = ids.dtype
        is_integer = _INTEGER_DTYPES.get(dtype)
        if is_integer is None:
            is_integer = _INTEGER_DTYPES[dtype] = not dtype.is_floating_point and not dtype.is_complex
        tokens = math.prod(shape) if is_integer else None
        # A jagged dimension is symbolic: no count to record.
        return int(shape[0]), (tokens if type(tokens) is int else None)
    except Exception:  # noqa: BLE001 - ours only: the forward has not started yet
        if not nested(ids):  # a strided nested tensor's shape raises: not counted
            _reading.fail("batches.batch_shape")
        return None, None


def _inputs_of(batch):
    """The inputs of an ``(inputs, targets, ...)`` batch passed whole; None for anything else. A list of samples
    (torchvision's detection images, sequences of their own lengths) is no batch whose first element is the
    inputs: its first element is one sample. Told apart by the first two elements: tensors with the same first
    dimension that differ in dtype or rank (features and their labels). Inputs and targets alike in both (a
    regression's, an autoencoder's) are left uncounted: a list of samples looks the same."""
    if len(batch) < 2:
        return None
    inputs, targets = batch[0], batch[1]
    if not (hasattr(inputs, "is_floating_point") and hasattr(targets, "is_floating_point")):
        return None
    if not inputs.ndim or not targets.ndim or inputs.shape[0] != targets.shape[0]:
        return None
    return inputs if inputs.dtype != targets.dtype or inputs.ndim != targets.ndim else None


_SEQUENCES = (list, tuple)
_INTEGER_DTYPES: dict = {}  # torch dtype -> whether it holds integers: two tensor calls fewer per forward


def nested(value) -> bool:
    """A nested tensor (whose strided layout has no shape to read), asked of anything: its attributes may raise."""
    try:
        return getattr(value, "is_nested", False) is True
    except Exception:  # noqa: BLE001 - not a tensor, whatever it raised
        return False
