"""The compiled latency path (shmcoll/torch_backend/lane.py, _lane.c): which calls it takes,
that they give what the Python path gives (values, sequence numbers, records, errors), and
that everything else still reaches the group's Python methods.

Every rank function here runs inside an initialized "shm" default group (harness); the
Lane is armed by the group's first latency-path call."""

import datetime
import gc
import time
import weakref

import pytest
import torch
import torch.distributed as dist

from shmcoll.torch_backend import lane as lane_mod
from shmcoll.torch_backend.compat import OPTIONS_HAVE_ASYNC_OP
from tests import harness

ON = lane_mod.available() and OPTIONS_HAVE_ASYNC_OP
pytestmark = pytest.mark.skipif(not lane_mod.available(),
                                reason="the C extension was not built here")
needs_lane = pytest.mark.skipif(not OPTIONS_HAVE_ASYNC_OP,
                                reason="this torch's options cannot say synchronous: no lane")

JOB_TIMEOUT_S = 90
_ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _pg(group=None):
    return harness.made(group or dist.group.WORLD)


def _lane_runs(pg):
    """Calls the lane ran (clean passes, resumed or sent down the engine's path)."""
    return sum(pg._lane.stats().values())


def _each_op(rank, ws, dtype, n):
    """Every lane collective once on `n` elements of `dtype`; checks the values."""
    x = (torch.arange(n) % 7 + rank).to(dtype)
    want = sum((torch.arange(n) % 7 + r).to(torch.float64) for r in range(ws))
    if dtype == torch.bool:
        want = want != 0
    dist.all_reduce(x)
    assert torch.equal(x, want.to(dtype)), (dtype, "all_reduce")
    b = torch.full((n,), rank + 2, dtype=dtype) if dtype != torch.bool else \
        torch.full((n,), rank == 1)
    dist.broadcast(b, 1)
    assert torch.equal(b, torch.full((n,), 3, dtype=dtype) if dtype != torch.bool else
                       torch.ones(n, dtype=torch.bool)), (dtype, "broadcast")
    mine = (torch.arange(n) + 100 * rank).to(dtype) if dtype != torch.bool else \
        torch.full((n,), rank == 0)
    out = torch.empty(n * ws, dtype=dtype)
    _ag(out, mine)
    for j in range(ws):
        piece = (torch.arange(n) + 100 * j).to(dtype) if dtype != torch.bool else \
            torch.full((n,), j == 0)
        assert torch.equal(out[j * n:(j + 1) * n], piece), (dtype, "all_gather", j)
    if dtype not in (torch.bool, torch.complex64):
        inp = (torch.arange(n * ws) % 5 + rank).to(dtype)
        o = torch.empty(n, dtype=dtype)
        _rs(o, inp)
        whole = sum((torch.arange(n * ws) % 5 + r).to(torch.float64) for r in range(ws))
        assert torch.equal(o, whole[rank * n:(rank + 1) * n].to(dtype)), (dtype, "rs")
    a = (torch.arange(n * ws) + 1000 * rank).to(dtype) if dtype != torch.bool else \
        torch.full((n * ws,), rank == 1)
    ao = torch.empty(n * ws, dtype=dtype)
    dist.all_to_all_single(ao, a)
    for j in range(ws):
        piece = (torch.arange(rank * n, (rank + 1) * n) + 1000 * j).to(dtype) \
            if dtype != torch.bool else torch.full((n,), j == 1)
        assert torch.equal(ao[j * n:(j + 1) * n], piece), (dtype, "all_to_all", j)


def _values_and_records(rank, ws):
    pg = _pg()
    assert pg._lane is not None
    dist.all_reduce(torch.ones(4))  # arms it
    assert pg._lane.armed
    seq0, engine_seq0, runs0 = pg._seq, pg.group.seq, _lane_runs(pg)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.int64, torch.int8,
                  torch.bool, torch.complex64):
        for n in (1, 1000):
            _each_op(rank, ws, dtype, n)
    calls = 7 * 2 * 5 - 2 * 2  # no reduce_scatter of bool or complex
    assert _lane_runs(pg) - runs0 == calls, (pg._lane.stats(), calls)
    assert pg._seq - seq0 == calls and pg.group.seq - engine_seq0 == calls
    last = list(pg.group.flight_record)[-1]
    assert last["op"] == "all_to_all" and last["state"] == "completed" \
        and last["seq"] == pg.group.seq, last
    # the other reductions; a 2-D tensor; the same shapes again (cached plans)
    for op, want in ((dist.ReduceOp.MAX, ws), (dist.ReduceOp.MIN, 1),
                     (dist.ReduceOp.PRODUCT, float(torch.arange(1, ws + 1).prod())),
                     (dist.ReduceOp.AVG, (ws + 1) / 2)):
        t = torch.full((3, 5), float(rank + 1))
        dist.all_reduce(t, op)
        assert torch.equal(t, torch.full((3, 5), float(want))), op
    return pg._seq


@needs_lane
def test_values_sequence_numbers_and_records_through_the_lane():
    seqs = harness.run_torch_ranks(_values_and_records, 2, "shm", JOB_TIMEOUT_S)
    assert seqs[0] == seqs[1]


