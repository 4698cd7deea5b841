"""Real rank processes for the failure, isolation, fuzz and soak tests.

Parent side (imported by tests): `Job(scenario, world_size, tmp_path, ...)` starts one
process per rank as `python tests/_ranks.py '<json spec>'` and gives the test what it needs to
hurt them: their pids, SIGKILL/SIGSTOP/SIGCONT, a line on their stdin ("go"), the JSON events
they print on stdout (each stamped with time.monotonic(), which is one clock for every process
of the machine, so "seconds from SIGKILL to error" is a plain subtraction), and their stderr
(the log, for the flight-record dump). A Job never outlives its test: leaving the `with`
block SIGCONTs and SIGKILLs whatever still runs.

Child side: `scenario_<name>(c)` below; every rank runs the same function with its own `c`
(a `Child`). Engine-level children block `import torch` so they start in about a second on
a loaded 2-core host (importing shmcoll would otherwise import torch to register the "shm"
backend); torch-level children (`torch=True`) import it and init backend "shm".

Also here: `shm_entries(pids)` (the /dev/shm snapshot the leak tests compare) and the
fuzz reference model (`make_input`, `reference`) that the fuzz workers check against.
"""

import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "shmcoll-"
FOREIGN_PREFIXES = ("sem.", "psm_")  # POSIX semaphores / multiprocessing.shared_memory
SETUP_TIMEOUT_S = 60.0  # init and warm-up of scenarios whose timeout under test is short


# ================================================================================== parent

