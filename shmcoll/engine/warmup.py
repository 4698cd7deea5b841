"""Compile (or load from numba's cache) kernels once, off the first collective's path.

`python -m shmcoll.engine.warmup` compiles every kernel for every dtype into numba's cache (~10 s
on the 2-core VM, once per machine, Python and numba version); nothing needs it, but it
takes the cold start (docs/COLD_START.md) out of a first job, e.g. in a container image.

Every group starts `warm_up_async()` at creation, once its store rendezvous is done (the
creation itself imports no numba: compiled.py): a thread that imports and readies numba
itself, then loads what nearly every first call needs: the atomics,
the one-step kernel (small collectives; it moves bytes, the same for every dtype), the
float32 sum reducer and the point-to-point progress thread's wait. Warm, loading them takes
~0.05-0.1 s; importing numba and readying its runtime ~0.3 s, most of what a warm first
call waits for (the kernels load without numba's typing and lowering registries, which
only a compilation reads: prebuilt.ready_runtime; with them it was ~1.1 s). The group does
not wait for it: its first call does (`ensure`, through Group's kernel gate), so
init_process_group returns after the rendezvous and the loading overlaps whatever the
program does before its first collective. Nothing loads beside a collective: loading
holds the GIL and a core, and a loader running beside the first collectives made them
3-30x slower for the first half second (a benchmark's small sizes, a training loop's
first steps; worst with more ranks than cores). Cold, the same kernels compile (~1-1.5 s);
the others load (or compile, 0.1-0.5 s each) on their first use.

All compilation runs under jit.compiling: the ranks of a job never compile the same kernel
at the same time. Readying numba compiles nothing, so it runs outside that lock (under
numba's own): inside it, the ranks of a job took turns at it, 2 ranks 2x its time, 4 ranks
4x (docs/notes/2026-11-28-warm-init.md). A rank that compiles loads numba's registries
then (numba's compiler does), inside the lock; the ranks that waited for it load the result
without them.

At interpreter exit the warm-up stops at its next step, and the exit waits for it (at most
EXIT_WAIT_S): a daemon thread is frozen wherever it stands when the interpreter finalizes,
and one frozen inside numba's loader holds llvmlite's lock, which finalizing numba's
modules takes: a program that made a group and ended at once hung there for good, about
one run in four. A p2p progress thread, which loads its kernel once the warm-up is done
(wait_ready), loads nothing once the interpreter is exiting. (A torch group's threads are
stopped by its close, which the adapter's weakref.finalize runs at exit after this
handler, in the exiting thread; that close loads what the warm-up left undone, there.)
"""

import atexit
import threading
import time

import numpy as np

from ..native import jit
from ..native.op_codes import OP_SUM
from ..p2p import compiled
from .init_phases import phase

__all__ = ["warm_up", "warm_up_async", "wait_ready", "ensure", "load_with_first",
           "FIRST_REDUCERS"]

# (kind, storage, kernel op): what a first collective nearly always reduces (a dtype, as
# ops.reduce_spec asks for it: kernels.reducer caches by the value it is given)
FIRST_REDUCERS = (("float", np.dtype(np.float32), OP_SUM),)

# What the exit waits for the warm-up: one step (readying numba, or loading a kernel,
# compiled first when the cache is cold): ~0.05-3 s on the 2-core VM.
EXIT_WAIT_S = 30.0

_lock = threading.Lock()
_ready = threading.Event()
_stop = threading.Event()  # set at exit (_at_exit): a running warm-up ends at its next step
_threads = []  # the threads warm_up_async started (its only writer)
_never = threading.Event()  # never set: wait_ready's sleep at exit


class _Stopped(Exception):
    """The interpreter is exiting: the warm-up ends here (not an error)."""


def _step(name):
    """The warm-up's phase `name`, unless the interpreter is exiting (_Stopped)."""
    if _stop.is_set():
        raise _Stopped(name)
    return phase(name)


