"""ProcessGroupGlooTest (seed 000, test_c10d_gloo.py) ported to backend "shm": the basics of
every collective (empty tensors, call forms, non-contiguous inputs) and the stress tests.

How the seeds run (one job per test on every rank of the harness pool, world size 4): see
seed_util.py. The subjects: test_gloo_seeds_{checks,basics,front_end,lifecycle}.py.
"""

import math
import time
from datetime import timedelta

import pytest

from seed_util import (assert_equal, ranks, run_job, simple_coalesced_reduce_tests,
                       simple_multi_input_reduce_tests, simple_reduce_tests,
                       simple_sparse_reduce_tests)

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch]


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
    timings = run_job(_basics_job, args=(fn_name,))
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
    timings = run_job(_stress_job, timeout_s=540, args=(1000,))
    print(timings[0])
