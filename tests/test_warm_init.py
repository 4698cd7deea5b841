"""Warm group creation (docs/notes/2026-11-28-warm-init.md): what init no longer waits for,
and that the guarantees hold without it.

A group is returned before its kernels are loaded (warmup.py): its first call waits for
them (Group's kernel gate), nothing of a rank holds the job's compile lock while numba
readies itself (so the ranks ready numba at once, not in turn), and a peer lost, or a close,
in that window ends as it always did. Real rank processes (tests/_ranks.py); no timing
bounds beyond "well before the group timeout".
"""

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
