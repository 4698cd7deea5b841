"""torch.distributed with backend "shm": rendezvous methods, every collective through dist.*
and through the ProcessGroup object (Work / Future semantics as ProcessGroupGloo), every
dtype, strided tensors, multi-tensor lists, hundreds of async ops in flight, errors at call
and in the future, torchrun and torch.multiprocessing.spawn.

Inputs are small integers (exact in every dtype), so expected values are computed with
plain torch arithmetic; the engine-level tests (cases.py) cover rounding bit for bit.
"""

import datetime
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import harness

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch, pytest.mark.timeout(600)]

JOB_TIMEOUT_S = 180
ALL_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
              torch.complex128, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
              torch.bool]
SENTINEL = 77


def _inp(rank, numel, dtype, salt=0):
    """Rank `rank`'s input: small integers (or their truth values), exact in every dtype."""
    v = (torch.arange(numel, dtype=torch.int64) * 7 + rank * 3 + salt) % 5 - 1
    if dtype == torch.bool:
        return v > 1
    if dtype.is_complex:
        return torch.complex(v.double(), (v - rank).double()).to(dtype)
    return v.to(dtype)


def _sum(tensors):
    if tensors[0].dtype == torch.bool:
        return torch.stack(tensors).any(0)
    wide = torch.complex128 if tensors[0].dtype.is_complex else torch.float64
    return torch.stack([t.to(wide) for t in tensors]).sum(0).to(tensors[0].dtype)


def _eq(got, expected, what):
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype}, expected {expected.dtype}"
    assert torch.equal(got, expected), f"{what}: got {got}, expected {expected}"


def _pg():
    return dist.group.WORLD  # the ProcessGroup object init_process_group made


# ------------------------------------------------------------------------- rendezvous

def _init_check(rank, world_size):
    assert dist.get_backend() == "shm"
    assert dist.get_rank() == rank and dist.get_world_size() == world_size
    t = _inp(rank, 5, torch.float32)
    dist.all_reduce(t)
    _eq(t, _sum([_inp(r, 5, torch.float32) for r in range(world_size)]), "all_reduce")
    dist.barrier()
    return type(_pg()).__name__


@pytest.mark.parametrize("init", ["file", "tcp", "env", "tcpstore", "filestore"])
def test_init_methods(init):
    names = harness.run_torch_ranks(_init_check, 2, "shm", JOB_TIMEOUT_S, init=init)
    assert len(set(names)) == 1


# ---------------------------------------------------------------- collectives via dist.*

