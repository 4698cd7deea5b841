"""Which spawn and rank the calling thread belongs to: a per-thread pointer that a spawn sets
for its own rank threads (runner.py, backend.py) and that rng.py and the backend read. Its
own module, owner of that one piece of state, so that a reader (rng_lock in a program whose
ranks are processes) imports neither the group machinery nor numba."""

import threading

__all__ = ["bind_rank", "current_rank"]

# Not a registry: nothing here outlives the thread's binding.
_thread_rank = threading.local()


def bind_rank(rendezvous, global_rank):
    """Mark the calling thread as rank `global_rank` of `rendezvous` (None: unbind)."""
    _thread_rank.binding = None if rendezvous is None else (rendezvous, global_rank)


def current_rank():
    """(rendezvous, global_rank) of the calling rank thread, or None."""
    return getattr(_thread_rank, "binding", None)
