"""ProcessGroupGlooTest (seed 000, test_c10d_gloo.py) ported to backend "shm", plus the gloo
behaviours of SEEDS.md that "shm" must reproduce as a drop-in (E-table, §3).

Each pytest test runs one job on every rank of the harness pool (harness.run_ranks) and
batches many seed checks into it, so the spawn/rendezvous cost is paid once per batch.
World size 4 like MultiProcessTestCase's default (DEFAULT_WORLD_SIZE) unless noted.
Point-to-point and the conformance-suite runner are covered elsewhere.
"""

import math
import os
import threading
import time
from datetime import timedelta

import pytest

import harness
from seed_util import (assert_equal, raises, ranks, simple_coalesced_reduce_tests,
                       simple_multi_input_reduce_tests, simple_reduce_tests,
                       simple_sparse_reduce_tests)

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch]

WS = 4


JOB_TIMEOUT_S = int(os.environ.get("SEED_JOB_TIMEOUT", 240))


def _run(fn, world_size=WS, timeout_s=JOB_TIMEOUT_S, args=(), env=None):
    return harness.run_ranks(fn, world_size, timeout_s=timeout_s, args=args, env=env)


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
    assert _run(_checks_job) == [True] * WS


# =============================================================================== basics

def _fut_value(work):
    fut = work.get_future()
    fut.wait()
    return fut.value()


