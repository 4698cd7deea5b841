"""Warm group creation (docs/notes/2026-11-28-warm-init.md): what init no longer waits for,
and that the guarantees hold without it.

A group is returned before its kernels are loaded (warmup.py): its first call waits for
them (Group's kernel gate), nothing of a rank holds the job's compile lock while numba
readies itself (so the ranks ready numba at once, not in turn), and a peer lost, or a close,
in that window ends as it always did. Real rank processes (tests/_ranks.py); no timing
bounds beyond "well before the group timeout".
"""

import subprocess
import sys

import pytest

from _ranks import Job
from support.devshm import shm_entries

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

TIMEOUT_S = 60.0


def test_first_call_waits_for_the_kernels_and_nothing_holds_the_compile_lock(tmp_path):
    """Guards: init returns before the group's warm-up has loaded its kernels; the first
    call waits for them (it has not returned while they are held, and when it returns they
    are loaded) and then computes the right sum; while the ranks ready numba, no thread --
    a first call in the gate, a p2p progress thread -- holds the job's compile lock, and
    one rank loads every kernel of its warm-up while the other still readies numba (the
    ranks do it at once, not in turn). Fails if init waits for the kernels again (rank 0's
    are held until after init: "init" says ready), if the gate is gone, or if anything
    takes the compile lock before numba is ready."""
    with Job("kernels_deferred", 2, tmp_path, args={"mode": "first"},
             timeout_s=TIMEOUT_S) as job:
        init = job.event(0, "init")
        assert init["ready"] is False, init
        assert job.event(0, "locks")["free"], job.events(0)
        assert job.event(1, "warm")["ok"], job.events(1)
        assert job.event(0, "peer_warm")["ok"], job.events(0)
        held = job.event(0, "held")
        assert held["first_done"] is False, held
        first = job.all_ranks("first")
        assert first[0]["ok"] and first[0]["ready"] is True, first
        assert first[0]["value"] == first[1]["value"] == 3.0, first
        assert job.join(60) == {0: 0, 1: 0}
    assert not shm_entries(list(job.pids.values()))


def test_peer_lost_before_the_first_call_is_named_by_it(tmp_path):
    """Guards: a rank that dies after init, while its peer's kernels are still loading,
    leaves no segment (they were unlinked when init ended) and the peer's first call,
    once its kernels are loaded, fails with PeerLostError naming it, well before the group
    timeout."""
    with Job("kernels_deferred", 2, tmp_path, args={"mode": "lost"},
             timeout_s=TIMEOUT_S) as job:
        job.event(1, "exiting")
        assert job.event(0, "peer_gone")["gone"], job.events(0)
        ev = job.event(0, "first", timeout_s=TIMEOUT_S / 2)
        assert not ev["ok"] and ev["type"] == "PeerLostError" and ev["peer"] == 1, ev
        assert "rank 1" in ev["msg"], ev
        assert ev["t"] - job.event(0, "peer_gone")["t"] < TIMEOUT_S / 2, ev
        job.join(60)
    assert not shm_entries(list(job.pids.values()))


def test_close_before_the_first_call_waits_for_the_warm_up(tmp_path):
    """Guards: a group closed before any call (while its warm-up still loads) closes
    without error once the warm-up is done, on every rank, and leaves nothing behind."""
    with Job("kernels_deferred", 2, tmp_path, args={"mode": "close"},
             timeout_s=TIMEOUT_S) as job:
        closed = job.all_ranks("closed")
        assert all(ev["ok"] and ev["ready"] for ev in closed.values()), closed
        assert job.join(60) == {0: 0, 1: 0}
    assert not shm_entries(list(job.pids.values()))


def test_group_creation_imports_no_numba(tmp_path):
    """Guards: init_process_group("shm") imports neither numba nor llvmlite nor any module
    of shmcoll that does (compiled.py: the kernels are imported by the group's warm-up
    thread and by its first call), so init pays no import of numba (~0.3 s) and no kernel
    load. The warm-up thread of every rank is held before it starts: whatever numba is
    imported by then came from the creation path (a module-level `import numba`, or a
    kernel module imported at module level, anywhere on it, fails this). Then the first
    all_reduce (which waits for the released warm-up) is right."""
    with Job("creation_without_numba", 2, tmp_path, torch=True, timeout_s=TIMEOUT_S) as job:
        created = job.all_ranks("created")
        for ev in created.values():
            assert ev["heavy"] == [] and ev["kernel_modules"] == [], ev
            assert ev["ready"] is False, ev
        first = job.all_ranks("first")
        assert all(ev["value"] == 3.0 and ev["numba"] for ev in first.values()), first
        assert job.join(60) == {0: 0, 1: 0}
    assert not shm_entries(list(job.pids.values()))


