"""threaded_pg: ranks as threads running the production algorithms (backend "threaded").

The collective sweeps run over threads through harness kind "threads" (test_<collective>.py);
this file covers what only the threaded runner does: failure propagation, no hangs, timeout
diagnostics, mismatch reporting, concurrent spawns, the pytest/unittest helpers, DDP, and
that nothing (threads, torch world state, registry entries) outlives a spawn. Each test says
what it guards.
"""

import datetime
import inspect
import os
import subprocess
import sys
import textwrap
import threading
import time
import unittest

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import threaded_pg
from shmcoll import CollectiveMismatchError, CollectiveTimeoutError, GroupAbortedError
from shmcoll.protocol import HEADER_NBYTES, MAGIC, Arena, read_header
from threaded_pg.arena import REGION_ALIGN_NBYTES, is_spin_off
from threaded_pg.spawning import group_timeout_s

pytestmark = [pytest.mark.torch, pytest.mark.timeout(120)]

FAST_S = 10.0  # generous on 2 loaded cores, far below the 60 s spawn/collective timeout


@pytest.fixture(autouse=True)
def nothing_outlives_the_test():
    """Guards: no rank, executor or p2p thread and no thread-local world survive a test."""
    before = set(threading.enumerate())
    original_world = c10d._world
    hook = sys.excepthook
    yield
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        extra = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not extra:
            break
        time.sleep(0.05)
    assert not extra, f"threads left behind: {[t.name for t in extra]}"
    assert c10d._world is original_world, "torch's _world was not restored"
    assert sys.excepthook is hook, "sys.excepthook was not restored"


@pytest.fixture(scope="module", autouse=True)
def warm():
    """The first spawn loads the numba kernels; keep that out of timed tests."""
    threaded_pg.spawn(lambda rank, ws: dist.all_reduce(torch.ones(2)), 2)


def _timed(fn, *args, **kwargs):
    t0 = time.monotonic()
    try:
        return fn(*args, **kwargs), None, time.monotonic() - t0
    except BaseException as e:  # returned for inspection
        return None, e, time.monotonic() - t0


# ===================================================================== basics


def test_spawn_returns_per_rank_values_with_thread_local_worlds():
    """Guards: each thread sees its own default group through ordinary dist calls, and the
    caller's thread sees none."""
    def body(rank, world_size, offset):
        t = torch.full((3,), float(rank + offset))
        dist.all_reduce(t)
        return dist.get_rank(), dist.get_world_size(), dist.get_backend(), t.tolist()

    results = threaded_pg.spawn(body, 4, args=(10,))
    total = float(sum(range(10, 14)))
    assert results == [(r, 4, threaded_pg.backend_name(), [total] * 3) for r in range(4)]
    assert not dist.is_initialized()


def test_every_collective_and_async_work():
    """Guards: the torch surface works over threads (all collectives, async Work, futures)."""
    def body(rank, ws):
        out = {}
        t = torch.arange(4, dtype=torch.float32) + rank
        w = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
        w.wait()
        out["all_reduce_max"] = t.tolist()
        b = torch.full((2,), float(rank))
        dist.broadcast(b, src=2)
        out["broadcast"] = b.tolist()
        g = torch.empty(2 * ws)
        dist.all_gather_into_tensor(g, torch.full((2,), float(rank)))
        out["all_gather"] = g.tolist()
        rs = torch.empty(1)
        dist.reduce_scatter_tensor(rs, torch.arange(ws, dtype=torch.float32) * (rank + 1))
        out["reduce_scatter"] = rs.item()
        r = torch.ones(2) * (rank + 1)
        dist.reduce(r, dst=1)
        out["reduce"] = r.tolist() if rank == 1 else None
        gl = [torch.empty(1) for _ in range(ws)] if rank == 0 else None
        dist.gather(torch.tensor([float(rank)]), gl, dst=0)
        out["gather"] = [x.item() for x in gl] if gl else None
        sc = torch.empty(1)
        dist.scatter(sc, [torch.tensor([float(i * 10)]) for i in range(ws)] if rank == 3 else None,
                     src=3)
        out["scatter"] = sc.item()
        a2a = torch.empty(ws)
        dist.all_to_all_single(a2a, torch.arange(ws, dtype=torch.float32) + 100 * rank)
        out["all_to_all"] = a2a.tolist()
        dist.barrier()
        fut = dist.all_reduce(torch.ones(1), async_op=True).get_future()
        out["future"] = fut.wait()[0].item()
        return out

    ws = 4
    for rank, out in enumerate(threaded_pg.spawn(body, ws)):
        assert out["all_reduce_max"] == [3.0, 4.0, 5.0, 6.0]
        assert out["broadcast"] == [2.0, 2.0]
        assert out["all_gather"] == [float(r) for r in range(ws) for _ in range(2)]
        assert out["reduce_scatter"] == rank * sum(range(1, ws + 1))
        assert out["reduce"] == ([10.0, 10.0] if rank == 1 else None)
        assert out["gather"] == ([0.0, 1.0, 2.0, 3.0] if rank == 0 else None)
        assert out["scatter"] == rank * 10.0
        assert out["all_to_all"] == [rank + 100.0 * s for s in range(ws)]
        assert out["future"] == ws


