"""Never hang: real rank processes killed, stopped and aborted (lost peers, stalled ranks and
timeouts, abort). Leaks and resource limits: test_failures_leaks.py; mismatched collectives
and bad arguments: test_failures_bad_calls.py.

Every test spawns real ranks (tests/_ranks.py, scenarios in _scenarios_*.py; engine level
through `shmcoll.new_shm_group(shmcoll.FileStore(dir), rank, ws, timeout_s=...)`, or torch
backend "shm") and hurts them from the outside with real signals. Each test says what it
guards. Timing bounds are generous (2 loaded cores shared with other jobs) but far below the
group timeouts, so a test fails if detection falls back to the timeout.

Measured figures are printed (run with -s to see them).
"""

import signal
import time

import numpy as np
import pytest

from _ranks import Job, error_class_names
from support.devshm import assert_job_left_nothing, shm_entries
from support.figures import report

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

LONG_TIMEOUT_S = 60.0  # group timeout where detection must NOT come from the timeout
DETECT_S = 2.0  # bullet 1: every survivor knows within 2 s


# ===================================================================== 1. lost peers

LOST = [
    # (op, how, world size)
    ("all_reduce", "kill", 3),
    ("broadcast", "kill", 3),
    ("barrier", "kill", 3),
    ("big_all_reduce", "kill", 2),
    ("all_reduce", "exit", 2),
    ("all_reduce", "close", 2),
]


@pytest.mark.parametrize("op,how,ws", LOST, ids=[f"{o}-{h}-ws{w}" for o, h, w in LOST])
def test_lost_peer_fails_every_survivor_fast_and_poisons(tmp_path, op, how, ws):
    """Guards: a rank that dies (SIGKILL), exits without joining, or closes its group while
    the others wait in a collective makes every survivor raise PeerLostError naming that
    rank and its pid within 2 s although the group timeout is 60 s; every later call raises
    the same error at once (poisoned) until close; no segment leaks. Without liveness checks
    the survivors would wait the full 60 s (and fail the 2 s bound); with only the first
    missing peer checked, the 3-rank cases report the wrong rank or an abort instead."""
    victim = ws - 1
    survivors = [r for r in range(ws) if r != victim]
    before = shm_entries()
    env = {}
    args = {"victim": victim, "op": op, "how": how}
    if op == "big_all_reduce":
        # 8 MiB through 64 KiB slots: 128 chunks, so the kill lands inside a chunk loop
        env["SHMCOLL_SLOT_BYTES"] = 64 << 10
        args["nbytes"] = 8 << 20
    with Job("lost_peer", ws, tmp_path, args=args, env=env, timeout_s=LONG_TIMEOUT_S) as job:
        job.all_ranks("ready")
        vpid = job.pids[victim]
        for r in survivors:
            job.event(r, "entering")
        if op == "big_all_reduce":
            job.event(victim, "iter", count=3)  # chunked all_reduces are running
        else:
            time.sleep(0.5)  # survivors are parked in the wait
        if how == "kill":
            t0 = job.signal(victim, signal.SIGKILL)
        else:
            t0 = time.monotonic()
            job.send(victim)
        errors = {r: job.event(r, "error", timeout_s=LONG_TIMEOUT_S + 30) for r in survivors}
        if how == "exit":
            # from the moment the process ended (its interpreter shutdown is not ours)
            deadline = time.monotonic() + 30
            while victim not in job.died and time.monotonic() < deadline:
                time.sleep(0.01)
            report("  (exit: seconds from 'go' to process end)",
                    s=round(job.died[victim] - t0, 4))
            t0 = job.died[victim]
        latencies = {r: round(e["t"] - t0, 4) for r, e in errors.items()}
        report(f"lost peer {op}/{how}/ws{ws}", seconds_to_error=latencies)
        for r, e in errors.items():
            assert e["type"] == "PeerLostError", e
            assert e["peer"] == victim, e
            assert f"rank {victim} (pid {vpid})" in e["msg"], e
            assert ("closed the group" if how == "close" else "exited") in e["msg"], e
            assert latencies[r] < DETECT_S, (r, latencies[r], e)
        for r in survivors:
            again = job.event(r, "again")
            assert again["type"] == "PeerLostError" and again["msg"] == errors[r]["msg"], again
            assert again["peer"] == victim
            assert again["dt"] < 0.5, again  # immediately: no wait at all
            assert job.event(r, "after_close")["type"] == "ShmcollError"
        if how == "close":
            job.send(victim)  # let the closed-but-alive victim exit
        codes = job.join(30)
    for r in survivors:
        assert codes[r] == 0, (r, codes, job.stderr(r)[-2000:])
    assert codes[victim] == (-signal.SIGKILL if how == "kill" else 0), codes
    assert_job_left_nothing(job.pids.values(), before)


