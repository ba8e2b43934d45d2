"""Span and trace ids no user seed reaches.

The SDK's default ``RandomIdGenerator`` draws from Python's global ``random``, which training
scripts seed (``transformers.set_seed``, ``random.seed``) identically on every rank and in every
run: the ranks then emit the same span ids into one step's trace, and the next run repeats them
(opentelemetry-python #4376). This generator draws from a ``random.Random`` of its own, seeded from
the operating system's randomness and re-seeded in a forked child (``runtime/lifecycle.py``); no
``random.seed``, numpy or torch seed reaches it. A draw costs what the SDK's does: the same
Mersenne Twister call, on another instance.

It is the default of ``opentelemetry-instrument`` with this distro (``OTEL_PYTHON_ID_GENERATOR`` =
``deepspeed_random``), and this package's spans use it wherever the provider holds the SDK's
``RandomIdGenerator`` (named ``random``, or the default of an SDK the application set up); any
other generator is used as it is.
"""

from __future__ import annotations

import random

from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator

_source = random.Random()  # seeded from os.urandom; module-level: one per process, re-seeded in a forked child
_bits = _source.getrandbits
_reseeds_in_child = False


def _reseed() -> None:
    _source.seed()


def reseed_in_forked_children() -> None:
    """A forked child continues the parent's sequence otherwise, and would repeat its ids (once per process)."""
    global _reseeds_in_child  # noqa: PLW0603
    if not _reseeds_in_child:
        from opentelemetry_instrumentation_deepspeed.runtime import lifecycle

        _reseeds_in_child = True
        lifecycle.in_forked_child(lifecycle.RESEED_IDS, _reseed)


class IsolatedRandomIdGenerator(IdGenerator):
    """Random ids, as the SDK's ``RandomIdGenerator`` makes them, from a generator of this process's own."""

    def __init__(self):
        reseed_in_forked_children()

    def generate_span_id(self) -> int:
        span_id = _bits(64)
        while not span_id:  # 0 is the invalid span id
            span_id = _bits(64)
        return span_id

    def generate_trace_id(self) -> int:
        trace_id = _bits(128)
        while not trace_id:
            trace_id = _bits(128)
        return trace_id

    def is_trace_id_random(self) -> bool:
        return True


def isolated(generator):
    """``generator``, or this project's in place of the SDK's default, which user seeds reach."""
    return IsolatedRandomIdGenerator() if type(generator) is RandomIdGenerator else generator
