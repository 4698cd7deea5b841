"""torch.distributed with backend "shm", through the ProcessGroup object (Work / Future
semantics as ProcessGroupGloo): strided and 0-d tensors, multi-tensor lists, hundreds of async
ops in flight, errors at call and in the future. dist.* and rendezvous: test_torch_backend.py.

Inputs are small integers (exact in every dtype), so expected values are computed with
plain torch arithmetic (support/torch_reference.py); the engine-level tests (cases.py) cover
rounding bit for bit.
"""

import contextlib
import time

import pytest
import torch
import torch.distributed as dist

import harness
from support.torch_reference import assert_same, small_ints, sum_of, world_pg

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch, pytest.mark.timeout(600)]

JOB_TIMEOUT_S = 180
SENTINEL = 77


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
    pg = world_pg()
    n = 6
    f32 = torch.float32
    inputs = [small_ints(r, n, f32) for r in range(ws)]

    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    t = inputs[rank].clone()
    work = pg.allreduce([t], opts)
    _check_work(work, [t], "allreduce")
    assert_same(t, sum_of(inputs), "allreduce")

    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = ws - 1, 0
    t = inputs[rank].clone()
    _check_work(pg.broadcast([t], opts), [t], "broadcast")
    assert_same(t, inputs[ws - 1], "broadcast")

    opts = dist.ReduceOptions()
    opts.rootRank, opts.reduceOp = 0, dist.ReduceOp.MAX
    t = inputs[rank].clone()
    _check_work(pg.reduce([t], opts), [t], "reduce")
    assert_same(t, torch.stack(inputs).max(0).values if rank == 0 else inputs[rank], "reduce")

    outs = [[torch.empty(n) for _ in range(ws)]]
    _check_work(pg.allgather(outs, [inputs[rank]]), outs[0], "allgather")
    for r in range(ws):
        assert_same(outs[0][r], inputs[r], "allgather")

    out = torch.empty(ws * n)
    _check_work(pg._allgather_base(out, inputs[rank]), [out], "_allgather_base")
    assert_same(out, torch.cat(inputs), "_allgather_base")

    out = torch.empty(n)
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    _check_work(pg.reduce_scatter([out], [[small_ints(rank, n, f32, j) for j in range(ws)]], opts),
                [out], "reduce_scatter")
    assert_same(out, sum_of([small_ints(r, n, f32, rank) for r in range(ws)]), "reduce_scatter")

    out = torch.empty(n)
    _check_work(pg._reduce_scatter_base(out, torch.cat([small_ints(rank, n, f32, j)
                                                        for j in range(ws)]), opts),
                [out], "_reduce_scatter_base")
    assert_same(out, sum_of([small_ints(r, n, f32, rank) for r in range(ws)]),
                "_reduce_scatter_base")

    opts = dist.GatherOptions()
    opts.rootRank = 0
    outs = [[torch.empty(n) for _ in range(ws)]] if rank == 0 else []
    work = pg.gather(outs, [inputs[rank]], opts)
    _check_work(work, outs[0] if rank == 0 else [], "gather")
    if rank == 0:
        for r in range(ws):
            assert_same(outs[0][r], inputs[r], "gather")

    opts = dist.ScatterOptions()
    opts.rootRank = ws - 1
    out = torch.empty(n)
    pieces = [[small_ints(ws - 1, n, f32, j) for j in range(ws)]] if rank == ws - 1 else []
    _check_work(pg.scatter([out], pieces, opts), [out], "scatter")
    assert_same(out, small_ints(ws - 1, n, f32, rank), "scatter")

    outs = [torch.empty(n) for _ in range(ws)]
    _check_work(pg.alltoall(outs, [small_ints(rank, n, f32, j) for j in range(ws)],
                            dist.AllToAllOptions()), outs, "alltoall")
    for r in range(ws):
        assert_same(outs[r], small_ints(r, n, f32, rank), "alltoall")

    out = torch.empty(ws * n)
    _check_work(pg.alltoall_base(out, torch.cat([small_ints(rank, n, f32, j) for j in range(ws)]),
                                 [], [], dist.AllToAllOptions()), [out], "alltoall_base")
    assert_same(out, torch.cat([small_ints(r, n, f32, rank) for r in range(ws)]), "alltoall_base")

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
    t.copy_(small_ints(rank, n, torch.float32))
    dist.all_reduce(t)
    assert_same(t, sum_of([small_ints(r, n, torch.float32) for r in range(ws)]),
                "all_reduce (strided)")
    assert (base[:, 0] == SENTINEL).all() and (base[:, 2] == SENTINEL).all(), base

    base = torch.full((4, 6), SENTINEL, dtype=torch.int64)
    t = base[:, ::2].t()  # 3 x 4, doubly strided
    t.copy_(small_ints(rank, 12, torch.int64).view(3, 4))
    dist.broadcast(t, src=0)
    assert_same(t, small_ints(0, 12, torch.int64).view(3, 4), "broadcast (strided)")
    assert (base[:, 1::2] == SENTINEL).all(), base

    bases = [torch.full((n, 2), SENTINEL, dtype=torch.bfloat16) for _ in range(ws)]
    outs = [b[:, 0] for b in bases]
    src = torch.full((n, 2), 0, dtype=torch.bfloat16)[:, 1]
    src.copy_(small_ints(rank, n, torch.bfloat16))
    dist.all_gather(outs, src)
    for r in range(ws):
        assert_same(outs[r], small_ints(r, n, torch.bfloat16), "all_gather (strided)")
        assert (bases[r][:, 1] == SENTINEL).all()

    base = torch.full((n, 2), SENTINEL, dtype=torch.float64)
    out = base[:, 1]
    dist.reduce_scatter(out, [small_ints(rank, n, torch.float64, j) for j in range(ws)])
    assert_same(out, sum_of([small_ints(r, n, torch.float64, rank) for r in range(ws)]),
        "reduce_scatter (strided)")
    assert (base[:, 0] == SENTINEL).all()

    base = torch.full((ws * n, 2), SENTINEL, dtype=torch.float32)
    out = base[:, 0]
    dist.all_gather_into_tensor(out, small_ints(rank, n, torch.float32))
    assert_same(out, torch.cat([small_ints(r, n, torch.float32) for r in range(ws)]),
        "all_gather_into_tensor (strided output)")
    assert (base[:, 1] == SENTINEL).all()

    base = torch.full((ws * n, 2), SENTINEL, dtype=torch.int32)
    src = base[:, 1]
    src.copy_(torch.cat([small_ints(rank, n, torch.int32, j) for j in range(ws)]))
    out = torch.empty(n, dtype=torch.int32)
    dist.reduce_scatter_tensor(out, src)
    assert_same(out, sum_of([small_ints(r, n, torch.int32, rank) for r in range(ws)]),
        "reduce_scatter_tensor (strided input)")

    base = torch.full((3, 4 * ws), SENTINEL, dtype=torch.float64)
    out = base[:, ::2].t()  # (2 * ws) x 3, doubly strided (gloo writes outside this view)
    dist.all_to_all_single(out, small_ints(rank, 6 * ws, torch.float64).view(2 * ws, 3))
    blocks = [small_ints(r, 6 * ws, torch.float64).view(2 * ws, 3) for r in range(ws)]
    expected = torch.cat([blk[2 * rank:2 * rank + 2] for blk in blocks])
    assert_same(out, expected, "all_to_all_single (strided output)")
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
    pg = world_pg()
    a, b = small_ints(rank, 5, torch.float32, 0), small_ints(rank, 5, torch.float32, 1)
    pg.allreduce([a, b], dist.AllreduceOptions()).wait()
    expected = sum_of([small_ints(r, 5, torch.float32, s) for r in range(ws) for s in (0, 1)])
    assert_same(a, expected, "allreduce [t1, t2] (first)")
    assert_same(b, expected, "allreduce [t1, t2] (second)")

    a, b = small_ints(rank, 5, torch.int32, 0), small_ints(rank, 5, torch.int32, 1)
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 1, 1
    pg.broadcast([a, b], opts).wait()
    assert_same(a, small_ints(1, 5, torch.int32, 1), "broadcast [t1, t2] rootTensor=1 (first)")
    assert_same(b, small_ints(1, 5, torch.int32, 1), "broadcast [t1, t2] rootTensor=1 (second)")

    k = 2
    inputs = [small_ints(rank, 4, torch.int16, j) for j in range(k)]
    outs = [[torch.empty(4, dtype=torch.int16) for _ in range(ws * k)] for _ in range(k)]
    work = pg.allgather(outs, inputs)
    work.wait()
    for i in range(k):  # gloo: outs[i][r * k + j] is rank r's input j
        for r in range(ws):
            for j in range(k):
                assert_same(outs[i][r * k + j], small_ints(r, 4, torch.int16, j),
                            f"allgather[{i}][{r},{j}]")
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
        assert_same(t, e, f"async op {i}")
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


