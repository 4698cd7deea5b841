"""Rank-side scenarios of the failure tests (test_failures.py, test_warm_init.py): lost
peers, stalls, abort, mismatches and their cost, leaks, deaths during init.

Run by tests/_ranks.py (`python tests/_ranks.py '<json spec>'` dispatches a plain scenario name
here); each `scenario_<name>(c)` gets a `_ranks.Child`."""

import os
import sys
import threading
import time

from _ranks import SETUP_TIMEOUT_S
from support.devshm import dev_shm_mappings


# -- bullet 1: lost peers ---------------------------------------------------------------------

def scenario_lost_peer(c):
    """args: victim, op (all_reduce | broadcast | barrier | big_all_reduce), how (kill |
    exit | close), nbytes. Survivors loop `op`; the victim is killed by the parent, exits
    normally on "go", or closes its group on "go" and stays alive."""
    victim, op, how = c.args["victim"], c.args["op"], c.args["how"]
    c.new_group()
    run = c.collective(op, c.args.get("nbytes", 64))
    run()  # warm-up: the group works and kernels are loaded
    c.emit("ready", pid=os.getpid())
    if c.rank == victim:
        if how == "kill" and op == "big_all_reduce":
            while True:  # killed mid-collective by the parent
                run()
                c.emit("iter")
        c.wait_cmd()
        if how == "exit":
            c.emit("leaving")
            sys.exit(0)  # a normal interpreter exit, without joining the collective
        if how == "close":
            c.close()
            c.emit("closed")
            c.wait_cmd()  # stay alive: the survivors must learn it from the group state
        return
    c.emit("entering")
    try:
        while True:
            run()
            c.emit("iter")
    except Exception as e:
        c.emit("error", **c.err(e))
    t0 = time.monotonic()
    try:
        run()
        c.emit("again", ok=True)
    except Exception as e:
        c.emit("again", dt=time.monotonic() - t0, **c.err(e))
    c.close()
    try:
        run()
        c.emit("after_close", ok=True)
    except Exception as e:
        c.emit("after_close", **c.err(e))


# -- bullet 2 / 10: stalled ranks, timeouts, flight record -------------------------------------

def scenario_stall(c):
    """args: victim, op_timeout (None: the group timeout). The victim does not arrive (the
    parent may SIGSTOP it) until "go"; survivors time out."""
    import logging
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="LOG %(name)s %(message)s")
    victim, op_timeout = c.args["victim"], c.args.get("op_timeout")
    # Init and warm up under a generous timeout: the short one is for the stalled call only
    # (on a loaded host the ranks' imports and kernel loads can skew them by seconds).
    c.new_group(timeout_s=max(c.timeout_s, SETUP_TIMEOUT_S))
    c.collective("all_reduce", 64)()
    c.collective("broadcast", 256)()
    c.group.timeout_s = c.timeout_s  # the group timeout under test, from here on
    run = c.collective("all_reduce", 64, timeout_s=op_timeout)
    c.emit("ready", pid=os.getpid())
    if c.rank == victim:
        c.wait_cmd()
        t0 = time.monotonic()
        try:
            run()
            c.emit("late", ok=True)
        except Exception as e:
            c.emit("late", dt=time.monotonic() - t0, **c.err(e))
        c.close()
        c.emit("closed")
        return
    c.emit("entering")
    t0 = time.monotonic()
    try:
        run()
        c.emit("error", ok=True)
    except Exception as e:
        c.emit("error", elapsed=time.monotonic() - t0, **c.err(e))
    t0 = time.monotonic()
    try:
        run()
    except Exception as e:
        c.emit("again", dt=time.monotonic() - t0, **c.err(e))
    c.close()
    c.emit("closed")


# -- bullet 3: abort from another thread ------------------------------------------------------