def warm_up(reducers=None):
    """Load/compile the small collectives' protocol kernels and `reducers` ((kind, storage,
    kernel op) triples); by default every kernel: every protocol kernel, every dtype's
    reducers and the point-to-point kernels. Returns the seconds spent."""
    t0 = time.perf_counter()
    with _lock:
        try:
            with _step("numba: import, runtime"):
                _ready_numba()
            with _step("kernels: import"):  # numba's modules and ours (compiled.py)
                atomics, kernels = compiled.atomics, compiled.kernels
                protocol_kernels, p2p_cells = compiled.protocol_kernels, compiled.p2p_cells
            with _step("kernels: atomics"):
                atomics.warm_up()
            with _step("kernels: one-step"):
                protocol_kernels.warm_up_one_step()
            for what, load in tuple(_with_first):
                with _step(f"kernels: {what}"):
                    load()
            if reducers is None:
                protocol_kernels.warm_up()
                kernels.warm_up()
                p2p_cells.ensure_kernels()
            else:
                for kind, storage, op in reducers:
                    with _step(f"kernels: {np.dtype(storage)} {kind} reducer"):
                        kernels.reducer(storage, kind, op)
                with _step("kernels: p2p progress wait"):
                    p2p_cells.ensure_progress_wait()
        except _Stopped:
            pass  # exiting: what is left is loaded by whoever needs it (ensure)
        finally:
            _ready.set()  # a failed warm-up must not block the first call (ensure raises)
    return time.perf_counter() - t0


_with_first = []  # (what, load): load_with_first's, in order


def load_with_first(what, load):
    """Have every warm-up also load `load()` (named `what` in its phases) right after the
    one-step kernel: what a layer above needs for its groups' first calls (the torch
    adapter's compiled latency path: its kernel entry). Once per `what`."""
    if all(w != what for w, _ in _with_first):
        _with_first.append((what, load))


def _ready_numba():
    """Import numba and ready its runtime (jit.ready), what the first kernel load would do,
    here, outside the job's compile lock, under numba's own (as numba does it): every rank
    of a job does it at once instead of in turn. Nothing is compiled."""
    jit.ready()


def wait_ready(timeout_s=None):
    """Block until the warm_up_async() of a group creation has finished; True then. False
    after `timeout_s`, and always once the interpreter is exiting (_at_exit; after waiting
    `timeout_s`, or for good): the warm-up stopped early then, and whoever waits for it (a
    p2p progress thread, before it loads its kernel) must not start loading while the
    interpreter finalizes (module docstring)."""
    if not _ready.wait(timeout_s):
        return False
    if _stop.is_set():
        _never.wait(timeout_s)
        return False
    return True


def ensure(timeout_s=None):
    """What a group's first call does before anything else (Group's kernel gate): wait for
    the warm-up of the group's creation (at most `timeout_s`; False if it still runs then),
    then load in this thread what it left undone (nothing, unless it failed: its error is
    raised here, in the caller). True when the kernels are loaded."""
    if not _ready.wait(timeout_s):
        return False
    compiled.atomics.warm_up()
    compiled.protocol_kernels.warm_up_one_step()
    compiled.p2p_cells.ensure_progress_wait()
    return True


def warm_up_async():
    """Start warm_up(FIRST_REDUCERS) in a daemon thread and return it; None when a warm-up
    of this process has already finished (every later group finds its kernels loaded)."""
    if _ready.is_set():
        return None
    thread = threading.Thread(target=warm_up, args=(FIRST_REDUCERS,), name="shmcoll-warmup",
                              daemon=True)
    _threads[:] = [t for t in _threads if t.is_alive()] + [thread]
    thread.start()
    return thread


@atexit.register
def _at_exit():
    """Let a running warm-up end at its next step, and wait for it, so that the
    interpreter's finalization finds llvmlite's lock free (module docstring)."""
    _stop.set()
    deadline = time.monotonic() + EXIT_WAIT_S
    for thread in list(_threads):
        thread.join(max(0.0, deadline - time.monotonic()))


if __name__ == "__main__":
    print(f"shmcoll kernels ready in {warm_up():.2f} s")