# --------------------------------------------------------------------------- errors

def _errors(rank, ws):
    pg = world_pg()
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
    assert_same(t, torch.full((3,), float(sum(range(ws)))), "all_reduce after errors")
    return str(raised)


def test_errors_at_call_and_in_future():
    messages = harness.run_torch_ranks(_errors, 2, "shm", JOB_TIMEOUT_S)
    assert all("all_reduce" in m or "allreduce" in m for m in messages), messages


# ------------------------------------------------- the list forms' latency path (fast.py)

@contextlib.contextmanager
def _general_path_calls():
    """The names of the calls that take the default group's general path (its _submit)
    while the block runs: the latency paths' tests expect none where they apply."""
    pg = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).made()
    general = []
    submit = pg._submit

    def counted(name, *args, **kwargs):
        general.append(name)
        return submit(name, *args, **kwargs)
    pg._submit = counted
    try:
        yield general
    finally:
        pg._submit = submit


def _list_forms_latency_path(rank, world_size):
    from shmcoll.torch_backend.compat import OPTIONS_HAVE_ASYNC_OP
    with _general_path_calls() as general:
        outs = [torch.full((2, 3), -1.0) for _ in range(world_size)]
        dist.all_gather(outs, torch.full((2, 3), float(rank)))
        gathered = [o.tolist() for o in outs]
        out = torch.zeros(3, dtype=torch.int64)
        dist.reduce_scatter(out, [torch.full((3,), rank + 10 * j, dtype=torch.int64)
                                  for j in range(world_size)])
        reduced = out.tolist()
        latency = list(general)
        # what the latency path leaves to the general one: gloo's checks, async ops
        outs[world_size - 1] = torch.zeros(2, 4)
        try:
            dist.all_gather(outs, torch.full((2, 3), float(rank)))
            refused = None
        except Exception as e:  # noqa: BLE001  (the message is what is checked)
            refused = str(e)
        outs = [torch.zeros(2, 3) for _ in range(world_size)]
        dist.all_gather(outs, torch.full((2, 3), float(rank)), async_op=True).wait()
        return (gathered, reduced, latency, refused, list(general), [o.tolist() for o in outs],
                OPTIONS_HAVE_ASYNC_OP)