def test_a_warm_first_call_loads_kernels_without_numbas_registries(tmp_path):
    """Guards: with the kernels in the cache, a group's first call loads them without
    numba's typing and lowering registries (prebuilt.ready_runtime: numba's own load would
    refresh its target context first, importing every implementation numba has, scipy's
    BLAS among them: ~0.7 s of a warm first call's ~1.1 s on the 2-core VM), and its sum is
    right. A process first fills the cache (the warm-up's kernels); the ranks then must
    compile nothing (else numba's compiler loads the registries, rightly) and no registry
    module may be imported. Fails if the kernel cache loads through numba's
    load_overload (its refresh) again, or if the warm-up readies numba by refreshing."""
    fill = subprocess.run(
        [sys.executable, "-c", "from shmcoll.engine import warmup; "
                               "warmup.warm_up(warmup.FIRST_REDUCERS)"],
        capture_output=True, text=True, timeout=TIMEOUT_S * 3)
    assert fill.returncode == 0, fill.stderr[-3000:]
    with Job("creation_without_numba", 2, tmp_path, torch=True, timeout_s=TIMEOUT_S) as job:
        first = job.all_ranks("first")
        for ev in first.values():
            assert ev["value"] == 3.0, ev
            assert ev["counts"]["compiled"] == 0, ev  # the cache was filled just before
            assert ev["counts"]["cached"] + ev["counts"]["shipped"] > 0, ev
            assert ev["registries"] == [], ev
        assert job.join(60) == {0: 0, 1: 0}
    assert not shm_entries(list(job.pids.values()))


_READY_LOCK_ORDER = r'''
import threading, time
import numba
from numba.core import registry
from numba.core.compiler_lock import global_compiler_lock
from shmcoll.native import jit
prop = registry.CPUTarget.__dict__["_toplevel_target_context"]
assert "_toplevel_target_context" not in vars(registry.cpu_target), "context made already"
with prop._lock:  # another thread creating the target context (its first numba function)
    ready = threading.Thread(target=jit.ready, daemon=True)
    ready.start()
    time.sleep(0.5)  # ready() is at the property by now
    free = global_compiler_lock._lock.acquire(timeout=5)  # what the creation takes next
    if free:
        global_compiler_lock._lock.release()
ready.join(60)
print("compiler lock free:", free, "ready done:", not ready.is_alive(), flush=True)
'''


