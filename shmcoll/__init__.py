"""shmcoll: collectives between ranks on one machine through POSIX shared memory.

Engine API (numpy only): new_shm_group(store, rank, world_size) -> Group.
With torch installed, importing shmcoll registers the torch.distributed backend "shm".
"""

# First: jit gives numba a writable cache directory (or a private one) before any module
# defines a cached kernel; numba refuses to define them at import when it finds none.
from . import jit  # noqa: F401,I001
from .errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    GroupAbortedError,
    PeerLostError,
    SegmentError,
    ShmcollError,
)
from .group import Group
from .ops import ReduceOp
from .shm_group import new_shm_group
from .store import FileStore

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


def _register_torch_backend():
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        return  # numpy-only install: the engine works without torch
    from .torch_backend import register

    register()


_register_torch_backend()