def test_list_all_gather_and_reduce_scatter_take_the_latency_path():
    """dist.all_gather into a list and dist.reduce_scatter of a list run inline (fast.py,
    no Job), with exact results; a wrong output shape still gets gloo's message from the
    general path, and an async call still goes through it. On a torch whose options cannot
    say "synchronous" (compat.OPTIONS_HAVE_ASYNC_OP false) every call takes the general
    path, with the same results."""
    ws = 2
    results = harness.run_torch_ranks(_list_forms_latency_path, ws, "shm", JOB_TIMEOUT_S)
    for rank, (gathered, reduced, latency, refused, general, async_outs,
               inline) in enumerate(results):
        assert gathered == [[[float(r)] * 3] * 2 for r in range(ws)], rank
        assert reduced == [sum(r + 10 * rank for r in range(ws))] * 3, rank
        before = [] if inline else ["allgather", "reduce_scatter"]
        assert latency == before, (rank, latency)
        assert refused is not None and "invalid tensor size at index 1" in refused, refused
        assert general == before + ["allgather"], (rank, general)
        assert async_outs == [[[float(r)] * 3] * 2 for r in range(ws)], rank


# ------------------------------------------------- all_to_all: latency path, mixed forms

def _all_to_all_forms(rank, world_size):
    """Rounds of all_to_all in which the ranks pass different forms of one exchange:
    all_to_all_single without splits, with explicit splits (equal or uneven), and the list
    form; rank r sends rank d (d - r) mod ws + 1 rows of 2 floats, except that rank 0 sends
    and receives 2 rows everywhere (so it may omit its splits)."""
    from shmcoll.torch_backend.compat import OPTIONS_HAVE_ASYNC_OP
    ws = world_size
    rows = [[2 if 0 in (s, d) else (d - s) % ws + 1 for d in range(ws)] for s in range(ws)]

    def piece(s, d):
        return torch.arange(rows[s][d] * 2, dtype=torch.float32).view(-1, 2) + 100 * s + 10 * d

    with _general_path_calls() as general:
        results = []
        for form in ("single", "splits", "list"):
            src = torch.cat([piece(rank, d) for d in range(ws)])
            want = torch.cat([piece(s, rank) for s in range(ws)])
            out = torch.full_like(want, -1.0)
            before = len(general)
            if rank == 0 and form == "single":
                call = "single"  # equal blocks, no splits
                dist.all_to_all_single(out, src)
            elif form == "list" or rank == 1:
                call = "list"
                outs = list(torch.split(out, [rows[s][rank] for s in range(ws)]))
                dist.all_to_all(outs, list(torch.split(src, rows[rank])))
            else:
                call = "splits"
                dist.all_to_all_single(out, src, [rows[s][rank] for s in range(ws)], rows[rank])
            results.append((call, torch.equal(out, want), len(general) - before))
        # same sizes, but the output's dim 0 does not divide: gloo's check, on every rank
        try:
            dist.all_to_all_single(torch.zeros(ws + 1, ws), torch.zeros(ws, ws + 1))
            refused = None
        except RuntimeError as e:
            refused = str(e)
        return results, refused, OPTIONS_HAVE_ASYNC_OP


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_to_all_forms_mix_and_take_the_latency_path(world_size):
    """The forms of all_to_all agree with each other whatever each rank passes
    (all_to_all_single with or without splits, the list form), and all of them run inline
    (no Job) where the torch can say "synchronous"; an output whose dim 0 does not divide
    by the group size still gets gloo's error, though the sizes match."""
    results = harness.run_torch_ranks(_all_to_all_forms, world_size, "shm", JOB_TIMEOUT_S)
    for rank, (rounds, refused, inline) in enumerate(results):
        assert refused and "does not divide equally" in refused, (rank, refused)
        for call, right, jobs in rounds:
            assert right, (rank, call)
            assert jobs == (0 if inline else 1), (rank, call, jobs)