def test_async_op_nobody_waits_for_still_runs():
    """Guards: an async collective whose Work is not waited on makes progress by itself
    (the executor's worker), also after the group sat idle, so a rank can block elsewhere
    (here in recv) while its collective completes."""
    def body(rank, ws):
        out = []
        for i in range(2):
            time.sleep(0.1 * i)  # the second round starts with every worker parked
            t = torch.full((3,), float(rank + i))
            if rank == 0:
                work = dist.all_reduce(t, async_op=True)
                token = torch.empty(1)
                dist.recv(token, 1)  # rank 1 sends only after its all_reduce completed
                work.wait()
                out.append((token.item(), t.tolist()))
            else:
                dist.all_reduce(t)
                dist.send(torch.tensor([42.0 + i]), 0)
        return out

    results = threaded_pg.spawn(body, 2)
    assert results[0] == [(42.0, [1.0] * 3), (43.0, [3.0] * 3)]


def test_object_collectives():
    """Guards: pickled-object collectives (they go through all_gather/broadcast underneath)."""
    def body(rank, ws):
        objs = [None] * ws
        dist.all_gather_object(objs, {"rank": rank, "sq": rank * rank})
        lst = [f"from {rank}", rank] if rank == 1 else [None, None]
        dist.broadcast_object_list(lst, src=1)
        got = [None]
        dist.scatter_object_list(got, [("x", i) for i in range(ws)] if rank == 0 else None, src=0)
        gathered = [None] * ws if rank == 2 else None
        dist.gather_object(rank * 2, gathered, dst=2)
        return objs, lst, got[0], gathered

    for rank, (objs, lst, got, gathered) in enumerate(threaded_pg.spawn(body, 3)):
        assert objs == [{"rank": r, "sq": r * r} for r in range(3)]
        assert lst == ["from 1", 1]
        assert got == ("x", rank)
        assert gathered == ([0, 2, 4] if rank == 2 else None)


def test_point_to_point():
    """Guards: send/recv, isend/irecv and batch_isend_irecv (the p2p engine) over threads."""
    def body(rank, ws):
        nxt, prv = (rank + 1) % ws, (rank - 1) % ws
        if rank == 0:
            dist.send(torch.tensor([1.0]), nxt)
            token = torch.empty(1)
            dist.recv(token, prv)
        else:
            token = torch.empty(1)
            dist.recv(token, prv)
            dist.send(token + 1, nxt)
        recv = torch.empty(100)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.irecv, recv, prv),
                                       dist.P2POp(dist.isend, torch.arange(100.0) + rank, nxt)])
        for req in reqs:
            req.wait()
        return token.item(), recv[:2].tolist()

    ws = 3
    results = threaded_pg.spawn(body, ws)
    assert results[0][0] == ws  # the token went once around the ring
    for rank, (_, recv) in enumerate(results):
        assert recv == [float((rank - 1) % ws), float((rank - 1) % ws) + 1]


