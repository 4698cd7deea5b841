"""Part 2 of benchmarks.threaded_bench: a suite of small distributed test bodies, run one
spawn per test on threads (threaded_pg.spawn) vs one `torch.multiprocessing.spawn` of 2 gloo
processes per test (what a process-per-test suite pays).

--tests bodies (10 kinds x parameters, 2 ranks each: collectives, subgroups, object
collectives, p2p, async, each asserting its results); --gloo-tests N runs only the first N
on gloo and extrapolates. Each implementation is timed in its own subprocess
(`python -m benchmarks.threaded_bench --worker suite-threads|suite-gloo`, _suite_worker).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

__all__ = ["SUITE_KINDS", "SUITE_PARAMS", "SUITE_WORLD_SIZE", "suite", "run_suite",
           "print_suite"]

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _t_all_reduce(rank, ws, p):
    import torch
    import torch.distributed as dist
    t = torch.full((p,), float(rank + 1))
    dist.all_reduce(t)
    assert bool((t == ws * (ws + 1) / 2).all()), t


def _t_broadcast(rank, ws, p):
    import torch
    import torch.distributed as dist
    t = torch.arange(p, dtype=torch.float64) if rank == 1 else torch.zeros(p, dtype=torch.float64)
    dist.broadcast(t, src=1)
    assert torch.equal(t, torch.arange(p, dtype=torch.float64))


def _t_all_gather(rank, ws, p):
    import torch
    import torch.distributed as dist
    outs = [torch.empty(p, dtype=torch.int64) for _ in range(ws)]
    dist.all_gather(outs, torch.full((p,), rank, dtype=torch.int64))
    assert all(bool((o == r).all()) for r, o in enumerate(outs))


def _t_reduce_scatter(rank, ws, p):
    import torch
    import torch.distributed as dist
    out = torch.empty(p)
    dist.reduce_scatter(out, [torch.full((p,), float(r + rank)) for r in range(ws)])
    assert bool((out == sum(rank + r for r in range(ws))).all()), out


def _t_all_to_all(rank, ws, p):
    import torch
    import torch.distributed as dist
    out = torch.empty(p * ws)
    dist.all_to_all_single(out, torch.arange(p * ws, dtype=torch.float32) + 1000 * rank)
    want = torch.cat([torch.arange(rank * p, (rank + 1) * p, dtype=torch.float32) + 1000 * s
                      for s in range(ws)])
    assert torch.equal(out, want)


def _t_objects(rank, ws, p):
    import torch.distributed as dist
    objs = [None] * ws
    dist.all_gather_object(objs, {"rank": rank, "data": list(range(p))})
    assert objs == [{"rank": r, "data": list(range(p))} for r in range(ws)]


def _t_subgroup(rank, ws, p):
    import torch
    import torch.distributed as dist
    sub = dist.new_group([0, 1])
    t = torch.full((p,), 2.0)
    dist.all_reduce(t, op=dist.ReduceOp.PRODUCT, group=sub)
    assert bool((t == 4.0).all())


def _t_p2p(rank, ws, p):
    import torch
    import torch.distributed as dist
    if rank == 0:
        dist.send(torch.arange(p, dtype=torch.float32), 1)
    else:
        t = torch.empty(p)
        dist.recv(t, 0)
        assert torch.equal(t, torch.arange(p, dtype=torch.float32))


def _t_async(rank, ws, p):
    import torch
    import torch.distributed as dist
    ts = [torch.full((p,), float(i)) for i in range(4)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for w in works:
        w.wait()
    assert all(bool((t == i * ws).all()) for i, t in enumerate(ts))


def _t_gather_scatter(rank, ws, p):
    import torch
    import torch.distributed as dist
    got = [torch.empty(p) for _ in range(ws)] if rank == 0 else None
    dist.gather(torch.full((p,), float(rank)), got, dst=0)
    if rank == 0:
        assert all(bool((g == r).all()) for r, g in enumerate(got))
    out = torch.empty(p)
    dist.scatter(out, [torch.full((p,), float(r * 3)) for r in range(ws)] if rank == 0 else None,
                 src=0)
    assert bool((out == rank * 3).all())
    dist.barrier()


SUITE_KINDS = [_t_all_reduce, _t_broadcast, _t_all_gather, _t_reduce_scatter, _t_all_to_all,
               _t_objects, _t_subgroup, _t_p2p, _t_async, _t_gather_scatter]
SUITE_PARAMS = [1, 7, 64, 1000, 4096]
SUITE_WORLD_SIZE = 2


def suite(n):
    """The first n (body, param) test cases."""
    cases = [(body, p) for p in SUITE_PARAMS for body in SUITE_KINDS]
    return (cases * (n // len(cases) + 1))[:n]


def _gloo_entry(rank, body_name, param, init_file):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=SUITE_WORLD_SIZE)
    try:
        globals()[body_name](rank, SUITE_WORLD_SIZE, param)
    finally:
        dist.destroy_process_group()


def _suite_worker(args):
    """Runs in a subprocess: times the suite on one implementation, prints one JSON line."""
    cases = suite(args.tests if args.worker == "suite-threads" else args.gloo_tests)
    failures = []
    t0 = time.perf_counter()
    if args.worker == "suite-threads":
        import threaded_pg
        for body, param in cases:
            try:
                threaded_pg.spawn(body, SUITE_WORLD_SIZE, args=(param,), timeout=120)
            except Exception as e:
                failures.append(f"{body.__name__}({param}): {e}")
    else:
        import torch.multiprocessing as mp
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        with tempfile.TemporaryDirectory() as tmp:
            for i, (body, param) in enumerate(cases):
                try:
                    mp.spawn(_gloo_entry, args=(body.__name__, param, f"{tmp}/init{i}"),
                             nprocs=SUITE_WORLD_SIZE, join=True)
                except Exception as e:
                    failures.append(f"{body.__name__}({param}): {e}")
    elapsed = time.perf_counter() - t0
    print(json.dumps({"impl": args.worker, "tests": len(cases), "seconds": elapsed,
                      "failures": failures}), flush=True)


def run_suite(args):
    rows = {}
    for worker in ("suite-threads", "suite-gloo"):
        print(f"# suite: {worker} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "benchmarks.threaded_bench", "--worker",
                               worker, "--tests", str(args.tests), "--gloo-tests",
                               str(args.gloo_tests)],
                              capture_output=True, text=True, timeout=7200, cwd=_REPO_ROOT)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{worker} failed:\n{proc.stderr[-4000:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        row["process_wall_s"] = wall  # including the driver's own start and imports
        rows[worker] = row
    return rows


def print_suite(rows, n):
    threads, gloo = rows["suite-threads"], rows["suite-gloo"]
    per_thread = threads["seconds"] / threads["tests"]
    per_gloo = gloo["seconds"] / gloo["tests"]
    gloo_total = per_gloo * n
    note = "" if gloo["tests"] == n else f" (extrapolated from {gloo['tests']} tests)"
    print(f"\n# suite of {n} small distributed tests, {SUITE_WORLD_SIZE} ranks each")
    print(f"{'runner':>36} {'total s':>9} {'per test ms':>12}")
    print(f"{'threaded_pg.spawn (threads)':>36} {threads['seconds']:>9.2f} {per_thread * 1e3:>12.1f}")
    print(f"{'mp.spawn + gloo (processes)':>36} {gloo_total:>9.2f} {per_gloo * 1e3:>12.1f}{note}")
    print(f"# threads are {per_gloo / per_thread:.1f}x faster per test")
    bad = threads["failures"] + gloo["failures"]
    for f in bad:
        print(f"# FAILED {f}")
    return bool(bad)
