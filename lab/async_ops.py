"""Per-call time of asynchronous collectives through dist.* (async_op=True, then a wait),
against the synchronous call, on one backend: the executor's path (a Work, its job, the
worker thread), which the synchronous latency path skips.

    python -m lab.async_ops                          # "shm", 2 ranks
    python -m lab.async_ops --world-size 4 --backend gloo
    cd /tmp && PYTHONPATH=/tmp/base:/work/main python -m lab.async_ops   # another tree's
        # shmcoll (git archive into /tmp/base); not from the repository root, whose own
        # shmcoll would come first on the path

Rows: a synchronous all_reduce of 64 B; async all_reduce of 64 B and 1 MiB and async
all_gather_into_tensor of 64 KiB per rank, each waited right away (Work.wait); four async
all_reduces, then their waits; an async all_reduce waited through its future
(get_future().wait(): torch's C++ wait, which only the worker can serve). Results are
checked after every block. Median over blocks of 20 calls, slowest rank per block, us.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

from lab.ranks import run_ranks

__all__ = ["main"]


def _rank(rank, world, backend, path, rounds, queue):
    import torch
    import torch.distributed as dist

    import shmcoll  # noqa: F401 - registers "shm"
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method="file://" + os.path.join(path, "store"),
                            rank=rank, world_size=world)
    small, big = torch.ones(16), torch.ones(1 << 18)
    ag_in = torch.full((1 << 14,), float(rank))
    ag_out = torch.empty(ag_in.numel() * world)

    def four():
        ts = [torch.ones(16) for _ in range(4)]
        works = [dist.all_reduce(t, async_op=True) for t in ts]
        for w in works:
            w.wait()
        assert all(t[0].item() == world for t in ts)

    rows = {
        "sync all_reduce 64 B": lambda: dist.all_reduce(small),
        "async all_reduce 64 B + wait": lambda: dist.all_reduce(small, async_op=True).wait(),
        "async all_reduce 1 MiB + wait": lambda: dist.all_reduce(big, async_op=True).wait(),
        "async all_gather 64 KiB + wait": lambda: dist.all_gather_into_tensor(
            ag_out, ag_in, async_op=True).wait(),
        "4 async all_reduce, then waits": four,
        "async all_reduce, future.wait": lambda: dist.all_reduce(
            small, async_op=True).get_future().wait(),
    }
    times = {}
    for _ in range(rounds):
        for name, call in rows.items():
            for _ in range(5):
                call()
            for _ in range(15):
                small.fill_(1.0)
                big.fill_(1.0)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(20):
                    call()
                times.setdefault(name, []).append((time.perf_counter() - t0) / 20)
            if name == "async all_gather 64 KiB + wait":
                want = torch.arange(world, dtype=torch.float32).repeat_interleave(ag_in.numel())
                assert torch.equal(ag_out, want), "all_gather: wrong result"
            elif name != "4 async all_reduce, then waits":  # (checked in four())
                t = big if "1 MiB" in name else small  # 20 sums of ones: world ** 20, exact
                assert bool((t == float(world) ** 20).all()), f"{name}: wrong result"
    dist.destroy_process_group()
    queue.put((rank, times))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lab.async_ops",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="shm")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="shmcoll-async-ops-") as tmp:
        results = run_ranks(_rank, args.world_size, lambda r: (
            r, args.world_size, args.backend, tmp, args.rounds))
    print(f"backend {args.backend}, {args.world_size} ranks; median of blocks of 20 calls "
          f"(slowest rank), us")
    for name in results[0]:
        per_block = [max(x) for x in zip(*(results[r][name] for r in results))]
        print(f"{name:<34} {statistics.median(per_block) * 1e6:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