def test_subgroups_and_group_names_reused_after_destroy():
    """Guards: dist.new_group over a subset (members only meet), new_subgroups, and a group
    destroyed and re-created under the same name gets fresh regions."""
    def body(rank, ws):
        evens = dist.new_group([0, 2])
        out = []
        if rank in (0, 2):
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t, group=evens)
            out.append((dist.get_rank(evens), t.item()))
        else:
            assert evens == dist.GroupMember.NON_GROUP_MEMBER
        mine, _ = dist.new_subgroups(group_size=2)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mine)
        out.append(t.item())
        dist.destroy_process_group()
        dist.init_process_group(threaded_pg.backend_name(), store=dist.HashStore(), rank=rank,
                                world_size=ws)  # same default group name "0" again
        t = torch.ones(1)
        dist.all_reduce(t)
        out.append(t.item())
        return out

    results = threaded_pg.spawn(body, 4)
    assert results[0] == [(0, 4.0), 1.0, 4.0]
    assert results[2] == [(1, 4.0), 5.0, 4.0]
    assert results[1] == [1.0, 4.0] and results[3] == [5.0, 4.0]


def test_split_group_makes_a_threaded_group():
    """Guards: ProcessGroup.split_group (what dist.split_group calls) builds its subgroup out
    of the same rank threads, not out of POSIX segments."""
    def body(rank, ws):
        sub = dist.group.WORLD.split_group([1, 2])
        if sub is None:
            return None
        try:
            t = torch.tensor([float(rank)])
            sub.allreduce([t]).wait()
            return type(sub).__name__, sub.rank(), sub.size(), t.item()
        finally:
            sub.shutdown()  # not registered with c10d: destroy_process_group would not see it

    assert threaded_pg.spawn(body, 3) == [None, ("ThreadedProcessGroup", 0, 2, 3.0),
                                          ("ThreadedProcessGroup", 1, 2, 3.0)]