def _dist_collectives(rank, ws, dtype):
    n = 7
    inputs = [_inp(r, n, dtype) for r in range(ws)]
    reducible = dtype in ALL_DTYPES
    if reducible:
        t = inputs[rank].clone()
        dist.all_reduce(t)
        _eq(t, _sum(inputs), "all_reduce")
        t = inputs[rank].clone()
        dist.reduce(t, dst=ws - 1)
        _eq(t, _sum(inputs) if rank == ws - 1 else inputs[rank], "reduce")
        out = torch.empty(n, dtype=dtype)
        dist.reduce_scatter(out, [_inp(rank, n, dtype, salt=j) for j in range(ws)])
        _eq(out, _sum([_inp(r, n, dtype, salt=rank) for r in range(ws)]), "reduce_scatter")
        out = torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(out, torch.cat([_inp(rank, n, dtype, salt=j)
                                                   for j in range(ws)]))
        _eq(out, _sum([_inp(r, n, dtype, salt=rank) for r in range(ws)]),
            "reduce_scatter_tensor")
    t = inputs[rank].clone()
    dist.broadcast(t, src=ws - 1)
    _eq(t, inputs[ws - 1], "broadcast")
    outs = [torch.empty(n, dtype=dtype) for _ in range(ws)]
    dist.all_gather(outs, inputs[rank])
    for r in range(ws):
        _eq(outs[r], inputs[r], f"all_gather[{r}]")
    out = torch.empty(ws * n, dtype=dtype)
    dist.all_gather_into_tensor(out, inputs[rank])
    _eq(out, torch.cat(inputs), "all_gather_into_tensor")
    outs = [torch.empty(n, dtype=dtype) for _ in range(ws)] if rank == 0 else None
    dist.gather(inputs[rank], outs, dst=0)
    if rank == 0:
        for r in range(ws):
            _eq(outs[r], inputs[r], f"gather[{r}]")
    out = torch.empty(n, dtype=dtype)
    pieces = [_inp(0, n, dtype, salt=j) for j in range(ws)]
    dist.scatter(out, pieces if rank == 0 else None, src=0)
    _eq(out, pieces[rank], "scatter")
    outs = [torch.empty(n + r, dtype=dtype) for r in range(ws)]  # rank r sends n + r
    dist.all_to_all(outs, [_inp(rank, n + rank, dtype, salt=j) for j in range(ws)])
    for r in range(ws):
        _eq(outs[r], _inp(r, n + r, dtype, salt=rank), f"all_to_all[{r}]")
    out = torch.empty(ws * 2, dtype=dtype)
    dist.all_to_all_single(out, torch.cat([_inp(rank, 2, dtype, salt=j) for j in range(ws)]))
    _eq(out, torch.cat([_inp(r, 2, dtype, salt=rank) for r in range(ws)]), "all_to_all_single")
    in_splits = [rank + j for j in range(ws)]  # uneven: rank r sends r + j rows to j
    out_splits = [r + rank for r in range(ws)]
    out = torch.empty(sum(out_splits), 3, dtype=dtype)
    src = torch.cat([_inp(rank, (rank + j) * 3, dtype, salt=j).view(-1, 3) for j in range(ws)])
    dist.all_to_all_single(out, src, out_splits, in_splits)
    expected = torch.cat([_inp(r, (r + rank) * 3, dtype, salt=rank).view(-1, 3)
                          for r in range(ws)])
    _eq(out, expected, "all_to_all_single (uneven splits)")
    dist.barrier()
    objects = [None] * ws
    dist.all_gather_object(objects, {"rank": rank})
    assert objects == [{"rank": r} for r in range(ws)]
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_dist_collectives(world_size):
    # uint16 has no reduction here: it only moves bytes (broadcast, gathers, all_to_all)
    assert all(harness.run_torch_ranks(_dist_sweep, world_size, "shm", JOB_TIMEOUT_S,
                                       args=(ALL_DTYPES + [torch.uint16],)))


def _dist_sweep(rank, ws, dtypes):
    for dtype in dtypes:
        try:
            _dist_collectives(rank, ws, dtype)
        except Exception as e:
            e.add_note(f"dtype {dtype}")
            raise
    return True


def _all_ops(rank, ws):
    """Every valid op on float32 and int32 through dist.all_reduce (incl. AVG, PREMUL_SUM)."""
    x = torch.tensor([1.0, -2.0, 3.0, 0.5]) * (rank + 1)
    xs = [torch.tensor([1.0, -2.0, 3.0, 0.5]) * (r + 1) for r in range(ws)]
    cases = {
        dist.ReduceOp.SUM: torch.stack(xs).sum(0),
        dist.ReduceOp.AVG: torch.stack(xs).sum(0) / ws,
        dist.ReduceOp.PRODUCT: torch.stack(xs).prod(0),
        dist.ReduceOp.MIN: torch.stack(xs).min(0).values,
        dist.ReduceOp.MAX: torch.stack(xs).max(0).values,
        dist._make_nccl_premul_sum(2.0): torch.stack(xs).sum(0) * 2,
    }
    for op, expected in cases.items():
        t = x.clone()
        dist.all_reduce(t, op=op)
        assert torch.allclose(t, expected), (op, t, expected)
    i = torch.tensor([0b1100, 0b1010, 7], dtype=torch.int32) + rank
    ii = [torch.tensor([0b1100, 0b1010, 7], dtype=torch.int32) + r for r in range(ws)]
    for op, fold in ((dist.ReduceOp.BAND, torch.bitwise_and), (dist.ReduceOp.BOR, torch.bitwise_or),
                     (dist.ReduceOp.BXOR, torch.bitwise_xor)):
        expected = ii[0]
        for y in ii[1:]:
            expected = fold(expected, y)
        t = i.clone()
        dist.all_reduce(t, op=op)
        _eq(t, expected, str(op))
    return True


def test_all_reduce_ops():
    assert all(harness.run_torch_ranks(_all_ops, 3, "shm", JOB_TIMEOUT_S))


# -------------------------------------------------------------- the ProcessGroup object