def scenario_abort(c):
    """args: api (engine | torch_abort | torch_shutdown), delay. Rank 0 blocks in all_reduce
    (rank 1 does not arrive); a thread aborts the group after `delay` s."""
    c.new_group()
    run = c.collective("all_reduce")
    run()
    c.emit("ready", pid=os.getpid())
    if c.rank != 0:
        c.wait_cmd()
        try:
            run()
            c.emit("late", ok=True)
        except Exception as e:
            c.emit("late", **c.err(e))
        try:
            c.close()
        except Exception as e:
            c.emit("close_error", **c.err(e))
        return
    api, stamps = c.args["api"], {}

    def aborter():
        time.sleep(c.args.get("delay", 0.5))
        stamps["abort"] = time.monotonic()
        if api == "engine":
            c.group.abort()
        elif api == "torch_abort":
            c.group.abort()
        else:
            c.group.shutdown()
        stamps["returned"] = time.monotonic()

    th = threading.Thread(target=aborter)
    th.start()
    try:
        run()
        c.emit("error", ok=True)
    except Exception as e:
        c.emit("error", since_abort=time.monotonic() - stamps.get("abort", float("nan")),
               **c.err(e))
    th.join()
    c.emit("abort_returned", took=stamps["returned"] - stamps["abort"])
    try:
        run()
        c.emit("again", ok=True)
    except Exception as e:
        c.emit("again", **c.err(e))
    try:
        c.close()
    except Exception as e:
        c.emit("close_error", **c.err(e))


# -- bullet 4: mismatches, and the cost of the check -------------------------------------------

MISMATCH_CASES = ("collective", "dtype", "count", "count_chunked", "shape", "root", "op",
                  "reduce_scatter_sizes")


def _mismatch_call(c, case):
    """(callable, user buffers) for this rank's side of `case`: rank 0 differs."""
    import numpy as np
    g, odd = c.group, c.rank == 0
    r = c.rank
    if case == "collective":
        a = np.full(8, r + 1.0, np.float32)
        return ((lambda: g.all_reduce(a)) if odd else (lambda: g.broadcast(a, 0))), [a]
    if case == "dtype":
        a = np.full(8, r + 1, np.float32 if odd else np.int32)
        return (lambda: g.all_reduce(a)), [a]
    if case == "count":
        a = np.full(8 if odd else 9, r + 1.0, np.float32)
        return (lambda: g.all_reduce(a)), [a]
    if case == "count_chunked":  # several slots' worth: the check precedes chunk 1's reduce
        a = np.full(3000 + (1 if odd else 0), r + 1.0, np.float32)
        return (lambda: g.all_reduce(a)), [a]
    if case == "shape":
        a = np.full((2, 6) if odd else (3, 4), r + 1.0, np.float32)
        return (lambda: g.all_reduce(a)), [a]
    if case == "root":
        a = np.full(8, r + 1.0, np.float32)
        return (lambda: g.broadcast(a, 0 if odd else 1)), [a]
    if case == "op":
        a = np.full(8, r + 1.0, np.float32)
        op = c.shmcoll.ReduceOp.SUM if odd else c.shmcoll.ReduceOp.MAX
        return (lambda: g.all_reduce(a, op)), [a]
    if case == "reduce_scatter_sizes":
        ws = c.world_size
        sizes = [2] * ws if odd else [1] * (ws - 1) + [ws + 1]
        ins = [np.full(s, r + 1.0, np.float32) for s in sizes]
        out = np.full(sizes[r], -1.0, np.float32)
        return (lambda: g.reduce_scatter(out, ins)), ins + [out]
    raise ValueError(case)


def scenario_mismatch(c):
    """For each case: rank 0 calls one thing, the others another; record the error and
    whether any user buffer changed; then a matched all_reduce must work."""
    import numpy as np

    import shmcoll
    c.shmcoll = shmcoll
    c.new_group()
    ok_sum = c.world_size * (c.world_size + 1) / 2
    for case in c.args["cases"]:
        fn, bufs = _mismatch_call(c, case)
        before = [b.copy() for b in bufs]
        seq = c.group.seq
        t0 = time.monotonic()
        try:
            fn()
            c.emit("case", case=case, ok=True)
        except Exception as e:
            c.emit("case", case=case, dt=time.monotonic() - t0, seq=seq,
                   unchanged=all(np.array_equal(b, a) for b, a in zip(before, bufs)),
                   **c.err(e))
        x = np.full(5, c.rank + 1.0, np.float32)
        c.group.all_reduce(x, timeout_s=30)
        c.emit("followup", case=case, ok=bool((x == ok_sum).all()))
    c.close()


