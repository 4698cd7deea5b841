"""Never leak: no segment left by close() or SIGKILL, segments of ranks killed during init
collected at the next init, gc_stale removing only dead owners' segments; resource limits
(/dev/shm too small, memory reserved at create).

Real rank processes, as in test_failures.py (its docstring says how). Each test says what it
guards; measured figures are printed (run with -s to see them).
"""

import os
import signal
import threading
import time

import pytest

from _ranks import Job
from support import devshm
from support.devshm import assert_job_left_nothing, shm_entries
from support.figures import report

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


# ============================================================================ 5. leaks

@pytest.mark.parametrize("mode", ["normal", "exception", "kill_all"])
def test_no_segment_leaks(tmp_path, mode):
    """Guards: segments are unlinked as soon as every rank attached (nothing named while
    the job runs, only '(deleted)' mappings), so a normal exit, an exception without
    close(), or SIGKILL of every rank mid-collective leaves nothing in /dev/shm."""
    before = shm_entries()
    with Job("leak", 2, tmp_path, args={"mode": mode}) as job:
        alive = job.all_ranks("alive")
        pids = list(job.pids.values())
        during = shm_entries(pids)
        for r, ev in alive.items():
            # its own and its peer's segment, mapped and already unlinked; nothing else of
            # /dev/shm (no sem.*, no psm_*) is used by our code
            assert len(ev["maps"]) == 2, ev
            for path, deleted in ev["maps"].items():
                assert path.startswith("/dev/shm/shmcoll-") and deleted, ev
        if mode == "kill_all":
            for r in range(2):
                job.event(r, "iter", count=3)
            for r in range(2):  # stop both first: a rank must not see its peer die and exit
                job.signal(r, signal.SIGSTOP)
            for r in range(2):
                job.signal(r, signal.SIGKILL)
        else:
            for r in range(2):
                job.send(r)
        codes = job.join(30)
    after = shm_entries(pids)
    report(f"leaks {mode}", named_while_running=len(during), named_after=len(after))
    assert not during, f"segments still named after init: {sorted(during)}"
    expected = {"normal": 0, "exception": 1, "kill_all": -signal.SIGKILL}[mode]
    assert set(codes.values()) == {expected}, codes
    assert_job_left_nothing(job.pids.values(), before)


def test_segments_of_ranks_killed_during_init_are_collected_at_next_init(tmp_path,
                                                                        monkeypatch):
    """Guards: every rank SIGKILLed right after creating its segment (the only window in
    which a name exists) leaks those names -- and the next group init anywhere removes them
    (gc_stale at init: our uid, owner pid dead)."""
    import shmcoll
    from shmcoll.shm import segments as shm
    with Job("init_killed", 2, tmp_path) as job:
        created = job.all_ranks("created")
        names = {e["name"] for e in created.values()}
        pids = list(job.pids.values())
        for r in range(2):
            job.signal(r, signal.SIGKILL)
        time.sleep(0.2)
        # zombies (not reaped yet) still count as alive: nobody's GC takes them yet
        leaked = shm_entries(pids)
        assert names <= leaked, (names, leaked)
        removed = []
        real_gc = shm.gc_stale

        def recording_gc(*a, **k):
            out = real_gc(*a, **k)
            removed.extend(out)
            return out

        monkeypatch.setattr(shm, "gc_stale", recording_gc)
        job.join(10)  # reap: now their pids are gone
        # the next init (two ranks as threads of this process) runs the GC
        store = shmcoll.FileStore(str(tmp_path / "next"))
        groups, errors = {}, []

        def init(rank):
            try:
                groups[rank] = shmcoll.new_shm_group(store, rank, 2, timeout_s=60)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=init, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        for g in groups.values():
            g.close()
    after = shm_entries(pids)
    report("killed during init", leaked_before_next_init=len(leaked & names),
            removed_by_next_init=len(names & set(removed)), left_after=len(after))
    assert not after, after
    assert names <= set(removed), (names, removed)


def test_gc_stale_only_removes_dead_owners_segments(tmp_path):
    """Guards: gc_stale removes this user's segments whose owner pid is dead and keeps live
    owners' segments and names that are not ours."""
    import subprocess

    import posix_ipc

    from shmcoll.shm import segments as shm
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])
    try:
        token = os.urandom(16).hex()
        names = {
            "dead": f"{shm.segment_prefix()}{token}-0-{dead.pid}",
            "live": f"{shm.segment_prefix()}{token}-1-{live.pid}",
            "other_user": f"shmcoll-{os.geteuid() + 4242}-{token}-0-{dead.pid}",
            "garbage_pid": f"{shm.segment_prefix()}{token}-0-notapid",
        }
        for n in names.values():
            posix_ipc.SharedMemory("/" + n, posix_ipc.O_CREX, size=4096).close_fd()
        removed = shm.gc_stale()
        present = devshm.listing()
        assert names["dead"] in removed and names["dead"] not in present
        for k in ("live", "other_user", "garbage_pid"):
            assert names[k] in present, k
    finally:
        live.kill()
        live.wait()
        for n in names.values():
            try:
                posix_ipc.unlink_shared_memory("/" + n)
            except posix_ipc.ExistentialError:
                pass


# ================================================================ 6. resource limits

def test_shm_too_small_fails_at_init_with_remedy(tmp_path):
    """Guards: when /dev/shm cannot hold the segment, init fails at once on every rank with
    a SegmentError that names the remedy (--shm-size, SHMCOLL_SLOT_BYTES), and leaves no
    segment behind (simulated with a slot size above the mount's total size)."""
    st = os.statvfs("/dev/shm")
    slot = (st.f_blocks * st.f_frsize // 64 + 1) * 64
    before = shm_entries()
    with Job("init_only", 2, tmp_path, env={"SHMCOLL_SLOT_BYTES": slot}, timeout_s=30) as job:
        evs = job.all_ranks("init", timeout_s=90)
        codes = job.join(30)
    for r, ev in evs.items():
        assert not ev["ok"] and ev["type"] == "SegmentError", ev
        assert "--shm-size" in ev["msg"] and "SHMCOLL_SLOT_BYTES" in ev["msg"], ev
        assert ev["elapsed"] < 20, ev
    assert codes == {0: 0, 1: 0}
    assert_job_left_nothing(job.pids.values(), before)


def test_segment_memory_is_reserved_at_create(tmp_path):
    """Guards: a new segment's pages are allocated up front (posix_fallocate: st_blocks
    covers the size), so a full /dev/shm fails at init and never SIGBUSes a collective later;
    its mode is exactly 0600 even under a permissive umask, owned by us."""
    from shmcoll import protocol
    from shmcoll.shm import segments as shm
    layout = protocol.RegionLayout(1 << 20, 2)
    regions = shm.ShmRegions.__new__(shm.ShmRegions)
    regions.rank, regions.world_size, regions.layout = 0, 2, layout
    regions.regions, regions._maps, regions._unlinked = [None, None], [], False
    token = os.urandom(16)
    regions._my_name = f"/{shm.segment_prefix()}{token.hex()}-0-{os.getpid()}"
    old = os.umask(0)
    try:
        regions._create(regions._my_name, token)
        st = os.stat("/dev/shm" + regions._my_name)
    finally:
        os.umask(old)
        regions.close()
    assert st.st_size == layout.nbytes
    assert st.st_blocks * 512 >= layout.nbytes, (st.st_blocks, layout.nbytes)
    assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.geteuid()
    assert not os.path.exists("/dev/shm" + regions._my_name)
