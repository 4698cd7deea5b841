"""Engine-level A/B of two versions of shmcoll in the same two rank processes, alternating
in blocks of calls, so both see the same machine moments (for kernel changes, on a
machine whose load moves).

    python -m lab.ab_engine --base 99d83ec                    # 8 B, 1 MiB, 16 MiB
    python -m lab.ab_engine --base 99d83ec --sizes 8,64K --blocks 40
    python -m lab.ab_engine --base 7f0a641 --ops broadcast,all_gather --sizes 64K,1M

The base revision is exported (git archive) and imported as package `shmcoll_ab_base`
(its torch registration skipped); this tree is `shmcoll`. Each rank makes one group per
version (own segments and rendezvous) and runs, per op of `--ops`, Group.all_reduce,
Group.broadcast (root 0), Group.all_gather (into one array, all_gather_into_tensor's
form), Group.all_to_all (the list form: equal pieces, views of one input and one output
array) or Group.all_to_all_single (one input and one output array, equal pieces, as the
adapter passes dist.all_to_all_single's tensors) on float32 buffers allocated by torch (on 4 KiB pages, as dist.*'s tensors; the
groups are told so), verified after every block. Sizes are per rank (all_gather: the
input). Per op and size: the median over blocks of each version's per-call time (a block:
`--calls` calls, timed as a whole, slowest rank), their ratio (B / A below 1: this tree is
faster) and the share of blocks B won.
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

from lab.ranks import run_ranks

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
    import torch

    import shmcoll
    import shmcoll_ab_base
    torch.set_num_threads(1)
    groups = {}
    for name, mod in (("A", shmcoll_ab_base), ("B", shmcoll)):
        store = mod.FileStore(os.path.join(path, f"store-{name}"))
        groups[name] = mod.new_shm_group(store, rank, 2, small_pages=True)
    out = {}
    for op in args.ops:
        for nbytes in args.sizes:
            out[op, nbytes] = _op_times(op, nbytes, rank, groups, args, torch)
    for g in groups.values():
        g.close()
    queue.put((rank, out))


def _op_times(op, nbytes, rank, groups, args, torch):
    """{"A": [...], "B": [...]}: per-call seconds of each block of `op` at `nbytes`."""
    buf = torch.empty(nbytes // 4).numpy()
    outs = torch.empty(2 * buf.size).numpy() if op == "all_gather" else \
        torch.empty(buf.size).numpy() if op.startswith("all_to_all") else None
    half = buf.size // 2

    def fill():
        buf[:] = 1.0 if op == "all_reduce" else (rank + 1 if op == "all_gather" else
                                                  (3.0 if rank == 0 else 0.0))
        if op.startswith("all_to_all"):  # rank r's piece for rank j: 10 r + j
            buf[:half], buf[half:] = 10.0 * rank, 10.0 * rank + 1
        if outs is not None:
            outs[:] = -1.0

    def call(g):
        if op == "all_reduce":
            g.all_reduce(buf)
        elif op == "broadcast":
            g.broadcast(buf, 0)
        elif op == "all_gather":
            g.all_gather(outs, buf)
        elif op == "all_to_all":
            g.all_to_all([outs[:half], outs[half:]], [buf[:half], buf[half:]])
        else:
            g.all_to_all_single(outs, buf)

    def check(name):
        if op == "all_reduce":
            ok = buf[0] == 2.0 ** args.calls and buf[-1] == buf[0]
        elif op == "broadcast":
            ok = bool((buf == 3.0).all())
        elif op == "all_gather":
            ok = bool((outs[:buf.size] == 1.0).all() and (outs[buf.size:] == 2.0).all())
        else:
            ok = bool((outs[:half] == rank).all() and (outs[half:] == 10.0 + rank).all())
        if not ok:
            raise AssertionError(f"{name} {op} {nbytes} B: wrong result")

    for g in groups.values():  # compile / load, fill the caches, touch the pages
        fill()
        for _ in range(3):
            call(g)
    times = {"A": [], "B": []}
    for block in range(args.blocks):
        for name in ("A", "B") if block % 2 == 0 else ("B", "A"):
            g = groups[name]
            fill()
            g.barrier()
            t = time.perf_counter()
            for _ in range(args.calls):
                call(g)
            times[name].append((time.perf_counter() - t) / args.calls)
            check(name)
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lab.ab_engine",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision (version A)")
    ap.add_argument("--ops", default="all_reduce",
                    help="comma list of all_reduce, broadcast, all_gather, all_to_all, "
                         "all_to_all_single")
    ap.add_argument("--sizes", default="8,1M,16M")
    ap.add_argument("--blocks", type=int, default=30, help="blocks per version and size")
    ap.add_argument("--calls", type=int, default=10, help="calls per block")
    args = ap.parse_args(argv)
    args.sizes = [_parse_size(s) for s in args.sizes.split(",")]
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = set(args.ops) - {"all_reduce", "broadcast", "all_gather", "all_to_all",
                           "all_to_all_single"}
    if bad:
        ap.error(f"unknown ops {sorted(bad)}")
    with tempfile.TemporaryDirectory(prefix="shmcoll-ab-engine-") as tmp:
        path = str(_export(args.base, tmp))
        results = run_ranks(_rank, 2, lambda r: (r, path, args), timeout_s=3600)
    print(f"A = {args.base}, B = this tree; {args.blocks} blocks of {args.calls} calls each, "
          f"alternating; slowest rank per block")
    print(f"{'op':<11} {'bytes':>10} {'A us':>9} {'B us':>9} {'B/A':>6} {'B won':>6}")
    for key in results[0]:
        op, nbytes = key
        a = [max(x) for x in zip(*(results[r][key]["A"] for r in results))]
        b = [max(x) for x in zip(*(results[r][key]["B"] for r in results))]
        won = sum(y < x for x, y in zip(a, b)) / len(a)
        print(f"{op:<11} {nbytes:>10} {statistics.median(a) * 1e6:>9.2f} "
              f"{statistics.median(b) * 1e6:>9.2f} "
              f"{statistics.median(b) / statistics.median(a):>6.3f} {won:>6.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
