"""GPU measurements beside the sweep (scripts/gpu_check.sh), each verified:

* enqueue: host time of an all_reduce on CUDA tensors against its device time (CUDA
  events), 2 ranks on GPU 0, 256 MiB: "shm" returns to the caller before the device is done.
* ddp: DDP on CUDA, 2 ranks on GPU 0, 20 SGD steps of the same model and data on "shm"
  and on gloo: the parameters after the last step (max |shm - gloo|, and whether the ranks
  agree bitwise) and the median step time.

    python -m benchmarks.gpu_extras --out docs/results/gpu_extras.jsonl [--timeout 60]

Each measurement's ranks run under a deadline (--timeout seconds each; then they are
killed and an error record says so), and each record is written to --out as soon as it
exists, so a hang in one leaves the others' results.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

WS = 2
STEPS = 20


def _init(rank, backend, path):
    import torch.distributed as dist
    import shmcoll  # noqa: F401
    torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{path}", rank=rank, world_size=WS,
                            timeout=datetime.timedelta(seconds=300))
    return dist


def _enqueue(rank, path, out):
    dist = _init(rank, "shm", os.path.join(path, "rdv_enqueue"))
    t = torch.empty((256 << 20) // 4, device="cuda")
    host, dev = [], []
    for i in range(12):
        t.fill_(rank + 1.0)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        host.append(time.perf_counter() - t0)
        end.record()
        end.synchronize()
        dev.append(start.elapsed_time(end) / 1e3)
        assert float(t[-1].item()) == 3.0 and float(t[0].item()) == 3.0
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"record": "enqueue", "nbytes": 256 << 20, "world_size": WS,
                       "host_ms_median": statistics.median(host[2:]) * 1e3,
                       "device_ms_median": statistics.median(dev[2:]) * 1e3}, f)
    dist.destroy_process_group()


def _ddp(rank, backend, path, out):
    dist = _init(rank, backend, os.path.join(path, f"rdv_{backend}"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024),
                                                      torch.nn.GELU()) for _ in range(8)]).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator(device="cuda").manual_seed(1 + rank)
    times = []
    for _ in range(STEPS):
        x = torch.randn(64, 1024, device="cuda", generator=gen)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]).cpu()
    torch.save({"params": flat, "step_ms": statistics.median(times[3:]) * 1e3},
               os.path.join(path, f"{backend}_{rank}.pt"))
    dist.destroy_process_group()


def _spawn(fn, args, timeout_s):
    """Run fn(rank, *args) on WS spawned ranks; None, or why they failed / were killed."""
    ctx = mp.start_processes(fn, args=args, nprocs=WS, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                return f"ranks still running after {timeout_s:.0f} s: killed"
        return None
    except Exception as e:  # noqa: BLE001 - a rank raised: reported as a record
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e}"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_extras")
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds each measurement's ranks may run (default 120)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_extras: no CUDA device", file=sys.stderr)
        return 3
    path = tempfile.mkdtemp()
    bad = False
    with open(args.out, "w") as out:
        def emit(rec):
            out.write(json.dumps(rec) + "\n")
            out.flush()
            print(json.dumps(rec), flush=True)

        enq = os.path.join(path, "enqueue.json")
        err = _spawn(_enqueue, (path, enq), args.timeout)
        if err is None:
            with open(enq) as f:
                emit(json.load(f))
        else:
            bad = True
            emit({"record": "error", "what": "enqueue", "message": err})
        res = {}
        for backend in ("shm", "gloo"):
            err = _spawn(_ddp, (backend, path, None), args.timeout)
            if err is None:
                res[backend] = [torch.load(os.path.join(path, f"{backend}_{r}.pt"))
                                for r in range(WS)]
            else:
                bad = True
                emit({"record": "error", "what": f"ddp {backend}", "message": err})
        if len(res) == 2:
            shm, gloo = res["shm"], res["gloo"]
            rec = {"record": "ddp", "world_size": WS, "steps": STEPS,
                   "ranks_bitwise_equal": all(torch.equal(shm[0]["params"], r["params"])
                                              for r in shm),
                   "max_abs_diff_vs_gloo": float((shm[0]["params"] - gloo[0]["params"])
                                                 .abs().max()),
                   "step_ms_shm": max(r["step_ms"] for r in shm),
                   "step_ms_gloo": max(r["step_ms"] for r in gloo)}
            emit(rec)
            bad = bad or not rec["ranks_bitwise_equal"] or rec["max_abs_diff_vs_gloo"] > 1e-3
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
