"""Rank-side scenarios of the isolation and guard tests (test_isolation.py,
test_failures.py, test_warm_init.py): kernels loaded behind the first collective, isolated
groups, bad arguments at engine and torch level, torch odds and ends.

Run by tests/_ranks.py (`python tests/_ranks.py '<json spec>'` dispatches a plain scenario name
here); each `scenario_<name>(c)` gets a `_ranks.Child`."""

import os
import threading
import time

from support.devshm import SEGMENT_PREFIX


def _hold_warm_up(c):
    """Hold this rank's warm-up (warmup.py) where it readies numba, holding numba's lock as
    that does, until release(c, rank) (or 60 s): the group's kernels load after that, and a
    thread of this rank that loads a kernel before waits on numba's lock (holding the job's
    compile lock, if it took it)."""
    from numba.core.compiler_lock import global_compiler_lock

    from shmcoll.engine import warmup
    ready_numba = warmup._ready_numba

    def held():
        with global_compiler_lock:
            _wait_file(_release_path(c, c.rank), 60)
            ready_numba()

    warmup._ready_numba = held


def _release_path(c, rank):
    return os.path.join(c.spec["store"], f"release-{rank}")


def _release(c, rank):
    open(_release_path(c, rank), "w").close()


def _compile_lock_free():
    """Whether the job's compile lock (jit.py) is free: the flock on its file (a second open
    file description conflicts with every other, in this process too) and the lock of this
    process's threads."""
    import fcntl

    from shmcoll.native import jit
    if not jit._tlock.acquire(blocking=False):
        return False
    jit._tlock.release()
    fd = os.open(os.path.join(jit.cache_dir(), jit.LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def _wait_file(path, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.path.exists(path)


def scenario_kernels_deferred(c):
    """Rank 0's warm-up is held (_hold_warm_up). args mode:
    "first": rank 1's warm-up is held too. Rank 0 reports whether its group came back
        before its warm-up finished, starts its first call (an all_reduce) in a thread,
        and reports whether the job's compile lock is free while both warm-ups are held
        (no first call, no p2p thread of either rank may have taken it); then it lets rank
        1's warm-up go, and rank 1 loads all its kernels and says so (a file); rank 0 gives
        its all_reduce time to finish wrongly, says whether it did, releases its warm-up
        and reports the all_reduce (and whether its kernels were loaded when it returned).
    "lost": rank 1 exits right after init without closing; rank 0 waits for its death,
        releases its warm-up and reports its first all_reduce's error.
    "close": both ranks close the group before any call; rank 0 releases its warm-up from
        a thread after 0.3 s, and each reports that close returned without error, after
        its warm-up."""
    import numpy as np
    from shmcoll.engine import warmup
    mode = c.args["mode"]
    peer_warm = os.path.join(c.spec["store"], "peer-warm")
    if c.rank == 0 or mode == "first":
        _hold_warm_up(c)
    c.new_group()
    a = np.full(4, c.rank + 1.0, np.float32)
    if mode == "close":
        if c.rank == 0:
            threading.Timer(0.3, _release, (c, 0)).start()
        try:
            c.group.close()
            c.emit("closed", ok=True, ready=warmup.wait_ready(0))
        except Exception as e:
            c.emit("closed", ok=False, **c.err(e))
        return
    if c.rank == 1:
        if mode == "lost":
            c.emit("exiting", pid=os.getpid())
            os._exit(0)
        c.emit("warm", ok=warmup.wait_ready(60) and warmup.ensure(60))
        open(peer_warm, "w").close()
        c.group.all_reduce(a)
        c.emit("first", value=float(a[0]))
        c.close()
        return
    c.emit("init", ready=warmup.wait_ready(0))
    if mode == "lost":
        peer = c.group._arena._pids[1]
        deadline = time.monotonic() + 60
        while c.group.is_peer_alive(1) and time.monotonic() < deadline:
            time.sleep(0.01)
        c.emit("peer_gone", pid=peer, gone=not c.group.is_peer_alive(1))
        _release(c, 0)
        try:
            c.group.all_reduce(a)
            c.emit("first", ok=True)
        except Exception as e:
            c.emit("first", ok=False, **c.err(e))
        c.close()
        return
    result = {}

    def first():
        try:
            c.group.all_reduce(a)
            result.update(ok=True, ready=warmup.wait_ready(0), value=float(a[0]))
        except Exception as e:
            result.update(ok=False, **c.err(e))

    thread = threading.Thread(target=first)
    thread.start()
    time.sleep(0.3)  # the first call and the p2p threads get going
    c.emit("locks", free=_compile_lock_free())
    _release(c, 1)
    c.emit("peer_warm", ok=_wait_file(peer_warm, 30))
    time.sleep(0.5)  # a first call that did not wait for the kernels would be done by now
    c.emit("held", first_done=not thread.is_alive())
    _release(c, 0)
    thread.join(60)
    c.emit("first", **result)
    c.close()


def scenario_creation_without_numba(c):
    """init_process_group("shm") with this rank's warm-up thread held before it starts
    (warmup.warm_up replaced by a wait, so nothing but the creation path runs in this
    process): report the numba / llvmlite modules and shmcoll's kernel modules imported
    when the group is back (there must be none: compiled.py), then let the warm-up go and
    report a first all_reduce, that numba is loaded after it, which of numba's registry
    modules are, and what prebuilt.counts() says was loaded and compiled."""
    import sys

    import torch

    from shmcoll.engine import warmup
    go = threading.Event()
    real = warmup.warm_up

    def held(reducers=None):
        go.wait(60)
        return real(reducers)

    warmup.warm_up = held
    c.new_group()
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("numba", "llvmlite"))
    kernel_modules = sorted(m for m in sys.modules if m in (
        "shmcoll.native.atomics", "shmcoll.native.reducers", "shmcoll.protocol.kernels", "shmcoll.p2p.cells",
        "shmcoll.native.single_copy_kernels", "shmcoll.native.prebuilt"))
    c.emit("created", heavy=heavy, kernel_modules=kernel_modules,
           ready=warmup.wait_ready(0))
    go.set()
    import torch.distributed as dist
    t = torch.full((4,), c.rank + 1.0)
    dist.all_reduce(t)
    from shmcoll.native import prebuilt
    registries = sorted(m for m in sys.modules if m in _NUMBA_REGISTRY_MODULES)
    c.emit("first", value=float(t[0]), numba="numba" in sys.modules, registries=registries,
           counts=prebuilt.counts())
    c.close()


# Modules only numba's registries import (CPUContext.refresh: its typing and lowering
# implementations), never numba's import or a kernel load (prebuilt.ready_runtime).
# numba.np.arrayobj (~30 ms with what it imports) is one: a reducer's cached code imported
# it through numba.carray's compiled helper until the reducers made their views with an
# intrinsic (reducers._view).
_NUMBA_REGISTRY_MODULES = ("numba.np.arraymath", "numba.np.linalg", "numba.cpython.listobj",
                           "numba.np.random.generator_methods", "numba.typed.listobject",
                           "numba.np.arrayobj")


# -- bullet 7: isolation ------------------------------------------------------------------------

def scenario_isolated(c):
    """args: base, iters. Collectives with job-specific values; report the segments mapped
    (from /proc/self/maps) and the group token, then wait for "go" (parent inspects)."""
    import numpy as np
    c.new_group()
    g, ws, base = c.group, c.world_size, c.args["base"]
    bad = 0
    for i in range(c.args["iters"]):
        a = np.full(256, base + c.rank + i, np.int64)
        g.all_reduce(a)
        bad += int((a != ws * (base + i) + ws * (ws - 1) // 2).any())
    token = c.store().get("shmcoll/1/token").decode()
    maps = {}
    for ln in open("/proc/self/maps"):
        if "/dev/shm/" + SEGMENT_PREFIX in ln:
            parts = ln.split()
            maps[parts[0]] = parts[5]
    c.emit("mapped", pid=os.getpid(), token=token, maps=maps, bad=bad)
    c.wait_cmd()
    c.close()


# -- bullet 8: bad arguments --------------------------------------------------------------------

def _engine_bad_calls(c):
    import numpy as np

    import shmcoll
    g, ws, R = c.group, c.world_size, shmcoll.ReduceOp
    f32 = np.zeros(4, np.float32)
    return {
        "broadcast root -1": lambda: g.broadcast(f32, -1),
        "broadcast root ws": lambda: g.broadcast(f32, ws),
        "reduce root ws": lambda: g.reduce(f32, ws),
        "gather root 99": lambda: g.gather(f32, [f32.copy() for _ in range(ws)], 99),
        "scatter root -1": lambda: g.scatter(f32, [f32.copy() for _ in range(ws)], -1),
        "all_gather short list": lambda: g.all_gather([f32.copy()] * (ws - 1), f32),
        "all_gather long list": lambda: g.all_gather([f32.copy()] * (ws + 1), f32),
        "all_gather wrong size": lambda: g.all_gather([np.zeros(5, np.float32)] * ws, f32),
        "all_gather mixed dtypes": lambda: g.all_gather(
            [np.zeros(4, np.int32) for _ in range(ws)], f32),
        "reduce_scatter long list": lambda: g.reduce_scatter(f32, [f32.copy()] * (ws + 1)),
        "reduce_scatter mixed dtypes": lambda: g.reduce_scatter(
            f32, [np.zeros(4, np.float64) for _ in range(ws)]),
        "scatter short list": lambda: g.scatter(f32, [f32.copy()] * (ws - 1), 0),
        "gather long list": lambda: g.gather(f32, [f32.copy()] * (ws + 1), 0),
        "all_to_all short list": lambda: g.all_to_all([f32.copy()] * (ws - 1), [f32] * ws),
        "all_to_all mixed dtypes": lambda: g.all_to_all(
            [np.zeros(4, np.float32) for _ in range(ws)], [np.zeros(4, np.int32)] * ws),
        "all_reduce list": lambda: g.all_reduce([1.0, 2.0]),
        "all_reduce object dtype": lambda: g.all_reduce(np.array([1, "a"], object)),
        "all_reduce str dtype": lambda: g.all_reduce(np.array(["ab", "cd"])),
        "all_reduce uint64": lambda: g.all_reduce(np.zeros(4, np.uint64)),
        "all_reduce bool AVG": lambda: g.all_reduce(np.zeros(4, bool), R.AVG),
        "all_reduce float BAND": lambda: g.all_reduce(f32, R.BAND),
        "all_reduce complex MAX": lambda: g.all_reduce(np.zeros(4, np.complex64), R.MAX),
        "all_reduce int AVG": lambda: g.all_reduce(np.zeros(4, np.int32), R.AVG),
        "reduce_scatter int PREMUL_SUM": lambda: g.reduce_scatter(
            np.zeros(4, np.int64), [np.zeros(4, np.int64)] * ws, R.PREMUL_SUM),
        "all_reduce op 99": lambda: g.all_reduce(f32, 99),
        "all_reduce bad dtype name": lambda: g.all_reduce(f32, R.SUM, "float8"),
        "all_reduce dtype width": lambda: g.all_reduce(f32, R.SUM, "bfloat16"),
    }


def _torch_bad_calls(c):
    import torch
    import torch.distributed as dist
    ws = c.world_size
    t = torch.zeros(4)
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))
    return {
        "broadcast src ws": lambda: dist.broadcast(t, ws, async_op=True),
        "reduce dst -1": lambda: dist.reduce(t, -1, async_op=True),
        "all_gather short list": lambda: dist.all_gather([torch.zeros(4)] * (ws - 1), t,
                                                         async_op=True),
        "all_gather mixed dtypes": lambda: dist.all_gather(
            [torch.zeros(4, dtype=torch.float64) for _ in range(ws)], t, async_op=True),
        "all_gather wrong size": lambda: dist.all_gather([torch.zeros(5) for _ in range(ws)],
                                                         t, async_op=True),
        "scatter long list": lambda: dist.scatter(t, [torch.zeros(4)] * (ws + 1), src=c.rank,
                                                  async_op=True),
        "gather wrong list": lambda: dist.gather(t, [torch.zeros(4)] * (ws + 2), dst=c.rank,
                                                 async_op=True),
        "all_to_all short list": lambda: dist.all_to_all([torch.zeros(4)] * (ws - 1),
                                                         [torch.zeros(4)] * (ws - 1),
                                                         async_op=True),
        "all_reduce sparse MAX": lambda: dist.all_reduce(sparse, dist.ReduceOp.MAX,
                                                         async_op=True),
        "broadcast sparse": lambda: dist.broadcast(sparse, 0, async_op=True),
        "all_gather sparse": lambda: dist.all_gather([sparse] * ws, sparse, async_op=True),
        "all_reduce meta": lambda: dist.all_reduce(torch.empty(4, device="meta"),
                                                   async_op=True),
        "broadcast meta": lambda: dist.broadcast(torch.empty(4, device="meta"), 0,
                                                 async_op=True),
        "all_reduce bool AVG": lambda: dist.all_reduce(torch.zeros(4, dtype=torch.bool),
                                                       dist.ReduceOp.AVG, async_op=True),
        "all_reduce float BAND": lambda: dist.all_reduce(t, dist.ReduceOp.BAND, async_op=True),
        "all_reduce complex MAX": lambda: dist.all_reduce(torch.zeros(4, dtype=torch.complex64),
                                                          dist.ReduceOp.MAX, async_op=True),
        "all_reduce uint32": lambda: dist.all_reduce(torch.zeros(4, dtype=torch.uint32),
                                                     async_op=True),
    }


def scenario_bad_args(c):
    """Rank 0 makes every bad call (each must raise at call time); then all ranks run a
    matched collective, which only works if no bad call consumed a seq or posted."""
    import numpy as np
    c.new_group()
    c.wait_kernels()  # the first call's wait for them is not what dt times
    if c.rank == 0:
        calls = _torch_bad_calls(c) if c.torch else _engine_bad_calls(c)
        seq0 = None if c.torch else c.group.seq
        for name, fn in calls.items():
            t0 = time.monotonic()
            try:
                fn()
                c.emit("bad", name=name, ok=True)
            except Exception as e:
                c.emit("bad", name=name, dt=time.monotonic() - t0, **c.err(e))
        if seq0 is not None:
            c.emit("seq", before=seq0, after=c.group.seq)
    ws = c.world_size
    if c.torch:
        import torch
        import torch.distributed as dist
        t = torch.full((6,), c.rank + 1.0)
        dist.all_reduce(t)
        ok = bool((t == ws * (ws + 1) / 2).all())
        out = [torch.zeros(2) for _ in range(ws)]
        dist.all_gather(out, torch.full((2,), float(c.rank)))
        ok = ok and all(bool((o == j).all()) for j, o in enumerate(out))
    else:
        a = np.full(6, c.rank + 1.0, np.float32)
        c.group.all_reduce(a, timeout_s=60)
        ok = bool((a == ws * (ws + 1) / 2).all())
    c.emit("followup", ok=ok)
    c.close()


# -- torch: mismatch + timeout on a subgroup + destroy ---------------------------------------------

def scenario_torch_misc(c):
    """Torch level: a mismatch (all_reduce vs broadcast) then a matched call; a timeout on a
    new group with a short timeout (rank 1 absent); destroy_process_group; report maps."""
    import datetime

    import torch
    import torch.distributed as dist
    c.new_group()
    ws = c.world_size
    t = torch.full((8,), c.rank + 1.0)
    before = t.clone()
    try:
        if c.rank == 0:
            dist.all_reduce(t)
        else:
            dist.broadcast(t, 0)
        c.emit("mismatch", ok=True)
    except Exception as e:
        c.emit("mismatch", unchanged=bool(torch.equal(t, before)), **c.err(e))
    t = torch.full((8,), c.rank + 1.0)
    dist.all_reduce(t)
    c.emit("followup", ok=bool((t == ws * (ws + 1) / 2).all()))
    short = dist.new_group(backend="shm", timeout=datetime.timedelta(seconds=c.args["short"]))
    dist.all_reduce(t, group=short)  # warm-up on the new group
    if c.rank == 0:
        t0 = time.monotonic()
        try:
            dist.all_reduce(t, group=short)
            c.emit("timeout", ok=True)
        except Exception as e:
            c.emit("timeout", elapsed=time.monotonic() - t0, **c.err(e))
    dist.barrier()  # the default group still works
    c.emit("world_ok")
    c.wait_cmd()
    dist.destroy_process_group()
    c.emit("destroyed")


# -- bullet 9: fuzz and soak ---------------------------------------------------------------------