@pytest.mark.torch
def test_torch_lost_peer_fails_fast_and_poisons(tmp_path):
    """Guards the same through torch "shm": a SIGKILLed rank makes dist.all_reduce on the
    survivors raise PeerLostError (also a DistBackendError) naming rank and pid within 2 s,
    later calls fail the same way at once, destroy_process_group does not hang."""
    ws, victim = 2, 1
    before = shm_entries()
    with Job("lost_peer", ws, tmp_path, torch=True, timeout_s=LONG_TIMEOUT_S,
             args={"victim": victim, "op": "all_reduce", "how": "kill"}) as job:
        job.all_ranks("ready", timeout_s=180)
        vpid = job.pids[victim]
        job.event(0, "entering")
        time.sleep(0.5)
        t0 = job.signal(victim, signal.SIGKILL)
        e = job.event(0, "error", timeout_s=LONG_TIMEOUT_S + 30)
        report("torch lost peer all_reduce/kill", seconds_to_error=round(e["t"] - t0, 4))
        assert e["type"] == "PeerLostError", e
        assert "DistBackendError" in error_class_names(e), e
        assert f"rank {victim} (pid {vpid})" in e["msg"], e
        assert e["t"] - t0 < DETECT_S
        # the torch layer re-raises a poisoned group's first failure inside its own
        # GroupAbortedError ("... first failure: <the PeerLostError text>")
        again = job.event(0, "again")
        assert again["type"] in ("PeerLostError", "GroupAbortedError"), again
        assert e["msg"] in again["msg"], again
        assert again["dt"] < 0.5
        job.event(0, "after_close")  # destroy_process_group returned
        codes = job.join(60)
    assert codes[0] == 0, job.stderr(0)[-2000:]
    assert_job_left_nothing(job.pids.values(), before)


def test_rank_killed_during_init_fails_peers_fast(tmp_path):
    """Guards: a rank SIGKILLed after creating its segment but before the group is set up
    does not leave its peers blocked in the store for the group timeout (60 s): they fail
    with SegmentError naming it within 2 s."""
    with Job("init_killed", 2, tmp_path, ranks=[1], timeout_s=LONG_TIMEOUT_S,
             args={"pause_at": "attach"}) as victim:
        with Job("init_only", 2, tmp_path, ranks=[0], store=victim.store,
                 timeout_s=LONG_TIMEOUT_S, args={"announce": True}) as peer:
            created = victim.event(1, "created")
            # rank 0 attaches rank 1's segment, then waits for rank 1 to attach its own
            deadline = time.monotonic() + 120
            while not any("attached/1" in e["key"] for e in peer.events(0, "waiting")):
                assert time.monotonic() < deadline, peer.events(0)
                time.sleep(0.05)
            time.sleep(0.3)
            t0 = victim.signal(1, signal.SIGKILL)
            ev = peer.event(0, "init", timeout_s=LONG_TIMEOUT_S + 30)
            report("rank killed during init", seconds_to_error=round(ev["t"] - t0, 4))
            assert not ev["ok"] and ev["type"] == "SegmentError", ev
            assert f"pid {created['pid']}" in ev["msg"] and "exited" in ev["msg"], ev
            assert ev["t"] - t0 < DETECT_S, ev
            peer.join(30)
        victim.join(30)
    # rank 1's name stays (it died inside the window); the next init collects it
    from shmcoll.shm import segments as shm
    assert created["name"] in shm.gc_stale() or created["name"] not in shm_entries()


# ======================================================== 2 + 10. stalled ranks, timeouts

STALL = [
    # (mode, which timeout): stop = SIGSTOP the rank, absent = it never calls
    ("stop", "group"),
    ("stop", "op"),
    ("absent", "group"),
]


