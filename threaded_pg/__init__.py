"""threaded_pg: ranks as threads of one process, running shmcoll's production algorithms.

Engine (numpy only): run_threads(fn, world_size) runs fn(rank, world_size, rendezvous) on
rank threads; new_threaded_group(rendezvous, rank, world_size) -> shmcoll Group over
in-process regions with the shm protocol (threaded_pg.arena).
With torch installed, importing threaded_pg also registers the torch.distributed backend
"threaded" (or "shmcoll_threaded" when torch's own threaded PG holds that name) and exports
spawn(), the @ranks(n) decorator, ThreadedTestCase, and rng_lock() (rank threads share
torch's RNG: threaded_pg/rng.py; reseeding it in a rank thread outside rng_lock warns,
SharedRNGWarning).
"""

from .group import Rendezvous, new_threaded_group
from .runner import RankFailedError, SpawnTimeoutError, run_threads

__all__ = ["Rendezvous", "new_threaded_group", "run_threads", "RankFailedError",
           "SpawnTimeoutError"]


def _load_torch_part():
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        return  # numpy-only install: the engine works without torch
    global spawn, ranks, ThreadedTestCase, backend_name, rng_lock, SharedRNGWarning
    from .backend import backend_name, register
    from .rng import SharedRNGWarning, rng_lock
    from .spawn import spawn
    from .testing import ThreadedTestCase, ranks

    register()
    __all__.extend(["spawn", "ranks", "ThreadedTestCase", "backend_name", "rng_lock",
                    "SharedRNGWarning"])


_load_torch_part()
