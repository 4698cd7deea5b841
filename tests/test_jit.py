"""Kernel compilation: one compile per kernel and job (jit.py's lock), one signature per
protocol kernel whatever the dtype, the lock's deadline and the cache-directory fallback."""

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numba
import numpy as np
import pytest
import torch.distributed as dist

import threaded_pg
from shmcoll.native import atomics, jit, reducers, single_copy_kernels
from shmcoll.p2p import cells as p2p_cells
from shmcoll.protocol import kernels as protocol_kernels

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Compiles the first-collective kernels and two reducers, recording which of ours this process
# compiled itself (numba's compile events; a reducer it compiled has no cache hit). numba's
# own overloads (np.empty, min...) are left out: they are compiled inside whichever kernel
# uses them, in each process that compiles such a kernel, and never cached on their own.
_WORKER = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    from numba.core import event
    compiled = []

    class Record(event.Listener):
        def on_start(self, ev):
            pass

        def on_end(self, ev):
            fn = ev.data["dispatcher"].py_func
            if fn.__module__.startswith("shmcoll"):
                compiled.append(fn.__qualname__)

    event.register("numba:compile", Record())
    from shmcoll.native import reducers as kernels
    from shmcoll.engine import warmup
    start = sys.argv[1]
    while not os.path.exists(start):  # both workers start compiling together
        time.sleep(0.005)
    warmup.warm_up(((("float", np.float32, kernels.OP_SUM), ("int", np.int64, kernels.OP_MAX))))
    compiled += [repr(key) for key, cf in kernels._cfuncs.items() if not cf.cache_hits]
    print(json.dumps(compiled))
""")


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


@pytest.mark.timeout(240)
def test_ranks_never_compile_the_same_kernel(tmp_path):
    """Two processes sharing an empty cache start the same warm-up at the same moment:
    every kernel is compiled by exactly one of them, the other loads it."""
    env = _env(NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    start = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(start)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    time.sleep(1.0)  # both have imported and wait at the start line
    start.touch()
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=200)
        assert p.returncode == 0, err[-3000:]
        outs.append(set(json.loads(out.splitlines()[-1])))
    a, b = outs
    assert a | b, "nothing was compiled: the cache was not empty?"
    assert "_one_step_kernel" in a | b
    assert not a & b, f"compiled in both processes: {sorted(a & b)}"


_HOLD = textwrap.dedent("""
    import sys, time
    from shmcoll.native import jit
    with jit.compiling("a test kernel"):
        print("held", flush=True)
        time.sleep(float(sys.argv[1]))
""")


def _holder(env, hold_s):
    p = subprocess.Popen([sys.executable, "-c", _HOLD, str(hold_s)], env=env,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


@pytest.mark.timeout(120)
def test_lock_wait_has_a_deadline_naming_the_holder(tmp_path):
    env = _env(NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    holder = _holder(env, 60)
    try:
        code = ("from shmcoll.native import jit\n"
                "with jit.compiling('the float32 sum kernel'):\n    pass\n")
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-c", code], env=dict(
            env, SHMCOLL_COMPILE_TIMEOUT_S="1"), capture_output=True, text=True, timeout=100)
        waited = time.monotonic() - t0
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode != 0
    assert "CollectiveTimeoutError" in r.stderr, r.stderr[-2000:]
    assert "compiling the float32 sum kernel: waited 1 s" in r.stderr
    assert f"held by pid {holder.pid}" in r.stderr
    assert waited < 60  # gave up at its deadline, not when the holder let go


@pytest.mark.timeout(120)
def test_a_killed_holder_releases_the_lock(tmp_path):
    env = _env(NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    holder = _holder(env, 60)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    code = "from shmcoll.native import jit\nwith jit.compiling('x'):\n    print('got it')\n"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], env=dict(
        env, SHMCOLL_COMPILE_TIMEOUT_S="30"), capture_output=True, text=True, timeout=100)
    assert r.stdout.strip() == "got it", r.stderr[-2000:]
    assert time.monotonic() - t0 < 20


def test_lock_is_reentrant_and_excludes_threads(tmp_path, monkeypatch):
    """Nested compiling() in one thread works; the lock file then names this process."""
    with jit.compiling("outer"):
        with jit.compiling("inner"):
            path = os.path.join(jit.cache_dir(), jit.LOCK_NAME)
            fd = os.open(path, os.O_RDONLY)
            try:
                with pytest.raises(BlockingIOError):  # held by this process's other fd
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                assert os.pread(fd, 32, 0).decode().strip() == str(os.getpid())
            finally:
                os.close(fd)


def test_no_flock_compiles_unlocked_and_says_so_once(monkeypatch, caplog):
    """Where the cache's filesystem has no flock (ENOLCK, some network filesystems)."""
    monkeypatch.setattr(jit, "_fd", None)  # a descriptor of this test's own
    real = fcntl.flock

    def flock(fd, op):
        if op & fcntl.LOCK_EX:
            raise OSError(errno.ENOLCK, "No locks available")
        return real(fd, op)

    monkeypatch.setattr(jit.fcntl, "flock", flock)
    for what in ("a", "b"):
        with jit.compiling(what):
            pass
    warned = [r for r in caplog.records if "no compile lock" in r.getMessage()]
    assert len(warned) == 1 and "No locks available" in warned[0].getMessage()


