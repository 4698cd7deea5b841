"""Compile (or load from numba's cache) kernels once, off the first collective's path.

`python -m shmcoll.warmup` compiles every kernel for every dtype into the on-disk cache (the
README commands run it after install: ~15 s once per machine and numba version).

Every group starts `warm_up_async()` at creation, overlapping the store rendezvous, and
waits for it before it returns: it loads the float32/float64 and byte kernels (~0.4 s from
the cache), what nearly every first collective needs. Other dtypes load on their first use
(numba reads their cache entry then, ~10-50 ms). Nothing keeps loading in the background
after the group is ready: loading holds the GIL and a core, and a loader running beside
the first collectives made them 3-30x slower for the first half second (a benchmark's
small sizes, a training loop's first steps; worst with more ranks than cores).
"""

import threading
import time

import numpy as np

from . import kernels, protocol
from .atomics import read_acquire, wait_all_ge, wait_any_ge, write_release

__all__ = ["warm_up", "warm_up_async", "wait_ready", "FIRST_KINDS"]

FIRST_KINDS = ("float",)  # float32 and float64: what a first collective nearly always uses
_ALL_KINDS = (["float"], ["bfloat16", "float16"], ["int", "bool", "complex"])

_lock = threading.Lock()
_loaded = set()  # kinds whose kernels are loaded in this process
_ready = threading.Event()


def warm_up(kinds=None):
    """Load/compile the atomics and the kernels of `kinds` (default: every kind), in
    order of likely use; returns seconds spent."""
    t0 = time.perf_counter()
    with _lock:
        try:
            if not _loaded:
                word = np.zeros(2, np.int64)
                write_release(word.ctypes.data, 1)
                read_acquire(word.ctypes.data)
                wait_all_ge(np.array([word.ctypes.data], np.int64), 0, 1, 1,
                            word.ctypes.data + 8)
                wait_any_ge(np.array([word.ctypes.data], np.int64), np.zeros(1, np.int64),
                            1, 1, word.ctypes.data + 8)
                protocol.warm_up([np.uint8])  # broadcast/gather kernels move bytes
            groups = _ALL_KINDS if kinds is None else [[k] for k in kinds]
            for group in groups:
                todo = [k for k in group if k not in _loaded]
                if todo:
                    kernels.warm_up(todo)
                    protocol.warm_up([np.dtype(d).type for k in todo for d in kernels.KINDS[k]])
                    _loaded.update(todo)
        finally:
            _ready.set()  # a failed warm-up must not block group creation
    return time.perf_counter() - t0


def wait_ready(timeout_s=None):
    """Block until the warm_up_async() of a group creation has finished; True then."""
    return _ready.wait(timeout_s)


def warm_up_async():
    """Start warm_up(FIRST_KINDS) in a daemon thread; returns the thread."""
    thread = threading.Thread(target=warm_up, args=(FIRST_KINDS,), name="shmcoll-warmup",
                              daemon=True)
    thread.start()
    return thread


if __name__ == "__main__":
    print(f"shmcoll kernels ready in {warm_up():.2f} s")
