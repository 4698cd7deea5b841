"""Compile (or load from numba's cache) every kernel once, off the first collective's path.

`python -m shmcoll.warmup` fills the on-disk cache (the README commands run it after
install); `warm_up()` is also started in a background thread by every group at creation,
overlapping the store rendezvous, so a first collective rarely pays for compilation.
"""

import threading
import time

import numpy as np

from . import kernels, protocol
from .atomics import read_acquire, wait_all_ge, wait_any_ge, write_release

__all__ = ["warm_up", "warm_up_async"]

_lock = threading.Lock()
_done = False


def warm_up():
    """Load/compile the atomics and all reduction kernels; returns seconds spent."""
    global _done
    with _lock:
        if _done:
            return 0.0
        t0 = time.perf_counter()
        word = np.zeros(2, np.int64)
        write_release(word.ctypes.data, 1)
        read_acquire(word.ctypes.data)
        wait_all_ge(np.array([word.ctypes.data], np.int64), 0, 1, 1, word.ctypes.data + 8)
        wait_any_ge(np.array([word.ctypes.data], np.int64), np.zeros(1, np.int64), 1, 1,
                    word.ctypes.data + 8)
        # Most likely first: a first collective of another dtype waits at most for the
        # specialization being compiled (numba compiles under one global lock).
        for kinds in (["float"], ["bfloat16", "float16"], ["int", "bool", "complex"]):
            kernels.warm_up(kinds)
            protocol.warm_up([np.dtype(d).type for k in kinds for d in kernels.KINDS[k]]
                             + ([np.uint8] if kinds[0] == "float" else []))
        _done = True
        return time.perf_counter() - t0


def warm_up_async():
    """Start warm_up() in a daemon thread (no-op if already done); returns the thread."""
    thread = threading.Thread(target=warm_up, name="shmcoll-warmup", daemon=True)
    thread.start()
    return thread


if __name__ == "__main__":
    print(f"shmcoll kernels ready in {warm_up():.2f} s")
