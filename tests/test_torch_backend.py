"""torch.distributed with backend "shm": rendezvous methods, every collective through dist.*,
every dtype, torchrun and torch.multiprocessing.spawn. The ProcessGroup object itself (Work /
Future semantics, strided tensors, lists, async ops, errors) is in test_torch_backend_pg.py.

Inputs are small integers (exact in every dtype), so expected values are computed with
plain torch arithmetic (support/torch_reference.py); the engine-level tests (cases.py) cover
rounding bit for bit.
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
from support.torch_reference import ALL_DTYPES, assert_same, small_ints, sum_of, world_pg

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch, pytest.mark.timeout(600)]

JOB_TIMEOUT_S = 180


# ------------------------------------------------------------------------- rendezvous

def _init_check(rank, world_size):
    assert dist.get_backend() == "shm"
    assert dist.get_rank() == rank and dist.get_world_size() == world_size
    t = small_ints(rank, 5, torch.float32)
    dist.all_reduce(t)
    assert_same(t, sum_of([small_ints(r, 5, torch.float32) for r in range(world_size)]),
                "all_reduce")
    dist.barrier()
    return type(world_pg()).__name__


@pytest.mark.parametrize("init", ["file", "tcp", "env", "tcpstore", "filestore"])
def test_init_methods(init):
    names = harness.run_torch_ranks(_init_check, 2, "shm", JOB_TIMEOUT_S, init=init)
    assert len(set(names)) == 1


# ---------------------------------------------------------------- collectives via dist.*

def _dist_collectives(rank, ws, dtype):
    n = 7
    inputs = [small_ints(r, n, dtype) for r in range(ws)]
    reducible = dtype in ALL_DTYPES
    if reducible:
        t = inputs[rank].clone()
        dist.all_reduce(t)
        assert_same(t, sum_of(inputs), "all_reduce")
        t = inputs[rank].clone()
        dist.reduce(t, dst=ws - 1)
        assert_same(t, sum_of(inputs) if rank == ws - 1 else inputs[rank], "reduce")
        out = torch.empty(n, dtype=dtype)
        dist.reduce_scatter(out, [small_ints(rank, n, dtype, salt=j) for j in range(ws)])
        assert_same(out, sum_of([small_ints(r, n, dtype, salt=rank) for r in range(ws)]),
                    "reduce_scatter")
        out = torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(out, torch.cat([small_ints(rank, n, dtype, salt=j)
                                                   for j in range(ws)]))
        assert_same(out, sum_of([small_ints(r, n, dtype, salt=rank) for r in range(ws)]),
            "reduce_scatter_tensor")
    t = inputs[rank].clone()
    dist.broadcast(t, src=ws - 1)
    assert_same(t, inputs[ws - 1], "broadcast")
    outs = [torch.empty(n, dtype=dtype) for _ in range(ws)]
    dist.all_gather(outs, inputs[rank])
    for r in range(ws):
        assert_same(outs[r], inputs[r], f"all_gather[{r}]")
    out = torch.empty(ws * n, dtype=dtype)
    dist.all_gather_into_tensor(out, inputs[rank])
    assert_same(out, torch.cat(inputs), "all_gather_into_tensor")
    outs = [torch.empty(n, dtype=dtype) for _ in range(ws)] if rank == 0 else None
    dist.gather(inputs[rank], outs, dst=0)
    if rank == 0:
        for r in range(ws):
            assert_same(outs[r], inputs[r], f"gather[{r}]")
    out = torch.empty(n, dtype=dtype)
    pieces = [small_ints(0, n, dtype, salt=j) for j in range(ws)]
    dist.scatter(out, pieces if rank == 0 else None, src=0)
    assert_same(out, pieces[rank], "scatter")
    outs = [torch.empty(n + r, dtype=dtype) for r in range(ws)]  # rank r sends n + r
    dist.all_to_all(outs, [small_ints(rank, n + rank, dtype, salt=j) for j in range(ws)])
    for r in range(ws):
        assert_same(outs[r], small_ints(r, n + r, dtype, salt=rank), f"all_to_all[{r}]")
    out = torch.empty(ws * 2, dtype=dtype)
    dist.all_to_all_single(out, torch.cat([small_ints(rank, 2, dtype, salt=j) for j in range(ws)]))
    assert_same(out, torch.cat([small_ints(r, 2, dtype, salt=rank) for r in range(ws)]),
                "all_to_all_single")
    in_splits = [rank + j for j in range(ws)]  # uneven: rank r sends r + j rows to j
    out_splits = [r + rank for r in range(ws)]
    out = torch.empty(sum(out_splits), 3, dtype=dtype)
    src = torch.cat([small_ints(rank, (rank + j) * 3, dtype, salt=j).view(-1, 3)
                     for j in range(ws)])
    dist.all_to_all_single(out, src, out_splits, in_splits)
    expected = torch.cat([small_ints(r, (r + rank) * 3, dtype, salt=rank).view(-1, 3)
                          for r in range(ws)])
    assert_same(out, expected, "all_to_all_single (uneven splits)")
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
        assert_same(t, expected, str(op))
    return True


def test_all_reduce_ops():
    assert all(harness.run_torch_ranks(_all_ops, 3, "shm", JOB_TIMEOUT_S))


# --------------------------------------------------------------------------- all dtypes

def _every_dtype(rank, ws):
    for dtype in ALL_DTYPES:
        inputs = [small_ints(r, 11, dtype) for r in range(ws)]
        t = inputs[rank].clone()
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        assert_same(t, sum_of(inputs), f"all_reduce {dtype}")
        value = work.get_future().wait()
        if dtype.is_complex:  # dist.all_reduce hands the backend torch.view_as_real(t)
            t = torch.view_as_real(t)
        assert len(value) == 1 and torch.equal(value[0], t), (dtype, value, t)
    return True


def test_every_dtype_all_reduce():
    assert all(harness.run_torch_ranks(_every_dtype, 2, "shm", JOB_TIMEOUT_S))


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
