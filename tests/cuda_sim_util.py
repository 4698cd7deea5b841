"""Engine-level cuda_ipc groups on the simulated device with asynchronous streams, for tests.

`device_group(store, rank, world_size, ...)` builds a shmcoll Group and a DeviceGroup over a
SimDevice whose stream runs its operations on a worker thread (optionally after random
delays): the host enqueues and returns, exactly as with a GPU. `random_program` and `check`
drive a seeded mix of every device collective through it and verify every result once
the stream drained (tests/test_cuda_ipc_async.py, tests/_cuda_scenarios.py).
"""

import random

import torch

import shmcoll
from cuda_ipc.group import DeviceGroup
from cuda_ipc.rendezvous import ProcessRendezvous
from cuda_ipc.sim import SimDevice
from shmcoll import config
from shmcoll.native.ops import ReduceOp

__all__ = ["device_group", "random_program", "run_program", "check"]


def device_group(store, rank, world_size, *, delay_s=0.0, slot_nbytes=4096, nslots=2,
                 timeout_s=60.0, sim_device=0, peer_access=True, tier="auto", seed=0):
    """(shmcoll Group, DeviceGroup, SimDevice) of this rank; close with group.close()."""
    group = shmcoll.new_shm_group(store, rank, world_size, timeout_s=timeout_s)
    cfg = config.from_env({}, cuda_sim="async", cuda_slot_nbytes=slot_nbytes,
                          cuda_nslots=nslots, cuda_host_slot_nbytes=max(slot_nbytes, 4096),
                          cuda_tier=tier)
    dev = SimDevice(sim_device, asynchronous=True, max_delay_s=delay_s, seed=seed * 97 + rank,
                    peer_access=peer_access)
    dg = DeviceGroup(group, dev, lambda: ProcessRendezvous(
        store, rank, world_size, group._arena._pids if group._arena else [0], timeout_s), cfg)
    group._closers.append(dev.close)  # its stream threads, after the arena closed
    return group, dg, dev


_KINDS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "gather",
          "scatter", "all_to_all")
_DTYPES = {"float32": torch.float32, "int64": torch.int64, "bfloat16": torch.bfloat16}
_OPS = {"float32": (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.AVG),
        "int64": (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.BXOR, ReduceOp.MAX),
        "bfloat16": (ReduceOp.SUM, ReduceOp.MIN)}


def random_program(seed, length, world_size, max_count):
    """The same list of (kind, dtype, op, count, root, extra) on every rank."""
    rng = random.Random(seed)
    prog = []
    for _ in range(length):
        kind = rng.choice(_KINDS)
        dtype = rng.choice(list(_DTYPES))
        count = rng.choice([0, 1, 3, rng.randrange(1, max_count + 1)])
        sizes = [[rng.randrange(0, max_count + 1) for _ in range(world_size)]
                 for _ in range(world_size)]  # all_to_all: sizes[src][dst]
        prog.append((kind, dtype, rng.choice(_OPS[dtype]), count,
                     rng.randrange(world_size), sizes))
    return prog


def _inp(seed, i, rank, count, dtype, salt=0):
    g = torch.Generator().manual_seed(seed * 1_000_003 + i * 1009 + rank * 17 + salt)
    v = torch.randint(-2, 3, (count,), generator=g)
    return v.to(_DTYPES[dtype])


def _reduce(xs, op, ws):
    x = torch.stack([t.double() if t.is_floating_point() else t for t in xs])
    if op == ReduceOp.SUM:
        r = x.sum(0)
    elif op == ReduceOp.AVG:
        r = x.sum(0) / ws
    elif op == ReduceOp.MAX:
        r = x.max(0).values
    elif op == ReduceOp.MIN:
        r = x.min(0).values
    elif op == ReduceOp.PRODUCT:
        r = x.prod(0)
    else:  # BXOR
        r = x[0]
        for y in x[1:]:
            r = r ^ y
    return r.to(xs[0].dtype)


def run_program(dg, prog, seed, rank, ws):
    """Enqueue every collective of `prog`; returns [(i, outputs, expected)] to check once the
    stream has drained. Inputs are fresh tensors never touched again by the host."""
    results = []
    for i, (kind, dtype, op, count, root, sizes) in enumerate(prog):
        x = [_inp(seed, i, r, count, dtype) for r in range(ws)]
        td = _DTYPES[dtype]
        if kind == "all_reduce":
            t = x[rank].clone()
            dg.all_reduce(t, dtype, op)
            results.append((i, [t], [_reduce(x, op, ws)]))
        elif kind == "reduce":
            t = x[rank].clone()
            dg.reduce(t, root, dtype, op)
            results.append((i, [t], [_reduce(x, op, ws) if rank == root else x[rank]]))
        elif kind == "broadcast":
            t = x[rank].clone()
            dg.broadcast(t.view(torch.uint8), root)
            results.append((i, [t], [x[root]]))
        elif kind in ("all_gather", "gather"):
            outs = [torch.empty(count, dtype=td) for _ in range(ws)]
            src = x[rank].clone().view(torch.uint8)
            views = [o.view(torch.uint8) for o in outs]
            if kind == "all_gather":
                dg.all_gather(views, src)
                results.append((i, outs, x))
            else:
                dg.gather(src, views if rank == root else None, root)
                if rank == root:
                    results.append((i, outs, x))
        elif kind == "reduce_scatter":
            blocks = [_inp(seed, i, r, count * ws, dtype, salt=1) for r in range(ws)]
            out = torch.empty(count, dtype=td)
            dg.reduce_scatter(out, blocks[rank].clone().view(ws, count), dtype, op)
            want = _reduce([b[rank * count:(rank + 1) * count] for b in blocks], op, ws)
            results.append((i, [out], [want]))
        elif kind == "scatter":
            pieces = [_inp(seed, i, root, count, dtype, salt=2 + d) for d in range(ws)]
            out = torch.empty(count, dtype=td)
            stacked = torch.stack(pieces).view(torch.uint8) if rank == root else None
            dg.scatter(out.view(torch.uint8), stacked, root)
            results.append((i, [out], [pieces[rank]]))
        else:  # all_to_all, uneven: sizes[src][dst] elements
            ins = [_inp(seed, i, rank, sizes[rank][d], dtype, salt=3 + d) for d in range(ws)]
            outs = [torch.empty(sizes[s][rank], dtype=td) for s in range(ws)]
            dg.all_to_all([o.view(torch.uint8) for o in outs], [t.view(torch.uint8) for t in ins])
            want = [_inp(seed, i, s, sizes[s][rank], dtype, salt=3 + rank) for s in range(ws)]
            results.append((i, outs, want))
    return results


def check(results, prog):
    """Indices (into prog) of the collectives whose outputs differ from the expected."""
    bad = []
    for i, outs, wants in results:
        for o, w in zip(outs, wants):
            if o.shape != w.shape or not torch.equal(o, w):
                bad.append((i, prog[i][:5]))
                break
    return bad
