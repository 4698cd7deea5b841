"""Run one function on every rank of a group and collect the per-rank results.

    run_ranks(fn, world_size, kind="processes", timeout_s=60, args=(), env=None)
        fn(rank, world_size, store, *args) on every rank, with `env` (e.g. SHMCOLL_SLOT_BYTES;
        None unsets) set for the job; `store` is a fresh rendezvous store
        (shmcoll.FileStore in a new temp dir for "processes"). Inside fn, build the engine
        group with `harness.new_group(store, rank, world_size)` so the same fn runs on every
        kind. Returns [result of rank 0, result of rank 1, ...].

    run_torch_ranks(fn, world_size, backend="shm", timeout_s=60, args=(), init="file")
        fn(rank, world_size, *args) after dist.init_process_group(backend, ...) in every rank;
        the default group is destroyed afterwards, whatever happened.

Failures (gloo's spawnThreads, torch's spawn_threads_and_init_comms): the first rank error is
re-raised as RankError("rank r: <original traceback>") and the other ranks are killed (those
still running dump their stacks to stderr first). Nothing can hang: past `timeout_s`, stuck
ranks dump their stacks to stderr, every rank is killed and RankTimeout names the ranks that
did not finish.

Kinds are pluggable: KINDS maps a name to a Kind(run, new_group, available). The threaded
engine adds "threads" there (see the marked block below); test files parametrize over
available_kinds() and need no edit.

"processes" keeps a pool of spawned worker processes across tests (spawning and importing
torch costs several seconds per process on a loaded 2-core host). A worker runs one job at a
time; any failure, timeout or a job that leaves torch.distributed initialized discards the
whole pool, so the next job starts from fresh processes.
"""

import contextlib
import dataclasses
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Callable

__all__ = [
    "Kind", "KINDS", "available_kinds", "run_ranks", "run_torch_ranks", "new_group",
    "RankError", "RankTimeout", "free_port", "patched_environ", "our_pids", "shutdown_pool",
    "made",
]

POOL_START_TIMEOUT_S = 300.0  # spawning + importing torch/numba on a loaded 2-core host
KILL_GRACE_S = 1.0  # after the first error: time for other ranks to report (message only)
POOL_MIN_WORKERS = 4  # world sizes 1-4 are the common case


class RankError(Exception):
    """A rank raised: message "rank r: <original traceback>"."""

    def __init__(self, rank, type_name, text, note=""):
        super().__init__(f"rank {rank}: {text}{note}")
        self.rank = rank
        self.type_name = type_name
        self.text = text


class RankTimeout(RankError):
    """Some ranks did not finish within timeout_s (all were killed)."""

    def __init__(self, ranks, timeout_s, note=""):
        Exception.__init__(self, f"ranks {ranks} did not finish within {timeout_s} s "
                                 f"(all ranks killed; stacks of the stuck ranks are on stderr)"
                                 f"{note}")
        self.rank = ranks[0] if ranks else -1
        self.ranks = ranks
        self.type_name = "RankTimeout"
        self.text = str(self)


@dataclasses.dataclass(frozen=True)
class Kind:
    """How ranks run: run(fn, world_size, timeout_s, args, env) -> per-rank results;
    new_group(store, rank, world_size, timeout_s) -> shmcoll.Group; available() -> bool."""

    run: Callable
    new_group: Callable
    available: Callable = lambda: True


# -------------------------------------------------------------------- active kind (per rank)

_active_kind = "processes"


def active_kind():
    """The kind the current rank runs under (set by the kind's runner before calling fn)."""
    return _active_kind


@contextlib.contextmanager
def running_as(kind):
    global _active_kind
    previous, _active_kind = _active_kind, kind
    try:
        yield
    finally:
        _active_kind = previous


def new_group(store, rank, world_size, timeout_s=60.0):
    """The engine Group of this rank for the active kind (slot size etc. from SHMCOLL_* env)."""
    return KINDS[_active_kind].new_group(store, rank, world_size, timeout_s)