def scenario_fp_cost(c):
    """Time an 8-byte all_reduce with the fingerprint check on and off (Arena.verify),
    alternating every call (same processes, same run, same load): per-call samples."""
    import numpy as np

    c.new_group()
    a = np.ones(1, np.float64)
    g = c.group
    arena = g._arena
    for _ in range(500):  # warm-up
        g.all_reduce(a)
    n = c.args["iters"]
    # the mode of each call from a shared seed (identical on both ranks), random rather than
    # alternating: strict alternation locks onto the ranks' period-2 arrival pattern
    modes = np.random.default_rng(12345).integers(0, 2, n).astype(bool)
    samples = np.empty(n)
    clock = time.perf_counter
    for i in range(n):
        arena.verify = not modes[i]
        t0 = clock()
        g.all_reduce(a)
        samples[i] = clock() - t0
    arena.verify = True
    us = samples * 1e6
    c.emit("times", on=[float(np.percentile(us[~modes], q)) for q in (10, 25, 50)],
           off=[float(np.percentile(us[modes], q)) for q in (10, 25, 50)])
    c.close()


# -- bullet 5: leaks ----------------------------------------------------------------------------

def scenario_leak(c):
    """args: mode (normal | exception | kill_all | destroy). `destroy` needs torch=True."""
    mode = c.args["mode"]
    c.new_group()
    run = c.collective("all_reduce", 1 << 16)
    run()
    c.emit("alive", pid=os.getpid(), maps=dev_shm_mappings())
    if mode == "kill_all":
        while True:
            run()
            c.emit("iter")
    c.wait_cmd()
    if mode == "exception":
        raise RuntimeError("deliberate failure after init, without closing the group")
    c.close()
    c.emit("done")


def scenario_init_killed(c):
    """Pause inside init so the parent can SIGKILL the rank where a segment name exists:
    args pause_at = "create" (right after creating it: before publishing it, so nobody can
    attach) or "attach" (after publishing it, before attaching peers: peers attach it and
    then wait for this rank)."""
    from shmcoll.shm import segments as shm
    where = c.args.get("pause_at", "create")
    create, attach = shm.ShmRegions._create, shm.ShmRegions._attach

    def pause(name):
        c.emit("created", name=name.lstrip("/"), pid=os.getpid())
        time.sleep(3600)

    def paused_create(self, name, token):
        region = create(self, name, token)
        if where == "create":
            pause(name)
        return region

    def paused_attach(self, name, token, peer):
        if where == "attach":
            pause(self._my_name)
        return attach(self, name, token, peer)

    shm.ShmRegions._create = paused_create
    shm.ShmRegions._attach = paused_attach
    c.new_group()


# -- bullet 6: resource limits ------------------------------------------------------------------

def scenario_init_only(c):
    """Create the group, report how that went (args announce: emit "waiting" with the key
    whenever init starts waiting for a store key)."""
    if c.args.get("announce"):
        from shmcoll.shm import segments as shm
        wait_key = shm.wait_key

        def announced(store, key, *a, **k):
            c.emit("waiting", key=key)
            return wait_key(store, key, *a, **k)

        shm.wait_key = announced
    t0 = time.monotonic()
    try:
        c.new_group()
        c.emit("init", ok=True)
        c.close()
    except Exception as e:
        c.emit("init", ok=False, elapsed=time.monotonic() - t0, **c.err(e))


# -- warm init: the group is returned before its kernels are loaded ------------------------------
