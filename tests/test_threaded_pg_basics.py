"""threaded_pg (ranks as threads running the production algorithms, backend "threaded"; the
collective sweeps run over threads through harness kind "threads", test_<collective>.py).
The basics: spawn, every collective and async work, objects, p2p, subgroups,
split_group, a DDP step.

Fixtures (nothing outlives a test, one warm-up spawn per module): support/threaded.py. Each
test says what it guards.
"""

import time

import pytest
import torch
import torch.distributed as dist

import threaded_pg
from support.threaded import nothing_outlives_the_test, warm  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.torch, pytest.mark.timeout(120)]


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