def _new_shm_group(store, rank, world_size, timeout_s):
    import shmcoll
    return shmcoll.new_shm_group(store, rank, world_size, timeout_s=timeout_s)


@contextlib.contextmanager
def patched_environ(env):
    """Set `env` (name -> value, or None to unset) in os.environ for the duration."""
    env = env or {}
    saved = {k: os.environ.get(k) for k in env}
    try:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = str(v)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------------------- the worker

def _worker_main(conn):
    """Loop of one pooled worker: run jobs until told to stop or the parent goes away."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 cores shared by up to 4+ ranks
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    try:
        import shmcoll  # noqa: F401  (imports numba and torch once per worker, registers "shm")
    except BaseException:
        conn.send(("fatal", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        job_id, fn, rank, world_size, store_path, args, env = job
        try:
            with patched_environ(env), running_as("processes"):
                from shmcoll import FileStore
                result = fn(rank, world_size, FileStore(store_path), *args)
            reply = ("ok", job_id, result)
        except BaseException as e:
            reply = ("err", job_id, type(e).__name__, traceback.format_exc())
        reply += (_is_clean(),)
        try:
            conn.send(reply)
        except Exception:  # unpicklable result: report that instead
            conn.send(("err", job_id, "PicklingError", traceback.format_exc(), False))


def _is_clean():
    """False when the job left state behind that a later job must not inherit."""
    dist = sys.modules.get("torch.distributed")
    try:
        return not (dist is not None and dist.is_available() and dist.is_initialized())
    except Exception:
        return False


class _Worker:
    def __init__(self, ctx, slot):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True,
                                name=f"shmcoll-test-rank-worker-{slot}")
        self.proc.start()
        child.close()
        self.ready = False

    def kill(self):
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)
        self.conn.close()


class _Pool:
    """Spawned workers reused across jobs; worker i runs rank i."""

    def __init__(self):
        self._ctx = multiprocessing.get_context("spawn")
        self.workers = []
        self._job_id = 0

    def ensure(self, n):
        # Start all the usual ranks at once: they import torch concurrently, once.
        while len(self.workers) < max(n, POOL_MIN_WORKERS):
            self.workers.append(_Worker(self._ctx, len(self.workers)))
        deadline = time.monotonic() + POOL_START_TIMEOUT_S
        for w in self.workers:
            if w.ready:
                continue
            remaining = deadline - time.monotonic()
            if not w.conn.poll(max(remaining, 0)):
                raise RuntimeError(f"test worker {w.proc.name} did not start within "
                                   f"{POOL_START_TIMEOUT_S} s")
            try:
                msg = w.conn.recv()
            except EOFError:
                raise RuntimeError(f"test worker {w.proc.name} exited at start (code "
                                   f"{w.proc.exitcode})") from None
            if msg[0] != "ready":
                raise RuntimeError(f"test worker {w.proc.name} failed at start:\n{msg[1]}")
            w.ready = True

    def pids(self):
        return [w.proc.pid for w in self.workers]

    def run(self, fn, world_size, timeout_s, args, env):
        self.ensure(world_size)
        self._job_id += 1
        job_id = self._job_id
        workers = self.workers[:world_size]
        store_path = tempfile.mkdtemp(prefix="shmcoll_test_store_")
        try:
            for rank, w in enumerate(workers):
                w.conn.send((job_id, fn, rank, world_size, store_path, args, env))
            return self._collect(workers, job_id, timeout_s)
        finally:
            shutil.rmtree(store_path, ignore_errors=True)

    def _collect(self, workers, job_id, timeout_s):
        results = [None] * len(workers)
        pending = set(range(len(workers)))
        errors = []  # (rank, type name, traceback text) in arrival order
        clean = True
        deadline = time.monotonic() + timeout_s
        while pending:
            if errors:  # short grace so the message can say what the others did
                wait_s = min(deadline, errors[0][3] + KILL_GRACE_S) - time.monotonic()
                if wait_s <= 0:
                    break
            else:
                wait_s = deadline - time.monotonic()
                if wait_s <= 0:
                    break
            ready = multiprocessing.connection.wait(
                [workers[r].conn for r in pending] + [workers[r].proc.sentinel for r in pending],
                timeout=wait_s)
            for r in sorted(pending):
                w = workers[r]
                if w.conn in ready or (w.proc.sentinel in ready and w.conn.poll()):
                    try:
                        msg = w.conn.recv()
                    except EOFError:
                        msg = None
                elif w.proc.sentinel in ready:
                    msg = None
                else:
                    continue
                pending.discard(r)
                if msg is None:
                    w.proc.join(5)  # reap it, so its exit code is known
                    errors.append((r, "ProcessExit", f"worker process exited with code "
                                   f"{w.proc.exitcode} (killed or crashed)", time.monotonic()))
                    clean = False
                elif msg[1] != job_id:
                    errors.append((r, "HarnessError", f"stale reply {msg!r}", time.monotonic()))
                    clean = False
                elif msg[0] == "ok":
                    results[r] = msg[2]
                    clean = clean and msg[3]
                else:
                    errors.append((r, msg[2], msg[3], time.monotonic()))
                    clean = False
        if not pending and not errors:
            if not clean:
                _discard_pool("a job left torch.distributed initialized")
            return results
        stuck = sorted(pending)
        for r in stuck:  # stacks to stderr (what a stuck rank waited on), then kill
            print(f"--- harness: stack of stuck rank {r} (pid {workers[r].proc.pid}) ---",
                  file=sys.stderr, flush=True)
            with contextlib.suppress(OSError):
                os.kill(workers[r].proc.pid, signal.SIGUSR1)
            time.sleep(0.3)  # one dump at a time, so they do not interleave
        _discard_pool("a rank failed or timed out")
        if errors:
            rank, type_name, text, _ = errors[0]
            others = [f"rank {r}: {text.strip().splitlines()[-1]}" for r, _, text, _ in errors[1:]]
            note = ""
            if others:
                note += "\n(also failed: " + "; ".join(others) + ")"
            if stuck:
                note += (f"\n(still running when killed: ranks {stuck}; their stacks are on "
                         f"stderr)")
            raise RankError(rank, type_name, text.rstrip(), note)
        raise RankTimeout(stuck, timeout_s)

    def close(self):
        for w in self.workers:
            with contextlib.suppress(Exception):
                w.conn.send(None)
        for w in self.workers:
            w.proc.join(5)
            w.kill()
        self.workers = []


_pool = None
_retired_pids = []


def _get_pool():
    global _pool
    if _pool is None:
        _pool = _Pool()
    return _pool


def _discard_pool(reason=""):
    global _pool
    if _pool is not None:
        pool, _pool = _pool, None
        _retired_pids.extend(pool.pids())
        for w in pool.workers:
            w.kill()


def shutdown_pool():
    """Stop the pooled workers (end of session)."""
    global _pool
    if _pool is not None:
        pool, _pool = _pool, None
        _retired_pids.extend(pool.pids())
        pool.close()


def our_pids():
    """Pids of every worker process this harness started (for leak attribution)."""
    pids = list(_retired_pids)
    if _pool is not None:
        pids += _pool.pids()
    return pids


def _run_processes(fn, world_size, timeout_s, args, env):
    pool = _get_pool()
    try:
        return pool.run(fn, world_size, timeout_s, args, env)
    except BaseException:
        # A failure was handled (pool gone already); an interruption (pytest-timeout,
        # Ctrl-C, a harness bug) leaves workers mid-job: discard them too.
        if _pool is pool:
            _discard_pool("interrupted")
        raise


# ---------------------------------------------------------------------- registry of kinds
# ==== KINDS registry: add a kind here (e.g. "threads": ranks as threads over threaded_pg).
# A runner must honour the contract of run_ranks (results in rank order; RankError /
# RankTimeout on failure; never hang) and wrap each rank's call in running_as(<kind>).
KINDS = {
    "processes": Kind(run=_run_processes, new_group=_new_shm_group),
}
# ==== end of KINDS registry


# ==== "threads" kind (owner: threaded_pg): ranks are threads of this process running the
# same algorithms over in-process regions; the store is the run's threaded_pg.Rendezvous.
def _run_threads(fn, world_size, timeout_s, args, env):
    import threaded_pg

    # running_as is set once around the whole run (not per rank thread): _active_kind is a
    # module global, and per-thread save/restore would race between the rank threads.
    with patched_environ(env), running_as("threads"):
        try:
            return threaded_pg.run_threads(fn, world_size, args=args, timeout=timeout_s)
        except threaded_pg.SpawnTimeoutError as e:
            raise RankTimeout(e.ranks, timeout_s, "\n" + str(e)) from None
        except threaded_pg.RankFailedError as e:
            note = str(e)[len(f"rank {e.rank}: {e.text}"):]
            raise RankError(e.rank, type(e.exception).__name__, e.text, note) from None


def _new_threaded_group(store, rank, world_size, timeout_s):
    import threaded_pg
    return threaded_pg.new_threaded_group(store, rank, world_size, timeout_s=timeout_s)


KINDS["threads"] = Kind(run=_run_threads, new_group=_new_threaded_group)
# ==== end of "threads" kind


def available_kinds():
    """Names of the kinds usable here, for pytest parametrization."""
    return [name for name, kind in KINDS.items() if kind.available()]


def run_ranks(fn, world_size, kind="processes", timeout_s=60, args=(), env=None):
    """fn(rank, world_size, store, *args) on every rank -> [result of rank 0, ...].

    `env`: SHMCOLL_* (or other) variables set for the duration of the job.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r} (known: {sorted(KINDS)})")
    return KINDS[kind].run(fn, world_size, timeout_s, tuple(args), dict(env or {}))


