"""What the instrumentors instrument: the contrib convention for dependency checks."""

_torch = "torch >= 2.1"
_deepspeed = "deepspeed >= 0.19"

_instruments = (_deepspeed, _torch)
_instruments_torch = (_torch,)