def _three(rank, ws):
    dist.all_reduce(torch.ones(1))
    _each_op(rank, ws, torch.float32, 777)
    _each_op(rank, ws, torch.int32, 5)
    return _lane_runs(_pg())


@needs_lane
def test_values_at_three_ranks():
    for runs in harness.run_torch_ranks(_three, 3, "shm", JOB_TIMEOUT_S):
        assert runs == 10, runs


def _off(rank, ws):
    pg = _pg()
    _each_op(rank, ws, torch.float32, 100)
    return pg._lane is None and pg.allreduce.__func__ is type(pg).allreduce


def test_off_with_the_variable_keeps_the_python_path():
    assert all(harness.run_torch_ranks(_off, 2, "shm", JOB_TIMEOUT_S,
                                       env={"SHMCOLL_LANE": "0"}))


def _declines(rank, ws):
    pg = _pg()
    dist.all_reduce(torch.ones(2))
    before, runs0 = pg._lane.plans(), _lane_runs(pg)
    # each of these goes to the Python method, which runs it (or refuses it) as before
    g = torch.ones(4, requires_grad=True)
    dist.all_reduce(g)
    assert torch.equal(g.detach(), torch.full((4,), float(ws)))
    w = dist.all_reduce(torch.ones(8), async_op=True)
    w.wait()
    s = torch.ones(8, 2)[:, 0]  # strided
    dist.all_reduce(s)
    assert torch.equal(s, torch.full((8,), float(ws)))
    p = torch.full((4,), 2.0)
    dist.all_reduce(p, dist._make_nccl_premul_sum(0.5))
    assert torch.equal(p, torch.full((4,), float(ws)))
    big = torch.ones(4 << 20)  # 16 MiB: more than a slot, not the one-step kernel's
    dist.all_reduce(big)
    assert torch.equal(big[:3], torch.full((3,), float(ws)))
    a = torch.arange(6.0) + 10 * rank
    ao = torch.empty(6)
    dist.all_to_all_single(ao, a, [2, 4] if rank == 0 else [4, 2],
                           [2, 4] if rank == 0 else [4, 2])  # splits: the Python path
    with dist._coalescing_manager():
        dist.all_reduce(torch.ones(3))
    b = torch.ones(3, dtype=torch.bfloat16)  # not numpy's: the Python path
    dist.all_reduce(b)
    assert torch.equal(b, torch.full((3,), float(ws), dtype=torch.bfloat16))
    k = torch.ones(3)  # the group's own call forms: keywords, a root without options
    pg.allreduce([k], op=dist.ReduceOp.SUM).wait()
    pg.broadcast([k], 1).wait()
    assert torch.equal(k, torch.full((3,), float(ws)))
    after = pg._lane.plans()
    new = {k: v for k, v in after.items() if k not in before}
    # only the 16 MiB all_reduce reached a plan, which the lane declined; it ran none
    return [v is None for v in new.values()], _lane_runs(pg) - runs0


@needs_lane
def test_other_calls_take_the_python_methods():
    for declined, ran in harness.run_torch_ranks(_declines, 2, "shm", JOB_TIMEOUT_S):
        assert declined == [True] and ran == 0, (declined, ran)


def _late_peer(rank, ws):
    pg = _pg()
    dist.all_reduce(torch.ones(2))
    for k in range(3):  # my kernel gives up waiting: the rest runs in Python
        if rank == 1:
            time.sleep(0.3)
        t = torch.full((1000,), float(rank + k))
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((1000,), float(sum(r + k for r in range(ws)))))
        out = torch.empty(2000)
        _ag(out, torch.full((1000,), float(rank)))
        assert torch.equal(out[1000:], torch.ones(1000))
    last = list(pg.group.flight_record)[-6:]
    assert all(e["state"] == "completed" for e in last), last
    stats = pg._lane.stats()
    assert rank == 1 or stats["resumed"] >= 3, stats  # rank 0 waited for rank 1
    return pg.group.seq


@needs_lane
def test_a_late_peer_is_finished_in_python():
    seqs = harness.run_torch_ranks(_late_peer, 2, "shm", JOB_TIMEOUT_S)
    assert seqs[0] == seqs[1]