def _basics_job(rank, world_size, store, fn_name):
    import torch
    import torch.distributed as c10d

    fn = {"clone": lambda t: t.clone(),
          "noncontiguous": lambda t: t.expand(2, 2).tril().contiguous()[:, 0]}[fn_name]
    ws = world_size
    timings = {}
    with ranks(rank, world_size, store) as ctx:
        t0 = time.monotonic()
        pg = ctx.pg()
        timings["create"] = time.monotonic() - t0
        if fn_name == "noncontiguous":  # the seed uses it for gather and allgather only
            _gather_allgather_basics(pg, rank, ws, fn)
            timings["total"] = time.monotonic() - t0
            return timings

        # ---- test_empty_tensors
        xs = [torch.FloatTensor([])]
        output = _fut_value(pg.broadcast(xs))
        assert output[0].numel() == 0
        assert_equal(xs[0], output[0])

        # ---- test_broadcast_basics
        def broadcast(xs, root_rank, root_tensor):
            opts = c10d.BroadcastOptions()
            opts.rootRank = root_rank
            opts.rootTensor = root_tensor
            return _fut_value(pg.broadcast(xs, opts))

        for i in range(ws):
            x = fn(torch.tensor([rank]))
            assert_equal(broadcast([x], i, 0)[0], torch.tensor([i]))
            num = 2
            for j in range(num):
                xs = [fn(torch.tensor([rank * num + 0.0])), fn(torch.tensor([rank * num + 1.0]))]
                output = broadcast(xs, i, j)
                assert_equal(output[0], torch.tensor([i * num + j], dtype=torch.float32))
                assert_equal(output[1], torch.tensor([i * num + j], dtype=torch.float32))
                assert output[0] is xs[0] and output[1] is xs[1]
            x = fn(torch.tensor([complex(rank, rank)], dtype=torch.cfloat))
            assert_equal(broadcast([x], i, 0)[0], torch.tensor([complex(i, i)], dtype=torch.cfloat))
        x = torch.tensor([rank + 1.0])
        assert_equal(_fut_value(pg.broadcast(x, root=0))[0], torch.tensor([1.0]))
        # every dtype bit-exact (002 test_broadcast values), root rotating
        for dtype, value in ((torch.float32, -1e-10), (torch.float64, -1e-100),
                             (torch.float16, -0.1), (torch.bfloat16, -0.1), (torch.int8, -2),
                             (torch.uint8, 129), (torch.int32, -1e5), (torch.int64, -1e15),
                             (torch.bool, True), (torch.complex64, 1 - 2j)):
            for src in range(ws):
                expected = torch.full((src + 1,) * 3, value, dtype=dtype)
                t = expected.clone() if rank == src else torch.zeros((src + 1,) * 3, dtype=dtype)
                pg.broadcast(t, src).wait()
                assert bool(t.eq(expected).all()), (dtype, src, t)

        # ---- test_allreduce_basics
        for op, inp, expected in simple_reduce_tests(rank, ws):
            opts = c10d.AllreduceOptions()
            opts.reduceOp = op
            tensor = fn(inp)
            result = _fut_value(pg.allreduce([tensor], opts))
            assert_equal(result[0], expected, f"allreduce {op}")
            assert result[0] is tensor
        for op, inputs, output in simple_multi_input_reduce_tests(rank, ws):
            opts = c10d.AllreduceOptions()
            opts.reduceOp = op
            tensors = [fn(inp) for inp in inputs]
            for tensor in _fut_value(pg.allreduce(tensors, opts)):
                assert_equal(tensor, output, f"multi-input allreduce {op}")
        x = fn(torch.tensor([rank + 1.0]))
        assert_equal(_fut_value(pg.allreduce(x))[0], torch.tensor([float(ws * (ws + 1) / 2)]))
        torch.manual_seed(rank)
        tensor = (torch.rand(200, 1, dtype=torch.float32) * 2 - 1) * 65504 / ws
        tensor = tensor.to(torch.float16)
        output = [[torch.zeros_like(tensor) for _ in range(ws)]]
        ag_result = _fut_value(pg.allgather(output, [tensor]))
        total = torch.stack(ag_result, dim=0).sum(dim=0)
        result_fp16 = _fut_value(pg.allreduce([tensor], c10d.AllreduceOptions()))
        assert_equal(result_fp16[0], total, "fp16 allreduce", rtol=1e-2, atol=1e-3)
        # other call forms: allreduce(list, op), allreduce(tensor, op=, timeout=)
        t = torch.tensor([rank + 1.0])
        pg.allreduce([t], c10d.ReduceOp.MAX).wait()
        assert_equal(t, torch.tensor([float(ws)]))
        t = torch.tensor([rank + 1.0])
        pg.allreduce(t, op=c10d.ReduceOp.MIN, timeout=timedelta(seconds=30)).wait()
        assert_equal(t, torch.tensor([1.0]))
        t = torch.tensor([rank + 1.0])  # positional (tensors, op, timeout)
        pg.allreduce([t], c10d.ReduceOp.PRODUCT, timedelta(seconds=30)).wait()
        assert_equal(t, torch.tensor([float(math.factorial(ws))]))
        t = torch.tensor([rank + 1.0])  # broadcast(tensor, root, timeout)
        pg.broadcast(t, ws - 1, timedelta(seconds=30)).wait()
        assert_equal(t, torch.tensor([float(ws)]))
        out = torch.empty(2)  # reduce_scatter(output, inputs, op, timeout)
        pg.reduce_scatter(out, [torch.full((2,), rank + 1.0 + r) for r in range(ws)],
                          c10d.ReduceOp.MAX, timedelta(seconds=30)).wait()
        assert_equal(out, torch.full((2,), float(ws + rank)))
        t = torch.tensor([rank + 1.0])  # reduce(tensor, root, op, timeout)
        pg.reduce(t, 1, c10d.ReduceOp.MAX, timedelta(seconds=30)).wait()
        if rank == 1:
            assert_equal(t, torch.tensor([float(ws)]))
        pg.barrier(timedelta(seconds=30)).wait()
        # PREMUL_SUM: factor as a float and as a tensor (not exercised by the seeds)
        for factor in (2.5, torch.tensor([3.0])):
            opts = c10d.AllreduceOptions()
            opts.reduceOp = c10d._make_nccl_premul_sum(factor)
            t = torch.tensor([rank + 1.0, 2.0 * rank], dtype=torch.float64)
            pg.allreduce([t], opts).wait()
            f = float(factor) if not isinstance(factor, torch.Tensor) else factor.item()
            assert_equal(t, f * torch.tensor([ws * (ws + 1) / 2, float(ws * (ws - 1))],
                                             dtype=torch.float64), "premul")
        # bool tensors (004 test_bool_tensors): SUM/MAX = any, PRODUCT/MIN = all
        for op, expected in ((c10d.ReduceOp.SUM, [True, False]), (c10d.ReduceOp.MAX, [True, False]),
                             (c10d.ReduceOp.PRODUCT, [False, False]),
                             (c10d.ReduceOp.MIN, [False, False])):
            t = torch.tensor([rank == 0, False])
            pg.allreduce(t, op=op).wait()
            assert_equal(t, torch.tensor(expected), f"bool {op}")

        # ---- test_allreduce_coalesced_basics
        for op, inputs, outputs in simple_coalesced_reduce_tests(rank, ws):
            opts = c10d.AllreduceCoalescedOptions()
            opts.reduceOp = op
            tensors = [fn(x) for x in inputs]
            result = _fut_value(pg.allreduce_coalesced(tensors, opts))
            for result_tensor, expected in zip(result, outputs):
                assert_equal(result_tensor, expected, f"coalesced {op}")
        # the same tensor twice is reduced once (aliasing, 000 _test_allreduce_coalesced_stress)
        t = torch.tensor([rank])
        result = _fut_value(pg.allreduce_coalesced(2 * [t]))
        assert_equal(result, 2 * [torch.tensor([ws * (ws - 1) // 2])])

        # ---- test_sparse_allreduce_basics (CPU: the test's tensors, not clones)
        for num_inputs_per_rank in (1, 2):
            for inputs, outputs in simple_sparse_reduce_tests(rank, ws, num_inputs_per_rank):
                tensors = list(inputs)
                result = _fut_value(pg.allreduce(tensors))
                assert_equal(tensors, outputs, "sparse inputs")
                assert_equal(result, outputs, "sparse future")
                assert all(t.is_coalesced() for t in tensors)

        # ---- test_scatter_basics
        inp = [fn(torch.tensor([rank])) for _ in range(ws)]
        outputs = [fn(torch.tensor([-1])) for _ in range(ws)]
        futures = []
        for i in range(ws):
            opts = c10d.ScatterOptions()
            opts.rootRank = i
            ins = [inp] if i == rank else []
            futures.append(pg.scatter([outputs[i]], ins, opts).get_future())
        for i in range(ws):
            futures[i].wait()
            assert_equal(futures[i].value()[0], torch.tensor([i]))
        # convenience form scatter(output, inputs, root)
        out = torch.tensor([-1])
        pg.scatter(out, [torch.tensor([10 + r]) for r in range(ws)] if rank == 1 else [], 1).wait()
        assert_equal(out, torch.tensor([10 + rank]))

        _gather_allgather_basics(pg, rank, ws, fn)

        # ---- 004 test_reduce_basics: every root, every op
        for root in range(ws):
            for op, inp, expected in simple_reduce_tests(rank, ws):
                opts = c10d.ReduceOptions()
                opts.reduceOp = op
                opts.rootRank = root
                tensor = fn(inp)
                result = _fut_value(pg.reduce([tensor], opts))
                if rank == root:
                    assert_equal(result[0], expected, f"reduce {op} root {root}")
            t = torch.tensor([rank + 1.0])
            pg.reduce(t, root, op=c10d.ReduceOp.SUM).wait()
            if rank == root:
                assert_equal(t, torch.tensor([ws * (ws + 1) / 2]))

        # ---- 004 test_all_to_all_single / alltoall (list form)
        inp = torch.arange(ws * 2, dtype=torch.float32) + 100 * rank
        out = torch.empty(ws * 2)
        pg.alltoall_base(out, inp, [], []).wait()
        expected = torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 100 * r
                              for r in range(ws)])
        assert_equal(out, expected)
        ins = [torch.full((r + 1,), float(rank)) for r in range(ws)]
        outs = [torch.empty(rank + 1) for _ in range(ws)]
        pg.alltoall(outs, ins).wait()
        assert_equal(outs, [torch.full((rank + 1,), float(r)) for r in range(ws)])

        # ---- allgather_coalesced (gloo: output_lists[r][i] = rank r's input i)
        inputs = [torch.tensor([rank, rank]), torch.tensor([rank * 1.5])]
        output_lists = [[torch.zeros(2, dtype=torch.int64), torch.zeros(1)] for _ in range(ws)]
        result = _fut_value(pg.allgather_coalesced(output_lists, inputs))
        expected = [[torch.tensor([r, r]), torch.tensor([r * 1.5])] for r in range(ws)]
        assert_equal(output_lists, expected)
        assert_equal(result, expected)

        # ---- test_multi_device_constructor: 4 ops through futures
        for fut in [pg.allreduce(torch.ones(i + 1)).get_future() for i in range(4)]:
            fut.wait()

        # ---- test_set_gloo_pg_timeout
        pg.allreduce(torch.rand(10))
        assert pg.options._timeout == timedelta(seconds=50)
        pg._set_default_timeout(timedelta(seconds=23))
        assert pg.options._timeout == timedelta(seconds=23)
        pg.set_timeout(timedelta(seconds=40))
        assert pg.options._timeout == timedelta(seconds=40)
        pg.barrier().wait()
        timings["total"] = time.monotonic() - t0
    return timings


def _gather_allgather_basics(pg, rank, ws, fn):
    import torch
    import torch.distributed as c10d

    # ---- test_gather_basics / test_gather_noncontiguous_input
    inp = [fn(torch.tensor([rank]))]
    outputs = [fn(torch.tensor([-1])) for _ in range(ws)]
    futures = []
    for i in range(ws):
        opts = c10d.GatherOptions()
        opts.rootRank = i
        outs = [outputs] if i == rank else []
        futures.append(pg.gather(outs, inp, opts).get_future())
    expected = [fn(torch.tensor([r])) for r in range(ws)]
    for i in range(ws):
        futures[i].wait()
        result = futures[i].value()
        if i == rank:
            assert_equal(result, expected, "gather root value")
        else:
            assert result == [], result
    # convenience form gather(outputs, input, root)
    outs = [torch.tensor([-1]) for _ in range(ws)] if rank == 2 else []
    pg.gather(outs, torch.tensor([rank * 3]), 2).wait()
    if rank == 2:
        assert_equal(outs, [torch.tensor([r * 3]) for r in range(ws)])

    # ---- test_allgather_basics / _noncontiguous_input / _inference_mode
    def allgather_basics():
        for n in (1, 2, 3):
            inp = [fn(torch.tensor([n * rank + i])) for i in range(n)]
            output = [[fn(torch.tensor([-1])) for _ in range(n * ws)] for _ in range(n)]
            expected_output = [[fn(torch.tensor([i])) for i in range(n * ws)]
                               for _ in range(n)]
            result = _fut_value(pg.allgather(output, inp))
            if n == 1:
                result = [result]  # gloo: a flat list for one output list
            assert_equal(result, expected_output, f"allgather n={n}")

    allgather_basics()
    with torch.inference_mode():
        allgather_basics()
    # convenience form allgather(outputs, input)
    outs = [torch.zeros(2) for _ in range(ws)]
    pg.allgather(outs, torch.full((2,), float(rank))).wait()
    assert_equal(outs, [torch.full((2,), float(r)) for r in range(ws)])



@pytest.mark.timeout(400)
@pytest.mark.parametrize("fn_name", ["clone", "noncontiguous"])
def test_basics(fn_name):
    """test_empty_tensors, test_{broadcast,allreduce,allreduce_coalesced,sparse_allreduce,
    scatter,gather,allgather}_basics, test_gather/allgather_noncontiguous_input,
    test_allgather_inference_mode, test_multi_device_constructor, test_set_gloo_pg_timeout,
    plus reduce/alltoall/allgather_coalesced/PREMUL_SUM/bool and every pybind call form."""
    timings = _run(_basics_job, args=(fn_name,))
    print(timings)


# =============================================================================== stress
# *_stress: hundreds of async ops in flight (1000, or 1000 * world_size for gather/scatter),
# issued before the first wait, matched in the same order on every rank, values checked.

def _stress_job(rank, world_size, store, n):
    import torch
    import torch.distributed as c10d

    ws = world_size
    timings = {}
    with ranks(rank, world_size, store) as ctx:
        pg = ctx.pg(threads=8)

        t0 = time.monotonic()  # test_broadcast_stress
        inputs = [torch.tensor([i * ws + rank]) for i in range(n)]
        works = [pg.broadcast(inputs[i], root=(i % ws)) for i in range(n)]
        for i, work in enumerate(works):
            work.wait()
            assert_equal(inputs[i], torch.tensor([(i * ws) + (i % ws)]), f"broadcast iter {i}")
        timings["broadcast"] = time.monotonic() - t0

        t0 = time.monotonic()  # test_allreduce_stress
        inputs = [torch.tensor([i + rank]) for i in range(n)]
        futs = [pg.allreduce(inputs[i]).get_future() for i in range(n)]
        for i, fut in enumerate(futs):
            fut.wait()
            assert_equal(fut.value()[0], torch.tensor([(i * ws) + (ws * (ws - 1) // 2)]),
                         f"allreduce iter {i}")
        timings["allreduce"] = time.monotonic() - t0

        t0 = time.monotonic()  # test_allreduce_coalesced_stress (same tensor twice)
        inputs = [2 * [torch.tensor([i + rank])] for i in range(n)]
        futs = [pg.allreduce_coalesced(inp).get_future() for inp in inputs]
        for i, fut in enumerate(futs):
            fut.wait()
            assert_equal(fut.value(), 2 * [torch.tensor([(i * ws) + (ws * (ws - 1) // 2)])],
                         f"allreduce_coalesced iter {i}")
        timings["allreduce_coalesced"] = time.monotonic() - t0

        t0 = time.monotonic()  # test_scatter_stress
        inputs = [[torch.tensor([i + rank]) for _ in range(ws)] for i in range(n)]
        outputs = [[torch.tensor([-1]) for _ in range(ws)] for _ in range(n)]
        futs = []
        for i in range(n):
            for root in range(ws):
                opts = c10d.ScatterOptions()
                opts.rootRank = root
                ins = [[e.clone() for e in inputs[i]]] if root == rank else []
                futs.append(pg.scatter([outputs[i][root]], ins, opts).get_future())
        for i, fut in enumerate(futs):
            fut.wait()
            it, root = i // ws, i % ws
            assert_equal(fut.value()[0], torch.tensor([it + root]), f"scatter {it} root {root}")
        timings["scatter"] = time.monotonic() - t0

        t0 = time.monotonic()  # test_gather_stress
        inputs = [torch.tensor([i + rank]) for i in range(n)]
        outputs = [[[torch.tensor([-1]) for _ in range(ws)]] for _ in range(n)]
        futs = []
        for i in range(n):
            for root in range(ws):
                opts = c10d.GatherOptions()
                opts.rootRank = root
                outs = outputs[i] if root == rank else []
                futs.append(pg.gather(outs, [inputs[i].clone()], opts).get_future())
        for i, fut in enumerate(futs):
            fut.wait()
            it, root = i // ws, i % ws
            if root == rank:
                assert_equal([fut.value()], [[torch.tensor([it + j]) for j in range(ws)]],
                             f"gather {it} root {root}")
        timings["gather"] = time.monotonic() - t0

        t0 = time.monotonic()  # test_allgather_stress (inputs passed directly: we keep them)
        outputs = [[[torch.tensor([-1]) for _ in range(ws)]] for _ in range(n)]
        futs = [pg.allgather(outputs[i], [torch.tensor([i + rank])]).get_future()
                for i in range(n)]
        for i, fut in enumerate(futs):
            fut.wait()
            assert_equal([fut.value()], [[torch.tensor([i + j]) for j in range(ws)]],
                         f"allgather iter {i}")
        timings["allgather"] = time.monotonic() - t0
        assert pg._get_sequence_number_for_group() == 1 + n * (4 + 2 * ws)
    return timings


@pytest.mark.timeout(600)
def test_stress():
    """test_{broadcast,allreduce,allreduce_coalesced,scatter,gather,allgather}_stress:
    1000 (1000 * world_size for scatter/gather) async ops in flight, values checked."""
    timings = _run(_stress_job, timeout_s=540, args=(1000,))
    print(timings[0])


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
    assert _run(_frontend_job) == [True] * WS


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
    assert _run(_split_group_job) == [True] * WS


# ============================================================== timeouts and monitoring

def _timeouts_job(rank, world_size, store):
    import torch
    import torch.distributed as c10d
    import torch.distributed as dist

    ws = world_size
    with ranks(rank, world_size, store) as ctx:
        sync = ctx.pg()  # phases stay aligned through a group no test poisons

        # ---- test_allreduce_op_timeout (E-06): only rank 0 calls, 1 ms per-op timeout;
        # then E-26: the next op fails fast, says "aborted", is a DistBackendError (E-27c)
        pg = ctx.pg()
        opts = c10d.AllreduceOptions()
        opts.timeout = timedelta(milliseconds=1)
        if rank == 0:
            t1 = torch.zeros([1], dtype=torch.float32)
            with raises(RuntimeError, "Timed out waiting 1ms"):
                pg.allreduce([t1], opts).wait()
            with raises(dist.DistBackendError, "Timed out waiting 1ms"):
                pg.allreduce([t1], opts).wait()
            t0 = time.monotonic()
            try:
                pg.allreduce([t1]).wait()
            except dist.DistBackendError as e:
                assert "aborted" in str(e), str(e)
                assert isinstance(e, dist.DistError) and isinstance(e, RuntimeError)
            else:
                raise AssertionError("expected the aborted group to refuse work")
            assert time.monotonic() - t0 < 5, "a poisoned group must fail fast"
        sync.barrier().wait()

        # ---- test_allreduce_overall_timeout: set_timeout(1 ms), rank 0 only
        pg = ctx.pg()
        pg.set_timeout(timedelta(milliseconds=1))
        if rank == 0:
            with raises(RuntimeError, "Timed out waiting 1ms"):
                pg.allreduce([torch.zeros([1])]).wait()
        sync.barrier().wait()

        # ---- per-op timeout wins over the group default; opts._timeout read back
        pg = ctx.pg(timeout_s=1.5)
        assert pg.options._timeout == timedelta(seconds=1.5)
        if rank == 0:
            opts = c10d.AllreduceOptions()
            opts.timeout = timedelta(milliseconds=300)
            t0 = time.monotonic()
            with raises(RuntimeError, "Timed out waiting 300ms"):
                pg.allreduce([torch.zeros([1])], opts).wait()
            assert 0.29 <= time.monotonic() - t0 < 5  # returned at the 300 ms timeout, not 1.5 s
        sync.barrier().wait()

        # ---- E-24 (002 _test_barrier_timeout): only the group's local rank 0 calls
        # barrier; it must not raise before timeout - 0.1 s; " (Timed out|closed|timeout) "
        def barrier_timeout(group_id, timeout):
            if dist.get_rank(group_id) == 0:
                expected_time = time.time() + timeout.total_seconds()
                with raises(Exception, " (Timed out|closed|timeout) "):
                    dist.barrier(group_id)
                assert time.time() >= expected_time - 0.1, (time.time(), expected_time)
                assert time.time() < expected_time + 5

        ctx.init(init_method=f"file://{ctx.file('global_init')}")  # destroy + re-init (PG-51)
        t = torch.ones(1)
        dist.all_reduce(t)
        assert_equal(t, torch.tensor([float(ws)]))
        dist.destroy_process_group()
        sync.barrier().wait()
        ctx.init(init_method=f"file://{ctx.file('global_init')}", timeout_s=1.0)
        # (the groups are made first: their rendezvous must not wait on a stuck rank 0)
        group = dist.new_group([1, 2], timeout=timedelta(seconds=2))
        full = dist.new_group(timeout=timedelta(seconds=1))
        barrier_timeout(dist.group.WORLD, timedelta(seconds=1))       # test_barrier_timeout_global
        if rank in (1, 2):
            barrier_timeout(group, timedelta(seconds=2))              # test_barrier_timeout_group
        else:
            barrier_timeout(full, timedelta(seconds=1))        # test_barrier_timeout_full_group
        sync.barrier().wait()
        dist.destroy_process_group()
        # E-25: with TORCH_DISTRIBUTED_DEBUG=DETAIL the message names the missing ranks
        pg = ctx.pg(timeout_s=1.0)
        previous = dist.get_debug_level()
        dist.set_debug_level(dist.DebugLevel.DETAIL)
        try:
            if rank == 0:
                with raises(Exception, r"rank\(s\) 1, 2, 3 failed to pass monitoredBarrier"):
                    dist.barrier(pg)
        finally:
            dist.set_debug_level(previous)
        sync.barrier().wait()

        # ---- test_nccl_propagate_error_reason, CPU: Work.wait(timeout) expiring raises
        # DistBackendError; the group is aborted; the next op says "aborted"
        shared_store = ctx.filestore()
        pg = ctx.pg(store=shared_store, timeout_s=15.0)
        # PG-05: a group of another backend on the same store, no prefix, used alongside
        pg_side = dist.ProcessGroupGloo(shared_store, rank, ws) \
            if dist.is_gloo_available() else ctx.pg()
        pg.barrier().wait(timedelta(seconds=5))
        if rank == 0:
            pg_side.barrier().wait()  # "stuck" until the others are done
        else:
            with raises(dist.DistBackendError, "Timed out waiting 1000ms"):
                pg.allreduce([torch.ones(1)]).wait(timedelta(seconds=1))
            try:
                pg.allreduce([torch.ones(2)]).wait()
            except dist.DistBackendError as e:
                assert "aborted" in str(e), str(e)
            else:
                raise AssertionError("Expected error to be raised!")
            pg_side.barrier().wait()
        sync.barrier().wait()

        # ---- monitored_barrier (gloo semantics; dist.monitored_barrier itself refuses
        # non-gloo backends, so the method is called on the group)
        pg = ctx.pg()
        pg.monitored_barrier(timedelta(seconds=30))
        pg.monitored_barrier(timedelta(seconds=30), wait_all_ranks=True)
        sync.barrier().wait()
        pg = ctx.pg()
        t0 = time.monotonic()
        if rank == 0:
            with raises(RuntimeError, "Rank 1 failed to pass monitoredBarrier in 1000 ms"):
                pg.monitored_barrier(timedelta(seconds=1))
            assert 0.9 <= time.monotonic() - t0 < 5
        elif rank != 1:
            with raises(RuntimeError, "received errors while waiting for send/recv from rank 0"):
                pg.monitored_barrier(timedelta(seconds=1))
        sync.barrier().wait()
        pg = ctx.pg()
        if rank == 0:
            with raises(RuntimeError, "Ranks 1, 2 failed to pass monitoredBarrier in 1000 ms"):
                pg.monitored_barrier(timedelta(seconds=1), wait_all_ranks=True)
        elif rank == 3:
            with raises(dist.DistBackendError, "Please check rank 0 logs for faulty rank"):
                pg.monitored_barrier(timedelta(seconds=1), wait_all_ranks=True)
        sync.barrier().wait()
        # the monitored barrier does not consume a sequence number of the group
        pg = ctx.pg()
        seq = pg._get_sequence_number_for_group()
        pg.monitored_barrier()
        assert pg._get_sequence_number_for_group() == seq
        pg.allreduce([torch.ones(1)]).wait()
    return True


@pytest.mark.timeout(300)
def test_timeouts():
    """test_allreduce_op_timeout / test_allreduce_overall_timeout (E-06), per-op vs default
    timeout, 002 test_barrier_timeout_{global,group,full_group} (E-24) incl. the re-init of
    the default group, E-25 under DETAIL, 003 test_nccl_propagate_error_reason on CPU (E-26,
    E-27c), monitored_barrier success, failure and wait_all_ranks."""
    assert _run(_timeouts_job) == [True] * WS


# ================================================================= destroy / abort / re-init

def _lifecycle_job(rank, world_size, store):
    import gc

    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from shmcoll.torch_backend.compat import DESTROY_SHUTS_DOWN

    ws = world_size
    with ranks(rank, world_size, store) as ctx:
        sync = ctx.pg()
        filestore = ctx.filestore("lifecycle")

        # ---- 003 test_abort_in_destroy_pg / test_close_pg: after destroy the old group
        # object refuses work with DistBackendError (E-27b), dist.* with ValueError (F-20)
        pg = ctx.init(store=filestore)
        t = torch.rand(10, 10)
        pg.allreduce(t).wait()
        new_pg1 = c10d.new_group([0, 1])
        new_pg2 = c10d.new_group([0, 1])  # PG-54: never runs a collective
        if rank in (0, 1):
            new_pg1.allreduce(torch.ones(3)).wait()
        dist.destroy_process_group()  # one call: default group and both subgroups
        if DESTROY_SHUTS_DOWN:
            with raises(dist.DistBackendError, "shut down"):
                pg.allreduce([t])
            if rank in (0, 1):
                with raises(dist.DistBackendError, "shut down"):
                    new_pg1.allreduce([t])
                with raises(dist.DistBackendError, "shut down"):
                    new_pg2.barrier()
        else:
            # torch 2.4's destroy shuts no group down but NCCL's: the old objects keep
            # working (as gloo's do) until they are shut down or dropped
            ones = torch.ones(3)
            pg.allreduce([ones]).wait()
            assert_equal(ones, torch.full((3,), float(ws)))
            if rank in (0, 1):
                ones = torch.ones(3)
                new_pg1.allreduce([ones]).wait()
                assert_equal(ones, torch.full((3,), 2.0))
                new_pg2.barrier().wait()
            for group in (pg, new_pg1, new_pg2) if rank in (0, 1) else (pg,):
                group.shutdown()
                with raises(dist.DistBackendError, "shut down"):
                    group.allreduce([ones])
        with raises(ValueError, ""):
            dist.all_reduce(t)

        # ---- 003 test_restart_pg: re-init on PrefixStore("2nd", store) in the same processes
        ctx.init(store=c10d.PrefixStore("2nd", filestore))
        t1 = torch.full((5, 5), float(rank))
        dist.all_reduce(t1)
        assert_equal(t1, torch.full((5, 5), ws * (ws - 1) / 2))
        dist.destroy_process_group()
        with raises(ValueError, ""):
            dist.all_reduce(t1)
        # ... and with a new file:// rendezvous
        ctx.init(init_method=f"file://{ctx.file('third_init')}")
        t1 = torch.ones(4)
        dist.all_reduce(t1)
        assert_equal(t1, torch.full((4,), float(ws)))

        # ---- 003 test_abort_pg on CPU: another thread aborts the group while the main
        # thread is blocked in a collective that only rank 0 entered
        if rank == 0:
            default = c10d._get_default_group()

            def abortpg():
                time.sleep(0.5)
                default._get_backend(torch.device("cpu")).abort()

            thread = threading.Thread(target=abortpg)
            thread.start()
            t0 = time.monotonic()
            with raises(dist.DistBackendError, "abort"):
                dist.all_reduce(t1)  # stuck until the abort wakes it (group timeout 60 s)
            assert time.monotonic() - t0 < 10, time.monotonic() - t0
            thread.join()
            with raises(dist.DistBackendError, "aborted"):
                default.allreduce([t1]).wait()
        sync.barrier().wait()
        dist.destroy_process_group()

        # ---- PG-53: del a group without shutting it down first
        pg = ctx.pg(barrier=False)
        ctx._pgs.remove(pg)
        pg.allreduce([torch.ones(1)]).wait()
        threads = threading.active_count()
        del pg
        gc.collect()
        assert threading.active_count() < threads, "the group's threads must be gone"
        sync.barrier().wait()

        # ---- abort on one rank: its peers blocked in a collective fail instead of hanging
        pg = ctx.pg(timeout_s=30.0)
        if rank == 1:
            time.sleep(0.3)
            pg.abort()
            with raises(dist.DistBackendError, "aborted"):
                pg.allreduce([torch.ones(1)])
        else:
            t0 = time.monotonic()
            with raises(dist.DistBackendError, "abort|closed"):
                pg.allreduce([torch.ones(1)]).wait()
            assert time.monotonic() - t0 < 10
        sync.barrier().wait()

        # ---- an async op nobody waits for is aborted by shutdown (no hang at destroy)
        pg = ctx.pg()
        if rank == 0:
            work = pg.allreduce([torch.ones(1)])  # the others never join
            time.sleep(0.2)
            pg.shutdown()
            with raises(dist.DistBackendError, ""):
                work.wait()
        sync.barrier().wait()
    return True


@pytest.mark.timeout(300)
def test_lifecycle():
    """003 test_abort_in_destroy_pg / test_close_pg / test_restart_pg / test_abort_pg /
    test_abort_in_destroy_multi_pgs / test_destruct_before_terminate_pg on CPU: destroy and
    re-init (PrefixStore, new file://), a destroyed group refusing work (E-27b), abort from
    another thread waking a blocked collective, shutdown with work in flight."""
    assert _run(_lifecycle_job) == [True] * WS
