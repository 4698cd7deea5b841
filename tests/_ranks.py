"""Real rank processes for the failure, isolation, fuzz and soak tests.

Parent side (imported by tests): `Job(scenario, world_size, tmp_path, ...)` starts one
process per rank as `python tests/_ranks.py '<json spec>'` and gives the test what it needs to
hurt them: their pids, SIGKILL/SIGSTOP/SIGCONT, a line on their stdin ("go"), the JSON events
they print on stdout (each stamped with time.monotonic(), which is one clock for every process
of the machine, so "seconds from SIGKILL to error" is a plain subtraction), and their stderr
(the log, for the flight-record dump). A Job never outlives its test: leaving the `with`
block SIGCONTs and SIGKILLs whatever still runs.

Child side: every rank runs the same `scenario_<name>(c)` with its own `c` (a `Child`). The
scenarios live by subject in _scenarios_faults.py (lost peers, stalls, abort, mismatches,
leaks, init), _scenarios_guards.py (isolation, kernels, bad arguments, torch odds and ends)
and _scenarios_fuzz.py (fuzz and soak workers, and the fuzz reference model); `main()` finds a
plain name there, "module.name" in another module of tests/. Engine-level children block
`import torch` so they start in about a second on a loaded 2-core host (importing shmcoll would
otherwise import torch to register the "shm" backend); torch-level children (`torch=True`)
import it and init backend "shm".

The /dev/shm snapshots the leak tests compare (`shm_entries(pids)`, ...) are in
support/devshm.py.
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
SETUP_TIMEOUT_S = 60.0  # init and warm-up of scenarios whose timeout under test is short


# ================================================================================== parent

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


# ============================================================================== entry point

SCENARIO_MODULES = ("_scenarios_faults", "_scenarios_guards", "_scenarios_fuzz")


def _scenario(module, name):
    """`scenario_<name>` of `module`, or of this module (a script such as _hier_ranks.py may
    add its own) or the SCENARIO_MODULES where `module` is empty."""
    if module:
        return getattr(importlib.import_module(module), "scenario_" + name)
    if "scenario_" + name in globals():
        return globals()["scenario_" + name]
    for m in SCENARIO_MODULES:
        fn = getattr(importlib.import_module(m), "scenario_" + name, None)
        if fn is not None:
            return fn
    raise KeyError(f"no scenario {name!r} in {SCENARIO_MODULES}")


def main():
    spec = json.loads(sys.argv[1])
    module, _, name = spec["scenario"].rpartition(".")
    if not spec["torch"] and not module:
        sys.modules["torch"] = None  # engine level: shmcoll imports without the torch adapter
    c = Child(spec)
    try:
        # "module.name": a scenario of another module in tests/ (cuda_ipc's use torch)
        _scenario(module, name)(c)
    except SystemExit:
        raise
    except BaseException as e:
        c.emit("crash", **c.err(e))
        raise


if __name__ == "__main__":
    main()
