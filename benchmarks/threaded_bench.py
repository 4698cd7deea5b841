"""Threaded backends compared: shmcoll's "threaded" vs torch's multi_threaded_pg, and a suite of
small distributed tests run on threads (threaded_pg.spawn) vs gloo processes per test.

    python -m benchmarks.threaded_bench                       # both parts, defaults below
    python -m benchmarks.threaded_bench --part latency --world-sizes 2,4,8 --rounds 2
    python -m benchmarks.threaded_bench --part suite --tests 50 --gloo-tests 10
    python -m benchmarks.threaded_bench --out results/threaded.jsonl

Part 1 (latency): per-collective latency (all_reduce, broadcast, all_gather, reduce_scatter,
barrier; float32 of --counts elements per rank) at each world size. Each implementation runs
in its own subprocess (both register the backend name "threaded"), alternating ours/torch
--rounds times so load changes on a shared host hit both; inside, every (op, size) runs
--reps timed loops of --iters calls between barriers and the median loop is reported.
Results are verified: before timing, and on the outputs of the last timed call (in-place
inputs are refilled inside the timed loop, the same way for both implementations).

Part 2 (suite): --tests small test bodies (10 kinds x parameters, 2 ranks each: collectives,
subgroups, object collectives, p2p, async, each asserting its results), run one spawn per test
on threads, vs one `torch.multiprocessing.spawn` of 2 gloo processes per test (what a
process-per-test suite pays). --gloo-tests N runs only the first N tests on gloo and
extrapolates (marked in the table). Its code: benchmarks/threaded_suite.py.

The torch worker drives torch's threaded PG the way its own test helpers do, through
private names of torch 2.13: multi_threaded_pg._install_threaded_pg / _uninstall_threaded_pg,
ProcessLocalGroup.reset / exception_handle and _C._distributed_c10d._set_thread_isolation_mode.

Exit status: 0 ok, 1 a result was wrong or a test body failed, 2 bad command line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import traceback

from benchmarks.threaded_suite import _suite_worker, print_suite, run_suite  # part 2

OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier")
EXIT_OK, EXIT_WRONG, EXIT_USAGE = 0, 1, 2


# ---------------------------------------------------------------------------------------
# part 1: one rank's latency loop (runs inside either implementation's rank thread)
# ---------------------------------------------------------------------------------------

def _op_runner(op, count, rank, ws):
    """(call, check) for one op: call() runs one collective (refilling in-place inputs);
    check() returns None or a description of a wrong result."""
    import torch
    import torch.distributed as dist

    expect_sum = float(ws * (ws + 1) // 2)
    if op == "all_reduce":
        t = torch.empty(count)

        def call():
            t.fill_(rank + 1)
            dist.all_reduce(t)
        return call, lambda: None if bool((t == expect_sum).all()) else f"all_reduce {t[:4]}"
    if op == "broadcast":
        t = torch.empty(count)

        def call():
            t.fill_(7.0 if rank == 0 else -1.0)
            dist.broadcast(t, 0)
        return call, lambda: None if bool((t == 7.0).all()) else f"broadcast {t[:4]}"
    if op == "all_gather":
        src = torch.full((count,), float(rank))
        out = torch.empty(count * ws)
        want = torch.arange(ws, dtype=torch.float32).repeat_interleave(count)

        def call():
            dist.all_gather_into_tensor(out, src)
        return call, lambda: None if torch.equal(out, want) else f"all_gather {out[:4]}"
    if op == "reduce_scatter":
        src = torch.full((count * ws,), float(rank + 1))
        out = torch.empty(count)

        def call():
            dist.reduce_scatter_tensor(out, src)
        return call, lambda: None if bool((out == expect_sum).all()) else f"reduce_scatter {out[:4]}"
    if op == "barrier":
        return dist.barrier, lambda: None
    raise ValueError(op)


def _engine_op_runner(group, op, count, rank, ws):
    """_op_runner for the numpy engine API (shmcoll Group) directly, without torch."""
    import numpy as np

    expect_sum = float(ws * (ws + 1) // 2)
    if op == "all_reduce":
        a = np.empty(count, np.float32)

        def call():
            a.fill(rank + 1)
            group.all_reduce(a)
        return call, lambda: None if bool((a == expect_sum).all()) else f"all_reduce {a[:4]}"
    if op == "broadcast":
        a = np.empty(count, np.float32)

        def call():
            a.fill(7.0 if rank == 0 else -1.0)
            group.broadcast(a, 0)
        return call, lambda: None if bool((a == 7.0).all()) else f"broadcast {a[:4]}"
    if op == "all_gather":
        src = np.full(count, rank, np.float32)
        out = np.empty(count * ws, np.float32)
        want = np.repeat(np.arange(ws, dtype=np.float32), count)
        return (lambda: group.all_gather(out, src),
                lambda: None if np.array_equal(out, want) else f"all_gather {out[:4]}")
    if op == "reduce_scatter":
        src = np.full(count * ws, rank + 1, np.float32)
        out = np.empty(count, np.float32)
        return (lambda: group.reduce_scatter(out, src),
                lambda: None if bool((out == expect_sum).all()) else f"reduce_scatter {out[:4]}")
    if op == "barrier":
        return group.barrier, lambda: None
    raise ValueError(op)


def latency_rank_engine(rank, ws, store, counts, iters, reps, warmup):
    """latency_rank over the engine Group API (threaded_pg.run_threads)."""
    import threaded_pg

    group = threaded_pg.new_threaded_group(store, rank, ws)
    rounds = iter(range(1 << 30))  # every rank gathers flags equally often

    def gather_flags(obj):
        key = f"flags/{next(rounds)}"
        store.set(f"{key}/{rank}", json.dumps(obj))
        return [json.loads(store.get(f"{key}/{r}")) for r in range(ws)]
    try:
        return _latency_loops(rank, ws, counts, iters, reps, warmup, group.barrier,
                              lambda op, count: _engine_op_runner(group, op, count, rank, ws),
                              gather_flags)
    finally:
        group.close()


def latency_rank(rank, ws, counts, iters, reps, warmup):
    """Every (op, count) on this rank; rank 0 returns rows (median/min loop time per call)."""
    import torch.distributed as dist

    def gather_flags(obj):
        flags = [None] * ws
        dist.all_gather_object(flags, obj)
        return flags
    return _latency_loops(rank, ws, counts, iters, reps, warmup, dist.barrier,
                          lambda op, count: _op_runner(op, count, rank, ws), gather_flags)


def _latency_loops(rank, ws, counts, iters, reps, warmup, barrier, runner, gather_flags):
    rows = []
    for op in OPS:
        for count in (counts if op != "barrier" else [0]):
            call, check = runner(op, max(count, 1))
            for _ in range(warmup):
                call()
            wrong = check()
            loops = []
            for _ in range(reps):
                barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    call()
                loops.append((time.perf_counter() - t0) / iters * 1e6)
            wrong = wrong or check()
            flags = gather_flags(wrong)
            bad = [f"rank {r}: {w}" for r, w in enumerate(flags) if w]
            rows.append({"op": op, "world_size": ws, "nbytes": 4 * count, "iters": iters,
                         "reps": reps, "us_median": statistics.median(loops),
                         "us_min": min(loops), "wrong": "; ".join(bad)})
    return rows if rank == 0 else None


def _silence_deprecations():
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)  # *_into_tensor renames


def _worker_ours(args):
    import threaded_pg

    params = (args.counts, args.iters, args.reps, args.warmup)
    for ws in args.world_sizes:
        rows = threaded_pg.spawn(latency_rank, ws, args=params, timeout=600)[0]
        for row in rows:
            print(json.dumps({"impl": "shmcoll threaded", **row}), flush=True)
        rows = threaded_pg.run_threads(latency_rank_engine, ws, args=params, timeout=600)[0]
        for row in rows:
            print(json.dumps({"impl": "shmcoll engine", **row}), flush=True)


def _worker_torch(args):
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg as mt

    for ws in args.world_sizes:
        mt._install_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        store, results, errors = dist.HashStore(), [None] * ws, []

        def rank_main(rank):
            try:
                dist.init_process_group("threaded", rank=rank, world_size=ws, store=store)
                results[rank] = latency_rank(rank, ws, args.counts, args.iters, args.reps,
                                             args.warmup)
                dist.destroy_process_group()
            except BaseException:
                errors.append(traceback.format_exc())
                mt.ProcessLocalGroup.exception_handle(None)

        threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(ws)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        mt.ProcessLocalGroup.reset()
        mt._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        if errors:
            raise RuntimeError(errors[0])
        for row in results[0]:
            print(json.dumps({"impl": "torch multi_threaded_pg", **row}), flush=True)


def run_latency(args):
    """Alternate worker subprocesses; returns the merged rows (median over all loops)."""
    base = [sys.executable, "-m", "benchmarks.threaded_bench", "--world-sizes",
            ",".join(map(str, args.world_sizes)), "--counts", ",".join(map(str, args.counts)),
            "--iters", str(args.iters), "--reps", str(args.reps), "--warmup", str(args.warmup)]
    samples = {}
    for round_ in range(args.rounds):
        for impl in ("ours", "torch"):
            print(f"# latency round {round_ + 1}/{args.rounds}: {impl} ...", file=sys.stderr,
                  flush=True)
            proc = subprocess.run(base + ["--worker", impl], capture_output=True, text=True,
                                  timeout=3600, cwd=_repo_root())
            if proc.returncode != 0:
                raise RuntimeError(f"{impl} worker failed:\n{proc.stderr[-4000:]}")
            for line in proc.stdout.splitlines():
                if line.startswith("{"):
                    row = json.loads(line)
                    key = (row["impl"], row["op"], row["world_size"], row["nbytes"])
                    samples.setdefault(key, []).append(row)
    rows = []
    for (impl, op, ws, nbytes), got in samples.items():
        rows.append({"impl": impl, "op": op, "world_size": ws, "nbytes": nbytes,
                     "us_median": statistics.median(r["us_median"] for r in got),
                     "us_min": min(r["us_min"] for r in got), "rounds": len(got),
                     "wrong": "; ".join(r["wrong"] for r in got if r["wrong"])})
    return rows


def print_latency(rows):
    by = {(r["impl"], r["op"], r["world_size"], r["nbytes"]): r for r in rows}
    print("\n# latency per call, microseconds (median of loops; min in brackets); "
          "speedup = torch / ours")
    print("# engine = the same algorithms over threads through the numpy Group API (no torch "
          "adapter)")
    print(f"{'op':>15} {'bytes':>7} {'ranks':>5} {'shmcoll threaded':>22} "
          f"{'torch threaded':>22} {'speedup':>8} {'shmcoll engine':>22}  check")
    wins = total = 0
    for (impl, op, ws, nbytes), ours in sorted(by.items(), key=lambda kv: (
            OPS.index(kv[0][1]), kv[0][3], kv[0][2])):
        if impl != "shmcoll threaded":
            continue
        theirs = by.get(("torch multi_threaded_pg", op, ws, nbytes))
        if theirs is None:
            continue
        speedup = theirs["us_median"] / ours["us_median"]
        total += 1
        wins += speedup > 1
        engine = by.get(("shmcoll engine", op, ws, nbytes))
        wrong = ours["wrong"] or theirs["wrong"] or (engine or {}).get("wrong")
        eng = f"{engine['us_median']:>12.1f} [{engine['us_min']:>7.1f}]" if engine else " " * 22
        print(f"{op:>15} {nbytes:>7} {ws:>5} {ours['us_median']:>12.1f} [{ours['us_min']:>7.1f}]"
              f" {theirs['us_median']:>12.1f} [{theirs['us_min']:>7.1f}] {speedup:>7.2f}x "
              f"{eng}  {'WRONG ' + wrong if wrong else 'ok'}")
    print(f"# shmcoll threaded faster in {wins} of {total} rows")
    return any(r["wrong"] for r in rows)


# ---------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------

def _repo_root():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("latency", "suite", "all"), default="all")
    ap.add_argument("--world-sizes", type=_ints, default=[2, 4, 8])
    ap.add_argument("--counts", type=_ints, default=[1, 256, 16384],
                    help="float32 elements per rank (4 B, 1 KiB, 64 KiB)")
    ap.add_argument("--iters", type=int, default=100, help="calls per timed loop")
    ap.add_argument("--reps", type=int, default=5, help="timed loops per (op, size)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2, help="alternations ours/torch")
    ap.add_argument("--tests", type=int, default=50)
    ap.add_argument("--gloo-tests", type=int, default=None,
                    help="run only this many tests on gloo and extrapolate (default: all)")
    ap.add_argument("--out", help="append JSON lines (header + rows) to this file")
    ap.add_argument("--worker", choices=("ours", "torch", "suite-threads", "suite-gloo"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.gloo_tests is None or args.gloo_tests > args.tests:
        args.gloo_tests = args.tests
    _silence_deprecations()
    if args.worker in ("ours", "torch"):
        (_worker_ours if args.worker == "ours" else _worker_torch)(args)
        return EXIT_OK
    if args.worker:
        _suite_worker(args)
        return EXIT_OK

    header = {"record": "header", "date": datetime.datetime.now().astimezone().isoformat(
        timespec="seconds"), "cpus": len(os.sched_getaffinity(0)), "load": os.getloadavg(),
        "python": platform.python_version(), "argv": sys.argv[1:]}
    print(f"# threaded_bench {header['date']}: {header['cpus']} usable cores, load average "
          f"{header['load'][0]:.1f} (other jobs share this host: compare rows of one run)")
    records, bad = [header], False
    if args.part in ("latency", "all"):
        rows = run_latency(args)
        bad |= print_latency(rows)
        records += [{"record": "latency", **r} for r in rows]
    if args.part in ("suite", "all"):
        rows = run_suite(args)
        bad |= print_suite(rows, args.tests)
        records += [{"record": "suite", **r} for r in rows.values()]
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    return EXIT_WRONG if bad else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