def test_ddp_step_on_threads_equals_single_process():
    """Guards: a DistributedDataParallel training step over threads gives the parameters of
    the same step taken in one process on the concatenated batch."""
    ws, batch = 3, 4

    def data(rank):
        g = torch.Generator().manual_seed(100 + rank)
        return torch.randn(batch, 5, generator=g), torch.randn(batch, 2, generator=g)

    def new_model():
        with threaded_pg.rng_lock(seed=0):  # rank threads share torch's global RNG
            return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(),
                                       torch.nn.Linear(8, 2))

    def body(rank, world_size):
        model = torch.nn.parallel.DistributedDataParallel(new_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            x, y = data(rank)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in model.module.parameters()]

    results = threaded_pg.spawn(body, ws)
    ref = new_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    xs, ys = zip(*[data(r) for r in range(ws)])
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    for rank in range(ws):
        for got, want in zip(results[rank], ref.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
        for got, other in zip(results[rank], results[0]):
            assert torch.equal(got, other), "ranks disagree (all-reduce results must be identical)"


# ===================================================================== failures


def test_exception_reraised_with_rank_and_traceback():
    """Guards: the first failing rank is re-raised as "rank r: <original traceback>", still
    catchable as the original type, naming the line that raised."""
    def body(rank, ws):
        dist.barrier()
        if rank == 2:
            raise KeyError("lost key")  # noqa: the line the traceback must show
        return rank

    with pytest.raises(KeyError) as info:
        threaded_pg.spawn(body, 3)
    err = info.value
    assert isinstance(err, threaded_pg.RankFailedError)
    assert err.rank == 2 and isinstance(err.exception, KeyError)
    text = str(err)
    assert text.startswith("rank 2: Traceback (most recent call last):")
    assert 'raise KeyError("lost key")' in text and "in body" in text
    assert "KeyError: 'lost key'" in text


def test_one_failing_rank_wakes_the_others_promptly():
    """Guards: ranks blocked in a collective the failed rank never joins return at once
    (group aborted), long before the 60 s timeout; their errors are listed."""
    def body(rank, ws):
        dist.all_reduce(torch.ones(2))
        if rank == 1:
            raise RuntimeError("rank 1 gives up")
        dist.all_reduce(torch.ones(2))  # blocks: rank 1 never comes
        dist.barrier()

    _, err, elapsed = _timed(threaded_pg.spawn, body, 4, timeout=60)
    print(f"\n[figures] failure propagated to 3 blocked ranks in {elapsed:.2f} s")
    assert isinstance(err, RuntimeError) and err.rank == 1, err
    assert "rank 1 gives up" in str(err)
    assert elapsed < FAST_S
    others = str(err).split("other ranks:", 1)[1]
    for rank in (0, 2, 3):
        assert f"rank {rank}: " in others


def test_rank_busy_in_python_is_interrupted_after_abort():
    """Guards: a rank that never enters a collective after a failure (a Python loop) is
    interrupted after the grace period instead of hanging the caller."""
    def body(rank, ws):
        if rank == 0:
            raise ValueError("boom")
        while True:
            time.sleep(0.01)

    _, err, elapsed = _timed(threaded_pg.spawn, body, 2)
    assert isinstance(err, ValueError) and err.rank == 0
    assert elapsed < threaded_pg.runner.ABORT_GRACE_S + FAST_S


def test_spawn_timeout_reports_what_each_rank_is_blocked_in():
    """Guards: past the spawn timeout, the error says per rank which collective (op, seq,
    group) it is blocked in and for whom it waits, or its source line outside collectives."""
    def body(rank, ws):
        dist.all_reduce(torch.ones(1))
        if rank == 1:
            while True:  # stuck in user code: never reaches the all_reduce
                time.sleep(0.01)
        dist.all_reduce(torch.ones(4))

    _, err, elapsed = _timed(threaded_pg.spawn, body, 3, timeout=2)
    assert isinstance(err, threaded_pg.SpawnTimeoutError), err
    assert isinstance(err, TimeoutError) and err.ranks == [0, 1, 2]
    text = str(err)
    for rank in (0, 2):
        assert (f"rank {rank}: in all_reduce (seq 2, 16 bytes) on group '0' (ranks [0, 1, 2])"
                in text), text
        assert "waiting for rank 1 at seq 1" in text
    assert "rank 1: not in a collective, at " in text and "time.sleep(0.01)" in text
    assert "last collective: all_reduce seq 1 (completed) on group '0'" in text
    assert elapsed < 2 + threaded_pg.runner.ABORT_GRACE_S + FAST_S


def test_spawn_report_wins_over_collective_timeouts_when_the_caller_wakes_late(monkeypatch):
    """Guards: the ranks' collective timeout outlasts the spawn's, so a caller thread that
    wakes late (a loaded machine) still finds the ranks blocked in their collectives; with
    equal timeouts they had failed by then and the report said "not in a collective"."""
    late_s = 0.3
    assert late_s < group_timeout_s(1) - 1
    wait = threaded_pg.runner._Run._wait_for_failure_or_end

    def late_wait(self, deadline):
        done = wait(self, deadline)
        time.sleep(late_s)  # the caller thread descheduled right at the deadline
        return done

    monkeypatch.setattr(threaded_pg.runner._Run, "_wait_for_failure_or_end", late_wait)

    def body(rank, ws):
        if rank == 0:
            dist.all_reduce(torch.ones(1))  # rank 1 never joins
        else:
            while True:
                time.sleep(0.01)

    _, err, _ = _timed(threaded_pg.spawn, body, 2, timeout=1)
    assert isinstance(err, threaded_pg.SpawnTimeoutError), err
    assert "rank 0: in all_reduce (seq 1, 4 bytes)" in str(err), err


def test_collective_timeout_names_seq_group_and_missing_peer():
    """Guards: a group's own timeout raises CollectiveTimeoutError in the waiting rank, and
    the report shows the state of every rank when it happened."""
    parked = threading.Event()

    def body(rank, ws):
        sub = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=1))
        if rank == 0:
            parked.wait(30)  # rank 1 is in its loop before rank 0's 1 s timeout starts
            dist.all_reduce(torch.ones(1), group=sub)  # rank 1 never joins
        else:
            rendezvous = threaded_pg.group.current_rank()[0]
            parked.set()
            while not rendezvous.aborted:  # until rank 0's failure aborts the spawn
                time.sleep(0.01)

    with pytest.raises(CollectiveTimeoutError) as info:
        threaded_pg.spawn(body, 2)
    text = str(info.value)
    assert text.startswith("rank 0: Traceback")
    assert "all_reduce (seq 1): Timed out waiting 1000ms for ranks [1]" in text
    assert "ranks when it failed:" in text
    report = text.split("ranks when it failed:", 1)[1]
    assert ("rank 0: raised CollectiveTimeoutError; last collective: all_reduce seq 1 (failed) "
            "on group '1'") in report
    rank1 = report.split("rank 1: ", 1)[1].splitlines()[0]
    assert rank1.startswith("not in a collective, at ") and " in body `" in rank1, report


