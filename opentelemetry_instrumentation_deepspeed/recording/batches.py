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
            ids = first.get("input_ids") if isinstance(first, dict) else first
        shape = getattr(ids, "shape", None)
        if not shape or not hasattr(ids, "is_floating_point"):  # a torch tensor, not an array or a list
            # A batch passed whole, looked at only here: a forward given a tensor pays nothing for it.
            ids = _inputs_of(ids) if shape is None and type(ids) in _SEQUENCES else None
            if isinstance(ids, dict):
                ids = ids.get("input_ids")
            shape = getattr(ids, "shape", None)
            if not shape or not hasattr(ids, "is_floating_point"):
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
    """The inputs of a batch passed whole, ``(inputs, targets, ...)``; None for anything else. A list of samples
    (torchvision's detection images, token sequences of their own lengths) is no such batch: its first element is
    one sample. Read as inputs: a dict first element (``({"input_ids": ...}, labels)``); a lone matrix of token ids
    (a ``TensorDataset`` of them); the first of two tensors of the same first dimension that differ in dtype or rank
    (features and labels), or that are both matrices of integers of one shape (a language model's token ids and
    labels: a list of token samples holds vectors). Inputs and targets alike otherwise (a regression's, an
    autoencoder's) are left uncounted: a list of samples looks the same."""
    first = batch[0] if batch else None
    if isinstance(first, dict):
        return first
    if not hasattr(first, "is_floating_point") or not first.ndim:
        return None
    tokens = first.ndim >= 2 and not first.is_floating_point() and not first.is_complex()
    if len(batch) == 1:
        return first if tokens and first.ndim == 2 else None
    second = batch[1]
    if not hasattr(second, "is_floating_point") or not second.ndim or first.shape[0] != second.shape[0]:
        return None
    if first.dtype != second.dtype or first.ndim != second.ndim:
        return first
    return first if tokens and first.shape == second.shape else None


_SEQUENCES = (list, tuple)
_INTEGER_DTYPES: dict = {}  # torch dtype -> whether it holds integers: two tensor calls fewer per forward


def nested(value) -> bool:
    """A nested tensor (whose strided layout has no shape to read), asked of anything: its attributes may raise."""
    try:
        return getattr(value, "is_nested", False) is True
    except Exception:  # noqa: BLE001 - not a tensor, whatever it raised
        return False
