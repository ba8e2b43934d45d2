"""Loss and gradient norm, taken from the training thread without ever waiting for the device.

A host value is read at once (a CPU tensor's ``item()``: no device is involved). A CUDA scalar is copied,
asynchronously, into a slot of a small pinned host ring; the step's close records one CUDA event
behind its copies, and the emitter reads the slots once that event has completed, a drain (half a
second) or more later. Nothing here calls ``item()`` on a device tensor or ``synchronize``.

The ring is reused: a slot written ``SLOTS`` copies ago may be overwritten by a later copy. A reader
therefore reads a slot, then checks that no copy into it was issued since (``_issued`` counts them,
incremented before each copy is issued): a value overwritten before it was read is dropped, never
reported wrong. Only our own ring is kept, never a user's tensor: the copy holds the loss on the
stream until it ran, as any ``non_blocking`` copy does.
"""

from __future__ import annotations

from opentelemetry_instrumentation_deepspeed.recording.gpu_timing import Captures, current_device, on_device

SLOTS = 1024  # at one loss per micro-batch, steps of 32 micro-batches stay readable for 30 steps


class Pending:
    """A value copied into slot ``index`` of ``ring``: readable once the step's event completed."""

    __slots__ = ("index", "ring")

    def __init__(self, ring: DeviceScalars, index: int):
        self.ring, self.index = ring, index


class DeviceScalars:
    """The pinned ring of one engine's CUDA scalars (torch.cuda and torch at the boundary)."""

    def __init__(self, torch, cuda=None, pin_memory: bool = True):
        self._cuda = cuda or torch.cuda
        self._device = current_device(self._cuda)
        self._buffer = torch.empty(SLOTS, dtype=torch.float64, pin_memory=pin_memory)
        self._slots = list(self._buffer.unbind())  # views made once: indexing would cost a call per copy
        self._issued = 0

    def copy(self, tensor) -> Pending:
        """Enqueue the copy of a CUDA scalar; its value is read later (``value``)."""
        index = self._issued
        self._issued = index + 1  # counted before the copy exists: a reader never misses an overwrite
        source = tensor.detach()
        # One element in any shape (DeepSpeed's backward takes a loss of shape [1]) goes to its 0-d slot as a view.
        self._slots[index % SLOTS].copy_(source.reshape(()) if source.ndim else source, non_blocking=True)
        return Pending(self, index)

    def event(self) -> Copied:
        """An event behind every copy enqueued so far on the current stream."""
        event = self._cuda.Event()
        event.record()
        return Copied(self, event)

    def read(self, index: int) -> float | None:
        value = float(self._slots[index % SLOTS])  # pinned host memory: no device involved
        return value if self._issued <= index + SLOTS else None  # overwritten meanwhile: unknown


class Copied:
    """The copies of a step's scalars, done once ``query()`` (from any thread) says so."""

    __slots__ = ("_event", "_ring")

    def __init__(self, ring: DeviceScalars, event):
        self._ring, self._event = ring, event

    def query(self) -> bool:
        with Captures.lock, on_device(self._ring._cuda, self._ring._device):
            return not Captures.running and self._event.query()


class Share:
    """A micro-batch's loss given as its share of the step's already: ``engine.backward(loss, scale_wrt_gas=False)``,
    which DeepSpeed does not divide by the accumulation (the Hugging Face Trainer's, whose loss is divided, or
    normalized by the step's tokens, before). The step's loss is the sum of such shares, not their mean."""

    __slots__ = ("taken",)

    def __init__(self, taken):
        self.taken = taken


def take(tensor, ring: DeviceScalars | None):
    """A host float now, a ``Pending`` copy of a CUDA scalar, or None (another device, not a tensor); one taken
    already is kept as it is."""
    if isinstance(tensor, (float, Pending)):
        return tensor
    if getattr(tensor, "is_cuda", None):
        if ring is None or (tensor.ndim and tensor.numel() != 1):  # more than one element is no loss or norm
            return None
        return ring.copy(tensor)
    if getattr(tensor, "is_cpu", False):
        return tensor.item() if tensor.numel() == 1 else None  # item(): float() warns on a tensor needing grad
    return float(tensor) if isinstance(tensor, int) else None


def value(taken) -> float | None:
    """What ``take`` kept, as a float: called by the emitter once the step's event completed."""
    if type(taken) is Pending:
        return taken.ring.read(taken.index)
    return taken


def step_loss(losses: list, summed: bool = False) -> float | None:
    """The step's loss: each micro-batch's over their number, summed in order, as a loop that prints
    ``sum(loss.item() / accumulation)`` computes it (so the two agree to the bit); ``summed``: each was divided
    already (a plain loop's ``(loss / accumulation).backward()``; a ``Share``), and they are summed in order."""
    if any(type(taken) is Share for taken in losses):
        summed, losses = True, [taken.taken if type(taken) is Share else taken for taken in losses]
    values = [value(taken) for taken in losses]
    if not values or any(v is None for v in values):
        return None
    total = 0.0
    for each in values:
        total += each if summed else each / len(values)
    return total
