"""cuda_ipc on a real GPU (marked `cuda`; skipped with a reason where no GPU is present).

Run by scripts/gpu_check.sh on a machine with a GPU. Several ranks share device 0 (the
same-GPU tier; with more GPUs, rank r uses GPU r % count). The bodies of the host
backend's torch tests run unchanged with CUDA as torch's default device.
"""

import os
import signal
import time

import pytest
import torch

import harness
import test_torch_backend as tb
from _ranks import Job, new_foreign_entries, shm_entries

pytestmark = [pytest.mark.cuda, pytest.mark.multiprocess, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (run scripts/gpu_check.sh on one)")]

JOB_TIMEOUT_S = 600
# uint16 has too few CUDA kernels for the sweep's reference arithmetic
GPU_DTYPES = [d for d in tb.ALL_DTYPES if d != torch.uint16]


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
        assert dist.group.WORLD._device is not None
        return fn(rank, ws, *args)
    finally:
        torch.set_default_device(None)


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_collective_and_dtype_on_one_gpu(world_size):
    assert all(harness.run_torch_ranks(_on_gpu, world_size, "shm", JOB_TIMEOUT_S,
                                       args=(tb._dist_sweep, GPU_DTYPES)))


@pytest.mark.parametrize("job,ws", [(tb._all_ops, 3), (tb._pg_direct, 2), (tb._strided, 2),
                                    (tb._lists, 2), (tb._every_dtype, 2),
                                    (tb._async_many, 2)],
                         ids=["ops", "pg_object", "strided", "lists", "dtypes", "async"])
def test_torch_surface_on_gpu(job, ws):
    args = (job, 100) if job is tb._async_many else (job,)
    assert all(harness.run_torch_ranks(_on_gpu, ws, "shm", JOB_TIMEOUT_S, args=args))


@pytest.mark.parametrize("env", [{"SHMCOLL_CUDA_TIER": "host"},
                                 {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
                                 {"SHMCOLL_CUDA_SLOT_BYTES": str(64 << 10)}],
                         ids=["host-tier", "expandable-segments", "small-slots"])
def test_tiers_and_allocator_settings(env):
    """The host-staged tier, torch's expandable segments (our slots are not torch's) and
    messages of many chunks give the same exact results."""
    assert all(harness.run_torch_ranks(_on_gpu, 2, "shm", JOB_TIMEOUT_S,
                                       args=(tb._dist_sweep, [torch.float32, torch.bfloat16]),
                                       env=env))


def _async_semantics(rank, ws):
    import torch.distributed as dist
    n = 64 << 20
    t = torch.full((n // 4,), float(rank + 1))
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of device work ahead of the collective
    t0 = time.perf_counter()
    work = dist.all_reduce(t, async_op=True)
    host_s = time.perf_counter() - t0
    pending = not work.is_completed()
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
    return host_s, pending


def test_calls_return_before_the_device_finishes():
    """Enqueued behind ~1 s of device work, a 64 MiB all_reduce returns to the host in
    well under that (host time measured), its Work is not completed yet, a side stream
    ordered by work.wait() sees the result, and the future is NCCL-style complete."""
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
        job.all_ranks("enqueued", timeout_s=240)
        time.sleep(0.5)
        t0 = job.signal(1, signal.SIGKILL)
        ev = job.event(0, "error", timeout_s=30)
        assert ev["type"] == "PeerLostError" and ev["peer"] == 1, ev
        assert ev["t"] - t0 < 2.0, (ev["t"] - t0, ev)
        synced = job.event(0, "synchronized", timeout_s=30)
        assert synced["ok"], synced
        assert job.join(60)[0] == 0
    assert not new_foreign_entries(before)


def _cycles(rank, ws, store, n):
    from cuda_ipc.cuda import CudaDevice
    import shmcoll
    from cuda_ipc.group import DeviceGroup
    from cuda_ipc.rendezvous import ProcessRendezvous
    from shmcoll import config
    from shmcoll.ops import ReduceOp
    torch.cuda.set_device(0)
    dev = CudaDevice(0)
    cfg = config.from_env()
    t = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info(0)[0]
    for i in range(n):
        sub = shmcoll.FileStore(os.path.join(store.path, f"c{i}"))
        group = shmcoll.new_shm_group(sub, rank, ws, timeout_s=60)
        dg = DeviceGroup(group, dev, lambda: ProcessRendezvous(
            sub, rank, ws, group._arena._pids, 60), cfg)
        t.fill_(1.0)
        dg.all_reduce(t, "float32", ReduceOp.SUM)
        group.close()
    torch.cuda.synchronize()
    assert float(t[0].item()) == ws
    return (free0 - torch.cuda.mem_get_info(0)[0]) / 2**20


def test_thousand_init_destroy_cycles_leak_no_gpu_memory():
    before = shm_entries()
    leaked_mib = harness.run_ranks(_cycles, 2, "processes", 1200, args=(1000,))
    assert all(m < 4 for m in leaked_mib), f"GPU memory not returned (MiB): {leaked_mib}"
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
    assert threaded_pg.spawn(_threaded, 3, timeout=300) == [True] * 3
