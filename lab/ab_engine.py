"""Engine-level A/B of two versions of shmcoll in the same two rank processes, alternating
in blocks of calls, so both see the same machine moments (for kernel changes, on a
machine whose load moves).

    python -m lab.ab_engine --base 99d83ec                    # 8 B, 1 MiB, 16 MiB
    python -m lab.ab_engine --base 99d83ec --sizes 8,64K --blocks 40

The base revision is exported (git archive) and imported as package `shmcoll_ab_base`
(its torch registration skipped); this tree is `shmcoll`. Each rank makes one group per
version (own segments and rendezvous) and runs Group.all_reduce on float32 buffers
allocated by torch (on 4 KiB pages, as dist.all_reduce's tensors; the groups are told
so), verified after every block. Per size: the median over blocks of each version's
per-call time (a block: `--calls` calls, timed as a whole, slowest rank), their ratio
(B / A below 1: this tree is faster) and the share of blocks B won.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main"]

_HERE = Path(__file__).resolve().parent.parent


def _export(rev, into):
    archive = subprocess.run(["git", "-C", str(_HERE), "archive", rev, "shmcoll"],
                             check=True, capture_output=True).stdout
    unpack = Path(into) / "unpack"
    unpack.mkdir()
    subprocess.run(["tar", "-x", "-C", str(unpack)], input=archive, check=True)
    pkg = Path(into) / "shmcoll_ab_base"
    shutil.move(str(unpack / "shmcoll"), pkg)
    init = pkg / "__init__.py"
    init.write_text(init.read_text().replace("\n_register_torch_backend()\n", "\n"))
    return Path(into)


def _parse_size(text):
    mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1].upper(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


def _rank(rank, path, args, queue):
    sys.path.insert(0, path)
    import numpy as np
    import torch

    import shmcoll
    import shmcoll_ab_base
    torch.set_num_threads(1)
    groups = {}
    for name, mod in (("A", shmcoll_ab_base), ("B", shmcoll)):
        store = mod.FileStore(os.path.join(path, f"store-{name}"))
        groups[name] = mod.new_shm_group(store, rank, 2, small_pages=True)
    out = {}
    for nbytes in args.sizes:
        buf = torch.empty(nbytes // 4).numpy()
        for g in groups.values():  # compile / load, fill the caches, touch the pages
            buf[:] = 1.0
            for _ in range(3):
                g.all_reduce(buf)
        times = {"A": [], "B": []}
        for block in range(args.blocks):
            for name in ("A", "B") if block % 2 == 0 else ("B", "A"):
                g = groups[name]
                buf[:] = 1.0
                g.barrier()
                t = time.perf_counter()
                for _ in range(args.calls):
                    g.all_reduce(buf)
                times[name].append((time.perf_counter() - t) / args.calls)
                if buf[0] != 2.0 ** args.calls:
                    raise AssertionError(f"{name} {nbytes} B: got {buf[0]}")
        out[nbytes] = times
    for g in groups.values():
        g.close()
    queue.put((rank, out))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lab.ab_engine",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision (version A)")
    ap.add_argument("--sizes", default="8,1M,16M")
    ap.add_argument("--blocks", type=int, default=30, help="blocks per version and size")
    ap.add_argument("--calls", type=int, default=10, help="calls per block")
    args = ap.parse_args(argv)
    args.sizes = [_parse_size(s) for s in args.sizes.split(",")]
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="shmcoll-ab-engine-") as tmp:
        path = str(_export(args.base, tmp))
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, path, args, queue)) for r in range(2)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=3600) for _ in procs)
        for p in procs:
            p.join(60)
    print(f"A = {args.base}, B = this tree; {args.blocks} blocks of {args.calls} calls each, "
          f"alternating; slowest rank per block")
    print(f"{'bytes':>10} {'A us':>9} {'B us':>9} {'B/A':>6} {'B won':>6}")
    for nbytes in args.sizes:
        a = [max(x) for x in zip(*(results[r][nbytes]["A"] for r in results))]
        b = [max(x) for x in zip(*(results[r][nbytes]["B"] for r in results))]
        won = sum(y < x for x, y in zip(a, b)) / len(a)
        print(f"{nbytes:>10} {statistics.median(a) * 1e6:>9.2f} "
              f"{statistics.median(b) * 1e6:>9.2f} "
              f"{statistics.median(b) / statistics.median(a):>6.3f} {won:>6.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
