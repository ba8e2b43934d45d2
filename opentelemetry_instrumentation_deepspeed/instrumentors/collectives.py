"""What a collective call is: its op, group, bytes and bus-bandwidth factor, read from its arguments.

Both layers that issue collectives, ``deepspeed.comm`` and ``torch.distributed``, name ops the
same way; only some parameter names differ, which the signature read at wrap time resolves.
Bandwidths follow nccl-tests: algbw = S / t, where S is the op's total size (for all-gather,
group size times this rank's input); busbw = algbw times 2(n-1)/n for all-reduce and (n-1)/n
for all-gather, reduce-scatter and all-to-all, times 1 otherwise.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass

# op -> (candidate names of the parameter that carries this rank's data, bus factor kind)
_OPS: dict[str, tuple[tuple[str, ...], str]] = {
    "all_reduce": (("tensor",), "all_reduce"),
    "inference_all_reduce": (("tensor",), "all_reduce"),
    "all_reduce_coalesced": (("tensors",), "all_reduce"),
    "all_gather": (("tensor",), "all_gather"),
    "all_gather_into_tensor": (("tensor", "input_tensor"), "all_gather"),
    "all_gather_single": (("input_tensor",), "all_gather"),
    "all_gather_coalesced": (("input_tensor_list",), "all_gather"),
    "reduce_scatter": (("input_list",), "reduce_scatter"),
    "reduce_scatter_tensor": (("tensor", "input"), "reduce_scatter"),
    "reduce_scatter_single": (("input",), "reduce_scatter"),
    "all_to_all_single": (("tensor", "input"), "all_to_all"),
    "all_to_all": (("input_tensor_list",), "all_to_all"),
    "broadcast": (("tensor",), "one"),
    "broadcast_object_list": ((), "one"),
    "all_gather_object": ((), "one"),
    "gather_object": ((), "one"),
    "scatter_object_list": ((), "one"),
    "send_object_list": ((), "one"),
    "recv_object_list": ((), "one"),
    "reduce": (("tensor",), "one"),
    "gather": (("tensor",), "one"),
    "scatter": (("tensor",), "one"),
    "send": (("tensor",), "one"),
    "recv": (("tensor",), "one"),
    "isend": (("tensor",), "one"),
    "irecv": (("tensor",), "one"),
    "batch_isend_irecv": (("p2p_op_list",), "one"),
    "barrier": ((), "one"),
    "monitored_barrier": ((), "one"),
    "reduce_scatter_coalesced": (("inputs",), "reduce_scatter"),  # the functional collectives' (below)
}
ALWAYS_ASYNC = frozenset({"isend", "irecv", "batch_isend_irecv"})
# Point-to-point ops (semconv.P2P_OPS) by direction: a rank's k-th send to a peer is that peer's k-th receive from it
_DIRECTIONS = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv", "batch_isend_irecv": "batch",
               "send_object_list": "send", "recv_object_list": "recv"}
# Point-to-point ops: the parameter that names the rank at the other end
_PEERS = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src", "send_object_list": "dst",
          "recv_object_list": "src"}
# ... or its rank in the call's group (torch 2.6 on), where the program names it so
_GROUP_PEERS = {name: f"group_{peer}" for name, peer in _PEERS.items()}

# Ops of deepspeed.comm.comm that its timed_op wraps (deepspeed 0.19), and the collectives of torch.distributed that
# a program can call without DeepSpeed. Torch's object collectives pickle the objects into tensors and move them with
# two tensor collectives (their sizes, then their bytes): observed as one call, they are one collective, as
# deepspeed.comm's are, where the two inside would be two of another name.
DEEPSPEED_OPS = (
    "broadcast", "broadcast_object_list", "all_gather", "all_gather_object", "reduce_scatter_tensor",
    "all_gather_into_tensor", "all_to_all_single", "all_to_all", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "gather", "scatter", "barrier", "monitored_barrier", "reduce", "reduce_scatter",
    "all_reduce", "inference_all_reduce", "all_reduce_coalesced",
)
TORCH_OPS = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_to_all_single", "all_to_all", "broadcast", "reduce", "gather", "scatter", "send", "recv", "isend",
    "irecv", "batch_isend_irecv", "barrier", "monitored_barrier", "broadcast_object_list", "all_gather_object",
    "gather_object", "scatter_object_list", "send_object_list", "recv_object_list",
)

# torch.distributed._functional_collectives (DTensor's redistributions, tensor parallelism, norms over DTensors):
# function -> the op its spans and metrics name, torch.distributed's, so that one kind of call aggregates across layers.
FUNCTIONAL_OPS = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce_coalesced", "broadcast": "broadcast",
    "all_gather_single": "all_gather_single", "all_gather_tensor": "all_gather_single",
    "all_gather_single_autograd": "all_gather_single", "all_gather_tensor_autograd": "all_gather_single",
    "all_gather_single_coalesced": "all_gather_coalesced", "all_gather_into_tensor_coalesced": "all_gather_coalesced",
    "reduce_scatter_single": "reduce_scatter_single", "reduce_scatter_tensor": "reduce_scatter_single",
    "reduce_scatter_single_autograd": "reduce_scatter_single",
    "reduce_scatter_tensor_autograd": "reduce_scatter_single",
    "reduce_scatter_single_coalesced": "reduce_scatter_coalesced",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_coalesced",
    "all_to_all_single": "all_to_all_single", "all_to_all_single_autograd": "all_to_all_single",
}


def bus_factor(kind: str, group_size: int) -> float:
    n = max(group_size, 1)
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def algorithm_bytes(kind: str, data_bytes: int, group_size: int) -> int:
    """nccl-tests' S: all-gather moves group size times this rank's input; the others their input."""
    return data_bytes * group_size if kind == "all_gather" else data_bytes


def _tensor_bytes(value) -> tuple[int, object]:
    """(bytes, first tensor) of a tensor, a list of tensors, or a list of P2POps."""
    if isinstance(value, (list, tuple)):
        total, first = 0, None
        for item in value:
            tensor = getattr(item, "tensor", item)
            if hasattr(tensor, "element_size"):
                total += tensor.element_size() * tensor.nelement()
                first = first if first is not None else tensor
        return total, first
    if hasattr(value, "element_size"):
        return value.element_size() * value.nelement(), value
    return 0, None


def _undecorated(function, name: str):
    """The function named ``name`` that a ``(*args, **kwargs)`` decorator closes over.

    DeepSpeed's ``timed_op`` keeps no ``__wrapped__``; its closure holds the op itself.
    """
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
        return function
    for cell in getattr(function, "__closure__", None) or ():
        inner = cell.cell_contents
        if callable(inner) and getattr(inner, "__name__", None) == name:
            return _undecorated(inner, name)
    return function


# The index of a parameter the function does not have: past any call's positional arguments, so that one comparison
# (``index < len(args)``) tells a positional argument from one to look up by keyword.
ABSENT = sys.maxsize


@dataclass(frozen=True)
class OpSpec:
    """Where the arguments of one wrapped function are; read once, at wrap time."""

    name: str
    kind: str
    data_index: int
    data_name: str | None
    group_index: int
    async_index: int
    always_async: bool
    peer_index: int = ABSENT
    peer_name: str | None = None  # the parameter that names the rank at the other end (send, recv, isend, irecv)
    p2p: str | None = None  # a point-to-point op's direction (send, recv, batch): numbered per direction and peer
    group_peer_index: int = ABSENT
    group_peer_name: str | None = None  # the parameter that names the other end by its rank in the group
    functional: bool = False  # a functional collective's: it completes where its result is waited for

    @classmethod
    def of(cls, name: str, function) -> OpSpec:
        parameters = list(inspect.signature(_undecorated(function, name)).parameters)
        data_names, kind = _OPS[name]
        data_name = next((candidate for candidate in data_names if candidate in parameters), None)

        def index(parameter):
            return parameters.index(parameter) if parameter in parameters else ABSENT

        peer_name = _PEERS.get(name) if _PEERS.get(name) in parameters else None
        group_peer = _GROUP_PEERS.get(name) if _GROUP_PEERS.get(name) in parameters else None
        return cls(name, kind, index(data_name), data_name, index("group"), index("async_op"), name in ALWAYS_ASYNC,
                   index(peer_name), peer_name, _DIRECTIONS.get(name), index(group_peer), group_peer)

    @classmethod
    def of_functional(cls, name: str, function) -> OpSpec:
        """A functional collective's: its data is ``self`` (or ``inputs``), its group any of the forms it takes (a
        process group, a device mesh and dimension, a group name); it always returns before it completes."""
        parameters = list(inspect.signature(function).parameters)
        op = FUNCTIONAL_OPS[name]
        data_name = next((candidate for candidate in ("self", "inputs") if candidate in parameters), None)
        return cls(op, _OPS[op][1], parameters.index(data_name) if data_name else ABSENT, data_name,
                   parameters.index("group") if "group" in parameters else ABSENT, ABSENT, True, functional=True)

    def peer(self, args, kwargs) -> int | None:
        """The global rank at the other end of a send or recv (None: any source)."""
        count = len(args)
        peer = args[self.peer_index] if self.peer_index < count else kwargs.get(self.peer_name)
        if peer is None and self.group_peer_name is not None:
            local = (args[self.group_peer_index] if self.group_peer_index < count
                     else kwargs.get(self.group_peer_name))
            if isinstance(local, int):
                group = args[self.group_index] if self.group_index < count else kwargs.get("group")
                dist = sys.modules["torch.distributed"]
                try:
                    return dist.get_global_rank(group or dist.distributed_c10d._get_default_group(), local)
                except (ValueError, RuntimeError):  # no such rank in the group: torch's call raises it to the program
                    return None
        return peer if isinstance(peer, int) else None

    def read(self, args, kwargs) -> tuple[object, int, object, bool]:
        """(group, bytes of this rank's data, its first tensor, async) of one call, in one pass."""
        count = len(args)
        group = args[self.group_index] if self.group_index < count else kwargs.get("group")
        if self.data_name is None:
            data_bytes, tensor = 0, None
        else:
            data = args[self.data_index] if self.data_index < count else kwargs.get(self.data_name)
            if hasattr(data, "element_size"):  # one tensor, the usual case: _tensor_bytes's answer without its frame
                data_bytes, tensor = data.element_size() * data.nelement(), data
            else:
                data_bytes, tensor = _tensor_bytes(data)
        is_async = self.always_async or bool(
            args[self.async_index] if self.async_index < count else kwargs.get("async_op", False))
        return group, data_bytes, tensor, is_async
