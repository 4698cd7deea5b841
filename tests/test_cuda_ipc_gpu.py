"""cuda_ipc on a real GPU (marked `cuda`; skipped with a reason where no GPU is present).

Run by scripts/gpu_check.sh on a machine with a GPU. Several ranks share device 0 (the
same-GPU tier; with more GPUs, rank r uses GPU r % count). The bodies of the host
backend's torch tests run unchanged with CUDA as torch's default device.

Time bounds, so that one device call of a few minutes brings results back: every job of
rank processes ends within SHMCOLL_GPU_JOB_TIMEOUT_S (default 300 s: the harness then kills
the ranks and prints their stacks), every test within SHMCOLL_GPU_TEST_TIMEOUT_S (default
900 s, pytest-timeout). The leak test runs SHMCOLL_GPU_LEAK_CYCLES init/destroy cycles
(default 1000), fewer if SHMCOLL_GPU_LEAK_BUDGET_S (default 0: none) runs out first; it
prints how many it ran.
"""

import os
import signal
import threading
import time

import pytest
import torch

import harness
import test_torch_backend as tb
import test_torch_backend_pg as tbpg
from _ranks import Job
from support.devshm import new_foreign_entries, shm_entries
from support.torch_reference import ALL_DTYPES, assert_same

JOB_TIMEOUT_S = float(os.environ.get("SHMCOLL_GPU_JOB_TIMEOUT_S", "300"))
TEST_TIMEOUT_S = float(os.environ.get("SHMCOLL_GPU_TEST_TIMEOUT_S", "900"))
LEAK_CYCLES = int(os.environ.get("SHMCOLL_GPU_LEAK_CYCLES", "1000"))
LEAK_BUDGET_S = float(os.environ.get("SHMCOLL_GPU_LEAK_BUDGET_S", "0"))

if os.environ.get("SHMCOLL_REQUIRE_GPU") == "1" and not torch.cuda.is_available():
    # scripts/gpu_check.sh sets it: there, "every test skipped" would read as a pass
    raise RuntimeError(f"SHMCOLL_REQUIRE_GPU=1 but torch {torch.__version__} (CUDA "
                       f"{torch.version.cuda}) sees no CUDA device")

