"""Engine-level all_to_all_single of equal blocks, by transport: what decided that the
messages ride with the size table up to a slot and single copy takes over above it
(algorithms/all_to_all.py; docs/notes/2026-11-29-all-to-all.md).

    python -m lab.all_to_all_transport --world-size 2 --sizes 1M,4M,16M
    python -m lab.all_to_all_transport --variants slot512k,default --buffers numpy

Variants, run one after the other in fresh rank processes (repeat them in the list to
alternate): `default` (the shipped choice), `slot512k` (a 512 KiB slot, so that from
1 MiB nothing rides: single copy), `nosc` (SHMCOLL_SINGLE_COPY=off: above a slot the
chunked slot steps). Buffers come from torch (4 KiB pages, as dist.*'s tensors; the group
is told so) or numpy. Sizes are each rank's input; every block is checked after the
timed calls. Prints per variant and size the median over 5 blocks of the per-call time
of the slowest rank.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

from benchmarks.sizes import parse_size
from lab.ranks import run_ranks

__all__ = ["main"]

_ENV = {"default": {}, "slot512k": {"SHMCOLL_SLOT_BYTES": str(512 << 10)},
        "nosc": {"SHMCOLL_SINGLE_COPY": "off"}}


def _rank(rank, world, path, sizes, variant, buffers, queue):
    os.environ.update(_ENV[variant])
    import numpy as np
    import torch

    import shmcoll
    torch.set_num_threads(1)
    group = shmcoll.new_shm_group(shmcoll.FileStore(path), rank, world,
                                  small_pages=buffers == "torch")
    out = {}
    for nbytes in sizes:
        if buffers == "torch":
            src, dst = torch.empty(nbytes // 4).numpy(), torch.empty(nbytes // 4).numpy()
        else:
            src, dst = np.empty(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
        block = src.size // world
        for j in range(world):
            src[j * block:(j + 1) * block] = 100 * rank + j
        iters = max(5, min(200, (64 << 20) // nbytes))
        for _ in range(3):
            group.all_to_all_single(dst, src)
        times = []
        for _ in range(5):
            group.barrier()
            t = time.perf_counter()
            for _ in range(iters):
                group.all_to_all_single(dst, src)
            times.append((time.perf_counter() - t) / iters)
        for j in range(world):
            if not (dst[j * block:(j + 1) * block] == 100 * j + rank).all():
                raise AssertionError(f"{variant} {nbytes} B: wrong block from rank {j}")
        out[nbytes] = statistics.median(times)
    group.close()
    queue.put((rank, out))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lab.all_to_all_transport",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--sizes", default="1M,2M,4M,16M")
    ap.add_argument("--variants", default="default,slot512k,nosc,default,slot512k,nosc")
    ap.add_argument("--buffers", choices=("torch", "numpy"), default="torch")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    for variant in args.variants.split(","):
        if variant not in _ENV:
            ap.error(f"unknown variant {variant!r} (known: {sorted(_ENV)})")
        with tempfile.TemporaryDirectory(prefix="shmcoll-a2a-lab-") as tmp:
            results = run_ranks(_rank, args.world_size, lambda r: (
                r, args.world_size, tmp + "/store", sizes, variant, args.buffers))
        row = "  ".join(f"{n >> 10}K {max(r[n] for r in results.values()) * 1e6:.0f} us"
                        for n in sizes)
        print(f"{variant:<9} {row}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