def shm_entries(pids=None):
    """A /dev/shm snapshot: with `pids`, the `shmcoll-*` segments owned by those pids (the
    owner pid is the last field of a name); without, every `shmcoll-*`, `sem.*` and `psm_*`
    entry (POSIX semaphores, multiprocessing.shared_memory)."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return set()
    if pids is not None:
        owners = {str(p) for p in pids}
        return {n for n in names if n.startswith(SEGMENT_PREFIX) and n.rsplit("-", 1)[-1] in owners}
    return {n for n in names if n.startswith((SEGMENT_PREFIX,) + FOREIGN_PREFIXES)}


def new_foreign_entries(before, settle_s=3.0):
    """sem.*/psm_* entries that appeared since `before` and are still there after
    `settle_s`. Not attributable to a pid (other jobs on this machine create them, e.g.
    multiprocessing's named semaphores), so tests only report them; that *our* processes
    create none is checked through their mappings (`dev_shm_mappings`)."""
    deadline = time.monotonic() + settle_s
    while True:
        new = {n for n in shm_entries() - before if n.startswith(FOREIGN_PREFIXES)}
        if not new or time.monotonic() > deadline:
            return new
        time.sleep(0.2)


def dev_shm_mappings(pid="self"):
    """Every /dev/shm file mapped by process `pid` ({path: deleted?})."""
    out = {}
    with open(f"/proc/{pid}/maps") as f:
        for ln in f:
            parts = ln.split(None, 5)
            if len(parts) == 6 and parts[5].startswith(SHM_DIR + "/"):
                path = parts[5].rstrip("\n")
                deleted = path.endswith(" (deleted)")
                out[path[:-len(" (deleted)")] if deleted else path] = deleted
    return out


class Job:
    """`world_size` rank processes running scenario `scenario` of SCRIPT (the child side)."""

    SCRIPT = "_ranks.py"  # a subclass may run the scenarios of another module

    def __init__(self, scenario, world_size, tmp_path, args=None, torch=False, env=None,
                 timeout_s=60.0, store=None, ranks=None):
        self.world_size = world_size
        self.store = str(store or os.path.join(str(tmp_path), f"store-{uuid.uuid4().hex[:8]}"))
        os.makedirs(self.store, exist_ok=True)
        self._events = {}
        self.died = {}  # rank -> time.monotonic() when its process ended
        self._cv = threading.Condition()
        self.procs = {}
        self._stderr = {}
        child_env = dict(os.environ)
        child_env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                          "PYTHONPATH": REPO + os.pathsep + child_env.get("PYTHONPATH", "")})
        child_env.update({k: str(v) for k, v in (env or {}).items()})
        for rank in (range(world_size) if ranks is None else ranks):
            spec = {"scenario": scenario, "rank": rank, "world_size": world_size,
                    "store": self.store, "timeout_s": timeout_s, "args": args or {},
                    "torch": torch}
            err_path = os.path.join(str(tmp_path), f"{scenario}-{uuid.uuid4().hex[:6]}-r{rank}.err")
            self._stderr[rank] = err_path
            with open(err_path, "wb") as err:
                p = subprocess.Popen([sys.executable, os.path.join(HERE, self.SCRIPT),
                                      json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=err, env=child_env,
                                     cwd=REPO)
            self.procs[rank] = p
            self._events[rank] = []
            threading.Thread(target=self._read, args=(rank, p), daemon=True).start()
            threading.Thread(target=self._watch, args=(rank, p.pid), daemon=True).start()

    # -- events ------------------------------------------------------------------------

    def _watch(self, rank, pid):
        """Stamp the moment the rank's process ends (pidfd: without reaping it)."""
        import select
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return
        try:
            select.select([fd], [], [])
            self.died[rank] = time.monotonic()
        finally:
            os.close(fd)

    def _read(self, rank, p):
        for raw in p.stdout:
            try:
                ev = json.loads(raw)
            except ValueError:
                continue  # stray print
            with self._cv:
                self._events[rank].append(ev)
                self._cv.notify_all()
        with self._cv:
            self._events[rank].append({"ev": "<eof>"})
            self._cv.notify_all()

    def events(self, rank, name=None):
        with self._cv:
            return [e for e in self._events[rank] if name is None or e["ev"] == name]

    def event(self, rank, name, timeout_s=120.0, count=1):
        """The `count`-th event `name` of `rank` (waits for it); AssertionError on timeout or
        if the rank exits first (with its stderr tail)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                found = [e for e in self._events[rank] if e["ev"] == name]
                if len(found) >= count:
                    return found[count - 1]
                if any(e["ev"] == "<eof>" for e in self._events[rank]):
                    raise AssertionError(f"rank {rank} exited (rc {self.procs[rank].poll()}) "
                                         f"before event {name!r}; events "
                                         f"{self._events[rank]}\n{self.stderr(rank)[-3000:]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"rank {rank}: no event {name!r} within {timeout_s} s; "
                                         f"events {self._events[rank]}\n"
                                         f"{self.stderr(rank)[-3000:]}")
                self._cv.wait(min(left, 0.5))

    def all_ranks(self, name, timeout_s=120.0, ranks=None):
        return {r: self.event(r, name, timeout_s) for r in (ranks or self.procs)}

    # -- control -----------------------------------------------------------------------

    @property
    def pids(self):
        return {r: p.pid for r, p in self.procs.items()}

    def signal(self, rank, sig):
        """Send `sig`; returns time.monotonic() just before sending."""
        t = time.monotonic()
        os.kill(self.procs[rank].pid, sig)
        return t

    def send(self, rank, line="go"):
        """Write a line to the rank's stdin (what `Child.wait_cmd` returns)."""
        try:
            self.procs[rank].stdin.write((line + "\n").encode())
            self.procs[rank].stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def stderr(self, rank):
        try:
            with open(self._stderr[rank], "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def join(self, timeout_s=60.0, ranks=None):
        """Wait for the ranks to exit; returns {rank: returncode}. A rank still running after
        `timeout_s` is a hang: every rank is killed and the test fails."""
        deadline = time.monotonic() + timeout_s
        codes = {}
        for r in (ranks or list(self.procs)):
            p = self.procs[r]
            try:
                codes[r] = p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill_all()
                raise AssertionError(f"rank {r} (pid {p.pid}) hung: still running {timeout_s} s "
                                     f"after join; events {self.events(r)}\n"
                                     f"{self.stderr(r)[-3000:]}") from None
        return codes

    def kill_all(self):
        for p in self.procs.values():
            if p.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(p.pid, sig)
                    except ProcessLookupError:
                        pass
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.procs.values():
            try:
                p.stdin.close()
            except OSError:
                pass
        self.kill_all()
        return False


def error_class_names(ev):
    """Class names in the MRO of the error an event reported."""
    return set(ev.get("mro", []))


# =================================================================================== child

class Child:
    """What a scenario function gets: rank, args, events out, commands in, the group."""

    def __init__(self, spec):
        self.spec = spec
        self.rank = spec["rank"]
        self.world_size = spec["world_size"]
        self.args = spec["args"]
        self.timeout_s = spec["timeout_s"]
        self.torch = spec["torch"]
        self.group = None

    def emit(self, ev, **kw):
        kw.update(ev=ev, rank=self.rank, t=time.monotonic())
        sys.stdout.write(json.dumps(kw, default=str) + "\n")
        sys.stdout.flush()

    def wait_cmd(self):
        """Block until the parent writes a line (or closes our stdin)."""
        return sys.stdin.readline().strip()

    @staticmethod
    def err(e):
        return {"type": type(e).__name__, "msg": str(e), "peer": getattr(e, "peer", None),
                "mro": [k.__name__ for k in type(e).__mro__]}

    def store(self):
        import shmcoll
        return shmcoll.FileStore(self.spec["store"])

    def new_group(self, timeout_s=None):
        """The engine group (engine level) or the default torch group (torch level)."""
        t = self.timeout_s if timeout_s is None else timeout_s
        if self.torch:
            import datetime

            import torch.distributed as dist

            import shmcoll  # noqa: F401  (registers backend "shm")
            dist.init_process_group(
                "shm", store=dist.FileStore(os.path.join(self.spec["store"], "torch"),
                                            self.world_size),
                rank=self.rank, world_size=self.world_size,
                timeout=datetime.timedelta(seconds=t))
            self.group = dist.group.WORLD
        else:
            import shmcoll
            self.group = shmcoll.new_shm_group(self.store(), self.rank, self.world_size,
                                               timeout_s=t)
        return self.group

    def wait_kernels(self):
        """Wait until the group's kernels are loaded: its first call does (Group's kernel
        gate, warmup.py), so a scenario that times its calls waits here first."""
        if self.torch:
            import torch
            import torch.distributed as dist
            pg = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
            pg.group.wait_kernels()
        else:
            self.group.wait_kernels()

    def close(self):
        if self.torch:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        elif self.group is not None:
            self.group.close()

    def collective(self, op, nbytes=64, timeout_s=None):
        """A zero-argument callable running one `op` on the group, checking the result."""
        import numpy as np
        rank, ws = self.rank, self.world_size
        n = max(1, nbytes // 4)
        if self.torch:
            import torch
            import torch.distributed as dist
            t = torch.empty(n)
            if op in ("all_reduce", "big_all_reduce"):
                def run():
                    t.fill_(rank + 1.0)
                    dist.all_reduce(t)
                    assert float(t[0]) == ws * (ws + 1) / 2, float(t[0])
            elif op == "broadcast":
                def run():
                    t.fill_(rank)
                    dist.broadcast(t, 0)
                    assert float(t[-1]) == 0.0
            elif op == "barrier":
                def run():
                    dist.barrier()
            else:
                raise ValueError(op)
            return run
        g = self.group
        a = np.empty(n, np.float32)
        if op in ("all_reduce", "big_all_reduce"):
            def run():
                a[:] = rank + 1.0
                g.all_reduce(a, timeout_s=timeout_s)
                assert a[0] == ws * (ws + 1) / 2 and a[-1] == a[0], (a[0], a[-1])
        elif op == "broadcast":
            def run():
                a[:] = rank
                g.broadcast(a, 0, timeout_s=timeout_s)
                assert a[-1] == 0.0
        elif op == "barrier":
            def run():
                g.barrier(timeout_s=timeout_s)
        else:
            raise ValueError(op)
        return run


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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
    from shmcoll import shm
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
        from shmcoll import shm
        wait_key = shm._wait_key

        def announced(store, key, *a, **k):
            c.emit("waiting", key=key)
            return wait_key(store, key, *a, **k)

        shm._wait_key = announced
    t0 = time.monotonic()
    try:
        c.new_group()
        c.emit("init", ok=True)
        c.close()
    except Exception as e:
        c.emit("init", ok=False, elapsed=time.monotonic() - t0, **c.err(e))


# -- warm init: the group is returned before its kernels are loaded ------------------------------

def _hold_warm_up(c):
    """Hold this rank's warm-up (warmup.py) where it readies numba, holding numba's lock as
    that does, until release(c, rank) (or 60 s): the group's kernels load after that, and a
    thread of this rank that loads a kernel before waits on numba's lock (holding the job's
    compile lock, if it took it)."""
    from numba.core.compiler_lock import global_compiler_lock

    from shmcoll import warmup
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

    from shmcoll import jit
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
    from shmcoll import warmup
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

def scenario_fuzz_worker(c):
    """Run programs (JSON lines on stdin) on the world group and lazily created subgroups;
    check every result against the numpy reference; report one event per program."""
    import numpy as np

    import shmcoll
    groups = {tuple(range(c.world_size)): c.new_group()}
    c.emit("ready", pid=os.getpid())
    while True:
        line = c.wait_cmd()
        if not line or line == "quit":
            break
        program = json.loads(line)
        if "seed" in program:  # every rank draws the same program from the shared seed
            program["ops"] = random_program(program["seed"], c.world_size, program["length"])
        problems, executed = [], 0
        try:
            for i, op in enumerate(program["ops"]):
                members = tuple(op.get("members") or range(c.world_size))
                if c.rank not in members:
                    continue
                g = groups.get(members)
                if g is None:
                    store = shmcoll.FileStore(os.path.join(c.spec["store"],
                                                           "sub-" + "-".join(map(str, members))))
                    g = groups[members] = shmcoll.new_shm_group(
                        store, members.index(c.rank), len(members), timeout_s=c.timeout_s)
                why = run_fuzz_op(g, op, members)
                executed += 1
                if why:
                    problems.append(f"op {i} {op}: {why}")
        except Exception as e:
            c.emit("done", id=program["id"], ok=False, problems=problems, **c.err(e))
            return
        c.emit("done", id=program["id"], ok=not problems, problems=problems[:5],
               executed=executed)
    for g in groups.values():
        g.close()


def scenario_soak(c):
    """args: iters, checkpoints. Small mixed collectives; every result checked; RSS sampled."""
    import numpy as np
    c.new_group()
    g, ws, r = c.group, c.world_size, c.rank
    a = np.empty(16, np.float32)
    b = np.empty(32, np.int64)
    outs = np.empty(8 * ws, np.int32)
    x = np.empty(8, np.int32)
    bad, rss = 0, {}
    checkpoints = set(c.args["checkpoints"])
    t0 = time.monotonic()
    for i in range(c.args["iters"]):
        k = i % 4
        if k == 0:
            a[:] = r + i % 7
            g.all_reduce(a)
            bad += a[0] != ws * (i % 7) + ws * (ws - 1) / 2
        elif k == 1:
            b[:] = r * 1000 + i
            g.broadcast(b, i % ws)
            bad += b[-1] != (i % ws) * 1000 + i
        elif k == 2:
            x[:] = r + i
            g.all_gather(outs, x)
            bad += outs[-1] != ws - 1 + i
        else:
            g.barrier()
        if i + 1 in checkpoints:
            rss[i + 1] = _rss_bytes()
    c.emit("soak", bad=int(bad), rss=rss, seconds=time.monotonic() - t0,
           per_call_us=(time.monotonic() - t0) / max(1, c.args["iters"]) * 1e6)
    c.close()


# ============================================================= fuzz reference model (both sides)

FUZZ_DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64",
               "bool", "complex64")


def _np_dtype(name):
    import numpy as np
    return np.dtype(np.uint16) if name == "bfloat16" else np.dtype(name)


def _bf16_to_f32(bits):
    import numpy as np
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(x):
    import numpy as np
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


FUZZ_KINDS = ("all_reduce", "reduce", "broadcast", "all_gather", "gather", "scatter",
              "reduce_scatter", "all_to_all", "barrier")
REDUCING = ("all_reduce", "reduce", "reduce_scatter")
BITWISE = ("BAND", "BOR", "BXOR")


def ops_for(dtype):
    """Reduce ops the engine supports for `dtype` (names)."""
    from shmcoll.ops import _OPS_BY_KIND, DTYPES
    return sorted(o.name for o in _OPS_BY_KIND[DTYPES[dtype].kind])


def random_program(seed, world_size, length, max_count=3000):
    """`length` random ops for `world_size` ranks from `seed` (numpy only, identical on every
    rank): collectives, dtypes, sizes (many beyond one slot), ops, roots, subgroups,
    strided views, uneven reduce_scatter/all_to_all splits."""
    import numpy as np
    rng = np.random.default_rng(seed)
    ops = []
    for _ in range(length):
        kind = FUZZ_KINDS[rng.integers(len(FUZZ_KINDS))]
        dtype = FUZZ_DTYPES[rng.integers(len(FUZZ_DTYPES))]
        members = None
        if world_size > 2 and rng.random() < 0.3:
            k = int(rng.integers(2, world_size + 1))
            members = sorted(int(m) for m in rng.choice(world_size, k, replace=False))
        n = len(members) if members else world_size
        count = int(rng.integers(0, 17) if rng.random() < 0.6 else rng.integers(17, max_count))
        op = {"kind": kind, "dtype": dtype, "count": count, "members": members,
              "root": int(rng.integers(n)), "seed": int(rng.integers(1 << 31)),
              "strided": bool(rng.random() < 0.3)}
        if kind in REDUCING:
            names = ops_for(dtype)
            op["op"] = names[rng.integers(len(names))]
        if kind == "reduce_scatter" and rng.random() < 0.5:
            op["sizes"] = [int(v) for v in rng.integers(0, 40, n)]
        if kind == "all_to_all":
            op["matrix"] = [[int(v) for v in rng.integers(0, 600, n)] for _ in range(n)]
        ops.append(op)
    return ops


def make_input(seed, rank, dtype, count, bitwise=False):
    """The input of `rank` for one op: small integers (exact in every dtype, sums and
    products of 4 of them too), bit patterns for bitwise ops."""
    import numpy as np
    rng = np.random.default_rng([seed, rank])
    if dtype == "bool":
        return rng.integers(0, 2, count).astype(bool)
    if bitwise or dtype == "uint8":
        vals = rng.integers(0, 4 if not bitwise else 64, count)
    else:
        vals = rng.integers(-3, 4, count)
    if dtype == "bfloat16":
        return _f32_to_bf16(vals.astype(np.float32))
    if dtype == "complex64":
        return (vals + 1j * rng.integers(-3, 4, count)).astype(np.complex64)
    return vals.astype(dtype)


def reference_reduce(inputs, dtype, op, premul=2.0):
    """Exact reduction over ranks of `inputs` (list of arrays) as the engine defines it."""
    import numpy as np
    n = len(inputs)
    if dtype == "bool":
        x = np.stack(inputs)
        if op in ("SUM", "MAX", "BOR"):
            return x.any(0)
        if op in ("PRODUCT", "MIN", "BAND"):
            return x.all(0)
        return np.bitwise_xor.reduce(x, 0)
    if dtype in ("float16", "bfloat16"):
        x = np.stack([_bf16_to_f32(a) if dtype == "bfloat16" else a.astype(np.float32)
                      for a in inputs]).astype(np.float64)
    else:
        x = np.stack(inputs)
    red = {"SUM": lambda v: v.sum(0, dtype=v.dtype), "AVG": lambda v: v.sum(0) / n,
           "PREMUL_SUM": lambda v: (v * premul).sum(0),
           "PRODUCT": lambda v: v.prod(0, dtype=v.dtype), "MIN": lambda v: v.min(0),
           "MAX": lambda v: v.max(0), "BAND": lambda v: np.bitwise_and.reduce(v, 0),
           "BOR": lambda v: np.bitwise_or.reduce(v, 0),
           "BXOR": lambda v: np.bitwise_xor.reduce(v, 0)}[op](x)
    if dtype == "bfloat16":
        return _f32_to_bf16(red.astype(np.float32))
    if dtype == "float16":
        return red.astype(np.float32).astype(np.float16)
    return red.astype(inputs[0].dtype)


def _same(got, want, dtype, op):
    import numpy as np
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    if op in ("AVG",) and dtype not in ("bool",):
        g = _bf16_to_f32(got) if dtype == "bfloat16" else got
        w = _bf16_to_f32(want) if dtype == "bfloat16" else want
        ok = np.allclose(g.astype(np.complex128), w.astype(np.complex128), rtol=1e-2, atol=1e-2)
    else:
        ok = np.array_equal(got.view(np.uint8) if got.dtype == bool else got,
                            want.view(np.uint8) if want.dtype == bool else want)
    if ok:
        return None
    bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))[:4]
    return (f"{dtype} {op}: got {got.reshape(-1)[bad].tolist()} want "
            f"{want.reshape(-1)[bad].tolist()} at {bad.tolist()}")


