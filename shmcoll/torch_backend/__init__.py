"""The torch.distributed adapter (leaf): registers backend "shm" over the engine.

Private torch symbols touched (checked against torch 2.13.0): subclassing
`torch.distributed.ProcessGroup` and `torch.distributed.Work` from Python (the pybind
trampolines), `dist.Backend.register_backend(..., extended_api=True)` with
`_DistributedBackendOptions` fields (store, group_rank, group_size, timeout, group_id).
"""

import torch.distributed as dist

from ..shm_group import new_shm_group
from .process_group import EngineProcessGroup

__all__ = ["register", "EngineProcessGroup", "create_shm_process_group"]


def create_shm_process_group(backend_opts, pg_options=None):
    """Creator for dist.Backend.register_backend: one engine Group per torch group."""
    timeout_s = backend_opts.timeout.total_seconds()
    group = new_shm_group(backend_opts.store, backend_opts.group_rank, backend_opts.group_size,
                          timeout_s=timeout_s, name=str(backend_opts.group_id))
    return EngineProcessGroup(group, "shm")


def register():
    """Register backend "shm" with torch.distributed (idempotent)."""
    if "SHM" in dist.Backend._plugins:
        return
    dist.Backend.register_backend("shm", create_shm_process_group, extended_api=True,
                                  devices=["cpu"])