def _in_place_all_to_all(rank, world_size):
    """dist.all_to_all_single(t, t) and dist.all_to_all(ts, ts), riding in the slot (64 KiB
    per rank), read by the peers from where it lies (8 MiB: above the 4 MiB slot) and, for
    the list form, the hierarchy of both; FSDP2's all_gather (the input a view of its own
    block of the output) beside them. Each rank returns which results were wrong."""
    ws = world_size
    wrong = []
    for n in (16 << 10, 2 << 20):  # float32 elements per rank: 64 KiB, 8 MiB
        per = n // ws

        def block(s, d):
            return torch.arange(per, dtype=torch.float32) + 1e6 * s + 1e3 * d

        want = torch.cat([block(s, rank) for s in range(ws)])
        t = torch.cat([block(rank, d) for d in range(ws)])
        dist.all_to_all_single(t, t)
        if not torch.equal(t, want):
            wrong.append(("all_to_all_single(t, t)", n))
        ts = [block(rank, d) for d in range(ws)]
        dist.all_to_all(ts, ts)
        if not torch.equal(torch.cat(ts), want):
            wrong.append(("all_to_all(ts, ts)", n))
        out = torch.zeros(ws * per)
        out[rank * per:(rank + 1) * per] = block(rank, 0)
        dist.all_gather_into_tensor(out, out[rank * per:(rank + 1) * per])
        if not torch.equal(out, torch.cat([block(s, 0) for s in range(ws)])):
            wrong.append(("all_gather_into_tensor(out, out[rank block])", n))
    return wrong


@pytest.mark.parametrize("world_size", [2, 3])
def test_in_place_all_to_all_and_all_gather(world_size):
    """An in-place all_to_all is right at every size (peers read the input where it lies
    only once it is a private copy; gloo's own is wrong at some sizes), and so is
    all_gather from the output's own block."""
    results = harness.run_torch_ranks(_in_place_all_to_all, world_size, "shm", JOB_TIMEOUT_S)
    assert results == [[]] * world_size, results


def _rooted_latency_path(rank, world_size):
    from shmcoll.torch_backend.compat import OPTIONS_HAVE_ASYNC_OP
    with _general_path_calls() as general:
        root = world_size - 1
        gathered = [torch.full((2, 3), -1.0) for _ in range(world_size)] if rank == root else None
        dist.gather(torch.full((2, 3), float(rank)), gathered, dst=root)
        out = torch.zeros(3, dtype=torch.int64)
        dist.scatter(out, [torch.full((3,), 10 * j, dtype=torch.int64) for j in range(world_size)]
                     if rank == 0 else None, src=0)
        scattered = out.tolist()
        latency = list(general)
        # async calls still take the general path
        dist.scatter(out, [torch.full((3,), 7 + j, dtype=torch.int64) for j in range(world_size)]
                     if rank == 0 else None, src=0, async_op=True).wait()
        return ([g.tolist() for g in gathered] if gathered else None, scattered, latency,
                out.tolist(), list(general), OPTIONS_HAVE_ASYNC_OP)


def test_gather_and_scatter_take_the_latency_path():
    """dist.gather and dist.scatter run inline (fast.py, no Job) where the torch can say
    "synchronous", with exact results at a root that is not rank 0; an async call still
    takes the general path."""
    ws = 2
    results = harness.run_torch_ranks(_rooted_latency_path, ws, "shm", JOB_TIMEOUT_S)
    for rank, (gathered, scattered, latency, async_out, general, inline) in enumerate(results):
        if rank == ws - 1:
            assert gathered == [[[float(r)] * 3] * 2 for r in range(ws)], gathered
        assert scattered == [10 * rank] * 3, scattered
        assert latency == ([] if inline else ["gather", "scatter"]), latency
        assert async_out == [7 + rank] * 3 and general[-1] == "scatter", (async_out, general)
