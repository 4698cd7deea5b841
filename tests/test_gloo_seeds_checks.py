"""ProcessGroupGlooTest (seed 000, test_c10d_gloo.py) ported to backend "shm": the argument
checks of every collective (gloo's assertRaisesRegex, raised synchronously on the caller).

How the seeds run (one job per test on every rank of the harness pool, world size 4): see
seed_util.py. The subjects: test_gloo_seeds_{checks,basics,front_end,lifecycle}.py.
"""

import pytest

from seed_util import assert_equal, raises, ranks, run_job, WS

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch]


# =============================================================================== checks
# test_{broadcast,allreduce,allreduce_coalesced,sparse_allreduce,scatter,gather,allgather}
# _checks: every assertRaisesRegex of the seed, raised synchronously on the calling rank.
# After each group of checks a good collective must still work and the sequence number
# must not have moved (validation consumes no sequence number, the group stays usable).

def _good_allreduce(pg, ctx, note):
    import torch
    seq = pg._get_sequence_number_for_group()
    t = torch.tensor([float(ctx.rank + 1)])
    pg.allreduce([t]).wait()
    ws = ctx.world_size
    assert_equal(t, torch.tensor([ws * (ws + 1) / 2]), f"allreduce after {note}")
    assert pg._get_sequence_number_for_group() == seq + 1, "seq must move by one"