# --------------------------------------------------------------------------- torch ranks

def free_port():
    """A TCP port that was free a moment ago (for tcp:// and env:// rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torch_job(rank, world_size, store, fn, backend, init, port, timeout_s, args):
    import datetime

    import torch.distributed as dist

    import shmcoll  # noqa: F401  (registers "shm")

    timeout = datetime.timedelta(seconds=timeout_s)
    kw = dict(backend=backend, rank=rank, world_size=world_size, timeout=timeout)
    if init == "file":
        kw["init_method"] = f"file://{store.path}/torch_rendezvous"
    elif init == "tcp":
        kw["init_method"] = f"tcp://127.0.0.1:{port}"
    elif init == "env":
        kw = dict(backend=backend, timeout=timeout)  # MASTER_ADDR/PORT, RANK, WORLD_SIZE
    elif init == "tcpstore":
        if rank == 0:
            tcp = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=timeout,
                                wait_for_workers=False)
            store.set("tcpstore_port", str(tcp.port))
        else:
            port = int(store.get("tcpstore_port"))
            tcp = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)
        kw["store"] = tcp
    elif init == "filestore":
        kw["store"] = dist.FileStore(f"{store.path}/torch_filestore", world_size)
    else:
        raise ValueError(f"unknown init {init!r}")
    env = {}
    if init == "env":
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world_size)}
    with patched_environ(env):
        dist.init_process_group(**kw)
    try:
        return fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def made(pg):
    """The group behind torch's handle: "shm" makes it in the background and hands torch a
    DeferredProcessGroup (torch_backend/deferred.py); other groups are their own."""
    return pg.made() if hasattr(pg, "made") else pg


def run_torch_ranks(fn, world_size, backend="shm", timeout_s=60, args=(), init="file", env=None):
    """fn(rank, world_size, *args) in every rank inside an initialized default group.

    init: "file" (file://), "tcp" (tcp:// on a free port), "env" (env:// with MASTER_ADDR/
    MASTER_PORT/RANK/WORLD_SIZE set), "tcpstore" / "filestore" (store= a torch store).
    """
    port = free_port() if init in ("tcp", "env") else 0
    return run_ranks(_torch_job, world_size, "processes", timeout_s,
                     (fn, backend, init, port, timeout_s, tuple(args)), env)
