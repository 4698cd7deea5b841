"""One node, A/B in one run: backend "shm" as the creator now builds it (node discovery,
then ProcessGroupShm when every rank is on one node) against "shm_direct", a creator that
builds ProcessGroupShm at once (what "shm" did before several nodes existed).

    python -m lab.one_node_ab                      # 2 and 4 ranks, 5 rounds
    python -m lab.one_node_ab --world-sizes 2 --rounds 9 \
        --out docs/results/one_node_ab.jsonl

The same processes alternate: init A, time, destroy, init B, time, destroy, ... (A/B order
flips every round, after one unreported warm-up of each). Reported per backend:
init_process_group wall time, and the median over rounds of the best block time per call
of dist.all_reduce at 8 B, 64 KiB and 1 MiB (float32, verified); then B/A ratios.
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

SIZES = (8, 64 << 10, 1 << 20)


def _create_direct(backend_opts, pg_options=None):
    from shmcoll.torch_backend import ProcessGroupShm, ShmOptions
    options = ShmOptions.coerce(pg_options)
    options.global_ranks_in_group = list(getattr(backend_opts, "global_ranks_in_group", []))
    return ProcessGroupShm(backend_opts.store, backend_opts.group_rank, backend_opts.group_size,
                           options, timeout=backend_opts.timeout,
                           group_name=str(backend_opts.group_id))


def _measure(rank, n, backend, path, calls, blocks):
    import torch
    import torch.distributed as dist
    t0 = time.perf_counter()
    dist.init_process_group(backend, init_method=f"file://{path}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=120))
    init_s = time.perf_counter() - t0
    out = {"init_s": init_s}
    for nbytes in SIZES:
        t = torch.empty(nbytes // 4)
        best = float("inf")
        for _ in range(blocks):
            dist.barrier()
            t1 = time.perf_counter()
            for _ in range(calls if nbytes < (1 << 20) else max(10, calls // 10)):
                t.fill_(1.0)
                dist.all_reduce(t)
            k = calls if nbytes < (1 << 20) else max(10, calls // 10)
            best = min(best, (time.perf_counter() - t1) / k)
            if float(t[0]) != n or float(t[-1]) != n:
                raise AssertionError(f"{backend}: wrong all_reduce result {float(t[0])}")
        out[str(nbytes)] = best * 1e6
    dist.destroy_process_group()
    return out


def _rank(rank, n, workdir, rounds, calls, blocks, queue):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    import shmcoll  # noqa: F401
    dist.Backend.register_backend("shm_direct", _create_direct, extended_api=True,
                                  devices=["cpu"])
    for backend in ("shm_direct", "shm"):  # warm-up (kernels, first init): not reported
        _measure(rank, n, backend, f"{workdir}/rdv-warm-{backend}", 10, 1)
    rows = []
    for r in range(rounds):
        for backend in (("shm_direct", "shm") if r % 2 == 0 else ("shm", "shm_direct")):
            res = _measure(rank, n, backend, f"{workdir}/rdv-{r}-{backend}", calls, blocks)
            rows.append(dict(res, backend=backend, round=r, world_size=n, rank=rank))
    queue.put(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lab.one_node_ab",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.pop("SHMCOLL_NODE_ID", None)
    every = []
    for n in (int(x) for x in args.world_sizes.split(",")):
        workdir = tempfile.mkdtemp(prefix="one_node_ab_")
        q = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, n, workdir, args.rounds, args.calls,
                                                 args.blocks, q)) for r in range(n)]
        for p in procs:
            p.start()
        rows = [row for _ in procs for row in q.get(timeout=1800)]
        for p in procs:
            p.join(60)
        every.extend(rows)
        print(f"\n{n} ranks, {args.rounds} rounds (median over rounds; per call, us; init ms)")
        print(f"{'metric':>10} | {'shm_direct':>10} | {'shm':>10} | shm / direct")
        for metric in ("init_s",) + tuple(str(s) for s in SIZES):
            vals = {}
            for b in ("shm_direct", "shm"):
                per_round = [max(x[metric] for x in rows if x["backend"] == b and
                                 x["round"] == r) for r in range(args.rounds)]
                vals[b] = statistics.median(per_round) * (1e3 if metric == "init_s" else 1)
            name = "init" if metric == "init_s" else f"{metric} B"
            print(f"{name:>10} | {vals['shm_direct']:10.1f} | {vals['shm']:10.1f} | "
                  f"{vals['shm'] / vals['shm_direct']:.3f}")
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in every))
    return 0


if __name__ == "__main__":
    sys.exit(main())
