"""First-collective latency: cold (empty numba cache) against warm (cache filled).

    python -m benchmarks.first_call

Each case spawns 2 fresh ranks that time init_process_group("shm") and then the first
dist.all_reduce (float32 and bfloat16), verifying the result. Cold uses a fresh
NUMBA_CACHE_DIR, so every kernel compiles; warm reuses the cache the cold run filled.
"""

import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["main"]


def _rank(rank, world_size, init_file, queue):
    import shmcoll  # noqa: F401  (registers "shm")

    t0 = time.perf_counter()
    dist.init_process_group("shm", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    t1 = time.perf_counter()
    out = {"init_s": t1 - t0}
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.full((1024,), float(rank + 1), dtype=dtype)
        s = time.perf_counter()
        dist.all_reduce(t)
        out[f"first_{dtype}".replace("torch.", "")] = time.perf_counter() - s
        expected = world_size * (world_size + 1) / 2
        if not bool((t == expected).all()):
            raise AssertionError(f"rank {rank}: wrong result {t[:4]} (expected {expected})")
    s = time.perf_counter()
    dist.all_reduce(torch.ones(1024))
    out["second_float32"] = time.perf_counter() - s
    dist.destroy_process_group()
    queue.put((rank, out))


def _run(cache_dir):
    os.environ["NUMBA_CACHE_DIR"] = cache_dir
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init_file = tempfile.mktemp(prefix="shmcoll-first-call-")
    procs = [ctx.Process(target=_rank, args=(r, 2, init_file, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    return {k: max(r[k] for r in results.values()) for k in results[0]}


def main():
    cache_dir = tempfile.mkdtemp(prefix="shmcoll-numba-cache-")
    print("case   " + "  ".join(f"{k:>16}" for k in ("init_s", "first_float32",
                                                       "first_bfloat16", "second_float32")))
    for case in ("cold", "warm"):
        r = _run(cache_dir)
        print(f"{case:6} " + "  ".join(f"{r[k] * 1e3:13.1f} ms" for k in
                                      ("init_s", "first_float32", "first_bfloat16",
                                       "second_float32")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