def test_mismatch_is_reported_on_every_rank_naming_both_sides():
    """Guards: different collectives at the same seq raise CollectiveMismatchError on every
    rank, naming both calls, and leave the group usable."""
    def body(rank, ws):
        t = torch.ones(3)
        try:
            if rank == 0:
                dist.all_reduce(t)
            else:
                dist.broadcast(t, src=0)
        except CollectiveMismatchError as e:
            message = str(e)
        else:
            message = None
        dist.all_reduce(t)  # still usable
        return message, t.tolist()

    results = threaded_pg.spawn(body, 3)
    for rank, (message, values) in enumerate(results):
        assert message is not None, f"rank {rank} did not see the mismatch"
        assert "all_reduce(float32, count=3" in message and "broadcast(float32, count=3" in message
        assert message.startswith(f"seq 1: rank {rank} called ")
        assert values == [3.0] * 3


def test_uncaught_mismatch_surfaces_as_collective_mismatch_error():
    """Guards: spawn() re-raises a mismatch as CollectiveMismatchError (pytest.raises works)
    with both sides in the message."""
    def body(rank, ws):
        if rank == 0:
            dist.all_reduce(torch.ones(2))
        else:
            dist.all_gather_into_tensor(torch.empty(2 * ws), torch.ones(2))

    with pytest.raises(CollectiveMismatchError, match=r"all_reduce\(.*\).*all_gather\(|"
                                                      r"all_gather\(.*\).*all_reduce\("):
        threaded_pg.spawn(body, 2)


# ===================================================================== isolation


def test_sequential_and_concurrent_spawns_do_not_interfere():
    """Guards: spawns keep their groups apart (per-spawn rendezvous, own store), run side by
    side from several threads, and each returns its own results."""
    def body(rank, ws, base):
        out = []
        for i in range(20):
            t = torch.tensor([float(base + rank + i)])
            dist.all_reduce(t)
            out.append(t.item())
        sub = dist.new_group(list(range(ws - 1)))
        if rank < ws - 1:
            dist.barrier(group=sub)
        return out

    def expected(ws, base):
        return [float(sum(base + r + i for r in range(ws))) for i in range(20)]

    for ws in (2, 3):
        assert threaded_pg.spawn(body, ws, args=(7,)) == [expected(ws, 7)] * ws
    results, errors = {}, []

    def one(ws, base):
        try:
            results[(ws, base)] = threaded_pg.spawn(body, ws, args=(base,))
        except BaseException as e:
            errors.append(e)

    callers = [threading.Thread(target=one, args=(ws, base))
               for ws, base in ((2, 1000), (3, 2000), (4, 3000))]
    for c in callers:
        c.start()
    for c in callers:
        c.join(60)
    assert not errors, errors[0]
    for (ws, base), res in results.items():
        assert res == [expected(ws, base)] * ws
    assert len(results) == 3


def test_main_thread_world_untouched_during_spawn():
    """Guards: the thread-local world only redirects rank threads; a default group the
    caller's thread owns (here gloo) keeps working before, during and after a spawn."""
    hook = sys.excepthook  # init_process_group wraps it (torch's doing, not ours)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mine = dist.group.WORLD
        seen = []

        def body(rank, ws):
            seen.append(dist.get_backend())
            dist.barrier()

        threaded_pg.spawn(body, 2)
        assert seen == [threaded_pg.backend_name()] * 2
        assert dist.group.WORLD is mine and dist.get_backend() == "gloo"
        t = torch.ones(1)
        dist.all_reduce(t)
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def test_main_thread_reads_and_writes_its_own_world_while_ranks_run():
    """Guards: while rank threads hold bound worlds, the caller's thread still reads and
    writes the original one (the proxy forwards it: default group, new_group's counters
    and maps), and the ranks never see it."""
    hook = sys.excepthook
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mine = dist.group.WORLD
        inside, release = threading.Barrier(3), threading.Event()

        def body(rank, ws):
            dist.barrier()
            inside.wait(30)
            assert release.wait(30)
            sub = dist.new_group([0, 1])
            dist.all_reduce(torch.ones(1), group=sub)
            return dist.get_backend(), dist.group.WORLD is mine

        results = []
        runner = threading.Thread(target=lambda: results.append(threaded_pg.spawn(body, 2)))
        runner.start()
        try:
            inside.wait(30)
            assert dist.group.WORLD is mine and dist.get_backend() == "gloo"
            count = c10d._world.group_count
            sub = dist.new_group([0])
            assert c10d._world.group_count == count + 1
            t = torch.ones(2)
            dist.all_reduce(t, group=sub)
            assert t.tolist() == [1.0, 1.0]
            dist.destroy_process_group(sub)
        finally:
            release.set()
            runner.join(60)
        assert results == [[(threaded_pg.backend_name(), False)] * 2]
        assert dist.group.WORLD is mine
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def test_threaded_backend_refuses_outside_spawn():
    """Guards: init_process_group("threaded") on a thread that is not a spawn's rank fails
    with a message saying what to use instead."""
    with pytest.raises(RuntimeError, match="only on rank threads started by threaded_pg.spawn"):
        dist.init_process_group(threaded_pg.backend_name(), store=dist.HashStore(), rank=0,
                                world_size=1)
    if dist.is_initialized():
        dist.destroy_process_group()


