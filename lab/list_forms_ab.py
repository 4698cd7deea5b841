"""The list forms (dist.all_gather into a list, dist.reduce_scatter of a list) with and
without their latency path and staging, in the same rank processes, alternating blocks:

    python -m lab.list_forms_ab                          # 2 ranks, 64 B .. 1 MiB per rank
    python -m lab.list_forms_ab --world-size 4 --sizes 64,64K

"old" turns off what 2026-11-28's change added: fast.all_gather_inline and
fast.reduce_scatter_inline (the adapter's general path runs instead) and the engine's staging
(algorithms.LIST_STAGED_MAX_NBYTES = -1: the list steps at every size). The tensor
forms (all_gather_into_tensor, reduce_scatter_tensor) run beside them as the reference.
Times are us per call, medians over blocks; every block's last result is checked.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

from benchmarks.sizes import parse_size

__all__ = ["main"]


def _variant(new, shipped):
    """Install the new variant (`shipped`: the limit and the two inline functions as the
    package has them) or the old one."""
    from shmcoll import algorithms
    from shmcoll.torch_backend import movement, reductions
    limit, inline_ag, inline_rs = shipped
    algorithms.LIST_STAGED_MAX_NBYTES = limit if new else -1
    movement.all_gather_inline = inline_ag if new else (lambda *a: None)
    reductions.reduce_scatter_inline = inline_rs if new else (lambda *a: None)


def _rank(rank, world, store, sizes, blocks, queue):
    import torch
    import torch.distributed as dist
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("shm", init_method=f"file://{store}", rank=rank, world_size=world)
    from shmcoll import algorithms
    from shmcoll.torch_backend import movement, reductions
    shipped = (algorithms.LIST_STAGED_MAX_NBYTES, movement.all_gather_inline,
               reductions.reduce_scatter_inline)
    rows = {}
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        t = torch.full((n,), float(rank + 1))
        outs = [torch.empty(n) for _ in range(world)]
        big = torch.empty(n * world)
        ins = [torch.full((n,), float(rank + 1)) for _ in range(world)]
        out = torch.empty(n)
        calls = {
            "all_gather list": lambda: dist.all_gather(outs, t),
            "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(big, t),
            "reduce_scatter list": lambda: dist.reduce_scatter(out, ins),
            "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(out, big),
        }
        iters = max(3, min(200, (32 << 20) // (n * 4 * world)))
        for block in range(blocks):
            order = ("new", "old") if block % 2 else ("old", "new")
            for variant in order:
                _variant(variant == "new", shipped)
                for name, call in calls.items():
                    if name.endswith("tensor") and variant == "old":
                        continue  # unchanged: once per block
                    call()
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        call()
                    key = (nbytes, name, "" if name.endswith("tensor") else variant)
                    rows.setdefault(key, []).append((time.perf_counter() - t0) / iters * 1e6)
                    _check(name, outs, out, world, n)
        _variant(True, shipped)
    if rank == 0:
        queue.put({k: statistics.median(v) for k, v in rows.items()})
    dist.destroy_process_group()


def _check(name, outs, out, world, n):
    import torch
    if name == "all_gather list":
        want = [torch.full((n,), float(r + 1)) for r in range(world)]
        if not all(torch.equal(o, w) for o, w in zip(outs, want)):
            raise AssertionError(f"{name}: wrong result")
    elif name == "reduce_scatter list":
        if not torch.equal(out, torch.full((n,), float(world * (world + 1) // 2))):
            raise AssertionError(f"{name}: wrong result")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--sizes", default="64,4K,64K,256K,1M", help="bytes per rank")
    ap.add_argument("--blocks", type=int, default=10)
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, args.world_size, os.path.join(tmp, "s"),
                                                 sizes, args.blocks, queue))
                 for r in range(args.world_size)]
        for p in procs:
            p.start()
        rows = queue.get(timeout=1800)
        for p in procs:
            p.join(60)
    print(f"{args.world_size} ranks, us per call (medians of {args.blocks} blocks)")
    print(f"{'bytes':>9} {'collective':24} {'new':>9} {'old':>9} {'new/old':>8} "
          f"{'tensor form':>12}")
    for nbytes in sizes:
        for name, ref in (("all_gather list", "all_gather_into_tensor"),
                          ("reduce_scatter list", "reduce_scatter_tensor")):
            new, old = rows[(nbytes, name, "new")], rows[(nbytes, name, "old")]
            print(f"{nbytes:>9} {name:24} {new:9.1f} {old:9.1f} {new / old:8.2f} "
                  f"{rows[(nbytes, ref, '')]:12.1f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
