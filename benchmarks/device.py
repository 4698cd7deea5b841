"""Device tensors in the benchmark (`python -m benchmarks.bench --device cuda|sim`).

cuda: every rank's buffers live on a CUDA device (rank r on device r % device_count, so
several ranks share one GPU when there are fewer GPUs than ranks); each timed call is
followed by a synchronization of the rank's stream, so a row's time is the call's latency
to completion on the device for every backend alike (gloo stages CUDA tensors through the
host and synchronizes inside; "shm" and NCCL only enqueue). The "nccl" backend is started
with NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL >= 2.30 lets 2 ranks share a GPU; older NCCL
refuses with "Duplicate GPU detected" and the run reports that error). The "memcpy" peer
becomes a device-to-device copy (torch copy_, CUDA-event timed): the device's own copy
bandwidth, the roofline of collectives among ranks of one GPU.

sim: the buffers stay on the CPU and "shm" runs with SHMCOLL_CUDA_SIM=inline, i.e. through
cuda_ipc's device path on the simulated device: a smoke test of the device benchmark
plumbing and of cuda_ipc without a GPU (times are not GPU times).
"""

import os
import statistics
import time

__all__ = ["DEVICES", "rank_env", "prepare_rank", "to_device", "synchronizer", "header",
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
    info = {"device": "cuda", "cuda_devices": [torch.cuda.get_device_name(i)
                                              for i in range(torch.cuda.device_count())],
            "torch_cuda": torch.version.cuda}
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
    print(f"# [memcpy] {time.monotonic() - t_start:.1f}s wall (device-to-device copy_ on "
          f"{torch.cuda.get_device_name(0)})", flush=True)


def environ_with(extra):
    env = dict(os.environ)
    env.update(extra)
    return env