def _checks_job(rank, world_size, store):
    import torch
    import torch.distributed as c10d

    with ranks(rank, world_size, store) as ctx:
        pg = ctx.pg()
        seq0 = pg._get_sequence_number_for_group()
        t1 = torch.zeros([1], dtype=torch.float32)
        t2 = torch.zeros([1], dtype=torch.float64)
        t3 = torch.zeros([2], dtype=torch.float32)

        # ---- test_broadcast_checks
        for root in (-1, world_size):
            with raises(RuntimeError, "invalid root rank"):
                opts = c10d.BroadcastOptions()
                opts.rootRank = root
                opts.rootTensor = 0
                pg.broadcast([t1], opts)
        for tensors, root_tensor in (([t1], -1), ([t1], 1), ([], 0)):
            with raises(RuntimeError, "invalid root tensor"):
                opts = c10d.BroadcastOptions()
                opts.rootRank = rank
                opts.rootTensor = root_tensor
                pg.broadcast(tensors, opts)
        with raises(RuntimeError, "invalid tensor type"):
            opts = c10d.BroadcastOptions()
            opts.rootRank = rank
            opts.rootTensor = 0
            pg.broadcast([t1, t2], opts)
        with raises(RuntimeError, "invalid tensor size"):
            opts = c10d.BroadcastOptions()
            opts.rootRank = rank
            opts.rootTensor = 0
            pg.broadcast([t1, t3], opts)
        assert pg._get_sequence_number_for_group() == seq0
        _good_allreduce(pg, ctx, "broadcast checks")

        # ---- test_allreduce_checks
        with raises(RuntimeError, "requires non-empty tensor list"):
            pg.allreduce([], c10d.AllreduceOptions())
        with raises(RuntimeError, "invalid tensor type"):
            pg.allreduce([t1, t2], c10d.AllreduceOptions())
        with raises(RuntimeError, "invalid tensor size"):
            pg.allreduce([t1, t3], c10d.AllreduceOptions())
        _good_allreduce(pg, ctx, "allreduce checks")

        # ---- test_allreduce_coalesced_checks
        s3 = torch.sparse_coo_tensor([[0]], [1], size=(1,))
        with raises(RuntimeError, "requires non-empty tensor list"):
            pg.allreduce_coalesced([], c10d.AllreduceCoalescedOptions())
        with raises(RuntimeError, "tensors must all have the same type"):
            pg.allreduce_coalesced([t1, t2], c10d.AllreduceCoalescedOptions())
        with raises(RuntimeError, "invalid tensor layout at index"):
            pg.allreduce_coalesced([t1, s3], c10d.AllreduceCoalescedOptions())
        with raises(RuntimeError, "unsupported layout"):
            pg.allreduce_coalesced([s3, s3.clone()], c10d.AllreduceCoalescedOptions())
        _good_allreduce(pg, ctx, "allreduce_coalesced checks")

        # ---- test_sparse_allreduce_checks
        d1 = torch.zeros([1])
        sp2 = torch.sparse_coo_tensor([[0]], [1], size=(2,))
        sp4 = torch.sparse_coo_tensor([[0]], [1], size=(4,))
        with raises(RuntimeError, "requires non-empty tensor list"):
            pg.allreduce([], c10d.AllreduceOptions())
        with raises(RuntimeError, "invalid tensor layout"):
            pg.allreduce([d1, sp2], c10d.AllreduceOptions())
        with raises(RuntimeError, "invalid tensor size"):
            pg.allreduce([sp2, sp4], c10d.AllreduceOptions())
        for op in (c10d.ReduceOp.PRODUCT, c10d.ReduceOp.MIN, c10d.ReduceOp.MAX):
            with raises(RuntimeError, "unsupported reduction operation"):
                opts = c10d.AllreduceOptions()
                opts.reduceOp = op
                pg.allreduce([sp4], opts)
        _good_allreduce(pg, ctx, "sparse allreduce checks")

        # ---- test_scatter_checks
        for root in (-1, world_size):
            with raises(RuntimeError, "invalid root rank"):
                opts = c10d.ScatterOptions()
                opts.rootRank = root
                pg.scatter([t1], [], opts)
        for outs in ([], [t1, t1]):
            with raises(RuntimeError, "requires a single-element output tensor list"):
                opts = c10d.ScatterOptions()
                opts.rootRank = 0
                pg.scatter(outs, [], opts)
        for ins in ([], [[t1] * world_size, [t1] * world_size]):
            with raises(RuntimeError, "requires a single-element input list"):
                opts = c10d.ScatterOptions()
                opts.rootRank = rank
                pg.scatter([t1], ins, opts)
        err = "Incorrect input list size {}. Input list size should be {}"
        for bad in (world_size - 1, world_size + 1):
            with raises(RuntimeError, err.format(bad, world_size)):
                opts = c10d.ScatterOptions()
                opts.rootRank = rank
                pg.scatter([t1], [[t1] * bad], opts)
        with raises(RuntimeError, "invalid tensor type"):
            opts = c10d.ScatterOptions()
            opts.rootRank = rank
            pg.scatter([t1], [[t2] * world_size], opts)
        with raises(RuntimeError, "invalid tensor size"):
            opts = c10d.ScatterOptions()
            opts.rootRank = rank
            pg.scatter([t1], [[t3] * world_size], opts)
        with raises(RuntimeError, "requires empty input on non-root"):
            opts = c10d.ScatterOptions()
            opts.rootRank = (rank + 1) % world_size
            pg.scatter([t1], [[t1] * world_size], opts)
        _good_allreduce(pg, ctx, "scatter checks")

        # ---- test_gather_checks
        for root in (-1, world_size):
            with raises(RuntimeError, "invalid root rank"):
                opts = c10d.GatherOptions()
                opts.rootRank = root
                pg.gather([], [t1], opts)
        for ins in ([], [t1, t1]):
            with raises(RuntimeError, "requires a single-element input tensor list"):
                opts = c10d.GatherOptions()
                opts.rootRank = 0
                pg.gather([], ins, opts)
        for outs in ([], [[t1] * world_size, [t1] * world_size]):
            with raises(RuntimeError, "requires a single-element output list"):
                opts = c10d.GatherOptions()
                opts.rootRank = rank
                pg.gather(outs, [t1], opts)
        err = "Incorrect output list size {}. Output list size should be {}"
        for bad in (world_size - 1, world_size + 1):
            with raises(RuntimeError, err.format(bad, world_size)):
                opts = c10d.GatherOptions()
                opts.rootRank = rank
                pg.gather([[t1] * bad], [t1], opts)
        with raises(RuntimeError, "invalid tensor type"):
            opts = c10d.GatherOptions()
            opts.rootRank = rank
            pg.gather([[t2] * world_size], [t1], opts)
        with raises(RuntimeError, "invalid tensor size"):
            opts = c10d.GatherOptions()
            opts.rootRank = rank
            pg.gather([[t3] * world_size], [t1], opts)
        with raises(RuntimeError, "requires empty output on non-root"):
            opts = c10d.GatherOptions()
            opts.rootRank = (rank + 1) % world_size
            pg.gather([[t1] * world_size], [t1], opts)
        _good_allreduce(pg, ctx, "gather checks")

        # ---- test_allgather_checks
        ws = world_size
        with raises(RuntimeError, "requires non-empty input tensor list"):
            pg.allgather([], [])
        with raises(RuntimeError, "requires input/output tensor lists to have the same length"):
            pg.allgather([], [t1])
        with raises(RuntimeError, "requires input/output tensor lists to have the same length"):
            pg.allgather([[t1] * ws, [t1] * ws], [t1])
        with raises(RuntimeError, "invalid output tensor list"):
            pg.allgather([[t1] * (ws - 1)], [t1])
        with raises(RuntimeError, "invalid output tensor list"):
            pg.allgather([[t1] * (ws + 1)], [t1])
        with raises(RuntimeError, "invalid tensor type"):
            pg.allgather([[t1, t1] * ws, [t1, t1] * ws], [t1, t2])
        with raises(RuntimeError, "invalid tensor size"):
            pg.allgather([[t1, t1] * ws, [t1, t1] * ws], [t1, t3])
        with raises(RuntimeError, "invalid tensor type"):
            pg.allgather([([t1, t2] * ws)[:ws]], [t1])
        with raises(RuntimeError, "invalid tensor size"):
            pg.allgather([([t1, t3] * ws)[:ws]], [t1])
        _good_allreduce(pg, ctx, "allgather checks")

        # ---- beyond the seed: the other collectives validate synchronously as well
        with raises(RuntimeError, "invalid root rank"):
            opts = c10d.ReduceOptions()
            opts.rootRank = ws
            pg.reduce([t1], opts)
        with raises(RuntimeError, "requires a single-element tensor list"):
            pg.reduce([t1, t1], c10d.ReduceOptions())
        with raises(RuntimeError, "input tensor must be the same size as output size times "
                                  "world size"):
            pg.reduce_scatter_single(t1, torch.zeros(ws + 1))
        with raises(RuntimeError, "output tensor size must be equal to world_size times "
                                  "input tensor size"):
            pg.all_gather_single(torch.zeros(ws + 1), t1)
        with raises(RuntimeError, "Tensor's dim 0 does not divide equally across group size"):
            pg.all_to_all_single(torch.zeros(ws + 1), torch.zeros(ws + 1))
        with raises(RuntimeError, "Split sizes doesn't match total dim 0 size"):
            pg.all_to_all_single(torch.zeros(ws), torch.zeros(ws), [1] * ws, [2] * ws)
        with raises(RuntimeError, "only supports dense tensors"):
            pg.broadcast([sp4], c10d.BroadcastOptions())
        with raises(RuntimeError, "not supported for dtype"):
            opts = c10d.AllreduceOptions()
            opts.reduceOp = c10d.ReduceOp.BAND
            pg.allreduce([t1], opts)
        meta = torch.zeros(1, device="meta")  # test_allreduce_coalesced_checks_cuda's path
        with raises(RuntimeError, "unsupported device type"):
            pg.allreduce_coalesced([meta, meta], c10d.AllreduceCoalescedOptions())
        with raises(RuntimeError, "unsupported device type"):
            pg.allreduce([meta])
        with raises(RuntimeError, "output lists should be equal to world size"):
            pg.allgather_coalesced([[t1]], [t1])
        # messages carry the observed values too
        with raises(RuntimeError, r"invalid root rank: -1 \(group size 4\)"):
            opts = c10d.BroadcastOptions()
            opts.rootRank = -1
            pg.broadcast([t1], opts)
        with raises(RuntimeError, r"invalid tensor type at index 1 \(expected cpu torch.float32, "
                                  r"got cpu torch.float64\)"):
            pg.allreduce([t1, t2])
        assert pg._get_sequence_number_for_group() == seq0 + 7
        _good_allreduce(pg, ctx, "other checks")
        # a bad call on one rank only: the others are not held up and nothing is desynced
        if rank == 0:
            with raises(RuntimeError, "invalid tensor size"):
                pg.allgather([[t1] * ws], [t3])
            with raises(RuntimeError, "requires empty output on non-root"):
                opts = c10d.GatherOptions()
                opts.rootRank = 1
                pg.gather([[t1] * ws], [t1], opts)
        _good_allreduce(pg, ctx, "a bad call on rank 0 only")
        assert pg._get_sequence_number_for_group() == seq0 + 9
    return True


@pytest.mark.timeout(300)
def test_checks():
    """test_{broadcast,allreduce,allreduce_coalesced,sparse_allreduce,scatter,gather,
    allgather}_checks (E-01..E-05, E-07..E-09, E-11..E-23); the group stays usable and the
    failed calls consume no sequence number."""
    assert run_job(_checks_job) == [True] * WS