def _check_work(work, expected_value, what):
    work.wait()
    assert work.is_completed(), what
    fut = work.get_future()
    value = fut.wait()
    assert fut.done(), what
    for got, exp in zip(_flatten(fut.value()), _flatten(expected_value)):
        assert got is exp or torch.equal(got, exp), f"{what}: future value {got} vs {exp}"
    assert len(_flatten(value)) == len(_flatten(expected_value)), f"{what}: {value}"


def _flatten(x):
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for item in x for t in _flatten(item)]


def _pg_direct(rank, ws):
    pg = _pg()
    n = 6
    f32 = torch.float32
    inputs = [_inp(r, n, f32) for r in range(ws)]

    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    t = inputs[rank].clone()
    work = pg.allreduce([t], opts)
    _check_work(work, [t], "allreduce")
    _eq(t, _sum(inputs), "allreduce")

    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = ws - 1, 0
    t = inputs[rank].clone()
    _check_work(pg.broadcast([t], opts), [t], "broadcast")
    _eq(t, inputs[ws - 1], "broadcast")

    opts = dist.ReduceOptions()
    opts.rootRank, opts.reduceOp = 0, dist.ReduceOp.MAX
    t = inputs[rank].clone()
    _check_work(pg.reduce([t], opts), [t], "reduce")
    _eq(t, torch.stack(inputs).max(0).values if rank == 0 else inputs[rank], "reduce")

    outs = [[torch.empty(n) for _ in range(ws)]]
    _check_work(pg.allgather(outs, [inputs[rank]]), outs[0], "allgather")
    for r in range(ws):
        _eq(outs[0][r], inputs[r], "allgather")

    out = torch.empty(ws * n)
    _check_work(pg._allgather_base(out, inputs[rank]), [out], "_allgather_base")
    _eq(out, torch.cat(inputs), "_allgather_base")

    out = torch.empty(n)
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    _check_work(pg.reduce_scatter([out], [[_inp(rank, n, f32, j) for j in range(ws)]], opts),
                [out], "reduce_scatter")
    _eq(out, _sum([_inp(r, n, f32, rank) for r in range(ws)]), "reduce_scatter")

    out = torch.empty(n)
    _check_work(pg._reduce_scatter_base(out, torch.cat([_inp(rank, n, f32, j)
                                                        for j in range(ws)]), opts),
                [out], "_reduce_scatter_base")
    _eq(out, _sum([_inp(r, n, f32, rank) for r in range(ws)]), "_reduce_scatter_base")

    opts = dist.GatherOptions()
    opts.rootRank = 0
    outs = [[torch.empty(n) for _ in range(ws)]] if rank == 0 else []
    work = pg.gather(outs, [inputs[rank]], opts)
    _check_work(work, outs[0] if rank == 0 else [], "gather")
    if rank == 0:
        for r in range(ws):
            _eq(outs[0][r], inputs[r], "gather")

    opts = dist.ScatterOptions()
    opts.rootRank = ws - 1
    out = torch.empty(n)
    pieces = [[_inp(ws - 1, n, f32, j) for j in range(ws)]] if rank == ws - 1 else []
    _check_work(pg.scatter([out], pieces, opts), [out], "scatter")
    _eq(out, _inp(ws - 1, n, f32, rank), "scatter")

    outs = [torch.empty(n) for _ in range(ws)]
    _check_work(pg.alltoall(outs, [_inp(rank, n, f32, j) for j in range(ws)],
                            dist.AllToAllOptions()), outs, "alltoall")
    for r in range(ws):
        _eq(outs[r], _inp(r, n, f32, rank), "alltoall")

    out = torch.empty(ws * n)
    _check_work(pg.alltoall_base(out, torch.cat([_inp(rank, n, f32, j) for j in range(ws)]),
                                 [], [], dist.AllToAllOptions()), [out], "alltoall_base")
    _eq(out, torch.cat([_inp(r, n, f32, rank) for r in range(ws)]), "alltoall_base")

    work = pg.barrier(dist.BarrierOptions())
    work.wait()
    assert work.is_completed()
    return True


def test_process_group_object():
    assert all(harness.run_torch_ranks(_pg_direct, 2, "shm", JOB_TIMEOUT_S))


# ------------------------------------------------------------------ strided tensors

