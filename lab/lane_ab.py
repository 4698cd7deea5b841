"""The compiled latency path against the Python one, through dist.*, in the same rank
processes: alternating blocks of calls on two "shm" groups of the same ranks, the default
group (the Lane, torch_backend/lane.py) and one made with SHMCOLL_LANE=0 (fast.py's
Python path). Every block's last result is checked.

    python -m lab.lane_ab                                  # 2 ranks, 64 KiB
    python -m lab.lane_ab --world-size 4 --sizes 8,64K,1M --blocks 6

Sizes are nccl-tests' (bytes of the all_reduce buffer; all_gather's output and
reduce_scatter's input; all_to_all's buffers). Prints, per op and size, the median
per-call time of each path, their ratio (lane / python: below 1, the lane is faster), the
blocks the lane won, and how the lane's calls ended (Lane.stats).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

from lab.ranks import run_ranks

__all__ = ["main"]

OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")


def _parse_size(text):
    mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1].upper(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


def _rank(rank, path, args):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    ws = args.world_size
    dist.init_process_group("shm", init_method=f"file://{path}/rendezvous", rank=rank,
                            world_size=ws)
    os.environ["SHMCOLL_LANE"] = "0"
    python_group = dist.new_group(list(range(ws)))
    del os.environ["SHMCOLL_LANE"]
    groups = {"lane": None, "python": python_group}
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    rows = []
    for nbytes in args.sizes:
        n = max(ws, nbytes // 4 // ws * ws)
        x, b = torch.ones(n), torch.empty(n)
        part, whole = torch.full((n // ws,), float(rank)), torch.empty(n)
        rs_in, rs_out = torch.ones(n), torch.empty(n // ws)
        a2a_in = torch.cat([torch.full((n // ws,), float(10 * rank + j)) for j in range(ws)])
        a2a_out = torch.empty(n)
        calls = {"all_reduce": lambda g: dist.all_reduce(x, group=g),
                 "broadcast": lambda g: dist.broadcast(b, 0, group=g),
                 "all_gather": lambda g: ag(whole, part, group=g),
                 "reduce_scatter": lambda g: rs(rs_out, rs_in, group=g),
                 "all_to_all": lambda g: dist.all_to_all_single(a2a_out, a2a_in, group=g)}

        def reset(op):
            x.fill_(1.0)
            b.fill_(3.0 if rank == 0 else -1.0)

        def check(op, k):
            if op == "all_reduce":
                ok = bool((x == torch.full((1,), float(ws)).pow(k)).all())  # float32
            elif op == "broadcast":
                ok = bool((b == 3.0).all())
            elif op == "all_gather":
                ok = all(bool((whole[j * (n // ws):(j + 1) * (n // ws)] == j).all())
                         for j in range(ws))
            elif op == "reduce_scatter":
                ok = bool((rs_out == float(ws)).all())
            else:
                ok = all(bool((a2a_out[j * (n // ws):(j + 1) * (n // ws)] == 10 * j + rank)
                              .all()) for j in range(ws))
            if not ok:
                raise AssertionError(f"rank {rank}: {op} of {nbytes} B: wrong result")

        for op in args.ops:
            for g in groups.values():
                reset(op)
                calls[op](g)  # arms the lane, plans the shape
            pg = dist.group.WORLD.made()
            stats0 = pg._lane.stats() if pg._lane is not None else {}
            times = {k: [] for k in groups}
            for block in range(args.blocks):
                for name in ("lane", "python") if block % 2 == 0 else ("python", "lane"):
                    reset(op)
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        calls[op](groups[name])
                    times[name].append((time.perf_counter() - t0) / args.calls * 1e6)
                    check(op, args.calls)
            stats = {k: v - stats0.get(k, 0) for k, v in pg._lane.stats().items()} \
                if pg._lane is not None else None
            rows.append((op, nbytes, times, stats))
    dist.destroy_process_group()
    return rows


def _worker(rank, path, args, queue):
    try:
        queue.put((rank, _rank(rank, path, args)))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        queue.put((rank, e))
        raise


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lab.lane_ab",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--sizes", default="64K")
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args(argv)
    args.ops = args.ops.split(",")
    args.sizes = [_parse_size(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as path:
        results = run_ranks(_worker, args.world_size, lambda r: (r, path, args))
    bad = [r for r in results.values() if isinstance(r, BaseException)]
    if bad:
        raise SystemExit(f"lane_ab: a rank failed: {bad[0]!r}")
    print(f"# lab.lane_ab, {args.world_size} ranks, {args.blocks} blocks of {args.calls} calls"
          f" per path; us per call through dist.*, slowest rank per block")
    print(f"{'op':15s} {'bytes':>9s} {'lane':>8s} {'python':>8s} {'lane/py':>8s} "
          f"{'won':>6s}  lane calls")
    per_rank = list(zip(*[results[r] for r in sorted(results)]))
    for rows in per_rank:
        op, nbytes, _, stats = rows[0]
        lane = [max(v) for v in zip(*[r[2]["lane"] for r in rows])]
        py = [max(v) for v in zip(*[r[2]["python"] for r in rows])]
        won = sum(a < b for a, b in zip(lane, py))
        ml, mp_ = statistics.median(lane), statistics.median(py)
        print(f"{op:15s} {nbytes:>9d} {ml:8.1f} {mp_:8.1f} {ml / mp_:8.2f} "
              f"{won:>3d}/{len(lane):<2d}  {stats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
