"""shmcoll: collectives between ranks on one machine through POSIX shared memory.

Engine API (numpy only): new_shm_group(store, rank, world_size) -> Group.
Importing shmcoll is cheap: it imports neither torch nor numba (the names below load their
modules on first use, PEP 562). It registers the torch.distributed backend "shm" (with
torch >= 2.5 `import torch` alone does: torch_backend/plugin.py), now if torch is imported,
else as soon as torch is.
"""

from .lazy_names import lazy_attributes

__all__ = [
    "Group",
    "ReduceOp",
    "new_shm_group",
    "FileStore",
    "ShmcollError",
    "CollectiveTimeoutError",
    "PeerLostError",
    "GroupAbortedError",
    "CollectiveMismatchError",
    "SegmentError",
]

__version__ = "0.1.0"

_WHERE = {  # name -> the module that defines it (each kernel module imports jit first)
    "Group": "engine.group",
    "ReduceOp": "native.ops",
    "new_shm_group": "shm.factory",
    "FileStore": "shm.store",
    "ShmcollError": "errors",
    "CollectiveTimeoutError": "errors",
    "PeerLostError": "errors",
    "GroupAbortedError": "errors",
    "CollectiveMismatchError": "errors",
    "SegmentError": "errors",
}


__getattr__, __dir__ = lazy_attributes(__name__, _WHERE)


def _register_torch_backend():
    from .torch_backend.plugin import register_when_torch_loads

    register_when_torch_loads()  # torch-free; never raises


_register_torch_backend()