def _strided(rank, ws):
    n = 9
    # a column of a row-major matrix: stride 3, the rest of the matrix is a sentinel
    base = torch.full((n, 3), SENTINEL, dtype=torch.float32)
    t = base[:, 1]
    t.copy_(_inp(rank, n, torch.float32))
    dist.all_reduce(t)
    _eq(t, _sum([_inp(r, n, torch.float32) for r in range(ws)]), "all_reduce (strided)")
    assert (base[:, 0] == SENTINEL).all() and (base[:, 2] == SENTINEL).all(), base

    base = torch.full((4, 6), SENTINEL, dtype=torch.int64)
    t = base[:, ::2].t()  # 3 x 4, doubly strided
    t.copy_(_inp(rank, 12, torch.int64).view(3, 4))
    dist.broadcast(t, src=0)
    _eq(t, _inp(0, 12, torch.int64).view(3, 4), "broadcast (strided)")
    assert (base[:, 1::2] == SENTINEL).all(), base

    bases = [torch.full((n, 2), SENTINEL, dtype=torch.bfloat16) for _ in range(ws)]
    outs = [b[:, 0] for b in bases]
    src = torch.full((n, 2), 0, dtype=torch.bfloat16)[:, 1]
    src.copy_(_inp(rank, n, torch.bfloat16))
    dist.all_gather(outs, src)
    for r in range(ws):
        _eq(outs[r], _inp(r, n, torch.bfloat16), "all_gather (strided)")
        assert (bases[r][:, 1] == SENTINEL).all()

    base = torch.full((n, 2), SENTINEL, dtype=torch.float64)
    out = base[:, 1]
    dist.reduce_scatter(out, [_inp(rank, n, torch.float64, j) for j in range(ws)])
    _eq(out, _sum([_inp(r, n, torch.float64, rank) for r in range(ws)]),
        "reduce_scatter (strided)")
    assert (base[:, 0] == SENTINEL).all()

    base = torch.full((ws * n, 2), SENTINEL, dtype=torch.float32)
    out = base[:, 0]
    dist.all_gather_into_tensor(out, _inp(rank, n, torch.float32))
    _eq(out, torch.cat([_inp(r, n, torch.float32) for r in range(ws)]),
        "all_gather_into_tensor (strided output)")
    assert (base[:, 1] == SENTINEL).all()

    base = torch.full((ws * n, 2), SENTINEL, dtype=torch.int32)
    src = base[:, 1]
    src.copy_(torch.cat([_inp(rank, n, torch.int32, j) for j in range(ws)]))
    out = torch.empty(n, dtype=torch.int32)
    dist.reduce_scatter_tensor(out, src)
    _eq(out, _sum([_inp(r, n, torch.int32, rank) for r in range(ws)]),
        "reduce_scatter_tensor (strided input)")

    base = torch.full((3, 4 * ws), SENTINEL, dtype=torch.float64)
    out = base[:, ::2].t()  # (2 * ws) x 3, doubly strided (gloo writes outside this view)
    dist.all_to_all_single(out, _inp(rank, 6 * ws, torch.float64).view(2 * ws, 3))
    expected = torch.cat([_inp(r, 6 * ws, torch.float64).view(2 * ws, 3)[2 * rank:2 * rank + 2]
                          for r in range(ws)])
    _eq(out, expected, "all_to_all_single (strided output)")
    assert (base[:, 1::2] == SENTINEL).all(), base

    t = torch.tensor(float(rank + 1))  # 0-d
    dist.all_reduce(t)
    assert t.dim() == 0 and t.item() == ws * (ws + 1) / 2
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_strided_and_0d_tensors(world_size):
    assert all(harness.run_torch_ranks(_strided, world_size, "shm", JOB_TIMEOUT_S))


# -------------------------------------------------------------- multi-tensor lists (gloo)

def _lists(rank, ws):
    pg = _pg()
    a, b = _inp(rank, 5, torch.float32, 0), _inp(rank, 5, torch.float32, 1)
    pg.allreduce([a, b], dist.AllreduceOptions()).wait()
    expected = _sum([_inp(r, 5, torch.float32, s) for r in range(ws) for s in (0, 1)])
    _eq(a, expected, "allreduce [t1, t2] (first)")
    _eq(b, expected, "allreduce [t1, t2] (second)")

    a, b = _inp(rank, 5, torch.int32, 0), _inp(rank, 5, torch.int32, 1)
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 1, 1
    pg.broadcast([a, b], opts).wait()
    _eq(a, _inp(1, 5, torch.int32, 1), "broadcast [t1, t2] rootTensor=1 (first)")
    _eq(b, _inp(1, 5, torch.int32, 1), "broadcast [t1, t2] rootTensor=1 (second)")

    k = 2
    inputs = [_inp(rank, 4, torch.int16, j) for j in range(k)]
    outs = [[torch.empty(4, dtype=torch.int16) for _ in range(ws * k)] for _ in range(k)]
    work = pg.allgather(outs, inputs)
    work.wait()
    for i in range(k):  # gloo: outs[i][r * k + j] is rank r's input j
        for r in range(ws):
            for j in range(k):
                _eq(outs[i][r * k + j], _inp(r, 4, torch.int16, j), f"allgather[{i}][{r},{j}]")
    value = work.get_future().wait()
    assert len(value) == k and all(len(v) == ws * k for v in value), value
    return True