@pytest.mark.parametrize("mode,which", STALL, ids=[f"{m}-{w}" for m, w in STALL])
def test_stalled_rank_times_out_naming_missing_ranks(tmp_path, mode, which):
    """Guards: a stopped (SIGSTOP) or absent rank makes the others raise
    CollectiveTimeoutError at the group timeout, or at a per-op timeout shorter than the
    group's, listing the ranks that have not arrived and their last seq; after SIGCONT the
    late rank fails fast instead of hanging, and every rank tears down and exits."""
    ws, victim, timeout = 3, 2, 3.0
    group_timeout = timeout if which == "group" else LONG_TIMEOUT_S
    args = {"victim": victim, "op_timeout": timeout if which == "op" else None}
    with Job("stall", ws, tmp_path, args=args, timeout_s=group_timeout) as job:
        job.all_ranks("ready")
        if mode == "stop":
            job.signal(victim, signal.SIGSTOP)
        errors = {r: job.event(r, "error", timeout_s=LONG_TIMEOUT_S + 30) for r in (0, 1)}
        report(f"stall {mode}/{which}", timeout_s=timeout,
                elapsed={r: round(e["elapsed"], 3) for r, e in errors.items()})
        for r, e in errors.items():
            assert e["type"] == "CollectiveTimeoutError", e
            assert timeout - 0.05 <= e["elapsed"] < timeout + 3.0, e
            assert f"Timed out waiting {int(timeout * 1000)}ms" in e["msg"], e
            assert "ranks [2]" in e["msg"], e  # only the stalled rank is missing
            assert "rank 2 at seq 2" in e["msg"], e  # its last seq: it did 2 collectives
            again = job.event(r, "again")
            assert again["type"] == "CollectiveTimeoutError" and again["dt"] < 0.5, again
        job.send(victim)
        if mode == "stop":
            job.signal(victim, signal.SIGCONT)
        late = job.event(victim, "late", timeout_s=30)
        assert late.get("type") in ("GroupAbortedError", "PeerLostError"), late
        assert late["dt"] < 5.0, late
        codes = job.join(30)
    assert codes == {0: 0, 1: 0, 2: 0}, codes


def test_timeout_dumps_flight_record(tmp_path):
    """Guards: on a timeout the rank logs its last collectives (seq, op, bytes, state, start
    time, duration) and every rank's step/seq/state, so a hang explains itself."""
    with Job("stall", 2, tmp_path, args={"victim": 1, "op_timeout": 1.0},
             timeout_s=LONG_TIMEOUT_S) as job:
        job.all_ranks("ready")
        e = job.event(0, "error", timeout_s=60)
        assert e["type"] == "CollectiveTimeoutError", e
        job.send(1)
        job.join(30)
        log = job.stderr(0)
    lines = [ln for ln in log.splitlines() if ln.startswith("LOG shmcoll")]
    text = "\n".join(lines)
    assert "rank 0: last 3 collectives" in text, log[-3000:]
    assert any("seq 1 all_reduce 64 bytes completed, started" in ln for ln in lines), text
    assert any("seq 2 broadcast 256 bytes completed, started" in ln for ln in lines), text
    assert any("seq 3 all_reduce 64 bytes failed, started" in ln for ln in lines), text
    assert "rank 1: step" in text and "seq 2, state 0" in text, text  # the peer's position
    assert "rank 0: step" in text and "seq 3, state 1" in text, text


# ======================================================================= 3. abort

@pytest.mark.parametrize("api", ["engine", pytest.param("torch_abort", marks=pytest.mark.torch),
                                 pytest.param("torch_shutdown", marks=pytest.mark.torch)])
def test_abort_from_another_thread_frees_blocked_collective(tmp_path, api):
    """Guards: Group.abort() / pg.abort() / pg.shutdown() called from another thread wakes a
    collective blocked on an absent peer within 1 s (group timeout 60 s), the group is
    poisoned afterwards, the peer learns it, and everything exits."""
    torch = api != "engine"
    with Job("abort", 2, tmp_path, torch=torch, args={"api": api, "delay": 0.5},
             timeout_s=LONG_TIMEOUT_S) as job:
        job.all_ranks("ready", timeout_s=180)
        e = job.event(0, "error", timeout_s=LONG_TIMEOUT_S + 30)
        took = job.event(0, "abort_returned")["took"]
        report(f"abort {api}", seconds_abort_to_error=round(e["since_abort"], 4),
                abort_call_s=round(took, 4))
        assert e["type"] == "GroupAbortedError", e
        assert e["since_abort"] < 1.0, e
        assert took < 2.0
        again = job.event(0, "again")
        assert not again.get("ok"), again
        job.send(1)
        late = job.event(1, "late", timeout_s=30)
        assert late.get("type") in ("GroupAbortedError", "PeerLostError"), late
        codes = job.join(60)
    assert codes == {0: 0, 1: 0}, (codes, job.stderr(0)[-2000:], job.stderr(1)[-2000:])
    assert not job.events(0, "close_error") and not job.events(1, "close_error")


