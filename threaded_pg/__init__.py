"""threaded_pg: ranks as threads of one process, running shmcoll's production algorithms.

Engine (numpy only): run_threads(fn, world_size) runs fn(rank, world_size, rendezvous) on
rank threads; new_threaded_group(rendezvous, rank, world_size) -> shmcoll Group over
in-process regions with the shm protocol (threaded_pg.arena).
With torch installed it also offers the torch.distributed backend "threaded" (or
"shmcoll_threaded" when torch's own threaded PG holds that name: plugin.py), spawn(), the
@ranks(n) decorator, ThreadedTestCase, backend_name() and rng_lock() (rank threads share
torch's RNG: threaded_pg/rng.py; reseeding it in a rank thread outside rng_lock warns,
SharedRNGWarning).

Importing threaded_pg imports neither torch nor numba: the names load their modules on
first use (PEP 562). The backend is registered now if torch is imported, else as soon as it
is (with torch >= 2.5, `import torch` alone registers it: the `torch.backends` entry point).
"""

import importlib
from shmcoll.lazy_names import lazy_attributes
import importlib.util

_ENGINE = {  # name -> the module that defines it
    "Rendezvous": "group",
    "new_threaded_group": "group",
    "run_threads": "runner",
    "RankFailedError": "runner",
    "SpawnTimeoutError": "runner",
}
_WITH_TORCH = {
    "spawn": "spawning",
    "ranks": "testing",
    "ThreadedTestCase": "testing",
    "backend_name": "plugin",
    "rng_lock": "rng",
    "SharedRNGWarning": "rng",
}


def _torch_installed():
    try:
        return importlib.util.find_spec("torch") is not None  # finds it, does not import it
    except (ImportError, ValueError):
        return False


__all__ = list(_ENGINE) + (list(_WITH_TORCH) if _torch_installed() else [])


__getattr__, __dir__ = lazy_attributes(__name__, {**_ENGINE, **_WITH_TORCH})


def _register_torch_backend():
    from .plugin import register_when_torch_loads

    register_when_torch_loads()  # torch-free; never raises


_register_torch_backend()
