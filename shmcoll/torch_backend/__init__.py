"""The torch.distributed adapter (leaf): registers backend "shm" over the engine.

Private torch symbols touched (checked against torch 2.13.0): subclassing
`torch.distributed.ProcessGroup` and `torch.distributed.Work` from Python (the pybind
trampolines), `dist.Backend.register_backend(..., extended_api=True)` with
`_DistributedBackendOptions` fields (store, group_rank, group_size, timeout, group_id).
"""

import os
import warnings

import torch
import torch.distributed as dist

from .hier_pg import HierProcessGroup, new_process_group
from .process_group import EngineProcessGroup, ProcessGroupShm, ShmOptions

__all__ = ["register", "EngineProcessGroup", "ProcessGroupShm", "HierProcessGroup",
           "ShmOptions", "create_shm_process_group", "new_process_group"]


def create_shm_process_group(backend_opts, pg_options=None):
    """Creator for dist.Backend.register_backend: one engine Group per torch group, or,
    when its ranks span nodes, a hierarchical one (hier_pg.new_process_group decides).

    The group keeps the (prefixed) store: monitored_barrier and split_group use it.
    init_process_group's timeout wins over pg_options._timeout (as for gloo/NCCL)."""
    options = ShmOptions.coerce(pg_options)
    options.global_ranks_in_group = list(getattr(backend_opts, "global_ranks_in_group", []))
    pg = new_process_group(backend_opts.store, backend_opts.group_rank,
                           backend_opts.group_size, options, timeout=backend_opts.timeout,
                           group_name=str(backend_opts.group_id))
    layout = getattr(pg, "layout", None)  # several nodes: the ranks on this machine count
    _warn_if_threads_oversubscribe(backend_opts.group_size if layout is None else
                                   layout.ranks_on_machine(backend_opts.group_rank))
    return pg


_threads_warned = False


def _warn_if_threads_oversubscribe(world_size):
    """Once per process: ranks x intra-op threads above the cores. Each rank's large tensor
    ops then leave OpenMP workers spin-waiting on the cores its peers need (measured: a
    16 MiB all_reduce at 2 ranks on 2 cores took 9-72 ms instead of ~2.8 ms), which is why
    torchrun sets OMP_NUM_THREADS=1. A warning only: the thread count is the user's call."""
    global _threads_warned
    if _threads_warned or world_size < 2:
        return
    threads = torch.get_num_threads()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    if threads > 1 and threads * world_size > cores:
        _threads_warned = True
        warnings.warn(
            f"shm: {world_size} ranks x {threads} intra-op threads each exceed this host's "
            f"{cores} cores; idle OpenMP workers spin and slow every collective. Set "
            f"OMP_NUM_THREADS={max(1, cores // world_size)} (torchrun does) or call "
            f"torch.set_num_threads({max(1, cores // world_size)}) in each rank.",
            RuntimeWarning, stacklevel=3)


def register():
    """Register backend "shm" with torch.distributed (idempotent): CPU tensors through the
    engine, CUDA tensors through cuda_ipc (imported when the first one arrives)."""
    if "SHM" in dist.Backend._plugins:
        return
    dist.Backend.register_backend("shm", create_shm_process_group, extended_api=True,
                                  devices=["cpu", "cuda"])