def test_compile_timeout_is_validated():
    from shmcoll import config
    assert config.compile_timeout_s({}) == config.COMPILE_TIMEOUT_S
    assert config.compile_timeout_s({"SHMCOLL_COMPILE_TIMEOUT_S": "2.5"}) == 2.5
    for bad in ("0", "-1", "soon"):
        with pytest.raises(ValueError, match="SHMCOLL_COMPILE_TIMEOUT_S"):
            config.compile_timeout_s({"SHMCOLL_COMPILE_TIMEOUT_S": bad})


def test_unwritable_cache_falls_back_to_a_private_directory(tmp_path, monkeypatch):
    """No writable place for numba's cache: a per-user directory under the temp dir, and
    never one that another user could have planted (cache files are executed)."""
    def nowhere():
        raise RuntimeError("cannot cache function '_probe': no locator available")

    monkeypatch.setattr(jit, "_cache_path", nowhere)
    monkeypatch.setattr(numba.config, "CACHE_DIR", "")
    monkeypatch.setattr(jit.tempfile, "gettempdir", lambda: str(tmp_path))
    jit._ensure_cache_dir()
    mine = tmp_path / f"shmcoll-numba-cache-{os.getuid()}"
    assert numba.config.CACHE_DIR == str(mine)
    assert mine.stat().st_mode & 0o777 == 0o700
    monkeypatch.setattr(numba.config, "CACHE_DIR", "")
    mine.chmod(0o777)  # group/other-writable: somebody else could write it
    jit._ensure_cache_dir()
    assert numba.config.CACHE_DIR != str(mine)
    assert os.path.basename(numba.config.CACHE_DIR).startswith("shmcoll-numba-cache-")


def _every_kind_of_collective(rank, world_size):
    import torch
    for dtype in (torch.float32, torch.float64, torch.int32, torch.bfloat16, torch.uint8):
        for numel in (3, 300_000):  # one-step and streamed / two-shot / single copy
            t = torch.ones(numel, dtype=dtype)
            dist.all_reduce(t)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            dist.broadcast(t, 0)
            out = torch.empty(numel * world_size, dtype=dtype)
            dist.all_gather_into_tensor(out, t)
            dist.reduce_scatter_tensor(t, out)
            dist.reduce_scatter_tensor(t, torch.ones(2 * numel * world_size, dtype=dtype)[::2])
            dist.reduce(t, 0)
    dist.barrier()
    t = torch.arange(5.0)
    if rank == 0:
        dist.send(t, 1)
    elif rank == 1:
        dist.recv(t, 0)


@pytest.mark.timeout(300)
def test_protocol_kernels_have_one_signature():
    """The protocol kernels move bytes: however many dtypes, sizes and collectives run,
    each is compiled once (a second signature would be a whole recompile per dtype)."""
    threaded_pg.spawn(_every_kind_of_collective, 4)
    many = {}
    for mod in (atomics, reducers, protocol_kernels, single_copy_kernels, p2p_cells):
        for name, d in vars(mod).items():
            if isinstance(d, numba.core.dispatcher.Dispatcher) and \
                    d.__module__ == mod.__name__ and len(d.signatures) > 1:
                many[f"{mod.__name__}.{name}"] = [str(s) for s in d.signatures]
    assert not many, many
    assert len({k for k in reducers._cfuncs}) >= 5  # one reducer per (dtype, sum or not)
