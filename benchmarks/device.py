"""Device tensors in the benchmark (`python -m benchmarks.bench --device cuda|sim`).

cuda: every rank's buffers live on a CUDA device (rank r on device r % device_count, so
several ranks share one GPU when there are fewer GPUs than ranks); each timed call is
followed by a synchronization of the rank's stream, so a row's time is the call's latency
to completion on the device for every backend alike (gloo stages CUDA tensors through the
host and synchronizes inside; "shm" and NCCL only enqueue). The "nccl" backend is started
with NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL >= 2.30 lets 2 ranks share a GPU; older NCCL
refuses with "Duplicate GPU detected", so with more ranks than GPUs the run skips the
nccl column and records why: `nccl_unavailable`). The "memcpy" peer
becomes a device-to-device copy (torch copy_, CUDA-event timed): the device's own copy
bandwidth, the roofline of collectives among ranks of one GPU.

sim: the buffers stay on the CPU and "shm" runs with SHMCOLL_CUDA_SIM=inline, i.e. through
cuda_ipc's device path on the simulated device: a smoke test of the device benchmark
plumbing and of cuda_ipc without a GPU (times are not GPU times).
"""

import os
import statistics
import time

__all__ = ["DEVICES", "rank_env", "nccl_unavailable", "prepare_rank", "to_device", "synchronizer", "header",
           "run_device_copy"]

DEVICES = ("cpu", "cuda", "sim")


def rank_env(device, backend):
    """Environment variables a rank of `backend` needs for `device` (set by the parent)."""
    env = {}
    if device == "sim" and backend == "shm":
        env["SHMCOLL_CUDA_SIM"] = "inline"
    if device == "cuda" and backend == "nccl":
        env["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    return env


NCCL_SHARED_GPU = (2, 30)  # the first NCCL that lets ranks share a GPU (env switch below)


def nccl_unavailable(device, world_size, nccl_version=None, gpus=None):
    """Why NCCL cannot run `world_size` ranks here (None when it can): NCCL before 2.30
    refuses two ranks on one GPU ("Duplicate GPU detected"; NCCL_MULTI_RANK_GPU_ENABLE does
    not exist there), so with more ranks than GPUs its column is skipped, with this reason
    recorded, instead of failing the run. Versions and GPU count are read from torch unless
    given."""
    if device != "cuda":
        return None
    import torch
    try:
        gpus = torch.cuda.device_count() if gpus is None else gpus
        nccl_version = tuple(torch.cuda.nccl.version()) if nccl_version is None else \
            tuple(nccl_version)
    except Exception:  # noqa: BLE001 - no CUDA/NCCL: the ranks report their own error
        return None
    if gpus < 1 or world_size <= gpus or nccl_version >= NCCL_SHARED_GPU:
        return None
    return (f"NCCL {'.'.join(map(str, nccl_version))} refuses several ranks on one GPU "
            f"('Duplicate GPU detected'): {world_size} ranks on {gpus} GPU(s) need NCCL >= "
            f"{'.'.join(map(str, NCCL_SHARED_GPU))} (NCCL_MULTI_RANK_GPU_ENABLE=1)")


def prepare_rank(device, rank):
    """Bind the rank to its device before init_process_group; the torch.device to use."""
    import torch
    if device != "cuda":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device in this rank")
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def to_device(buf, dev):
    """The Buffers of one (op, count) moved to `dev` (a no-op on the CPU)."""
    if dev.type == "cpu":
        return buf
    from dataclasses import replace
    move = (lambda t: None if t is None else t.to(dev))
    same = buf.out is buf.inp
    inp = move(buf.inp)
    return replace(buf, inp=inp, out=inp if same else move(buf.out),
                   expected=move(buf.expected), pristine=move(buf.pristine))


def synchronizer(dev):
    """What a timed call is followed by: wait for the rank's stream (None on the CPU)."""
    if dev.type != "cuda":
        return None
    import torch
    stream = torch.cuda.current_stream(dev)
    return stream.synchronize


def header(device):
    """Device facts for the result header: name, driver, CUDA and NCCL versions."""
    if device != "cuda":
        return {"device": device}
    import torch
    info = {"device": "cuda", "torch_cuda": torch.version.cuda}
    try:
        info["cuda_devices"] = [torch.cuda.get_device_name(i)
                                for i in range(torch.cuda.device_count())]
    except Exception as e:  # noqa: BLE001 - a broken CUDA init still gets its rows' errors
        info["cuda_devices"] = f"unavailable: {type(e).__name__}: {e}"
    try:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 - informational
        pass
    try:
        import subprocess
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        info["driver"] = out.stdout.strip().splitlines()[0] if out.stdout.strip() else "?"
    except Exception:  # noqa: BLE001
        info["driver"] = "?"
    return info


def run_device_copy(args, rep, make_row, plan_iterations, collectives, copy_spec):
    """The "memcpy" peer on the device: copy_ of nbytes on one GPU, verified, CUDA-event
    timed per call; busbw = 2 * nbytes / time (bytes read + written)."""
    import torch
    dev = torch.device("cuda", 0)
    dtype, tab, plan = collectives.copy_plan(args, plan_iterations)
    t_start = time.monotonic()
    for count, nbytes, warm, iters in plan:
        try:
            src = collectives.tiled(tab, 0, count, dtype).to(dev)
            dst = torch.empty_like(src)
            for _ in range(max(1, warm)):
                dst.zero_()
                dst.copy_(src)
            torch.cuda.synchronize(dev)
            wrong = collectives.count_wrong(dst, src)
            times = []
            for _ in range(iters):
                dst.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                dst.copy_(src)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e6)  # ms -> ns
            wrong = max(wrong, collectives.count_wrong(dst, src))
            src = dst = None
        except Exception as e:  # noqa: BLE001 - e.g. out of memory
            rep.error("memcpy", 1, "op failed", f"{type(e).__name__}: {e}", op="memcpy",
                      nbytes=nbytes)
            break
        rep.row(make_row("memcpy", copy_spec, 1, nbytes, count, args.dtype, iters, warm,
                         [float(statistics.median(times))], [float(min(times))], wrong))
    try:
        name = torch.cuda.get_device_name(0)
    except Exception as e:  # noqa: BLE001 - the ranks' backends still run and report
        name = f"a device torch cannot name: {type(e).__name__}: {e}"
    print(f"# [memcpy] {time.monotonic() - t_start:.1f}s wall (device-to-device copy_ on "
          f"{name})", flush=True)


def environ_with(extra):
    env = dict(os.environ)
    env.update(extra)
    return env
