"""What a forward's batch holds, read on the training thread from its shape and dtype, never its data."""

from __future__ import annotations

import math


def batch_shape(args, kwargs) -> tuple[int | None, int | None]:
    """(samples, tokens) of a forward's batch, from its token ids if it has any.

    Token ids: the ``input_ids`` keyword, an ``input_ids`` entry of a dict argument, or else the
    first positional tensor of an integer dtype. Tokens are its element count, padding included
    (counting a mask would need the device); samples its first dimension.
    """
    ids = kwargs.get("input_ids")
    if ids is None and args:
        first = args[0]
        ids = first.get("input_ids") if isinstance(first, dict) else first
    shape = getattr(ids, "shape", None)
    if not shape or not hasattr(ids, "is_floating_point"):  # a torch tensor, not an array or a list
        return None, None
    dtype = ids.dtype
    is_integer = _INTEGER_DTYPES.get(dtype)
    if is_integer is None:
        is_integer = _INTEGER_DTYPES[dtype] = not dtype.is_floating_point and not dtype.is_complex
    return int(shape[0]), (math.prod(shape) if is_integer else None)


_INTEGER_DTYPES: dict = {}  # torch dtype -> whether it holds integers: two tensor calls fewer per forward
