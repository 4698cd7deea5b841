"""Several nodes: backend "shm" (shared memory inside each node, gloo between nodes) against
plain gloo over the same ranks, on namespaced hosts of this machine (benchmarks/hosts.py:
private /dev/shm, hostname and network per host; needs root), every result verified.

    python -m benchmarks.hier_bench                               # 2 hosts x 2 ranks
    python -m benchmarks.hier_bench --hosts 2 --ranks-per-host 2 --ops all_reduce,all_gather \\
        --sizes 8,64,512,4K,32K,64K,256K,1M,4M,16M,64M,256M --rounds 3 \\
        --out docs/results/hier.jsonl
    python -m benchmarks.hier_bench --load docs/results/hier.jsonl   # the tables again

One torchrun per host and backend (`--nnodes H --node-rank k`, rendezvous on host 0), the
backends alternating within each round; every row is the round with the median time. The
timing loop and the checks are benchmarks.bench's (`_bench_one`: warm-up, verify, time,
verify again; a wrong element fails the run). Rows: JSON lines as benchmarks.bench writes
them, plus "hosts", "ranks_per_host" and "round".
"""

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

DEFAULT_SIZES = "8,64,512,4K,32K,64K,256K,1M,4M,16M,64M,256M"


def _worker(cfg_path):
    """One rank (torchrun runs this on every host): the sweep, rows from rank 0."""
    import torch
    import torch.distributed as dist

    from benchmarks import collectives
    from benchmarks.bench import _bench_one, make_row, plan_iterations

    warnings.filterwarnings("ignore", category=FutureWarning)
    cfg = json.loads(Path(cfg_path).read_text())
    torch.set_num_threads(1)
    import shmcoll  # noqa: F401  (registers "shm")
    timeout = datetime.timedelta(seconds=cfg["timeout_s"])
    dist.init_process_group(cfg["backend"], timeout=timeout)
    rank, n = dist.get_rank(), dist.get_world_size()
    meta = dist.new_group(backend="gloo", timeout=timeout)  # bookkeeping, never timed
    dtype = collectives.DTYPES["float32"]
    rows = []
    for op_idx, op in enumerate(cfg["ops"]):
        spec = collectives.get(op)
        for size_idx, req in enumerate(cfg["sizes"]):
            count = spec.count_for(req, 4, n)
            nbytes = spec.nbytes_for(count, 4)
            warm, iters = plan_iterations(nbytes, cfg["iters"], cfg["warmup"],
                                          cfg["iter_bytes"], 3)
            res = _bench_one(spec, dist, rank, n, count, dtype, 17 + op_idx * 100 + size_idx,
                             warm, iters, {"inject_error": False, "root": 0,
                                           "check_all": False})
            if res["error"] is not None:
                raise RuntimeError(f"{op} {nbytes} B: {res['error']}")
            vec = torch.tensor([res["median_ns"], res["min_ns"], float(res["wrong"])],
                               dtype=torch.float64)
            allv = torch.empty(3 * n, dtype=torch.float64)
            dist.all_gather_into_tensor(allv, vec, group=meta)
            allv = allv.view(n, 3)
            row = make_row(cfg["backend"], spec, n, nbytes, count, "float32", iters, warm,
                           allv[:, 0].tolist(), allv[:, 1].tolist(), int(allv[:, 2].sum()))
            row.update(hosts=cfg["hosts"], ranks_per_host=cfg["ranks_per_host"],
                       round=cfg["round"])
            rows.append(row)
            if rank == 0:
                print(f"{cfg['backend']:5s} {op:11s} {nbytes:>11d} B {row['time_us']:12.1f} us"
                      f"{'  WRONG' if row['wrong'] else ''}", file=sys.stderr, flush=True)
    if rank == 0:
        Path(cfg["out"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    dist.destroy_process_group()


def _run_backend(hosts, backend, args, round_, workdir):
    """One torchrun per host for `backend`; -> its rows."""
    out = Path(workdir) / f"{backend}-{round_}.jsonl"
    cfg = dict(backend=backend, ops=args.ops, sizes=args.sizes, iters=args.iters,
               warmup=args.warmup, iter_bytes=args.iter_bytes, timeout_s=args.timeout,
               hosts=args.hosts, ranks_per_host=args.ranks_per_host, round=round_,
               out=str(out))
    cfg_path = Path(workdir) / f"cfg-{backend}-{round_}.json"
    cfg_path.write_text(json.dumps(cfg))
    logs = [Path(workdir) / f"{backend}-{round_}-host{k}.log" for k in range(args.hosts)]
    procs = hosts.torchrun(args.ranks_per_host, ["-m", "benchmarks.hier_bench", "--worker",
                                                 str(cfg_path)], logs=logs, cwd=REPO)
    deadline = time.monotonic() + args.timeout
    codes = [p.wait(max(1.0, deadline - time.monotonic())) for p in procs]
    if any(codes) or not out.exists():
        tails = "".join(log.read_text(errors="replace")[-3000:] for log in logs)
        raise RuntimeError(f"{backend} round {round_}: torchrun exit codes {codes}\n{tails}")
    return [json.loads(line) for line in out.read_text().splitlines()]


def median_rows(rows):
    """Per (backend, op, nbytes): the row of the round with the median time."""
    groups = {}
    for r in rows:
        groups.setdefault((r["backend"], r["op"], r["nbytes"]), []).append(r)
    picked = {}
    for key, rs in groups.items():
        rs = sorted(rs, key=lambda r: r["time_us"])
        pick = dict(rs[(len(rs) - 1) // 2])
        pick["rounds_us"] = [round(r["time_us"], 1) for r in sorted(rs, key=lambda r: r["round"])]
        pick["wrong"] = max(r["wrong"] for r in rs)
        picked[key] = pick
    return picked


def table(rows, a="shm", b="gloo"):
    picked = median_rows(rows)
    lines = []
    for op in sorted({k[1] for k in picked}):
        lines.append(f"\n{op} (median round; us per call; busbw GB/s)")
        lines.append(f"{'bytes':>11} | {a + ' us':>11} | {b + ' us':>11} | {b}/{a} | "
                     f"{a} busbw | {b} busbw | rounds {a} / {b}")
        for nbytes in sorted({k[2] for k in picked if k[1] == op}):
            ra, rb = picked.get((a, op, nbytes)), picked.get((b, op, nbytes))
            if ra is None or rb is None:
                continue
            flag = "  WRONG" if ra["wrong"] or rb["wrong"] else ""
            lines.append(f"{nbytes:>11} | {ra['time_us']:11.1f} | {rb['time_us']:11.1f} | "
                         f"{rb['time_us'] / ra['time_us']:5.2f}x | {ra['busbw_GBps']:9.3f} | "
                         f"{rb['busbw_GBps']:10.3f} | {ra['rounds_us']} / "
                         f"{rb['rounds_us']}{flag}")
    return "\n".join(lines)


def _sizes(text):
    from benchmarks.bench import parse_size
    return [parse_size(s) for s in text.split(",") if s]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.hier_bench",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--ranks-per-host", type=int, default=2)
    ap.add_argument("--backends", default="shm,gloo")
    ap.add_argument("--ops", default="all_reduce,all_gather")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="comma list, K/M/G suffixes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", "--iters", type=int, default=50)
    ap.add_argument("-w", "--warmup", type=int, default=5)
    ap.add_argument("--iter-bytes", default="1G", help="caps iters x bytes per size")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--out", help="JSON lines (a header, then every round's rows)")
    ap.add_argument("--load", help="print the tables of a saved run")
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args.worker)
    if args.load:
        rows = [json.loads(x) for x in Path(args.load).read_text().splitlines()]
        print(table([r for r in rows if r.get("record") == "row"]))
        return 0
    from benchmarks.bench import _cpu_model, git_commit, parse_size
    from benchmarks.hosts import Hosts
    ok, why = Hosts.available()
    if not ok:
        print(f"hier_bench: namespaced hosts unavailable: {why}", file=sys.stderr)
        return 3
    args.ops = args.ops.split(",")
    args.sizes = _sizes(args.sizes)
    args.iter_bytes = parse_size(args.iter_bytes)
    backends = args.backends.split(",")
    import torch
    header = {"record": "header", "bench": "hier_bench", "hosts": args.hosts,
              "ranks_per_host": args.ranks_per_host, "rounds": args.rounds,
              "backends": backends, "ops": args.ops, "sizes": args.sizes,
              "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "cpu_model": _cpu_model(), "cpu_cores": os.cpu_count(),
              "torch": torch.__version__, "git_commit": git_commit(),
              "load_avg_start": os.getloadavg(),
              "command": " ".join(["python", "-m", "benchmarks.hier_bench"] +
                                  (argv if argv is not None else sys.argv[1:]))}
    rows = []
    workdir = tempfile.mkdtemp(prefix="hier_bench_")
    t0 = time.monotonic()
    with Hosts(args.hosts) as hosts:
        for round_ in range(args.rounds):
            order = backends if round_ % 2 == 0 else backends[::-1]
            for backend in order:
                print(f"--- round {round_ + 1}/{args.rounds}: {backend}", flush=True)
                rows.extend(_run_backend(hosts, backend, args, round_, workdir))
    header["wall_s"] = round(time.monotonic() - t0, 1)
    header["load_avg_end"] = os.getloadavg()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in [header] + rows))
    print(table(rows, *backends[:2]) if len(backends) > 1 else "")
    wrong = sum(r["wrong"] for r in rows)
    print(f"\n{len(rows)} rows, {wrong} wrong, {header['wall_s']} s")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