def _arena_pair(ws=2):
    """`ws` in-process Arenas over plain memory (no processes): one rank's steps can be
    interleaved with another's deterministically."""
    from shmcoll import protocol
    layout = protocol.RegionLayout(4096, 2)
    regions = [np.zeros(layout.nbytes, np.uint8) for _ in range(ws)]
    return [protocol.Arena(regions, r, layout, lambda p: True) for r in range(ws)]


def test_peer_aborting_a_later_collective_does_not_fail_this_one():
    """Guards (CI flake of test_gloo_seeds_lifecycle::test_timeouts): rank 0 finishes seq 1
    (rank 1 has posted), begins seq 2 and fails it (a 1 ms timeout) before rank 1, descheduled, got
    to its fingerprint check of seq 1. Rank 1 must complete seq 1 -- everything it reads is
    there -- and fail at seq 2, where rank 0 failed. A peer that aborted AT seq 1 (or fails
    before seq 2's first post, SEQ not yet written by a post) still fails seq 1's check."""
    from shmcoll.errors import GroupAbortedError
    fp = (2, 3, 1, 0, 0, 1234)
    # rank 0 aborts the next collective: rank 1 completes seq 1, fails seq 2
    a0, a1 = _arena_pair()
    a0.begin(1, "barrier", fp, 5.0)
    a1.begin(1, "barrier", fp, 5.0)
    a1._write_fp()
    a1.post()  # rank 1 posted seq 1 and was descheduled before its check
    a0.exchange()  # rank 0 completes seq 1
    a0.begin(2, "all_reduce", fp, 0.001)
    a0.abort_at(2)  # rank 0 fails seq 2 before its first post there
    a1.wait_all()  # no error: rank 0 finished seq 1
    a1.begin(2, "all_reduce", fp, 5.0)
    with pytest.raises(GroupAbortedError, match="rank 0 aborted the group"):
        a1.exchange()
    # rank 0 aborts seq 1 itself after posting it: rank 1 fails seq 1
    a0, a1 = _arena_pair()
    for a in (a0, a1):
        a.begin(1, "barrier", fp, 5.0)
        a._write_fp()
        a.post()
    a0.abort_at(1)
    with pytest.raises(GroupAbortedError, match="before rank 1 reached seq 1"):
        a1.wait_all()


def test_abort_while_idle_names_the_next_collective_not_the_completed_one():
    """Guards: Group.abort() between collectives (rank 0 completed seq 1; rank 1 posted it
    but was descheduled before its check) must not fail seq 1 on rank 1: it announces the
    next collective as the aborted one. Aborting while a collective is unfinished still
    names that one."""
    from shmcoll.errors import CollectiveTimeoutError, GroupAbortedError
    from shmcoll.engine.group import Group
    a0, a1 = _arena_pair()
    g0 = Group(a0, 0, 2, timeout_s=5.0)
    fp = (1,)  # Group.barrier's fingerprint
    a1.begin(1, "barrier", fp, 5.0)
    a1._write_fp()
    a1.post()  # rank 1 posted seq 1, then was descheduled
    g0.barrier()  # rank 0 completes seq 1 ...
    g0.abort()  # ... and aborts while idle
    a1.wait_all()  # rank 1 completes seq 1
    assert g0.flight_record[-1]["state"] == "completed"
    a1.begin(2, "barrier", fp, 5.0)
    with pytest.raises(GroupAbortedError, match="rank 0 aborted the group"):
        a1.exchange()  # and fails seq 2, the one rank 0 will never run
    # a failed collective stays the aborted one after a later abort()
    a0, a1 = _arena_pair()
    g0 = Group(a0, 0, 2, timeout_s=0.05)
    a1.begin(1, "barrier", fp, 5.0)
    with pytest.raises(CollectiveTimeoutError):
        g0.barrier()  # rank 1 never posts: rank 0 times out at seq 1
    g0.abort()
    a1._write_fp()
    a1.post()
    with pytest.raises(GroupAbortedError, match="before rank 1 reached seq 1"):
        a1.wait_all()