pytestmark = [pytest.mark.cuda, pytest.mark.multiprocess, pytest.mark.timeout(TEST_TIMEOUT_S),
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (run scripts/gpu_check.sh on one)")]

# uint16 has too few CUDA kernels for the sweep's reference arithmetic
GPU_DTYPES = [d for d in ALL_DTYPES if d != torch.uint16]


def _on_gpu(rank, ws, fn, *args):
    """fn with CUDA as the default device (this rank's GPU), after checking that the group
    moves CUDA tensors through cuda_ipc."""
    import torch.distributed as dist
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    torch.set_default_device(dev)
    try:
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.is_cuda and float(t[0].item()) == ws
        assert harness.made(dist.group.WORLD)._device is not None
        return fn(rank, ws, *args)
    finally:
        torch.set_default_device(None)


def _smoke(rank, ws):
    """The first contact: a small and a chunked all_reduce, bf16, a broadcast and an
    all_gather on CUDA tensors, exact results; which tier the ranks took."""
    import torch.distributed as dist
    for n, dtype in ((5, torch.float32), ((3 << 20) + 11, torch.float32), (4099, torch.bfloat16)):
        x = torch.arange(n, dtype=torch.int64) % 7
        t = (x + rank).to(dtype)
        dist.all_reduce(t)
        assert_same(t, (x * ws + sum(range(ws))).to(dtype), f"all_reduce {dtype} n={n}")
    b = torch.full((1000,), float(rank))
    dist.broadcast(b, 1)
    assert_same(b, torch.full((1000,), 1.0), "broadcast")
    out = torch.empty(ws * 3)
    dist.all_gather_into_tensor(out, torch.full((3,), float(rank)))
    assert_same(out, torch.arange(ws, dtype=torch.float32).repeat_interleave(3), "all_gather")
    torch.cuda.synchronize()
    return harness.made(dist.group.WORLD)._device.dg.tier


def test_smoke_two_ranks_on_one_gpu():
    """Run first by scripts/gpu_check.sh (its own stage, a short deadline): when the basics
    fail, the suite after it runs with a smaller --maxfail."""
    tiers = harness.run_torch_ranks(_on_gpu, 2, "shm", JOB_TIMEOUT_S, args=(_smoke,))
    print(f"smoke: tiers {tiers}")
    assert len(set(tiers)) == 1, tiers


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_collective_and_dtype_on_one_gpu(world_size):
    assert all(harness.run_torch_ranks(_on_gpu, world_size, "shm", JOB_TIMEOUT_S,
                                       args=(tb._dist_sweep, GPU_DTYPES)))


@pytest.mark.parametrize("job,ws", [(tb._all_ops, 3), (tbpg._pg_direct, 2), (tbpg._strided, 2),
                                    (tbpg._lists, 2), (tb._every_dtype, 2),
                                    (tbpg._async_many, 2)],
                         ids=["ops", "pg_object", "strided", "lists", "dtypes", "async"])
def test_torch_surface_on_gpu(job, ws):
    args = (job, 100) if job is tbpg._async_many else (job,)
    assert all(harness.run_torch_ranks(_on_gpu, ws, "shm", JOB_TIMEOUT_S, args=args))


@pytest.mark.parametrize("env", [{"SHMCOLL_CUDA_TIER": "host"},
                                 {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
                                 {"SHMCOLL_CUDA_SLOT_BYTES": str(64 << 10)}],
                         ids=["host-tier", "expandable-segments", "small-slots"])
def test_tiers_and_allocator_settings(env):
    """The host-staged tier, torch's expandable segments (our slots are not torch's) and
    messages of many chunks give the same exact results. For expandable segments the
    pooled rank processes are replaced around the test: torch reads PYTORCH_CUDA_ALLOC_CONF
    once, at its first CUDA allocation, so a worker that used CUDA before would ignore it
    (and one that ran this test would keep it)."""
    fresh = "PYTORCH_CUDA_ALLOC_CONF" in env
    if fresh:
        harness.shutdown_pool()
    try:
        assert all(harness.run_torch_ranks(_on_gpu, 2, "shm", JOB_TIMEOUT_S,
                                           args=(_with_alloc_conf, env),
                                           env=env))
    finally:
        if fresh:
            harness.shutdown_pool()


def _with_alloc_conf(rank, ws, env):
    if "PYTORCH_CUDA_ALLOC_CONF" in env:  # set before this fresh worker's first CUDA use
        assert os.environ.get("PYTORCH_CUDA_ALLOC_CONF") == env["PYTORCH_CUDA_ALLOC_CONF"]
    return tb._dist_sweep(rank, ws, [torch.float32, torch.bfloat16])


def _async_semantics(rank, ws):
    import torch.distributed as dist
    n = 64 << 20
    t = torch.full((n // 4,), float(rank + 1))
    torch.cuda.synchronize()
    s1 = torch.cuda.Stream()
    with torch.cuda.stream(s1):
        torch.cuda._sleep(2_000_000_000)  # ~1 s of device work ahead of the collective
        t0 = time.perf_counter()
        work = dist.all_reduce(t, async_op=True)
        host_s = time.perf_counter() - t0
    pending = not work.is_completed()
    # A thread that made no CUDA call yet (no current context) makes its current stream
    # (the default one) wait for the collective: a driver call on that thread.
    errors = []

    def wait_elsewhere():
        try:
            work.wait()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))
    th = threading.Thread(target=wait_elsewhere)
    th.start()
    th.join(60)
    assert not th.is_alive() and not errors, errors
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        work.wait()  # the side stream now waits for the collective
        doubled = t * 2
    side.synchronize()
    assert work.is_completed()
    want = float(sum(range(1, ws + 1)))
    assert float(t[0].item()) == want and float(t[-1].item()) == want
    assert float(doubled[-1].item()) == 2 * want
    fut = work.get_future()
    assert fut.done() and fut.value()[0] is t
    torch.cuda.synchronize()  # the default stream's wait (from the thread) passed too
    return host_s, pending


def test_calls_return_before_the_device_finishes():
    """Enqueued behind ~1 s of device work on a side stream, a 64 MiB all_reduce returns to
    the host in well under that (host time measured), its Work is not completed yet, a
    thread with no CUDA context yet and a side stream both wait for it through
    work.wait(), the side stream sees the result, and the future is NCCL-style complete."""
    out = harness.run_torch_ranks(_on_gpu, 2, "shm", JOB_TIMEOUT_S, args=(_async_semantics,))
    for host_s, pending in out:
        assert host_s < 0.25, out
        assert pending, out


def test_killed_peer_leaves_the_survivor_gpu_usable(tmp_path):
    """SIGKILL a rank whose stream is 30 s behind: the survivor's watchdog raises
    PeerLostError within 2 s, torch.cuda.synchronize() on the survivor returns (its stream
    was released), and nothing is left in /dev/shm."""
    before = shm_entries()
    with Job("_cuda_scenarios.gpu_lost_peer", 2, tmp_path, timeout_s=60) as job:
        job.all_ranks("enqueued", timeout_s=min(240, JOB_TIMEOUT_S))
        time.sleep(0.5)
        t0 = job.signal(1, signal.SIGKILL)
        ev = job.event(0, "error", timeout_s=30)
        assert ev["type"] == "PeerLostError" and ev["peer"] == 1, ev
        assert ev["t"] - t0 < 2.0, (ev["t"] - t0, ev)
        synced = job.event(0, "synchronized", timeout_s=30)
        assert synced["ok"], synced
        assert job.join(60)[0] == 0
    assert not new_foreign_entries(before)


def _barrier(store, name, rank, ws, timeout_s=120.0):
    store.add(name, 1)
    deadline = time.monotonic() + timeout_s
    while int(store.add(name, 0)) < ws:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: barrier {name!r} not reached by every rank")
        time.sleep(1e-3)


def _cycles(rank, ws, store, n, budget_s, warm=5):
    """`warm` cycles (driver and allocator caches settle), then up to `n` more until rank 0
    says the budget is spent; the device's free memory is read when every rank is between
    cycles (a barrier), so no peer's allocation is counted."""
    import shmcoll
    from cuda_ipc import cuda as cuda_mod
    from cuda_ipc.group import DeviceGroup
    from cuda_ipc.rendezvous import ProcessRendezvous
    from shmcoll import config
    from shmcoll.native.ops import ReduceOp
    torch.cuda.set_device(0)
    dev = cuda_mod.CudaDevice(0)
    cfg = config.from_env()
    t = torch.ones(1 << 20, device="cuda")

    def cycle(i):
        sub = shmcoll.FileStore(os.path.join(store.path, f"c{i}"))
        group = shmcoll.new_shm_group(sub, rank, ws, timeout_s=60)
        try:
            dg = DeviceGroup(group, dev, lambda: ProcessRendezvous(
                sub, rank, ws, group._arena._pids, 60), cfg)
            t.fill_(1.0)
            dg.all_reduce(t, "float32", ReduceOp.SUM)
        finally:
            group.close()
    for i in range(warm):
        cycle(i)
    torch.cuda.synchronize()
    _barrier(store, "warm", rank, ws)
    free0, ledger0 = torch.cuda.mem_get_info(0)[0], cuda_mod.outstanding()
    torch0 = torch.cuda.memory_allocated(0)
    t0 = time.monotonic()
    done = 0
    for i in range(n):
        if rank == 0:  # one rank decides, so every rank runs the same cycles
            go = budget_s <= 0 or time.monotonic() - t0 < budget_s
            store.set(f"go{i}", "1" if go else "0")
        if store.get(f"go{i}") != b"1":
            break
        cycle(warm + i)
        done += 1
    seconds = time.monotonic() - t0
    torch.cuda.synchronize()
    assert float(t[0].item()) == ws
    _barrier(store, "end", rank, ws)
    return {"cycles": done, "seconds": round(seconds, 2),
            "leaked_mib": (free0 - torch.cuda.mem_get_info(0)[0]) / 2**20,
            "ledger": cuda_mod.outstanding(), "ledger_before": ledger0,
            "torch_allocated_delta": torch.cuda.memory_allocated(0) - torch0}


def test_thousand_init_destroy_cycles_leak_no_gpu_memory():
    """Groups with a device arena built and destroyed LEAK_CYCLES times (1000 by default;
    fewer when LEAK_BUDGET_S runs out, printed): no GPU memory lost (device free memory
    read between cycles on every rank), no allocation / IPC mapping / host registration
    left in the process, no segment left in /dev/shm."""
    before, before_ours = shm_entries(), shm_entries(harness.our_pids())
    # with a budget the job deadline is JOB_TIMEOUT_S (the script sets one above the budget);
    # without, 1000 cycles may need 20 minutes on a slow host
    out = harness.run_ranks(_cycles, 2, "processes",
                            JOB_TIMEOUT_S if LEAK_BUDGET_S > 0 else max(JOB_TIMEOUT_S, 1200),
                            args=(LEAK_CYCLES, LEAK_BUDGET_S))
    print(f"\nleak test: {out}")
    cycles = out[0]["cycles"]
    print(f"leak test: {cycles} init/destroy cycles in {out[0]['seconds']} s "
          f"({out[0]['seconds'] / max(cycles, 1) * 1e3:.1f} ms each)")
    assert cycles >= min(LEAK_CYCLES, 50), f"only {cycles} cycles ran: {out}"
    for r in out:
        assert r["ledger"] == {"allocations": 0, "mappings": 0, "registrations": 0}, out
        assert r["leaked_mib"] < 4, f"GPU memory not returned (MiB): {out}"
        assert r["torch_allocated_delta"] == 0, out
    assert not (shm_entries(harness.our_pids()) - before_ours), "shmcoll segments left"
    assert not new_foreign_entries(before)


def _threaded(rank, ws):
    import torch.distributed as dist
    torch.cuda.set_device(0)
    t = torch.full((1 << 20,), float(rank), device="cuda")
    dist.all_reduce(t)
    out = torch.empty(ws * 4, device="cuda")
    dist.all_gather_into_tensor(out, torch.full((4,), float(rank), device="cuda"))
    torch.cuda.current_stream().synchronize()
    assert float(t[-1].item()) == sum(range(ws))
    assert out.tolist() == [float(r) for r in range(ws) for _ in range(4)]
    return True


def test_threaded_pg_with_cuda_tensors():
    import threaded_pg
    assert threaded_pg.spawn(_threaded, 3, timeout=JOB_TIMEOUT_S) == [True] * 3
