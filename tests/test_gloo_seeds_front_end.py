"""The gloo seeds through torch.distributed with init_process_group("shm") (SEEDS.md, E-table
§3): coalescing, object collectives, new_group / split_group and sequence numbers.

How the seeds run (one job per test on every rank of the harness pool, world size 4): see
seed_util.py. The subjects: test_gloo_seeds_{checks,basics,front_end,lifecycle}.py.
"""

import pytest

from seed_util import assert_equal, ranks, run_job, simple_sparse_reduce_tests, WS

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch]


# ============================================================ through torch.distributed

def _verify_seq_across(pg, verify_pg):
    """001 _verify_sequence_number_across_pg (the verify group is a separate "shm" group)."""
    import torch.distributed as dist
    seq_num = pg._get_sequence_number_for_group()
    obj_list = [None for _ in range(dist.get_world_size(verify_pg))]
    dist.all_gather_object(obj_list, seq_num, group=verify_pg)
    assert len(set(obj_list)) == 1, obj_list
    return obj_list[0]


def _seq_incremented(process_group, group_ranks):
    """001 _test_sequence_num_incremented (PG-30..33), incl. the op only some ranks issue."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    verify_pg = dist.new_group(ranks=group_ranks, backend="shm")
    member = not c10d._rank_not_in_group(process_group)
    initial = _verify_seq_across(process_group, verify_pg) if member else -1
    for i in range(10):
        t = torch.ones(1)
        dist.all_reduce(t, group=process_group)
        if member:
            assert _verify_seq_across(process_group, verify_pg) == initial + i + 1
    if member and dist.get_world_size(process_group) > 2:
        if dist.get_rank(process_group) not in (0, 2):  # ranks 0 and 2 never join this one
            dist.all_reduce(t, group=process_group, async_op=True)
        seq_num = process_group._get_sequence_number_for_group()
        obj_list = [None for _ in range(dist.get_world_size(verify_pg))]
        dist.all_gather_object(obj_list, (dist.get_rank(process_group), seq_num),
                               group=verify_pg)  # must not be blocked by the orphan op
        rank_to_seq = dict(obj_list)
        assert len(set(rank_to_seq.values())) == 2, rank_to_seq
        assert rank_to_seq[0] == rank_to_seq[2]
        assert len({rank_to_seq[i] for i in rank_to_seq if i not in (0, 2)}) == 1
        assert rank_to_seq[0] + 1 == rank_to_seq[1]


def _frontend_job(rank, world_size, store):
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    ws = world_size
    with ranks(rank, world_size, store) as ctx:
        ctx.init()
        world = dist.group.WORLD
        assert dist.get_backend() == "shm"
        # PG-30: equal sequence numbers right after init
        obj_list = [None] * ws
        dist.all_gather_object(obj_list, world._get_sequence_number_for_group())
        assert len(set(obj_list)) == 1, obj_list

        # ---- test_allreduce_coalesced_async: a Future through the front end
        xs = [2 * [torch.tensor([i + rank])] for i in range(2)]
        futs = [c10d.all_reduce_coalesced(x, async_op=True) for x in xs]
        torch.futures.wait_all(futs)
        for i, fut in enumerate(futs):
            assert_equal(fut.wait(), 2 * [torch.tensor([(i * ws) + (ws * (ws - 1) // 2)])])

        # ---- test_allgather_into_tensor_coalesced
        torch.manual_seed(42)
        in_shapes = [(5, 5), (10, 10), (15, 15)]
        outputs = [torch.empty((s[0] * ws,) + s[1:]) for s in in_shapes]
        inputs = [torch.rand(s) for s in in_shapes]
        dist.group.WORLD.allgather_into_tensor_coalesced(outputs, inputs).wait()
        for output, inp in zip(outputs, inputs):
            assert torch.allclose(output, torch.cat([inp] * ws))
        # ... with per-rank data and mixed dtypes
        inputs = [torch.full((2, 3), float(rank)), torch.arange(4) + 10 * rank]
        outputs = [torch.empty(2 * ws, 3), torch.empty(4 * ws, dtype=torch.int64)]
        world.allgather_into_tensor_coalesced(outputs, inputs).wait()
        assert_equal(outputs[0], torch.cat([torch.full((2, 3), float(r)) for r in range(ws)]))
        assert_equal(outputs[1], torch.cat([torch.arange(4) + 10 * r for r in range(ws)]))

        # ---- test_reduce_scatter: uneven, rank 0's output has 0 elements
        torch.manual_seed(42)
        inputs = [torch.rand(i) for i in range(ws)]
        output = torch.empty(rank)
        dist.reduce_scatter(output, inputs, async_op=True).wait()
        assert torch.allclose(output, inputs[rank] * ws)

        # ---- test_reduce_scatter_tensor
        torch.manual_seed(42)
        out_shape = (20, 20)
        output = torch.empty(out_shape)
        inp = torch.rand((out_shape[0] * ws,) + out_shape[1:])
        dist.reduce_scatter_tensor(output, inp, async_op=True).wait()
        assert torch.allclose(output, inp.view(ws, *out_shape).chunk(ws)[rank] * ws)

        # ---- test_reduce_scatter_tensor_coalesced
        torch.manual_seed(42)
        out_shapes = [(5, 5), (10, 10), (15, 15)]
        outputs = [torch.empty(s) for s in out_shapes]
        inputs = [torch.rand((s[0] * ws,) + s[1:]) for s in out_shapes]
        dist.group.WORLD.reduce_scatter_tensor_coalesced(outputs, inputs).wait()
        for output, inp in zip(outputs, inputs):
            assert torch.allclose(output, inp.view(ws, *output.shape).chunk(ws)[rank] * ws)
        # per-rank data, MAX
        outputs = [torch.empty(3), torch.empty(2, 2)]
        inputs = [torch.arange(3 * ws, dtype=torch.float32) * (rank + 1),
                  torch.ones(2 * ws, 2) * rank]
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        world.reduce_scatter_tensor_coalesced(outputs, inputs, opts).wait()
        assert_equal(outputs[0], (torch.arange(3 * rank, 3 * rank + 3, dtype=torch.float32) * ws))
        assert_equal(outputs[1], torch.full((2, 2), float(ws - 1)))

        # ---- both method-name families
        out = torch.empty(ws * 2)
        world._allgather_base(out, torch.full((2,), float(rank))).wait()
        assert_equal(out, torch.repeat_interleave(torch.arange(ws, dtype=torch.float32), 2))
        out = torch.empty(ws * 2)
        world.all_gather_single(out, torch.full((2,), float(rank))).wait()
        assert_equal(out, torch.repeat_interleave(torch.arange(ws, dtype=torch.float32), 2))
        out = torch.empty(2)
        world._reduce_scatter_base(out, torch.ones(2 * ws)).wait()
        assert_equal(out, torch.full((2,), float(ws)))
        world.reduce_scatter_single(out, torch.ones(2 * ws) * 2).wait()
        assert_equal(out, torch.full((2,), 2.0 * ws))
        inp = torch.arange(ws, dtype=torch.float32) + 10 * rank
        out = torch.empty(ws)
        world.alltoall_base(out, inp, [], []).wait()
        assert_equal(out, torch.tensor([rank + 10.0 * r for r in range(ws)]))
        world.all_to_all_single(out, inp, [1] * ws, [1] * ws).wait()
        assert_equal(out, torch.tensor([rank + 10.0 * r for r in range(ws)]))
        # strided outputs of the tensor forms
        base = torch.zeros(ws * 2, 2)
        dist.all_gather_into_tensor(base[:, 0], torch.full((2,), float(rank)))
        assert_equal(base[:, 0], torch.repeat_interleave(torch.arange(ws, dtype=torch.float32), 2))
        assert_equal(base[:, 1], torch.zeros(ws * 2))

        # ---- all_gather_coalesced, all_to_all, all_to_all_single (uneven) via dist
        outs = [[torch.empty(2), torch.empty(1)] for _ in range(ws)]
        dist.all_gather_coalesced(outs, [torch.full((2,), float(rank)), torch.tensor([rank * 1.])])
        assert_equal(outs, [[torch.full((2,), float(r)), torch.tensor([r * 1.])]
                            for r in range(ws)])
        in_splits = [r + 1 for r in range(ws)]
        out_splits = [rank + 1] * ws
        inp = torch.cat([torch.full((r + 1,), float(rank)) for r in range(ws)])
        out = torch.empty(sum(out_splits))
        dist.all_to_all_single(out, inp, out_splits, in_splits)
        assert_equal(out, torch.cat([torch.full((rank + 1,), float(r)) for r in range(ws)]))
        outs = [torch.empty(1) for _ in range(ws)]
        dist.all_to_all(outs, [torch.tensor([float(rank * 10 + r)]) for r in range(ws)])
        assert_equal(outs, [torch.tensor([float(r * 10 + rank)]) for r in range(ws)])

        # ---- object collectives through the front end
        objs = [{"rank": rank, "x": [rank] * 3} if rank == 1 else None, "pad"]
        dist.broadcast_object_list(objs, src=1)
        assert objs == [{"rank": 1, "x": [1, 1, 1]}, "pad"], objs
        gathered = [None] * ws
        dist.all_gather_object(gathered, ("r", rank, "y" * rank))
        assert gathered == [("r", r, "y" * r) for r in range(ws)]
        gathered = [None] * ws if rank == 2 else None
        dist.gather_object({"from": rank}, gathered, dst=2)
        if rank == 2:
            assert gathered == [{"from": r} for r in range(ws)], gathered
        out = [None]
        dist.scatter_object_list(out, [f"obj{r}" * (r + 1) for r in range(ws)] if rank == 3
                                 else None, src=3)
        assert out == [f"obj{rank}" * (rank + 1)], out

        # ---- coalescing manager (002 test_coalescing_manager[_async]), fast path + device
        for device in (None, torch.device("cpu")):
            small = [torch.ones(8) * (rank + 1) for _ in range(2)]
            with c10d._coalescing_manager(device=device):
                for t in small:
                    dist.all_reduce(t)
            big = torch.ones(16) * (rank + 1)
            dist.all_reduce(big)
            for i in range(2):
                assert_equal(small[i], big[i * 8:(i + 1) * 8])
            small = [torch.ones(8) * (rank + 1) for _ in range(2)]
            with c10d._coalescing_manager(device=device, async_ops=True) as cm:
                for t in small:
                    dist.all_reduce(t)
            cm.wait()
            for i in range(2):
                assert_equal(small[i], big[i * 8:(i + 1) * 8])
            outs = [torch.empty(2 * ws), torch.empty(ws)]
            with c10d._coalescing_manager(device=device):
                dist.all_gather_into_tensor(outs[0], torch.full((2,), float(rank)))
                dist.all_gather_into_tensor(outs[1], torch.tensor([rank * 2.0]))
            assert_equal(outs[0], torch.repeat_interleave(torch.arange(ws, dtype=torch.float32), 2))
            assert_equal(outs[1], torch.arange(ws, dtype=torch.float32) * 2)
            outs = [torch.empty(2), torch.empty(1)]
            with c10d._coalescing_manager(device=device, async_ops=True) as cm:
                dist.reduce_scatter_tensor(outs[0], torch.ones(2 * ws))
                dist.reduce_scatter_tensor(outs[1], torch.ones(ws) * 3)
            cm.wait()
            assert_equal(outs, [torch.full((2,), float(ws)), torch.tensor([3.0 * ws])])

        # ---- sparse through dist.all_reduce (000 test_sparse_allreduce_cuda_dispatched, CPU)
        for inputs, outputs in simple_sparse_reduce_tests(rank, ws, num_inputs=1):
            tensors = inputs[-1].clone()
            dist.all_reduce(tensors, async_op=True).wait()
            assert_equal([tensors], outputs)

        # ---- PREMUL_SUM / AVG through dist.all_reduce
        t = torch.tensor([1.0, rank])
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
        assert_equal(t, torch.tensor([ws * 0.5, 0.5 * ws * (ws - 1) / 2]))
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        assert_equal(t, torch.tensor([(ws - 1) / 2]))

        # ---- subgroups: new_group [1, 2] (002 *_group tests) and the full group
        group = dist.new_group([1, 2])
        full = dist.new_group()
        for g, members in ((group, [1, 2]), (full, list(range(ws)))):
            if rank not in members:
                assert dist.get_rank(g) == -1 and dist.get_world_size(g) == -1
                continue
            for src in members:
                t = torch.full((src + 1,) * 3, float(src)) if rank == src else \
                    torch.zeros((src + 1,) * 3)
                dist.broadcast(t, src, g)
                assert bool(t.eq(float(src)).all())
                t = torch.tensor([2.0]) if rank == src else torch.tensor([10.0])
                dist.reduce(t, src, dist.ReduceOp.SUM, g)
                if rank == src:
                    assert_equal(t, torch.tensor([2.0 + 10 * (len(members) - 1)]))
            dist.barrier(g)
        # new_subgroups / new_subgroups_by_enumeration (002 test_new_subgroups*)
        cur, subgroups = dist.new_subgroups(2)
        assert cur.size() == 2 and len(subgroups) == ws // 2
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=cur)
        base_rank = rank - rank % 2
        assert_equal(t, torch.tensor([base_rank * 2 + 1.0]))
        cur2, subgroups2 = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
        if rank in (0, 2):
            assert cur2 == subgroups2[0]
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=cur2)
        assert_equal(t, torch.tensor([2.0 if rank in (0, 2) else 4.0]))
        for g in subgroups + subgroups2:
            dist.destroy_process_group(g)

        # ---- several groups used concurrently: a collective that only half the ranks have
        # issued yet on group A must not hold up group B
        group_a = dist.new_group()
        group_b = dist.new_group()
        a = torch.tensor([float(rank)])
        if rank < 2:
            work_a = dist.all_reduce(a, group=group_a, async_op=True)
        for i in range(5):
            b = torch.tensor([float(i)])
            dist.all_reduce(b, group=group_b)
            assert_equal(b, torch.tensor([float(i * ws)]))
        if rank < 2:
            assert not work_a.is_completed()
        # ranks 2 and 3 join group A only after ranks 0 and 1 looked: without this barrier
        # (itself on group B, with A still pending) a fast rank 2 could complete A first
        dist.barrier(group=group_b)
        if rank >= 2:
            work_a = dist.all_reduce(a, group=group_a, async_op=True)
        work_a.wait()
        assert_equal(a, torch.tensor([ws * (ws - 1) / 2]))

        # ---- sequence numbers: subgroup [0, 1, 2] then the default group (PG-30..33);
        # the default-group variant leaves an orphan op on WORLD, so it runs last
        subgroup = dist.new_group([0, 1, 2])
        _seq_incremented(subgroup, [0, 1, 2])
        sub01 = dist.new_group([0, 1])
        if not c10d._rank_not_in_group(sub01):
            obj_list = [None] * 2
            dist.all_gather_object(obj_list, sub01._get_sequence_number_for_group(), group=sub01)
            assert len(set(obj_list)) == 1
        _seq_incremented(c10d._get_default_group(), list(range(ws)))
    return True


def _split_group_job(rank, world_size, store):
    with ranks(rank, world_size, store) as ctx:
        ctx.init()
        _split_group_checks(rank, world_size)
    return True


def _split_group_checks(rank, ws):
    """split_group (plugin path; on CPU-only torch needs an accelerator and a bound device, so
    both are faked for the duration)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    default_pg = c10d._get_default_group()
    saved = (torch.accelerator.is_available, torch.accelerator.current_accelerator,
             default_pg.bound_device_id)
    torch.accelerator.is_available = lambda: True
    torch.accelerator.current_accelerator = lambda *a, **k: torch.device("cpu")
    default_pg.bound_device_id = torch.device("cpu", 0)
    try:
        ng1 = c10d.split_group(default_pg, [[0, 1], [2, 3]])
        ng2 = c10d.split_group(default_pg, [[0, 2]])
    finally:
        torch.accelerator.is_available, torch.accelerator.current_accelerator = saved[:2]
        default_pg.bound_device_id = saved[2]
    assert ng1 is not None and ng1.size() == 2
    assert ng1.group_desc == "default_pg:split:0", ng1.group_desc
    members = [0, 1] if rank < 2 else [2, 3]
    assert dist.get_process_group_ranks(ng1) == members
    t = torch.tensor([float(rank)])
    dist.broadcast(t, dist.get_global_rank(ng1, 0), group=ng1)
    assert_equal(t, torch.tensor([float(members[0])]))
    if rank in (0, 2):
        assert ng2.group_desc == "default_pg:split:1", ng2.group_desc
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=ng2)
        assert_equal(t, torch.tensor([2.0]))
    else:
        assert ng2 is None
    # direct method: every rank of the parent calls it, non-members get None
    sub = default_pg.split_group([1, 3], group_name="direct_split_13")
    if rank in (1, 3):
        t = torch.tensor([float(rank)])
        sub.allreduce([t]).wait()
        assert_equal(t, torch.tensor([4.0]))
        sub.shutdown()
    else:
        assert sub is None