def _reads(rank, ws):
    """all_to_all_single of 4 MiB per rank at 4 ranks: the kernel reads the peers' blocks
    where they lie (CMA) and hands its closing step to Python (a resumed call); then the
    same call in place, which the lane leaves to the group's method (the input is copied
    before the peers read it: no lane call)."""
    n = (4 << 20) // 4
    t = torch.arange(n, dtype=torch.float32) + 10_000_000 * rank
    want = torch.cat([torch.arange(n // ws * rank, n // ws * (rank + 1), dtype=torch.float32)
                      + 10_000_000 * s for s in range(ws)])
    out = torch.full_like(t, -1.0)
    dist.all_to_all_single(torch.empty(4 * ws), torch.ones(4 * ws))  # arms the lane
    pg = _pg()
    before = pg._lane.stats()
    dist.all_to_all_single(out, t)
    after = pg._lane.stats()
    assert torch.equal(out, want)
    reads = pg.group._arena.single_copy != 0
    assert after["resumed"] - before["resumed"] == (1 if reads else 0), (before, after)
    dist.all_to_all_single(t, t)
    assert torch.equal(t, want)
    assert pg._lane.stats() == after or not reads, (after, pg._lane.stats())
    return reads


@needs_lane
def test_all_to_all_read_through_the_lane_and_in_place_past_it():
    reads = harness.run_torch_ranks(_reads, 4, "shm", JOB_TIMEOUT_S * 2,
                                    env={"SHMCOLL_SLOT_BYTES": None})
    assert len(set(reads)) == 1


def _mismatch(rank, ws):
    dist.all_reduce(torch.ones(2))
    t = torch.ones(64 if rank == 0 else 32)
    try:
        dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001
        err = (type(e).__name__, isinstance(e, dist.DistBackendError), "all_reduce" in str(e))
    else:
        err = None
    t = torch.ones(16)
    dist.all_reduce(t)  # the group stays usable after a mismatch
    assert torch.equal(t, torch.full((16,), float(ws)))
    return err


@needs_lane
@pytest.mark.parametrize("lane", ["1", "0"])
def test_a_mismatch_raises_what_the_python_path_raises(lane):
    errs = harness.run_torch_ranks(_mismatch, 2, "shm", JOB_TIMEOUT_S,
                                   env={"SHMCOLL_LANE": lane})
    assert errs[0] == errs[1] and errs[0] is not None and errs[0][1] and errs[0][2], errs


def _timeout(rank, ws):
    g = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    dist.all_reduce(torch.ones(2), group=g)
    if rank == 1:
        time.sleep(4)  # never joins in time
        return None
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:
        dist.all_reduce(torch.ones(8), group=g)
    took = time.monotonic() - t0
    text = str(info.value)
    with pytest.raises(Exception) as again:  # poisoned: the Python path's wording
        dist.all_reduce(torch.ones(8), group=g)
    return took, isinstance(info.value, dist.DistBackendError), "all_reduce" in text, \
        "timed out" in text.lower() or "timeout" in text.lower(), \
        "aborted after an earlier failure" in str(again.value)


@needs_lane
def test_a_peer_that_never_comes_times_out_then_the_group_is_poisoned():
    took, typed, names_op, says_timeout, poisoned = \
        harness.run_torch_ranks(_timeout, 2, "shm", JOB_TIMEOUT_S)[0]
    assert 1.5 < took < 30 and typed and names_op and says_timeout and poisoned, \
        (took, typed, names_op, says_timeout, poisoned)


def _after_async(rank, ws):
    dist.all_reduce(torch.ones(2))
    ts = [torch.full((100,), float(rank + k)) for k in range(20)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    last = torch.full((100,), 1.0)
    dist.all_reduce(last)  # the lane's run_inline runs the queued ones first
    assert torch.equal(last, torch.full((100,), float(ws)))
    # their values are in before waiting: they ran first (their Works complete on the
    # executor's completer thread, in order, just after)
    for k, t in enumerate(ts):
        assert torch.equal(t, torch.full((100,), float(sum(r + k for r in range(ws))))), k
    for w in works:
        w.wait()
    return True


@needs_lane
def test_queued_async_ops_run_before_a_lane_call():
    assert all(harness.run_torch_ranks(_after_async, 2, "shm", JOB_TIMEOUT_S))


def _deferred_forwards(rank, ws):
    stub = dist.group.WORLD
    dist.all_reduce(torch.ones(2))
    pg = stub.made()
    return all(getattr(stub, name) is getattr(pg, name) and
               type(getattr(pg, name)).__name__ == "LaneCall"
               for names in lane_mod.METHODS for name in names)


@needs_lane
def test_torch_reaches_the_lane_through_the_deferred_group():
    assert all(harness.run_torch_ranks(_deferred_forwards, 2, "shm", JOB_TIMEOUT_S))


def _released(rank, ws):
    g = dist.new_group([0, 1])
    pg = g.made()
    dist.all_reduce(torch.ones(4), group=g)
    assert pg._lane.armed
    ref, lane_ref = weakref.ref(pg), weakref.ref(pg._lane)
    gc.disable()
    try:
        dist.destroy_process_group(g)
        del g, pg
        gone = ref() is None and lane_ref() is None  # no reference cycle keeps them
    finally:
        gc.enable()
    return gone


@needs_lane
def test_a_destroyed_group_and_its_lane_go_without_the_collector():
    assert all(harness.run_torch_ranks(_released, 2, "shm", JOB_TIMEOUT_S))


def _installed(rank, ws):
    return _pg()._lane is not None


def test_on_by_default_where_torch_can_say_synchronous():
    """torch >= 2.5's options carry asyncOp: the lane is on; torch 2.4's do not (compat):
    every call keeps the Python path, which runs nothing inline there either."""
    assert harness.run_torch_ranks(_installed, 2, "shm", JOB_TIMEOUT_S) == [ON, ON]
