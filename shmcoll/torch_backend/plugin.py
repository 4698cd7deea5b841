"""Backend "shm" as a torch.distributed plugin: its creator and its registration.

Importing this module imports neither torch nor the engine (numba): it is on the path of
every `import torch` in an environment where shmcoll is installed. Three ways in, all ending
in register(), which is idempotent and cheap (the creator it registers imports the adapter
and the engine on its first call, inside init_process_group / new_group):

- torch >= 2.5 calls autoload() at the end of `import torch` (the `torch.backends` entry
  point in pyproject.toml; TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns that off). An exception
  there would become a failure of `import torch` for every program in the environment, so
  autoload() never raises: a failed registration is a warning.
- `import shmcoll` with torch already imported: register_when_torch_loads() registers now.
- `import shmcoll` before torch (autoload off, or torch 2.4): register_when_torch_loads()
  registers right after torch.distributed's import (import_hook.after_import).

Private torch symbols touched (checked against torch 2.13.0): `dist.Backend._plugins` (is
the name taken) and `dist.Backend.register_backend(..., extended_api=True)` with the
`_DistributedBackendOptions` fields store, group_rank, group_size, timeout, group_id,
global_ranks_in_group.
"""

import os

from .import_hook import after_import

__all__ = ["create_shm_process_group", "register", "register_when_torch_loads", "autoload",
           "register_guarded", "NAME"]

NAME = "shm"


def create_shm_process_group(backend_opts, pg_options=None):
    """Creator for dist.Backend.register_backend: a DeferredProcessGroup, which makes one
    engine Group per torch group, or, when its ranks span nodes, a hierarchical one
    (hier_pg.new_process_group decides), on a background thread (deferred.py;
    SHMCOLL_EAGER_INIT=1: before returning).

    The group keeps the (prefixed) store: monitored_barrier and split_group use it.
    init_process_group's timeout wins over pg_options._timeout (as for gloo/NCCL)."""
    from . import compat  # torch's version is checked here, in the caller's thread
    compat.require_supported_torch()
    from .. import config
    from .deferred import DeferredProcessGroup

    store, rank, size = backend_opts.store, backend_opts.group_rank, backend_opts.group_size
    timeout, name = backend_opts.timeout, str(backend_opts.group_id)
    global_ranks = list(getattr(backend_opts, "global_ranks_in_group", []))
    environ = dict(os.environ)  # the group is made with the environment of this call
    eager = config.from_env(environ).eager_init  # a bad SHMCOLL_* value fails here

    def make():  # on the creation thread: the adapter and the engine load here
        from .hier_pg import new_process_group
        from .pg_args import ShmOptions

        with config.environment(environ):
            options = ShmOptions.coerce(pg_options)
            options.global_ranks_in_group = global_ranks
            pg = new_process_group(store, rank, size, options, timeout=timeout,
                                   group_name=name)
        layout = getattr(pg, "layout", None)  # several nodes: the ranks on this machine count
        _warn_if_threads_oversubscribe(size if layout is None else
                                       layout.ranks_on_machine(rank))
        return pg

    return DeferredProcessGroup(make, rank, size, store, name, timeout.total_seconds(),
                                eager=eager)


_threads_warned = False


def _warn_if_threads_oversubscribe(world_size):
    """Once per process: ranks x intra-op threads above the cores. Each rank's large tensor
    ops then leave OpenMP workers spin-waiting on the cores its peers need (measured: a
    16 MiB all_reduce at 2 ranks on 2 cores took 9-72 ms instead of ~2.8 ms), which is why
    torchrun sets OMP_NUM_THREADS=1. A warning only: the thread count is the user's call."""
    global _threads_warned
    if _threads_warned or world_size < 2:
        return
    import warnings

    import torch
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
    engine, CUDA tensors through cuda_ipc (imported when the first one arrives). Imports
    torch.distributed; does nothing where torch was built without it."""
    import torch.distributed as dist
    if not dist.is_available() or NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(NAME, create_shm_process_group, extended_api=True,
                                  devices=["cpu", "cuda"])


def register_when_torch_loads():
    """register() now if torch is imported, else right after torch.distributed is (what
    `import shmcoll` does: it never imports torch itself). Never raises: warns."""
    after_import("torch.distributed", autoload)


def autoload():
    """The `torch.backends` entry point: torch >= 2.5 calls it at the end of `import torch`.
    Never raises (that would fail `import torch` itself): a failure to register warns."""
    register_guarded(NAME, register)


def register_guarded(name, register_fn):
    """register_fn(), with whatever it raises turned into a warning naming backend `name`
    (and silenced where warnings are errors): what runs inside `import torch` never raises."""
    try:
        register_fn()
    except Exception as error:  # noqa: BLE001 -- see above
        try:
            import warnings
            warnings.warn(
                f"shmcoll: torch.distributed backend {name!r} not registered "
                f"({type(error).__name__}: {error}); init_process_group({name!r}) will not "
                f"find it. TORCH_DEVICE_BACKEND_AUTOLOAD=0 skips this at `import torch`",
                RuntimeWarning, stacklevel=3)
        except Exception:  # noqa: BLE001
            pass
