"""What each micro-batch holds as it leaves the DataLoader: samples, padded length and real tokens.

Read on the training thread from the batch on the host, before anything moves it to a device:
its shape (metadata, free) and, when it says which tokens are padding (an ``attention_mask``, or
the padding id of the model's config or ``OTEL_PYTHON_DEEPSPEED_PAD_TOKEN_ID``), one count over the
mask or the ids on the CPU. A batch already on a device keeps its shape figures but is not counted:
that would synchronize the device. Only integers are kept, never a tensor.

Token ids: the ``input_ids`` entry of a mapping (a dict, Hugging Face's ``BatchEncoding``), the
first element of a tuple or list, or the batch itself, when it is a 2-D tensor of integers
(samples x sequence length). Anything else records a placeholder, so the next forward still takes
the batch it was given, not a later one.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry_instrumentation_deepspeed.recording.batches import nested
from opentelemetry_instrumentation_deepspeed.runtime.safety import Component

_reading = Component("input batch counting")
_INTEGER_DTYPES: dict = {}  # torch dtype -> whether it holds integers (token ids)


def left_loader(recorder, batch) -> None:
    """Queue ``batch``'s (samples, padded length, real tokens) for the forward that will take it.

    ``recorder.inputs`` is a bounded queue, oldest first: a loader may fetch ahead of the forwards
    (Hugging Face's Trainer fetches all micro-batches of a step first), and a forward takes the
    oldest. Real tokens are None where they cannot be read on the host.
    """
    if _reading.broken:
        return
    ids = None
    try:
        mask = None
        if type(batch) is dict or isinstance(batch, Mapping):
            ids, mask = batch.get("input_ids"), batch.get("attention_mask")
        elif isinstance(batch, (tuple, list)):
            ids = batch[0] if batch else None
        else:
            ids = batch
        shape = getattr(ids, "shape", None)
        if shape is None or len(shape) != 2 or not hasattr(ids, "is_floating_point"):  # not a torch tensor of ids
            recorder.inputs.append(None)
            return
        dtype = ids.dtype
        integer = _INTEGER_DTYPES.get(dtype)
        if integer is None:
            integer = _INTEGER_DTYPES[dtype] = not (dtype.is_floating_point or dtype.is_complex or
                                                    str(dtype) == "torch.bool")
        if not integer:
            recorder.inputs.append(None)
            return
        samples, length = shape
        padded = samples * length
        if type(padded) is not int:  # a jagged nested tensor's length is symbolic
            recorder.inputs.append(None)
            return
        if mask is not None and getattr(mask, "shape", None) == shape and hasattr(mask, "is_cpu"):  # a torch mask
            tokens = _attended(mask) if mask.is_cpu else None
        elif recorder.pad_token_id is not None:
            tokens = padded - int((ids == recorder.pad_token_id).count_nonzero()) if ids.is_cpu else None
        else:
            tokens = padded  # nothing says which tokens are padding: every one is real
        recorder.inputs.append((samples, length, tokens))
    except Exception:  # noqa: BLE001 - a batch of a kind not foreseen: counting stops, training goes on
        _unreadable(recorder, ids)


def _attended(mask) -> int:
    """The entries of a 2-D attention mask that are attended to.

    Integer and boolean masks, and float masks of 1s and 0s, mark them non-zero. An additive float mask (0 where
    attended, a large negative number or -inf where not) is told apart by its negative entries: its zeros are; all
    zeros, it is one without padding (a mask that attends to nothing would be no batch at all).
    """
    attended = int(mask.count_nonzero())
    if mask.is_floating_point():
        if attended == 0:
            return mask.numel()
        if bool((mask < 0).any()):
            return int((mask == 0).count_nonzero())
    return attended


def failed(where: str) -> None:
    """From an ``except`` block around ``left_loader``: what raised past its own guard turns the counting off."""
    _reading.fail(where)


def _unreadable(recorder, ids) -> None:
    if nested(ids):  # a strided nested tensor has no shape to read: a placeholder, as for any batch not counted
        recorder.inputs.append(None)
    else:
        _reading.fail("inputs.left_loader")


def pad_token_id(engine, configured: int | None) -> int | None:
    """The padding id: configured, else the model's ``config.pad_token_id`` (Hugging Face models)."""
    if configured is not None:
        return configured
    value = getattr(getattr(getattr(engine, "module", None), "config", None), "pad_token_id", None)
    return value if type(value) is int else None
