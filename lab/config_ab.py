"""Engine-level A/B of group configurations (SHMCOLL_* settings) in the same rank processes,
alternating in blocks of calls, so every configuration meets the same machine moments.

    python -m lab.config_ab --op all_gather --sizes 1M,8M,32M -- - SHMCOLL_SINGLE_COPY=always
    python -m lab.config_ab --op all_reduce --world-size 4 --sizes 1M \\
        -- - SHMCOLL_DIRECT_MAX_BYTES=99999999 SHMCOLL_SINGLE_COPY=always

Each configuration after `--` is a comma list of NAME=VALUE (`-`: the defaults); each rank
makes one group per configuration (the settings apply while it is made, config.from_env).
Per size, blocks of calls run configuration by configuration (the order reverses every
block); each block is timed as a whole after a barrier and verified after. Printed: the
median over blocks of the slowest rank's per-call time, and its ratio to the first
configuration. Sizes are per rank (all_gather: the input; all_to_all: all_to_all_single's
input, world_size equal pieces). Buffers are torch tensors (4 KiB
pages; the groups are told so) or, with --numpy, numpy arrays (huge pages from 4 MiB).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from unittest import mock

from benchmarks.sizes import parse_size
from lab.ranks import run_ranks

__all__ = ["main"]

OPS = ("all_reduce", "all_gather", "broadcast", "all_to_all")


def _configs(texts):
    out = []
    for text in texts:
        out.append({} if text == "-" else dict(kv.split("=", 1) for kv in text.split(",")))
    return out


def _rank(rank, world, store_dir, args, configs, queue):
    import numpy as np
    import torch

    import shmcoll
    from shmcoll import config
    from shmcoll.native.ops import ReduceOp
    from shmcoll.shm.factory import new_shm_group
    from shmcoll.torch_backend.convert import plain_array
    torch.set_num_threads(1)
    store = shmcoll.FileStore(os.path.join(store_dir, "store"))
    groups = []
    for k, env in enumerate(configs):
        with mock.patch.dict(os.environ, env):
            groups.append(new_shm_group(store, rank, world, cfg=config.from_env(), name=f"c{k}",
                                        small_pages=not args.numpy))
    rows, keep = {}, []
    for nbytes in args.sizes:
        count = max(1, nbytes // 4)
        if args.numpy:
            inp = np.full(count, rank + 1.0, np.float32)
            out = np.empty(count * world, np.float32)
        else:  # the arrays view the tensors' memory: keep the tensors alive
            keep += [torch.full((count,), rank + 1.0), torch.empty(count * world)]
            inp, out = plain_array(keep[-2]), plain_array(keep[-1])
        gathered = np.repeat(np.arange(1, world + 1, dtype=np.float32), count)
        if args.op == "all_to_all":  # rank r's piece for rank j: 10 r + j
            count -= count % world
            piece = count // world
            inp, out = inp[:count], out[:count]
            inp[:] = np.repeat(10.0 * rank + np.arange(world, dtype=np.float32), piece)
            exchanged = np.repeat(10.0 * np.arange(world, dtype=np.float32) + rank, piece)
        calls = max(5, min(200, (32 << 20) // (nbytes * world)))
        times = [[] for _ in groups]
        order = list(range(len(groups)))
        for block in range(args.blocks):
            for k in order if block % 2 == 0 else order[::-1]:
                g = groups[k]
                g.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    if args.op == "all_reduce":
                        inp[:] = rank + 1
                        g.all_reduce(inp, ReduceOp.SUM)
                    elif args.op == "all_gather":
                        g.all_gather(out, inp)
                    elif args.op == "all_to_all":
                        g.all_to_all_single(out, inp)
                    else:
                        inp[:] = 7.0 if rank == 0 else 0.0
                        g.broadcast(inp, 0)
                times[k].append((time.perf_counter() - t0) / calls * 1e6)
                if args.op == "all_reduce":
                    ok = bool((inp == world * (world + 1) / 2).all())
                elif args.op == "all_gather":
                    ok = bool((out == gathered).all())
                elif args.op == "all_to_all":
                    ok = bool((out == exchanged).all())
                else:
                    ok = bool((inp == 7.0).all())
                if not ok:
                    raise AssertionError(f"rank {rank}: wrong {args.op} result, configuration "
                                         f"{k}, {nbytes} bytes")
        rows[nbytes] = [statistics.median(t) for t in times]
    for g in groups:
        g.close()
    queue.put((rank, rows))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("give the configurations after --  (for example: -- - NAME=VALUE)")
    cut = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", choices=OPS, default="all_reduce")
    p.add_argument("--sizes", default="64K,1M,16M")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--numpy", action="store_true")
    args = p.parse_args(argv[:cut])
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    texts = argv[cut + 1:]
    configs = _configs(texts)
    with tempfile.TemporaryDirectory() as store_dir:
        results = run_ranks(_rank, args.world_size, lambda r: (
            r, args.world_size, store_dir, args, configs))
    print(f"{args.op}, {args.world_size} ranks, {'numpy' if args.numpy else 'torch'} buffers, "
          f"{args.blocks} blocks; us per call (ratio to the first configuration)")
    for nbytes in args.sizes:
        ts = [max(results[r][nbytes][k] for r in results) for k in range(len(configs))]
        print(f"{nbytes:>10d} B  " + "  ".join(f"{texts[k]}: {t:9.1f} ({t / ts[0]:.2f})"
                                                for k, t in enumerate(ts)))


if __name__ == "__main__":
    main()