def test_multi_tensor_lists():
    assert all(harness.run_torch_ranks(_lists, 2, "shm", JOB_TIMEOUT_S))


# ------------------------------------------------------------------- async in flight

def _async_many(rank, ws, count):
    done = []
    works, tensors, expected = [], [], []
    for i in range(count):
        if i % 3 == 2:
            t = torch.full((3,), float(rank * 1000 + i))
            works.append(dist.broadcast(t, src=i % ws, async_op=True))
            expected.append(torch.full((3,), float((i % ws) * 1000 + i)))
        else:
            t = torch.full((i % 5 + 1,), float(rank + i))
            works.append(dist.all_reduce(t, async_op=True))
            expected.append(torch.full((i % 5 + 1,), float(sum(r + i for r in range(ws)))))
        tensors.append(t)
        works[-1].get_future().then(lambda fut, i=i: done.append(i))
    for w in reversed(works):  # waiting on the last one first must not deadlock
        w.wait()
    assert all(w.is_completed() for w in works)
    torch.futures.wait_all([w.get_future() for w in works])
    for i, (t, e) in enumerate(zip(tensors, expected)):
        _eq(t, e, f"async op {i}")
    deadline = time.monotonic() + 60
    while len(done) < count and time.monotonic() < deadline:
        time.sleep(0.01)  # then-callbacks may run just after wait() returns
    if done != list(range(count)):
        first = next((k for k, (a, b) in enumerate(zip(done, range(count))) if a != b),
                     min(len(done), count))
        raise AssertionError(f"async ops did not complete in issue order: {len(done)} of "
                             f"{count} callbacks ran, first out of order at {first}: "
                             f"{done[max(0, first - 3):first + 5]}")
    return True


def test_hundreds_of_async_ops_in_issue_order():
    assert all(harness.run_torch_ranks(_async_many, 2, "shm", JOB_TIMEOUT_S, args=(300,)))


def _future_done_after_wait(rank, ws, count):
    late = []
    for i in range(count):
        work = dist.all_reduce(torch.full((2,), float(rank)), async_op=True)
        if i % 2:
            time.sleep(0.001)  # let the executor thread, not this one, run some of them
        work.wait()
        if not work.get_future().done():
            late.append(i)
    return late


def test_future_is_complete_when_wait_returns():
    """Regression: Job.run used to set the Work's event before the future's result, so
    get_future() could still be pending right after wait() (gloo completes it first)."""
    late = harness.run_torch_ranks(_future_done_after_wait, 2, "shm", JOB_TIMEOUT_S,
                                   args=(200,))
    assert late == [[], []], f"futures still pending after wait(): {late}"


# --------------------------------------------------------------------------- all dtypes

def _every_dtype(rank, ws):
    for dtype in ALL_DTYPES:
        inputs = [_inp(r, 11, dtype) for r in range(ws)]
        t = inputs[rank].clone()
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        _eq(t, _sum(inputs), f"all_reduce {dtype}")
        value = work.get_future().wait()
        if dtype.is_complex:  # dist.all_reduce hands the backend torch.view_as_real(t)
            t = torch.view_as_real(t)
        assert len(value) == 1 and torch.equal(value[0], t), (dtype, value, t)
    return True


def test_every_dtype_all_reduce():
    assert all(harness.run_torch_ranks(_every_dtype, 2, "shm", JOB_TIMEOUT_S))


# --------------------------------------------------------------------------- errors

