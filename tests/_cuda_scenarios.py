"""Rank-process scenarios for cuda_ipc's fault tests (run by tests/_ranks.py as
"_cuda_scenarios.<name>"): engine-level device groups on the simulated device with
asynchronous streams (cuda_sim_util.device_group)."""

import time

import torch

import harness
from cuda_sim_util import device_group
from shmcoll.native.ops import ReduceOp


def _setup(c, timeout_s=30.0):
    group, dg, dev = device_group(c.store(), c.rank, c.world_size, timeout_s=timeout_s)
    stream = dev.current_stream()
    t = torch.ones(1000)
    dg.all_reduce(t, "float32", ReduceOp.SUM)  # builds the device arena on every rank
    dev.synchronize(stream, 30)
    assert float(t[0]) == c.world_size
    return group, dg, dev, stream


def _watchdog_error(dg, within_s):
    deadline = time.monotonic() + within_s
    while dg.arena.watchdog.error is None and time.monotonic() < deadline:
        time.sleep(1e-3)
    return dg.arena.watchdog.error


def _drained(c, dev, stream):
    try:
        dev.synchronize(stream, 10)
        c.emit("drained", ok=True)
    except Exception as e:
        c.emit("drained", ok=False, **c.err(e))


def scenario_lost_peer(c):
    """Rank 1's stream is busy for 30 s when both enqueue an all_reduce; the parent then
    SIGKILLs rank 1. Rank 0 reports its watchdog's error, whether its stream drained, and
    what the next call raises."""
    group, dg, dev, stream = _setup(c)
    if c.rank == 1:
        dev.run(stream, time.sleep, 30)
    dg.all_reduce(torch.ones(1000), "float32", ReduceOp.SUM)
    c.emit("enqueued")
    if c.rank == 1:
        c.wait_cmd()  # killed here
        return
    err = _watchdog_error(dg, 60)
    c.emit("error", **c.err(err))
    _drained(c, dev, stream)
    try:
        dg.all_reduce(torch.ones(10), "float32", ReduceOp.SUM)
        c.emit("again", type=None)
    except Exception as e:
        c.emit("again", **c.err(e))
    group.close()


def scenario_stalled_peer(c):
    """Rank 1's stream is busy for 5 s (alive, not dead) when both enqueue an all_reduce,
    rank 0 with a 1 s timeout, rank 1 with 30 s: rank 0 times out naming rank 1; rank 1's
    collective completes once its stream gets there, and its next call fails because rank 0
    aborted the group."""
    group, dg, dev, stream = _setup(c)
    if c.rank == 1:
        dev.run(stream, time.sleep, 5)
    t0 = time.monotonic()
    dg.all_reduce(torch.ones(1000), "float32", ReduceOp.SUM,
                  timeout_s=1.0 if c.rank == 0 else 30.0)
    c.emit("enqueued")
    if c.rank == 0:
        err = _watchdog_error(dg, 60)
        c.emit("error", elapsed=time.monotonic() - t0, **c.err(err))
        _drained(c, dev, stream)
    else:
        _drained(c, dev, stream)
        try:
            dg.all_reduce(torch.ones(10), "float32", ReduceOp.SUM)
            c.emit("error", type=None)
        except Exception as e:
            c.emit("error", **c.err(e))
    group.close()


def scenario_gpu_lost_peer(c):
    """Real CUDA, through torch "shm": rank 1's stream is ~30 s behind when both enqueue
    an all_reduce; the parent SIGKILLs rank 1. Rank 0 reports its watchdog's error and
    whether torch.cuda.synchronize() returns (its stream was released)."""
    import threading

    import torch.distributed as dist
    torch.cuda.set_device(0)
    c.torch = True
    c.new_group()
    t = torch.ones(1000, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    if c.rank == 1:
        torch.cuda._sleep(60_000_000_000)  # ~30 s of clock cycles on the device
    dist.all_reduce(torch.ones(1000, device="cuda"))
    c.emit("enqueued")
    if c.rank == 1:
        c.wait_cmd()
        return
    dg = harness.made(dist.group.WORLD)._device.dg
    err = _watchdog_error(dg, 60)
    c.emit("error", **c.err(err))
    done = threading.Event()
    threading.Thread(target=lambda: (torch.cuda.synchronize(), done.set()), daemon=True).start()
    c.emit("synchronized", ok=done.wait(20))
    c.close()


def scenario_inline_lost_peer(c):
    """torch "shm" with SHMCOLL_CUDA_SIM=inline: both ranks loop a chunked all_reduce on the
    device path (4 KiB slots, 256 KiB messages: 64 chunks) until rank 1 SIGKILLs itself in
    the middle of one; rank 0's inline waits must end in PeerLostError, and the group stays
    failed."""
    import torch.distributed as dist
    c.torch = True
    c.new_group()
    t = torch.ones(1 << 16)
    dist.all_reduce(t)
    c.emit("ready")
    if c.rank == 1:  # die inside the 4th collective, between two of its 64 chunks
        import os
        import signal
        from cuda_ipc import collectives
        reduce, calls = collectives.reduce_into, [0]

        def reduce_then_die(*args):
            calls[0] += 1
            if calls[0] == 3 * 64 + 20:
                os.kill(os.getpid(), signal.SIGKILL)
            reduce(*args)
        collectives.reduce_into = reduce_then_die
    try:
        while True:
            t.fill_(1.0)
            dist.all_reduce(t)
            c.emit("iter")
    except Exception as e:
        c.emit("error", **c.err(e))
    try:
        dist.all_reduce(t)
        c.emit("again", type=None)
    except Exception as e:
        c.emit("again", **c.err(e))
    c.close()
