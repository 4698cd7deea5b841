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

The seed watch: while a spawn runs, the functions that reseed the default generator
(`torch.manual_seed`, `torch.seed` under every alias: `compat.rng_seed_hooks`) are wrapped.
A rank thread that calls one outside a section gets a SharedRNGWarning naming rng_lock,
once per spawn (each test that has the bug is told, not only the first of a session; the
ranks' repeats are not). The main thread, other threads, and calls inside a section cost
one thread-local read and are not warned. The last spawn to end puts the originals back.
"""

import contextlib
import functools
import os
import sys
import threading
import warnings
import weakref

import torch

from shmcoll.torch_backend import compat

from .binding import current_rank

__all__ = ["rng_lock", "in_rng_section", "SharedRNGWarning", "watch_seeding",
           "unwatch_seeding"]

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


# -- the seed watch ------------------------------------------------------------------------


class SharedRNGWarning(UserWarning):
    """A rank thread reseeded torch's default generator, which every rank thread shares,
    outside threaded_pg.rng_lock."""


_watch_lock = threading.Lock()
_watchers = 0  # running spawns
_patched = []  # (module, attribute, original, wrapper) while _watchers > 0
_warned = weakref.WeakSet()  # rendezvous (spawns) already warned

_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def watch_seeding():
    """Take one reference on the seed watch (a spawn starting); the first wraps the
    seeding functions."""
    global _watchers
    with _watch_lock:
        if _watchers == 0:
            wrappers = {}  # id(original) -> wrapper: aliases of one function share one
            for module, attribute, public in compat.rng_seed_hooks():
                original = getattr(module, attribute)
                wrapper = wrappers.get(id(original))
                if wrapper is None:
                    wrapper = wrappers[id(original)] = _watched(original, public)
                setattr(module, attribute, wrapper)
                _patched.append((module, attribute, original, wrapper))
        _watchers += 1


def unwatch_seeding():
    """Drop one reference; the last puts every original back. An attribute that someone
    replaced meanwhile (importing torch._dynamo wraps torch.manual_seed once, where that is
    the public function) keeps its new value: the wrapper inside it only warns in a rank
    thread of a running spawn, and forwards."""
    global _watchers
    with _watch_lock:
        _watchers -= 1
        if _watchers > 0:
            return
        for module, attribute, original, wrapper in reversed(_patched):
            if getattr(module, attribute) is wrapper:
                setattr(module, attribute, original)
        _patched.clear()


def _watched(original, public):
    @functools.wraps(original)
    def seed_watch(*args, **kwargs):
        binding = current_rank()
        if binding is not None and getattr(_section, "depth", 0) == 0:
            _warn_once(binding, public)
        return original(*args, **kwargs)
    return seed_watch


def _warn_once(binding, public):
    rendezvous, rank = binding
    with _watch_lock:
        if rendezvous in _warned:
            return
        _warned.add(rendezvous)
    warnings.warn(
        f"threaded_pg: rank {rank} called {public}() outside threaded_pg.rng_lock. Rank "
        f"threads share torch's default generator, so the ranks' draws interleave and "
        f"differ from a process's, and from run to run. Build what must match inside "
        f"`with threaded_pg.rng_lock(seed):` (the ranks take turns, each reseeding) and give "
        f"per-rank randomness a torch.Generator of its own (docs/THREADED_PG.md). Warned "
        f"once per spawn; to silence it: warnings.filterwarnings('ignore', "
        f"category=threaded_pg.SharedRNGWarning)",
        SharedRNGWarning, stacklevel=_caller_level())


def _caller_level():
    """warnings.warn's stacklevel for the first frame outside threaded_pg and torch: the
    line that called the seeding function (torch's own frames vary with the version)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith((_OWN_DIR, _TORCH_DIR)):
        frame, level = frame.f_back, level + 1
    return level