def _errors(rank, ws):
    pg = _pg()
    # An unsupported (op, dtype) raises on the calling thread, before any communication,
    # and consumes nothing: the next collective still matches on every rank.
    for dtype, op in ((torch.bool, dist.ReduceOp.AVG), (torch.complex64, dist.ReduceOp.MAX),
                      (torch.float32, dist.ReduceOp.BAND), (torch.int32, dist.ReduceOp.AVG)):
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        with_error = None
        try:
            pg.allreduce([torch.ones(3, dtype=dtype)], opts)
        except (RuntimeError, TypeError, ValueError) as e:
            with_error = e
        assert with_error is not None, f"allreduce({dtype}, {op}) did not raise at the call"
        try:
            dist.all_reduce(torch.ones(3, dtype=dtype), op=op)
        except (RuntimeError, TypeError, ValueError):
            pass
        else:
            raise AssertionError(f"dist.all_reduce({dtype}, {op}) did not raise")
    with_error = None
    try:
        dist.all_reduce(torch.ones(3, dtype=torch.uint32))  # no reduction for this dtype
    except (RuntimeError, TypeError, ValueError) as e:
        with_error = e
    assert with_error is not None, "all_reduce(uint32) did not raise"

    # A failure inside the operation (ranks disagree on the shape) surfaces through wait()
    # and through the future, as a RuntimeError, on every rank.
    t = torch.ones(4 + rank)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    raised = None
    try:
        work.wait()
    except RuntimeError as e:
        raised = e
    assert raised is not None, "mismatched all_reduce did not fail"
    assert work.is_completed()
    try:
        fut.wait()
    except RuntimeError:
        pass
    else:
        raise AssertionError("the future of a failed all_reduce did not raise")
    assert work.exception() is not None

    # the group is still usable and in step
    t = torch.full((3,), float(rank))
    dist.all_reduce(t)
    _eq(t, torch.full((3,), float(sum(range(ws)))), "all_reduce after errors")
    return str(raised)


def test_errors_at_call_and_in_future():
    messages = harness.run_torch_ranks(_errors, 2, "shm", JOB_TIMEOUT_S)
    assert all("all_reduce" in m or "allreduce" in m for m in messages), messages


# ------------------------------------------------------------- torchrun and mp.spawn

TORCHRUN_SCRIPT = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    import shmcoll  # noqa: F401  (registers "shm")

    dist.init_process_group("shm")
    rank, ws = dist.get_rank(), dist.get_world_size()
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    assert t.tolist() == [ws * (ws + 1) / 2] * 4, t
    dist.barrier()
    print(f"rank {rank} ok {dist.get_backend()}", flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.timeout(400)
def test_torchrun_smoke(tmp_path):
    script = tmp_path / "smoke.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout}\n{proc.stderr}"
    assert "rank 0 ok shm" in proc.stdout and "rank 1 ok shm" in proc.stdout, proc.stdout


def _spawned(rank, world_size, init_file, out_dir):
    import shmcoll  # noqa: F401

    dist.init_process_group("shm", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)
        with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
            f.write(repr(t.tolist()))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(400)
def test_torch_multiprocessing_spawn_file_init(tmp_path):
    import torch.multiprocessing as mp

    context = mp.start_processes(_spawned, args=(2, str(tmp_path / "init"), str(tmp_path)),
                                 nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 300
    try:
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, "spawned ranks did not finish in 300 s"
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
    for rank in range(2):
        assert (tmp_path / f"rank{rank}").read_text() == repr([3.0, 3.0, 3.0])


def test_warns_once_when_ranks_times_threads_exceed_cores(monkeypatch):
    """Guards: ranks x intra-op threads above the cores (OpenMP workers spinning on the
    peers' cores: a 16 MiB all_reduce 3-25x slower) is warned about once per process, with
    the thread count to set; a fitting configuration is not."""
    import warnings

    from shmcoll.torch_backend import plugin
    monkeypatch.setattr(plugin, "_threads_warned", False)
    monkeypatch.setattr(plugin.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin._warn_if_threads_oversubscribe(2)  # 2 x 1 <= 2 cores
        monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
        plugin._warn_if_threads_oversubscribe(1)  # one rank: nothing to collide with
        plugin._warn_if_threads_oversubscribe(2)  # 2 x 2 > 2 cores: warned
        plugin._warn_if_threads_oversubscribe(4)  # once per process
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert caught[0].category is RuntimeWarning
    assert "2 ranks x 2 intra-op threads" in str(caught[0].message)
    assert "OMP_NUM_THREADS=1" in str(caught[0].message)
