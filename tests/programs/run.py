"""Run the programs in one set of ranks: every program on every backend, one after another.

run_in_processes(rank, world_size, store, names, backends): a harness job (tests/harness.py
runs it on 2 pooled rank processes). For each backend it initialises the default group
(file:// rendezvous in the store's directory), runs every program named, and destroys the
group: gloo and shm run in the same processes, one process start for all programs.

run_on_threads(rank, world_size, names, workdir, store): the body of a threaded_pg.spawn
(the default group is "threaded" already; `store`, shared by the rank threads, is where they
agree on failures).

Each program's outcome is ("ok", {name: tensor}) or ("error", "Type: first line", traceback).
After a program failed on any rank, the ranks agree on it through a store (not the process
group, which may be the broken thing) and start a fresh default group for the next program,
so a failure never spills into the programs after it. The old group object is kept: work a
failed program left in flight may still hold it, and a gloo group whose last reference goes
away on one of its own worker threads joins that thread from itself ("terminate called
after throwing std::system_error: Resource deadlock avoided", seen after the quantization
hooks' failure).
"""

import datetime
import os
import traceback

import torch
import torch.distributed as dist

from . import programs

__all__ = ["run_in_processes", "run_on_threads", "GROUP_TIMEOUT_S"]

GROUP_TIMEOUT_S = 30.0  # a program's collective that cannot complete fails within this


def _outcome(fn, rank, world_size, workdir):
    try:
        return "ok", fn(rank, world_size, workdir)
    except Exception as e:  # reported per program; the test compares it with gloo's
        first = (str(e).strip().splitlines() or [""])[0]
        return "error", f"{type(e).__name__}: {first}", traceback.format_exc()


def _run_all(rank, world_size, names, workdir, store, restart, tag, between=None):
    """{name: outcome} of every program in `names` on the current default group, each
    started after every rank finished the one before (`between()` runs before each)."""
    table = programs()
    results = {}
    for name in names:
        if between is not None:
            between()
        sub = os.path.join(workdir, name)
        os.makedirs(sub, exist_ok=True)
        results[name] = _outcome(table[name].fn, rank, world_size, sub)
        failed = results[name][0] == "error"
        store.set(f"{tag}/{name}/{rank}", "1" if failed else "0")
        others = [store.get(f"{tag}/{name}/{r}") for r in range(world_size)]
        if any(v in (b"1", "1") for v in others):
            restart(name)
    return results


_RETIRED = []  # default groups replaced after a failed program (see the docstring)


def _retire_default_group():
    from shmcoll.torch_backend.deferred import DeferredProcessGroup

    group = dist.group.WORLD
    backend = group._get_backend(torch.device("cpu"))
    _RETIRED.append(group)
    dist.destroy_process_group()
    if isinstance(backend, DeferredProcessGroup):
        backend.shutdown()  # ours releases its memory now; gloo's threads stay with it


def _init(backend, rank, world_size, init_method):
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))


def run_in_processes(rank, world_size, store, names, backends):
    """{backend: {program: outcome}} (a tests/harness.py job: `store` is its FileStore)."""
    import shmcoll  # noqa: F401  (registers "shm")

    torch.set_num_threads(1)
    out = {}
    for i, backend in enumerate(backends):
        if i:  # the previous backend's groups are gone on every rank (see _torn_down)
            _torn_down(store, backends[i - 1], world_size)
        workdir = os.path.join(store.path, f"work_{backend}")
        os.makedirs(workdir, exist_ok=True)
        generation = [0]

        def init():
            url = f"file://{store.path}/rdv_{backend}_{generation[0]}"
            _init(backend, rank, world_size, url)

        def restart(name):
            _retire_default_group()
            generation[0] += 1
            init()

        init()
        try:
            out[backend] = _run_all(rank, world_size, names, workdir, store, restart,
                                    f"programs/{backend}")
        finally:
            dist.destroy_process_group()
        store.set(f"programs/{backend}/torn_down/{rank}", "1")
    return out


def _torn_down(store, backend, world_size):
    """Wait (the store's deadline, 300 s) until every rank destroyed `backend`'s groups.

    A group's teardown may wait out its timeout on one rank only: on torch 2.4, rank 0's
    destroy_process_group() of the gloo group after the programs once stayed in the call for
    more than GROUP_TIMEOUT_S (no Python frame below it: gloo's C++ teardown) while rank 1
    went on, and rank 1's "shm" init then timed out in node discovery waiting for rank 0
    (1 run in ~10). The next backend's init starts together on every rank, so its timeout
    measures its own rendezvous."""
    for r in range(world_size):
        store.get(f"programs/{backend}/torn_down/{r}")


def run_on_threads(rank, world_size, names, workdir, store):
    """{program: outcome} on rank threads (inside threaded_pg.spawn)."""
    import threaded_pg

    backend = threaded_pg.backend_name()
    default_store = dist.distributed_c10d._get_default_store()
    generation = [0]

    def restart(name):
        _retire_default_group()
        generation[0] += 1
        dist.init_process_group(
            backend, store=dist.PrefixStore(f"restart{generation[0]}", default_store),
            rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))

    return _run_all(rank, world_size, names, workdir, store, restart, "programs/threaded",
                    between=_clear_active_ddp_module)


def _clear_active_ddp_module():
    """DDP marks the module whose forward is running in a class attribute, saving and
    restoring the previous value: rank threads interleaving their forwards leave another
    rank's module there for good, and a later torch.compile then believes it runs inside a
    DDP forward (DDPOptimizer: "First bucket should be smaller/equal to other buckets").
    No DDP forward runs between programs: clear it (THREADED_PG.md, what rank threads share)."""
    from torch.nn.parallel import DistributedDataParallel
    DistributedDataParallel._active_ddp_module = None