def test_readying_numba_takes_numbas_locks_in_numbas_order():
    """Guards: the warm-up's first step (jit.ready) takes the target context's lazy
    property before numba's compiler lock, as numba does when a thread defines its first
    numba function (the property's lock held while the context's creation takes the
    compiler lock). The test holds the property's lock, as such a thread would, while
    ready() runs; the compiler lock must stay free. Fails if ready() takes the compiler
    lock around the context (what it did: a node group of one rank loading its reducer
    beside the warm-up deadlocked there, both threads for good)."""
    proc = subprocess.run([sys.executable, "-c", _READY_LOCK_ORDER], capture_output=True,
                          text=True, timeout=TIMEOUT_S * 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiler lock free: True ready done: True" in proc.stdout, proc.stdout


_ONE_RANK_GATE = r'''
import threading
import numpy as np
import shmcoll
from shmcoll.engine import warmup
release, real = threading.Event(), warmup._ready_numba
def held():
    release.wait(60)
    real()
warmup._ready_numba = held
group = shmcoll.new_shm_group(shmcoll.FileStore(__import__("sys").argv[1]), 0, 1)
a = np.ones(8, np.float32)
call = threading.Thread(target=group.all_reduce, args=(a,), daemon=True)
call.start()
call.join(1.0)
print("returned while held:", not call.is_alive(), flush=True)
release.set()
call.join(60)
print("returned:", not call.is_alive(), "value:", float(a[0]), flush=True)
group.close()
'''


def test_a_group_of_one_rank_waits_for_the_warm_up_too(tmp_path):
    """Guards: a group of one rank (no shared memory; a hierarchical group's node of one
    rank) starts the warm-up like any group, and its first call waits for it (the kernel
    gate) instead of loading its reducer beside it. Fails if its first all_reduce returns
    while the warm-up is held, or does not return once it is let go."""
    proc = subprocess.run([sys.executable, "-c", _ONE_RANK_GATE, str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=TIMEOUT_S * 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "returned while held: False" in proc.stdout, proc.stdout
    assert "returned: True value: 1.0" in proc.stdout, proc.stdout


def _run_to_exit(script, arg):
    """Run `script arg` to its end: (process, stdout, stderr), the exit status 0; a program
    still running after TIMEOUT_S hung (at exit, for these scripts) and fails the test."""
    proc = subprocess.Popen([sys.executable, str(script), arg], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the program hung at exit; stdout {out!r}")
    assert proc.returncode == 0, err[-3000:]
    return proc, out, err


_EXIT_WHILE_WARMING = r'''
import atexit, sys, threading, time


def report():  # registered before shmcoll's exit handler: runs after it
    alive = [t.name for t in threading.enumerate() if t.name == "shmcoll-warmup"]
    print("at exit:", alive, steps, flush=True)


atexit.register(report)
import torch.distributed as dist
from shmcoll.engine import warmup

started = threading.Event()
real, real_phase = warmup._ready_numba, warmup.phase
steps = []  # the warm-up's steps begun


def slowly():  # a long step: readying numba under load, or a cold compile
    started.set()
    time.sleep(2.0)
    real()


def recorded(name):
    steps.append(name)
    return real_phase(name)


warmup._ready_numba, warmup.phase = slowly, recorded
dist.init_process_group("shm", init_method=sys.argv[1], rank=0, world_size=1)
assert started.wait(60), "the warm-up never started"
print("exiting", flush=True)
'''


def test_a_program_ending_while_the_warm_up_runs_waits_for_its_step(tmp_path):
    """Guards: a program that ends while its group's warm-up thread runs waits for the
    warm-up's current step and no further (warmup._at_exit): when the handlers registered
    before shmcoll's run, the warm-up thread has ended without beginning another step. A
    daemon thread is frozen where it stands when the interpreter finalizes; frozen inside
    numba's loader, it holds llvmlite's lock, which finalizing numba's modules takes: a
    script that made a group and ended at once hung at exit in 3 of 12 runs before. Fails
    if the exit does not wait for the warm-up (its thread is still alive then), or waits
    for all of it (it began a step after the one under way)."""
    script = tmp_path / "exit_while_warming.py"
    script.write_text(_EXIT_WHILE_WARMING)
    proc, out, err = _run_to_exit(script, f"file://{tmp_path / 'store'}")
    assert "exiting" in out and "at exit: [] ['numba: import, runtime']" in out, \
        (out, err[-3000:])
    assert not shm_entries([proc.pid])


_ENGINE_EXIT_WHILE_WARMING = r'''
import atexit, sys, threading, time


def report():  # registered before shmcoll's exit handler: runs after it
    time.sleep(0.5)  # a p2p progress thread woken by the warm-up's end would import now
    print("at exit:", "shmcoll.p2p.cells" in sys.modules, flush=True)


atexit.register(report)
import numpy as np
import shmcoll
from shmcoll.engine import warmup

started = threading.Event()
real = warmup._ready_numba


def slowly():
    started.set()
    time.sleep(2.0)
    real()


warmup._ready_numba = slowly
g = shmcoll.new_shm_group(shmcoll.FileStore(sys.argv[1]), 0, 1)
assert started.wait(60), "the warm-up never started"
print("exiting", flush=True)  # without closing g
'''


def test_an_engine_group_left_open_loads_nothing_at_exit(tmp_path):
    """Guards: a numpy program that ends, its group left open, while the warm-up runs:
    the warm-up stops at its next step (as above), and the group's p2p progress thread,
    which waits for the warm-up before it loads its own kernel, loads nothing then
    (warmup.wait_ready says False once the interpreter exits): a load under way when the
    interpreter finalizes can hang the exit for good. Fails if the progress thread goes on
    to import its kernel module after the exit handler."""
    script = tmp_path / "engine_exit_while_warming.py"
    script.write_text(_ENGINE_EXIT_WHILE_WARMING)
    proc, out, err = _run_to_exit(script, str(tmp_path / "store"))
    assert "exiting" in out and "at exit: False" in out, (out, err[-3000:])
