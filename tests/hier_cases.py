"""Checks of backend "shm" across nodes, run inside every rank (tests/test_hier.py runs them
on simulated nodes, tests/test_hier_namespaces.py on namespaced "hosts").

Every function takes (rank, world_size, nodes) -- nodes[r]: the node id of rank r -- runs
collectives on the initialized default group, asserts the values, and returns digests of
results that must be bitwise identical on every rank. Reductions are checked against the
documented order (shmcoll/hier/reduce.py): inside each node in rank order, then over the
nodes in node order, rounding to the dtype after each level.
"""

import hashlib

import torch
import torch.distributed as dist

COUNTS = (5, 3000, 40000)  # inline / leaders in two rounds / sharded (at a 64 KiB threshold)


def layout(nodes):
    """Members of every node (ascending), nodes numbered by their lowest rank."""
    order = {}
    for n in nodes:
        order.setdefault(n, len(order))
    members = [[] for _ in order]
    for r, n in enumerate(nodes):
        members[order[n]].append(r)
    return members


def digest(t):
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _input(seed, rank, count, dtype):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype == torch.bool:
        return torch.rand(count, generator=g) < 0.5
    if dtype.is_complex:
        return torch.randn(count, generator=g, dtype=dtype)
    if not dtype.is_floating_point:
        return torch.randint(-20, 20, (count,), generator=g, dtype=dtype)
    return (torch.randn(count, generator=g) * 3).to(dtype)


def _fold(a, b, op):
    if op == "sum":
        return a + b
    if op == "product":
        return a * b
    if op == "max":
        return torch.maximum(a, b)
    if op == "min":
        return torch.minimum(a, b)
    if op == "band":
        return a & b
    if op == "bor":
        return a | b
    return a ^ b


def reference(inputs, nodes, op, pre=1.0, post=1.0):
    """The documented two-level reduction of `inputs` (one tensor per rank)."""
    dtype = inputs[0].dtype
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype

    def level(xs, pre, post):
        acc = None
        for x in xs:
            x = x.to(wide)
            if pre != 1.0:
                x = x * torch.tensor(pre, dtype=wide)
            acc = x if acc is None else _fold(acc, x, op)
        if post != 1.0:
            acc = acc * torch.tensor(post, dtype=wide)
        return acc.to(dtype)

    if dtype == torch.bool:  # bool: sum/max are "any", product/min "all"
        op = {"sum": "bor", "max": "bor", "product": "band", "min": "band"}.get(op, op)
    partials = [level([inputs[r] for r in m], pre, 1.0) for m in layout(nodes)]
    return level(partials, 1.0, post)


_OPS = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN, "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR,
        "bxor": dist.ReduceOp.BXOR}


def check_all_reduce(rank, world_size, nodes, counts=COUNTS):
    out = []
    cases = [(torch.float32, "sum"), (torch.float16, "sum"), (torch.bfloat16, "sum"),
             (torch.float64, "product"), (torch.int64, "sum"), (torch.int32, "max"),
             (torch.int16, "bxor"), (torch.bool, "sum"), (torch.complex64, "sum"),
             (torch.float32, "min")]
    for i, (dtype, op) in enumerate(cases):
        for count in counts:
            inputs = [_input(i, r, count, dtype) for r in range(world_size)]
            t = inputs[rank].clone()
            dist.all_reduce(t, _OPS[op])
            want = reference(inputs, nodes, op)
            assert torch.equal(t.view(torch.uint8), want.view(torch.uint8)) if \
                dtype != torch.bool else torch.equal(t, want), \
                f"all_reduce {dtype} {op} count {count}: got {t[:4]}, want {want[:4]}"
            out.append(digest(t))
    for count in counts:  # AVG divides once at the end; PREMUL_SUM scales every input
        inputs = [_input(50, r, count, torch.float32) for r in range(world_size)]
        t = inputs[rank].clone()
        dist.all_reduce(t, dist.ReduceOp.AVG)
        want = reference(inputs, nodes, "sum", post=1.0 / world_size)
        assert torch.equal(t, want), f"AVG count {count}: {t[:3]} vs {want[:3]}"
        t = inputs[rank].clone()
        dist.all_reduce(t, dist._make_nccl_premul_sum(2.5))
        assert torch.equal(t, reference(inputs, nodes, "sum", pre=2.5)), f"PREMUL count {count}"
        out.append(digest(t))
    strided = torch.zeros(8, 6)[:, 1]  # a strided view: only its elements are written
    strided.fill_(rank + 1.0)
    base = strided._base
    dist.all_reduce(strided)
    assert torch.all(strided == world_size * (world_size + 1) / 2)
    assert torch.all(base[:, 0] == 0) and torch.all(base[:, 2:] == 0)
    work = dist.all_reduce(torch.ones(7), async_op=True)
    work.wait()
    assert torch.all(work.get_future().value()[0] == world_size)
    return out


