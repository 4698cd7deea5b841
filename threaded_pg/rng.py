"""rng_lock(seed): per-rank deterministic randomness for rank threads that share one RNG.

The rank threads of a spawn are threads of one process, so they share torch's default
generator (and numpy's and Python's global RNGs). `torch.manual_seed(0); model = Model()`
on every rank interleaves the ranks' draws: a rank's model then differs from the one a
single process builds, differently from run to run. Inside

    with threaded_pg.rng_lock(seed=0):
        model = Model()

the ranks take turns (one rank thread at a time per spawn), and each reseeds torch on
entry: every rank draws exactly what `torch.manual_seed(0); Model()` draws in one process.
Without `seed`, the turn alone is kept, and what a rank draws depends on the order the
ranks enter in. A collective inside the section raises at once (the peers are waiting for
their turn and could never join it); RNG use outside any section still interleaves.

Outside a spawn (ranks that are processes, or no ranks at all) the section only seeds, so
the same code runs unchanged on "shm" and gloo.
"""

import contextlib
import threading

import torch

from .group import current_rank

__all__ = ["rng_lock", "in_rng_section"]

_section = threading.local()  # .depth: sections the calling thread is inside


@contextlib.contextmanager
def rng_lock(seed=None):
    """Take this spawn's RNG turn (one rank thread at a time); then torch.manual_seed(seed)
    when `seed` is given. Nests on one thread."""
    binding = current_rank()
    turn = None if binding is None else binding[0].rng_turn
    if turn is not None:
        turn.acquire(binding[1])
    _section.depth = getattr(_section, "depth", 0) + 1
    try:
        if seed is not None:
            torch.manual_seed(seed)
        yield
    finally:
        _section.depth -= 1
        if turn is not None:
            turn.release()


def in_rng_section():
    """The calling thread is inside rng_lock()."""
    return getattr(_section, "depth", 0) > 0