def test_regions_use_the_protocol_layout_and_the_shared_arena():
    """Guards: every rank's region carries the protocol header (magic, rank, world size),
    regions are page aligned, ranks use protocol.Arena itself, and threads > cores switches
    the spin tier off."""
    def body(rank, ws, store):
        group = threaded_pg.new_threaded_group(store, rank, ws)
        try:
            record = next(r for r in store.records() if r.group is group)
            assert type(record.arena) is Arena
            regions = record.arena._regions
            a = np.full(5, rank + 1, np.int32)
            group.all_reduce(a)
            return ([read_header(reg) for reg in regions],
                    [reg.ctypes.data % REGION_ALIGN_NBYTES for reg in regions], a.tolist())
        finally:
            group.close()

    results = threaded_pg.run_threads(body, 3)
    headers, offsets, values = results[0]
    assert [h["rank"] for h in headers] == [0, 1, 2]
    assert all(h["magic"] == MAGIC and h["world_size"] == 3 and h["pid"] == os.getpid()
               for h in headers)
    assert offsets == [0, 0, 0] and HEADER_NBYTES == 4096
    assert all(v == [6] * 5 for _, _, v in results)
    assert is_spin_off("auto", len(os.sched_getaffinity(0)) + 1)
    assert not is_spin_off("spin", 64)


def test_engine_store_and_run_threads_failure():
    """Guards: run_threads (numpy only) gives ranks a shared store and the same failure
    semantics as spawn."""
    def body(rank, ws, store):
        store.add("count", 1)
        if rank == 0:
            store.set("hello", b"world")
        return store.get("hello")

    assert threaded_pg.run_threads(body, 3) == [b"world"] * 3

    def failing(rank, ws, store):
        group = threaded_pg.new_threaded_group(store, rank, ws)
        try:
            if rank == 1:
                raise ArithmeticError("bad")
            group.barrier()
        finally:
            group.close()

    with pytest.raises(ArithmeticError, match="rank 1: Traceback"):
        threaded_pg.run_threads(failing, 3)


def test_the_failing_rank_is_reported_not_the_peers_it_knocked_over():
    """Guards: a rank that closes its group on the way out of an error makes its waiting
    peers raise PeerLostError, and those can be recorded before its own exception reaches
    the runner (the order CI once hit with the test above). The caller must still get the
    original error first. Forced here: rank 1 closes, then raises 0.3 s later."""
    def failing(rank, ws, store):
        group = threaded_pg.new_threaded_group(store, rank, ws)
        try:
            if rank == 1:
                group.close()
                time.sleep(0.3)  # the peers' PeerLostError is recorded meanwhile
                raise ArithmeticError("bad")
            group.barrier()
        finally:
            group.close()

    with pytest.raises(ArithmeticError, match="rank 1: Traceback") as info:
        threaded_pg.run_threads(failing, 3)
    assert "PeerLostError" in str(info.value)  # the peers' errors follow, as "other ranks"