def check_large_all_reduce(rank, world_size, nodes):
    """Shards of 256 KiB and more: from 3 nodes they are reduce-scattered and all-gathered
    across nodes; an odd count pads the last shard."""
    out = []
    for count in (140000, 140001):
        inputs = [_input(60, r, count, torch.float32) for r in range(world_size)]
        t = inputs[rank].clone()
        dist.all_reduce(t)
        assert torch.equal(t, reference(inputs, nodes, "sum")), f"large all_reduce {count}"
        out.append(digest(t))
    return out


def check_reduce_scatter(rank, world_size, nodes, counts=COUNTS):
    for count in counts:
        per = max(1, count // world_size)
        inputs = [_input(7, r, per * world_size, torch.float32) for r in range(world_size)]
        o = torch.empty(per)
        dist.reduce_scatter_tensor(o, inputs[rank].clone())
        want = reference(inputs, nodes, "sum")[rank * per:(rank + 1) * per]
        assert torch.equal(o, want), f"reduce_scatter_tensor per {per}: {o[:3]} vs {want[:3]}"
    sizes = [r + 1 for r in range(world_size)]  # uneven list form
    ins = [torch.full((s,), float(rank + 1)) for s in sizes]
    o = torch.empty(sizes[rank])
    dist.reduce_scatter(o, ins)
    assert torch.all(o == world_size * (world_size + 1) / 2)


def check_reduce(rank, world_size, nodes):
    for root in sorted({0, world_size - 1, layout(nodes)[-1][0]}):
        for count in (5, 40000):
            inputs = [_input(9, r, count, torch.float32) for r in range(world_size)]
            t = inputs[rank].clone()
            dist.reduce(t, root)
            if rank == root:
                assert torch.equal(t, reference(inputs, nodes, "sum")), f"reduce root {root}"
            else:
                assert torch.equal(t, inputs[rank]), "reduce wrote a non-root's tensor"


def check_broadcast(rank, world_size, nodes):
    for root in range(world_size):
        for count in (1, 3000, 40001):
            t = torch.arange(count, dtype=torch.float32) * (root + 1) if rank == root \
                else torch.full((count,), -1.0)
            dist.broadcast(t, root)
            assert torch.equal(t, torch.arange(count, dtype=torch.float32) * (root + 1)), \
                f"broadcast root {root} count {count}"
    objs = [{"from": rank, "x": list(range(rank + 3))}] if rank == 1 else [None]
    dist.broadcast_object_list(objs, src=1)
    assert objs[0] == {"from": 1, "x": [0, 1, 2, 3]}


def check_all_gather(rank, world_size, nodes):
    for count in (3, 300, 20000):
        mine = torch.arange(count, dtype=torch.float64) + 1000 * rank
        outs = [torch.empty(count, dtype=torch.float64) for _ in range(world_size)]
        dist.all_gather(outs, mine)
        whole = torch.empty(world_size * count, dtype=torch.float64)
        dist.all_gather_into_tensor(whole, mine)
        for r in range(world_size):
            want = torch.arange(count, dtype=torch.float64) + 1000 * r
            assert torch.equal(outs[r], want) and torch.equal(whole[r * count:(r + 1) * count],
                                                              want), f"all_gather {count}"
        # in place, as FSDP2 calls it: the input is this rank's block of the output
        whole = torch.zeros(world_size * count, dtype=torch.float64)
        whole[rank * count:(rank + 1) * count] = mine
        dist.all_gather_into_tensor(whole, whole[rank * count:(rank + 1) * count])
        assert torch.equal(whole, torch.cat([torch.arange(count, dtype=torch.float64) + 1000 * r
                                             for r in range(world_size)])), \
            f"all_gather in place {count}"
    got = [None] * world_size
    dist.all_gather_object(got, ("rank", rank, "x" * rank))
    assert got == [("rank", r, "x" * r) for r in range(world_size)]


def check_gather_scatter(rank, world_size, nodes):
    for root in sorted({0, world_size - 1, layout(nodes)[-1][-1]}):
        for count in (2, 9000):
            mine = torch.full((count,), float(rank))
            outs = [torch.empty(count) for _ in range(world_size)] if rank == root else None
            dist.gather(mine, outs, dst=root)
            if rank == root:
                assert all(torch.all(o == r) for r, o in enumerate(outs)), f"gather {root}"
            ins = [torch.full((count,), float(r * 10 + root)) for r in range(world_size)] \
                if rank == root else None
            o = torch.empty(count)
            dist.scatter(o, ins, src=root)
            assert torch.all(o == rank * 10 + root), f"scatter root {root}"
    got = [None] * world_size if rank == 0 else None
    dist.gather_object({"r": rank}, got, dst=0)
    if rank == 0:
        assert got == [{"r": r} for r in range(world_size)]
    mine = [None]
    dist.scatter_object_list(mine, [f"obj{r}" for r in range(world_size)] if rank == 1 else
                             None, src=1)
    assert mine[0] == f"obj{rank}"


def check_all_to_all(rank, world_size, nodes):
    for per in (1, 2000):
        src = torch.arange(world_size * per, dtype=torch.float32) + 100000 * rank
        dst = torch.empty(world_size * per)
        dist.all_to_all_single(dst, src)
        for r in range(world_size):
            want = torch.arange(rank * per, (rank + 1) * per, dtype=torch.float32) + 100000 * r
            assert torch.equal(dst[r * per:(r + 1) * per], want), f"all_to_all_single {per}"
    # uneven: rank r sends (r + j + 1) elements to rank j
    ins = [torch.full((rank + j + 1,), float(rank * 100 + j)) for j in range(world_size)]
    outs = [torch.empty(r + rank + 1) for r in range(world_size)]
    dist.all_to_all(outs, ins)
    for r in range(world_size):
        assert torch.all(outs[r] == r * 100 + rank), f"all_to_all from {r}"
    # in place, uneven (rank s sends 3 + 2 ((d - s) mod n) elements to rank d): blocks move
    # within the one tensor, and the inter-node round sends after the intra-node one wrote
    n = world_size
    sends = [3 + 2 * ((j - rank) % n) for j in range(n)]
    recvs = [3 + 2 * ((rank - j) % n) for j in range(n)]
    t = torch.cat([torch.full((c,), float(rank * 100 + j)) for j, c in enumerate(sends)])
    dist.all_to_all_single(t, t, recvs, sends)
    want = torch.cat([torch.full((c,), float(j * 100 + rank)) for j, c in enumerate(recvs)])
    assert torch.equal(t, want), f"all_to_all_single in place: {t.tolist()}"
    dist.barrier()


def check_p2p(rank, world_size, nodes):
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for count in (4, 50000):
        send = torch.full((count,), float(rank))
        recv = torch.empty(count)
        reqs = [dist.isend(send, right, tag=count), dist.irecv(recv, left, tag=count)]
        for q in reqs:
            q.wait()
        assert torch.all(recv == left), f"ring count {count}"
    ops = [dist.P2POp(dist.isend, torch.full((3,), float(rank)), right),
           dist.P2POp(dist.irecv, got := torch.empty(3), left)]
    for q in dist.batch_isend_irecv(ops):
        q.wait()
    assert torch.all(got == left)
    if rank == 0:  # any source: one message from every other rank
        seen = set()
        for _ in range(world_size - 1):
            t = torch.empty(2)
            src = dist.recv(t)
            assert torch.all(t == src)
            seen.add(src)
        assert seen == set(range(1, world_size))
    else:
        dist.send(torch.full((2,), float(rank)), 0)
    strided = torch.zeros(4, 3)[:, 1]
    if rank == 0:
        dist.send(torch.arange(4, dtype=torch.float32), world_size - 1, tag=7)
    elif rank == world_size - 1:
        dist.recv(strided, 0, tag=7)
        assert torch.equal(strided, torch.arange(4, dtype=torch.float32))
        assert torch.all(strided._base[:, 0] == 0)
    dist.barrier()


def check_subgroups(rank, world_size, nodes):
    from shmcoll.torch_backend import HierProcessGroup, ProcessGroupShm
    members = layout(nodes)
    leaders = [m[0] for m in members]  # one rank per node: a group spanning nodes
    node0 = members[0]  # one node: the single-node engine
    g_lead = dist.new_group(leaders)
    g_node = dist.new_group(node0)
    if rank in leaders:
        assert isinstance(g_lead._get_backend(torch.device("cpu")).made(), HierProcessGroup)
        t = torch.full((5,), float(rank))
        dist.all_reduce(t, group=g_lead)
        assert torch.all(t == sum(leaders))
    if rank in node0:
        assert isinstance(g_node._get_backend(torch.device("cpu")).made(), ProcessGroupShm)
        t = torch.ones(3)
        dist.all_reduce(t, group=g_node)
        assert torch.all(t == len(node0))
    # ProcessGroup.split_group (what dist.split_group calls once a device is bound): every
    # rank calls it, non-members get None; the evens span nodes in every layout tested
    default = dist.distributed_c10d._get_default_group()
    evens = [r for r in range(world_size) if r % 2 == 0]
    odds = [r for r in range(world_size) if r % 2]
    splits = [default.split_group(evens), default.split_group(odds)]
    sub = splits[rank % 2]
    assert splits[1 - rank % 2] is None
    t = torch.full((4,), float(rank))
    sub.allreduce([t]).wait()
    assert torch.all(t == sum(evens if rank % 2 == 0 else odds))
    sub.shutdown()
    for g in (g_lead, g_node):
        if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(g)


def check_monitored_barrier(rank, world_size, nodes):
    """monitored_barrier across nodes (through the store; rank 0 asks whether ranks of
    other nodes are alive): passes when every rank comes; with a rank of another node 1 s
    late and a 0.3 s timeout, rank 0 names it and every rank raises; the group goes on.
    (dist.monitored_barrier admits only backend "gloo" by name: the ProcessGroup's own
    method, which it calls, is called directly, as tests/test_gloo_seeds_lifecycle.py does.)"""
    import datetime
    import time
    pg = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    pg.monitored_barrier(datetime.timedelta(seconds=60))
    pg.monitored_barrier(datetime.timedelta(seconds=60), wait_all_ranks=True)
    late = world_size - 1
    assert nodes[late] != nodes[0]
    if rank == late:
        time.sleep(1.0)
    try:
        pg.monitored_barrier(datetime.timedelta(seconds=0.3))
        raised = ""
    except RuntimeError as e:
        raised = str(e)
    if rank == 0:
        assert f"Rank {late} failed to pass monitoredBarrier" in raised, raised
    else:
        assert "monitoredBarrier" in raised, raised
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.all(t == world_size)


ALL = (check_all_reduce, check_large_all_reduce, check_reduce_scatter, check_reduce,
       check_broadcast, check_all_gather, check_gather_scatter, check_all_to_all, check_p2p,
       check_subgroups, check_monitored_barrier)


def run_all(rank, world_size, nodes):
    """Every check; -> the digests that must agree across ranks."""
    from shmcoll.torch_backend import HierProcessGroup
    pg = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).made()
    assert isinstance(pg, HierProcessGroup), type(pg)
    out = []
    for check in ALL:
        out.extend(check(rank, world_size, nodes) or [])
    return out
