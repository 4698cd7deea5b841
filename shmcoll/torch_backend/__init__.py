"""The torch.distributed adapter (leaf): registers backend "shm" over the engine.

Private torch symbols touched (checked against torch 2.13.0): subclassing
`torch.distributed.ProcessGroup` and `torch.distributed.Work` from Python (the pybind
trampolines), `dist.Backend.register_backend(..., extended_api=True)` with
`_DistributedBackendOptions` fields (store, group_rank, group_size, timeout, group_id).
"""

import torch.distributed as dist

from .process_group import EngineProcessGroup, ProcessGroupShm, ShmOptions

__all__ = ["register", "EngineProcessGroup", "ProcessGroupShm", "ShmOptions",
           "create_shm_process_group"]


def create_shm_process_group(backend_opts, pg_options=None):
    """Creator for dist.Backend.register_backend: one engine Group per torch group.

    The group keeps the (prefixed) store: monitored_barrier and split_group use it.
    init_process_group's timeout wins over pg_options._timeout (as for gloo/NCCL)."""
    options = ShmOptions.coerce(pg_options)
    options.global_ranks_in_group = list(getattr(backend_opts, "global_ranks_in_group", []))
    return ProcessGroupShm(backend_opts.store, backend_opts.group_rank, backend_opts.group_size,
                           options, timeout=backend_opts.timeout,
                           group_name=str(backend_opts.group_id))


def register():
    """Register backend "shm" with torch.distributed (idempotent)."""
    if "SHM" in dist.Backend._plugins:
        return
    dist.Backend.register_backend("shm", create_shm_process_group, extended_api=True,
                                  devices=["cpu"])