def test_aborted_group_error_class():
    """Guards: ranks woken by an abort raise GroupAbortedError (a ShmcollError), listed."""
    def body(rank, ws):
        if rank == 0:
            raise OSError("disk")
        dist.barrier()

    with pytest.raises(OSError) as info:
        threaded_pg.spawn(body, 2)
    assert GroupAbortedError.__name__ in str(info.value) or "PeerLostError" in str(info.value)


# ===================================================================== test helpers


@threaded_pg.ranks(4)
@pytest.mark.parametrize("count", [1, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_ranks_decorator_with_parametrize(rank, world_size, count, dtype):
    """Guards: @ranks(n) runs the body per rank and hides rank/world_size from pytest, so
    parametrize and -k work."""
    t = torch.full((count,), rank + 1, dtype=dtype)
    dist.all_reduce(t)
    assert world_size == 4 and dist.get_rank() == rank
    assert t.tolist() == [10] * count


@threaded_pg.ranks(2)
def test_ranks_decorator_with_fixture(tmp_path):
    """Guards: fixtures are resolved once and shared by the ranks."""
    (tmp_path / f"rank{dist.get_rank()}").write_text("x")
    dist.barrier()
    assert len(list(tmp_path.iterdir())) == 2


def test_ranks_decorator_signature_and_failure():
    """Guards: the wrapper's signature lacks rank/world_size; a failing rank fails the test
    with its rank and traceback."""
    def body(rank, count):
        assert rank == 0, f"rank {rank} disagrees"

    wrapped = threaded_pg.ranks(2)(body)
    assert list(inspect.signature(wrapped).parameters) == ["count"]
    assert wrapped.__name__ == "body"
    with pytest.raises(AssertionError, match="(?s)rank 1: Traceback.*rank 1 disagrees"):
        wrapped(count=3)


class TestThreadedCase(threaded_pg.ThreadedTestCase):
    world_size = 3

    def setUp(self):
        self.value = 5  # setUp runs once, before the ranks

    def test_all_reduce(self):
        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t)
        self.assertEqual(t.item(), 3.0)
        self.assertEqual(dist.get_world_size(), self.world_size)
        self.assertEqual(self.value, 5)


def test_unittest_case_reports_rank_failures():
    """Guards: a ThreadedTestCase whose assertion fails on one rank is a unittest *failure*
    (not an error) whose text names the rank."""
    class Failing(threaded_pg.ThreadedTestCase):
        world_size = 2

        def test_it(self):
            dist.barrier()
            self.assertEqual(self.rank, 0)

    result = unittest.TestResult()
    Failing("test_it").run(result)
    assert not result.errors and len(result.failures) == 1
    assert "rank 1: Traceback" in result.failures[0][1]


# ===================================================================== name clash


def test_coexists_with_torchs_threaded_pg_in_one_process():
    """Guards: importing torch's multi_threaded_pg (which registers "threaded") after
    threaded_pg moves spawn() to the alias and leaves torch's backend usable. Where torch's
    register_backend refuses a taken name (torch 2.4), threaded_pg never holds "threaded"."""
    script = textwrap.dedent("""
        import threading, torch, torch.distributed as dist
        import threaded_pg
        from threaded_pg.plugin import ALIAS, create_threaded_process_group
        from shmcoll.torch_backend.compat import registration_replaces
        replaces = registration_replaces(ALIAS, create_threaded_process_group, ["cpu", "cuda"])
        assert threaded_pg.backend_name() == ("threaded" if replaces else ALIAS)
        from torch.testing._internal.distributed import multi_threaded_pg as mt
        assert threaded_pg.backend_name() == "shmcoll_threaded"
        def body(rank, ws):
            t = torch.ones(1); dist.all_reduce(t); return dist.get_backend(), t.item()
        assert threaded_pg.spawn(body, 2) == [("shmcoll_threaded", 2.0)] * 2
        mt._install_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        store, out = dist.HashStore(), []
        def theirs(rank):
            dist.init_process_group("threaded", rank=rank, world_size=2, store=store)
            t = torch.ones(1); dist.all_reduce(t)
            out.append((type(dist.group.WORLD).__name__, t.item()))
            dist.destroy_process_group()
        ts = [threading.Thread(target=theirs, args=(r,)) for r in range(2)]
        [t.start() for t in ts]; [t.join() for t in ts]
        assert out == [("ProcessLocalGroup", 2.0)] * 2, out
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True,
                          text=True, timeout=110)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