def _strided(arr, strided):
    """`arr`'s values in a strided view (every other element of a 2x buffer)."""
    import numpy as np
    if not strided or arr.ndim != 1:
        return arr
    buf = np.zeros(arr.size * 2, arr.dtype)
    view = buf[::2]
    view[:] = arr
    return view


def run_fuzz_op(g, op, members):
    """Run one fuzz op on group `g` (this rank's part); return a problem string or None."""
    import numpy as np

    import shmcoll
    kind, dtype, count, seed = op["kind"], op["dtype"], op["count"], op["seed"]
    n, me = len(members), g.rank
    root = op.get("root", 0) % n
    red = op.get("op", "SUM")
    bitwise = red in ("BAND", "BOR", "BXOR")
    eng_dtype = "bfloat16" if dtype == "bfloat16" else None
    premul = 2.0
    ins = [make_input(seed, j, dtype, count, bitwise) for j in range(n)]
    strided = op.get("strided", False)
    if kind == "barrier":
        g.barrier()
        return None
    if kind == "all_reduce":
        a = _strided(ins[me].copy(), strided)
        g.all_reduce(a, shmcoll.ReduceOp[red], eng_dtype, premul=premul)
        return _same(np.ascontiguousarray(a), reference_reduce(ins, dtype, red, premul), dtype,
                     red)
    if kind == "reduce":
        a = _strided(ins[me].copy(), strided)
        g.reduce(a, root, shmcoll.ReduceOp[red], eng_dtype, premul=premul)
        want = reference_reduce(ins, dtype, red, premul) if me == root else ins[me]
        return _same(np.ascontiguousarray(a), want, dtype, red if me == root else "SUM")
    if kind == "broadcast":
        a = _strided(ins[me].copy(), strided)
        g.broadcast(a, root)
        return _same(np.ascontiguousarray(a), ins[root], dtype, "SUM")
    if kind == "all_gather":
        outs = [np.zeros(count, ins[0].dtype) for _ in range(n)]
        g.all_gather(outs, _strided(ins[me], strided))
        for j in range(n):
            why = _same(outs[j], ins[j], dtype, "SUM")
            if why:
                return f"from rank {j}: {why}"
        return None
    if kind == "gather":
        outs = [np.zeros(count, ins[0].dtype) for _ in range(n)] if me == root else None
        g.gather(_strided(ins[me], strided), outs, root)
        for j in range(n if me == root else 0):
            why = _same(outs[j], ins[j], dtype, "SUM")
            if why:
                return f"from rank {j}: {why}"
        return None
    if kind == "scatter":
        rng = np.random.default_rng([seed, 999])
        pieces = [make_input(int(rng.integers(1 << 30)), j, dtype, count) for j in range(n)]
        out = _strided(np.zeros(count, pieces[0].dtype), strided)
        g.scatter(out, pieces if me == root else None, root)
        return _same(np.ascontiguousarray(out), pieces[me], dtype, "SUM")
    if kind == "reduce_scatter":
        sizes = op.get("sizes") or [count] * n
        blocks = {j: [make_input(seed * 31 + j, k, dtype, sizes[k], bitwise) for k in range(n)]
                  for j in range(n)}  # blocks[j][k]: rank j's contribution to rank k
        out = np.zeros(sizes[me], blocks[0][0].dtype)
        g.reduce_scatter(out, blocks[me], shmcoll.ReduceOp[red], eng_dtype, premul=premul)
        want = reference_reduce([blocks[j][me] for j in range(n)], dtype, red, premul)
        return _same(out, want, dtype, red)
    if kind == "all_to_all":
        sz = op["matrix"]  # sz[j][k]: elements rank j sends to rank k
        data = {j: [make_input(seed * 17 + j, k, dtype, sz[j][k]) for k in range(n)]
                for j in range(n)}
        outs = [np.zeros(sz[j][me], data[0][0].dtype) for j in range(n)]
        g.all_to_all(outs, data[me])
        for j in range(n):
            why = _same(outs[j], data[j][me], dtype, "SUM")
            if why:
                return f"from rank {j}: {why}"
        return None
    raise ValueError(kind)


# ============================================================================== entry point

def main():
    spec = json.loads(sys.argv[1])
    module, _, name = spec["scenario"].rpartition(".")
    if not spec["torch"] and not module:
        sys.modules["torch"] = None  # engine level: shmcoll imports without the torch adapter
    c = Child(spec)
    try:
        # "module.name": a scenario of another module in tests/ (cuda_ipc's use torch)
        scenarios = importlib.import_module(module).__dict__ if module else globals()
        scenarios["scenario_" + name](c)
    except SystemExit:
        raise
    except BaseException as e:
        c.emit("crash", **c.err(e))
        raise


if __name__ == "__main__":
    main()
