"""cuda_ipc's protocol with asynchronous streams (simulated device): ordering, faults, leaks.

The simulated streams run their operations on worker threads, after random delays, while
the host enqueues the next collectives: what the host does not order (slot reuse, a
peer's data arriving) only the flag words order, as on a GPU. A missing wait shows up as
wrong data here (checked by mutation: dropping the claim wait of arena rule 1, or the
collect wait of rule 3, fails test_random_programs_are_exact_under_stream_delays).
Faults run real rank processes (tests/_ranks.py, scenarios in _cuda_scenarios.py): a
SIGKILLed or stalled peer must fail the survivor within the bound and leave its stream
drained (no operation left waiting on a flag that will never move).
"""

import signal
import time

import pytest

import harness
from _ranks import Job
from support.devshm import new_foreign_entries, shm_entries

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

JOB_TIMEOUT_S = 240
DETECT_S = 2.0  # issue 14: PeerLostError on every survivor within 2 s


def _random_programs(rank, ws, store, seed, length, delay_s, tier):
    from cuda_sim_util import check, device_group, random_program, run_program
    group, dg, dev = device_group(store, rank, ws, delay_s=delay_s, seed=seed,
                                  sim_device=rank if tier != "same_gpu" else 0,
                                  peer_access=tier != "host")
    try:
        prog = random_program(seed, length, ws, max_count=3 * 4096 // 8)
        results = run_program(dg, prog, seed, rank, ws)
        ahead = not dev.stream_idle(dev.current_stream())  # the host ran ahead of its stream
        dev.synchronize(dev.current_stream(), 120)
        return check(results, prog), ahead, dg.tier
    finally:
        group.close()


@pytest.mark.parametrize("ws,tier", [(2, "same_gpu"), (3, "same_gpu"), (3, "p2p"),
                                     (2, "host")])
def test_random_programs_are_exact_under_stream_delays(ws, tier, seed):
    """80 random collectives (every kind, three dtypes, counts from 0 to 3 slots, uneven
    all_to_all) enqueued back to back through 4 KiB slots while every stream sleeps up to
    0.3 ms before each operation: every result exact, on every rank, in every tier."""
    out = harness.run_ranks(_random_programs, ws, "processes", JOB_TIMEOUT_S,
                            args=(seed, 80, 3e-4, tier))
    for rank, (bad, ahead, got_tier) in enumerate(out):
        assert bad == [], f"rank {rank}: wrong results at {bad}"
        assert got_tier == tier, (rank, got_tier)
    assert any(ahead for _, ahead, _ in out), "the streams never lagged: the test ordered nothing"


def _interleaved(rank, ws, store):
    """Host and device collectives alternate on one group; every result exact."""
    import numpy as np
    import torch
    from cuda_sim_util import device_group
    from shmcoll.native.ops import ReduceOp
    group, dg, dev = device_group(store, rank, ws, delay_s=2e-4)
    try:
        dev_out, host_out = [], []
        for i in range(30):
            t = torch.full((1000,), float(rank + i))
            dg.all_reduce(t, "float32", ReduceOp.SUM)
            dev_out.append((t, float(sum(r + i for r in range(ws)))))
            a = np.full(10, rank * i, np.int64)
            group.all_reduce(a)
            host_out.append((a, sum(r * i for r in range(ws))))
        dev.synchronize(dev.current_stream(), 60)
        assert all(bool((t == v).all()) for t, v in dev_out)
        assert all(bool((a == v).all()) for a, v in host_out)
        return group.seq
    finally:
        group.close()


def test_host_and_device_collectives_share_one_sequence():
    assert harness.run_ranks(_interleaved, 2, "processes", JOB_TIMEOUT_S) == [61, 61]


def _shm_mappings():
    with open("/proc/self/maps") as f:
        return sum("shmcoll" in line for line in f)


def _cycles(rank, ws, store, n):
    import os

    import torch
    from cuda_sim_util import device_group
    from shmcoll.native.ops import ReduceOp
    before = _shm_mappings()
    for i in range(n):
        sub = type(store)(os.path.join(store.path, f"c{i}"))
        group, dg, dev = device_group(sub, rank, ws)
        t = torch.ones(5000)
        dg.all_reduce(t, "float32", ReduceOp.SUM)
        group.close()  # drains the stream first
        assert float(t[0]) == ws
    return _shm_mappings() - before  # at once, not whenever the cyclic GC runs


def test_init_destroy_cycles_leak_nothing():
    """100 group + device arena lifetimes: no segment left in /dev/shm (conftest checks),
    no mapping left in the process, no named simulated-device memory left behind."""
    before = shm_entries()
    out = harness.run_ranks(_cycles, 2, "processes", JOB_TIMEOUT_S, args=(100,))
    assert out == [0, 0], f"mappings of shmcoll segments left: {out}"
    assert not new_foreign_entries(before), "segments left in /dev/shm"


def _close_with_a_waiting_stream(rank, ws, store):
    import torch
    from cuda_sim_util import device_group
    from shmcoll.native.ops import ReduceOp
    group, dg, dev = device_group(store, rank, ws)
    t = torch.ones(1000)
    last = dg.all_reduce(t, "float32", ReduceOp.SUM)
    side = dev.new_stream("side")
    dev.run(side, time.sleep, 0.5)  # the side stream reaches its wait late
    dg.arena.stream_wait_done(side, last)  # what Work.wait() does on another stream
    group.close()
    idle_at_close = side.idle()
    dg.arena.stream_wait_done(side, last)  # after close: must enqueue nothing
    return idle_at_close, side.idle(), float(t[0])


def test_close_waits_for_streams_that_wait_on_its_flags():
    """A stream made to wait on the arena's MINE word (Work.wait on another stream) reads
    that word when it gets there: close() lets it do so before unmapping the word (else a
    device page fault on a GPU; a crash here), and a Work.wait() after close enqueues
    nothing on the unmapped word."""
    out = harness.run_ranks(_close_with_a_waiting_stream, 2, "processes", JOB_TIMEOUT_S)
    assert out == [(True, True, 2.0)] * 2, out


# ---------------------------------------------------------------------------- faults

def test_killed_peer_fails_the_survivor_fast_and_its_stream_drains(tmp_path):
    """Rank 1 enqueues an all_reduce behind 30 s of work on its stream, then is SIGKILLed:
    its READY flag never moves. Rank 0's host returned long ago; its watchdog must raise
    PeerLostError naming rank 1 within 2 s, release rank 0's stream (it drains, the device
    stays usable) and poison the group (the next call raises at once)."""
    before = shm_entries()
    with Job("_cuda_scenarios.lost_peer", 2, tmp_path, timeout_s=60) as job:
        job.all_ranks("enqueued")
        time.sleep(0.3)
        t0 = job.signal(1, signal.SIGKILL)
        ev = job.event(0, "error", timeout_s=30)
        assert ev["type"] == "PeerLostError" and ev["peer"] == 1, ev
        assert "rank 1" in ev["msg"] and "exited" in ev["msg"], ev
        assert ev["t"] - t0 < DETECT_S, (ev["t"] - t0, ev)
        drained = job.event(0, "drained", timeout_s=30)
        assert drained["ok"], drained
        again = job.event(0, "again", timeout_s=30)
        assert again["type"] == "PeerLostError", again
        assert job.join(60)[0] == 0
    assert not new_foreign_entries(before)


def test_stalled_peer_times_out_naming_it(tmp_path):
    """Rank 1 is alive but its stream is blocked (5 s of earlier work): rank 0's device
    all_reduce (timeout 1 s) fails with CollectiveTimeoutError naming rank 1 and the seq,
    and its stream drains; rank 1's next collective fails because rank 0 aborted."""
    with Job("_cuda_scenarios.stalled_peer", 2, tmp_path, timeout_s=60) as job:
        job.all_ranks("enqueued")
        ev = job.event(0, "error", timeout_s=30)
        assert ev["type"] == "CollectiveTimeoutError", ev
        assert "ranks [1]" in ev["msg"] and "seq 3" in ev["msg"] and "(cuda" in ev["msg"], ev
        assert 0.9 < ev["elapsed"] < 5.0, ev
        assert job.event(0, "drained", timeout_s=30)["ok"]
        assert job.event(1, "drained", timeout_s=30)["ok"]
        ev1 = job.event(1, "error", timeout_s=60)
        assert ev1["type"] == "GroupAbortedError" and "rank 0" in ev1["msg"], ev1
        assert job.join(60) == {0: 0, 1: 0}


def test_inline_waits_end_when_a_peer_dies(tmp_path):
    """The device path through torch (inline simulated streams, chunked messages): a rank
    SIGKILLed between two chunks of a collective makes the survivor's waits raise PeerLostError (via the
    per-wait guard) within 2 s; the next call raises it again."""
    env = {"SHMCOLL_CUDA_SIM": "inline", "SHMCOLL_CUDA_SLOT_BYTES": "4096"}
    with Job("_cuda_scenarios.inline_lost_peer", 2, tmp_path, timeout_s=60, env=env) as job:
        job.all_ranks("ready", timeout_s=180)
        deadline = time.monotonic() + 60
        while 1 not in job.died and time.monotonic() < deadline:
            time.sleep(0.001)  # rank 1 kills itself inside its 4th collective
        t0 = job.died[1]
        ev = job.event(0, "error", timeout_s=30)
        assert ev["type"] == "PeerLostError" and ev["peer"] == 1, ev
        assert "stream waited" in ev["msg"], ev  # found by a chunk's wait, not the host's
        assert ev["t"] - t0 < DETECT_S, (ev["t"] - t0, ev)
        assert job.event(0, "again", timeout_s=30)["type"] == "PeerLostError"
        assert job.join(60)[0] == 0
