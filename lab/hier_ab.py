"""Fine-grained A/B of hierarchical "shm" variants on namespaced hosts (benchmarks/hosts.py),
for tuning: every variant is a process group of the same ranks, created with its own
SHMCOLL_* settings, and the variants take turns block by block (so load swings hit all of
them alike). Results are verified.

    python -m lab.hier_ab --op all_reduce --sizes 64K,1M,16M \\
        --variant leaders:SHMCOLL_HIER_SHARD_MIN_BYTES=1073741824 \\
        --variant sharded:SHMCOLL_HIER_SHARD_MIN_BYTES=0 --variant gloo:gloo

A variant is NAME:ENV=VALUE[;ENV=VALUE...] (a "shm" group) or NAME:gloo (a gloo group).
Reported: per variant and size, the median over blocks of the mean time per call (us),
and each variant's time over the first one's.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _worker(cfg_path):
    import torch
    import torch.distributed as dist

    from shmcoll.torch_backend import HierProcessGroup  # noqa: F401  (registers "shm")
    cfg = json.loads(Path(cfg_path).read_text())
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=600)
    dist.init_process_group("gloo", timeout=timeout)
    rank, n = dist.get_rank(), dist.get_world_size()
    groups = {}
    for name, spec in cfg["variants"]:
        if spec == "gloo":
            groups[name] = dist.new_group(backend="gloo", timeout=timeout)
            continue
        saved = dict(os.environ)
        os.environ.update(dict(kv.split("=", 1) for kv in spec.split(";") if kv))
        try:
            groups[name] = dist.new_group(backend="shm", timeout=timeout)
        finally:
            os.environ.clear()
            os.environ.update(saved)
    results = {}
    for nbytes in cfg["sizes"]:
        count = max(1, nbytes // 4)
        t = torch.empty(count)
        out = torch.empty(count * n)
        times = {name: [] for name in groups}
        calls = max(3, min(cfg["calls"], (64 << 20) // max(nbytes, 1)))
        for block in range(cfg["blocks"]):
            order = list(groups) if block % 2 == 0 else list(groups)[::-1]
            for name in order:
                g = groups[name]
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    if cfg["op"] == "all_reduce":
                        t.fill_(1.0)
                        dist.all_reduce(t, group=g)
                    else:
                        t.fill_(float(rank))
                        dist.all_gather_into_tensor(out, t, group=g)
                times[name].append((time.perf_counter() - t0) / calls * 1e6)
                ok = bool(torch.all(t == n)) if cfg["op"] == "all_reduce" else \
                    bool(torch.equal(out.view(n, -1)[:, 0], torch.arange(n, dtype=out.dtype)))
                if not ok:
                    raise AssertionError(f"{name}: wrong {cfg['op']} result at {nbytes} B")
        results[nbytes] = {k: statistics.median(v) for k, v in times.items()}
    if rank == 0:
        Path(cfg["out"]).write_text(json.dumps(results))
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lab.hier_ab",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--ranks-per-host", type=int, default=2)
    ap.add_argument("--op", default="all_reduce", choices=("all_reduce", "all_gather"))
    ap.add_argument("--sizes", default="8,64K,1M,16M")
    ap.add_argument("--variant", action="append", default=[])
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args.worker)
    from benchmarks.bench import parse_size
    from benchmarks.hosts import Hosts
    ok, why = Hosts.available()
    if not ok:
        print(f"hier_ab: namespaced hosts unavailable: {why}", file=sys.stderr)
        return 3
    variants = [v.split(":", 1) for v in args.variant] or [["shm", ""], ["gloo", "gloo"]]
    work = Path(tempfile.mkdtemp(prefix="hier_ab_"))
    cfg = {"variants": variants, "op": args.op, "blocks": args.blocks, "calls": args.calls,
           "sizes": [parse_size(s) for s in args.sizes.split(",")], "out": str(work / "out")}
    (work / "cfg.json").write_text(json.dumps(cfg))
    with Hosts(args.hosts) as hosts:
        procs = hosts.torchrun(args.ranks_per_host, ["-m", "lab.hier_ab", "--worker",
                                                     str(work / "cfg.json")], cwd=REPO)
        codes = [p.wait(3600) for p in procs]
    if any(codes):
        print(f"hier_ab: torchrun exit codes {codes}", file=sys.stderr)
        return 1
    results = json.loads((work / "out").read_text())
    names = [v[0] for v in variants]
    print(f"{args.op}, {args.hosts} hosts x {args.ranks_per_host} ranks, load "
          f"{os.getloadavg()[0]:.1f}; us per call (median over {args.blocks} blocks)")
    print(f"{'bytes':>10} | " + " | ".join(f"{n:>12}" for n in names) + " | ratios to "
          + names[0])
    for nbytes, row in results.items():
        base = row[names[0]]
        print(f"{nbytes:>10} | " + " | ".join(f"{row[n]:12.1f}" for n in names) + " | " +
              " ".join(f"{row[n] / base:.2f}" for n in names[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
