"""Compile (or load from numba's cache) kernels once, off the first collective's path.

`python -m shmcoll.warmup` compiles every kernel for every dtype into numba's cache (~10 s
on the 2-core VM, once per machine, Python and numba version); nothing needs it, but it
takes the cold start (docs/COLD_START.md) out of a first job, e.g. in a container image.

Every group starts `warm_up_async()` at creation, overlapping the store rendezvous, and
waits for it (at most the group's timeout) before it returns: it loads the one-step kernel
(small collectives; it moves bytes, the same for every dtype) and the float32 sum reducer,
what nearly every first collective needs; cold, it compiles them (~1-1.5 s). The other
kernels load (or compile, 0.1-0.5 s each) on their first use. Nothing keeps loading in the background after the group is ready: loading holds the
GIL and a core, and a loader running beside the first collectives made them 3-30x slower
for the first half second (a benchmark's small sizes, a training loop's first steps; worst
with more ranks than cores).

All compilation runs under jit.compiling: the ranks of a job never compile the same kernel
at the same time.
"""

import threading
import time

import numpy as np

from . import atomics, kernels, p2p, protocol
from .init_phases import phase

__all__ = ["warm_up", "warm_up_async", "wait_ready", "FIRST_REDUCERS"]

# (kind, storage, kernel op): what a first collective nearly always reduces
FIRST_REDUCERS = (("float", np.float32, kernels.OP_SUM),)

_lock = threading.Lock()
_ready = threading.Event()


def warm_up(reducers=None):
    """Load/compile the small collectives' protocol kernels and `reducers` ((kind, storage,
    kernel op) triples); by default every kernel: every protocol kernel, every dtype's
    reducers and the point-to-point kernels. Returns the seconds spent."""
    t0 = time.perf_counter()
    with _lock:
        try:
            with phase("kernels: atomics"):
                atomics.warm_up()
            with phase("kernels: one-step"):
                protocol.warm_up_one_step()
            if reducers is None:
                protocol.warm_up()
                kernels.warm_up()
                p2p.ensure_kernels()
            else:
                for kind, storage, op in reducers:
                    with phase(f"kernels: {np.dtype(storage)} {kind} reducer"):
                        kernels.reducer(storage, kind, op)
        finally:
            _ready.set()  # a failed warm-up must not block group creation
    return time.perf_counter() - t0


def wait_ready(timeout_s=None):
    """Block until the warm_up_async() of a group creation has finished; True then."""
    return _ready.wait(timeout_s)


def warm_up_async():
    """Start warm_up(FIRST_REDUCERS) in a daemon thread; returns the thread."""
    thread = threading.Thread(target=warm_up, args=(FIRST_REDUCERS,), name="shmcoll-warmup",
                              daemon=True)
    thread.start()
    return thread


if __name__ == "__main__":
    print(f"shmcoll kernels ready in {warm_up():.2f} s")