@pytest.mark.timeout(400)
def test_front_end():
    """Through torch.distributed with init_process_group("shm"): test_allreduce_coalesced_async,
    test_allgather_into_tensor_coalesced, test_reduce_scatter (uneven, 0-element output),
    test_reduce_scatter_tensor(_coalesced), both method-name families, object collectives,
    the coalescing manager (fast path and _start/_end_coalescing), sparse via dist.all_reduce,
    PREMUL_SUM, new_group / new_subgroups, concurrent groups and the sequence-number tests
    of test_c10d_common (incl. an op only some ranks issue)."""
    assert run_job(_frontend_job) == [True] * WS


def _split_group_missing():
    """What this torch lacks for split_group on a backend other than NCCL ("" if nothing)."""
    import torch
    import torch.distributed as dist
    missing = []
    if not hasattr(dist.ProcessGroup, "split_group"):
        missing.append("ProcessGroup.split_group, the split for plugin backends (torch >= 2.8)")
    if not hasattr(torch, "accelerator"):
        missing.append("torch.accelerator, which the test fakes for the CPU path (torch >= 2.6)")
    return "; ".join(missing)


@pytest.mark.timeout(300)
def test_split_group():
    """c10d.split_group and ProcessGroup.split_group on "shm" (the group_desc torch gives
    each split, members and non-members, a collective on each new group)."""
    missing = _split_group_missing()
    if missing:
        import torch
        pytest.skip(f"split_group needs what torch {torch.__version__} lacks: {missing}")
    assert run_job(_split_group_job) == [True] * WS
