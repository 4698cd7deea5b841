"""Run from an installed shmcoll (scripts/wheel_check.sh): a 2-rank dist.all_reduce on
backend "shm", checked, plus where the package and numba's kernel cache are.

    python wheel_check.py [--expect-prefix DIR] [--expect-cache-outside DIR]

Exits non-zero if the result is wrong, if shmcoll was imported from outside
--expect-prefix (a stray editable install or the source tree on sys.path), or if the
kernel cache is inside --expect-cache-outside (read-only site-packages).
"""

import argparse
import json
import os
import sys
import tempfile
import time


def _rank(rank, init_file, queue):
    import torch
    import torch.distributed as dist

    import shmcoll  # noqa: F401  (registers "shm")
    torch.set_num_threads(1)
    t = time.perf_counter()
    dist.init_process_group("shm", init_method=f"file://{init_file}", rank=rank,
                            world_size=2)
    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x)
    took = time.perf_counter() - t
    ok = bool((x == 3.0).all())
    dist.destroy_process_group()
    queue.put((rank, ok, took))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--expect-prefix")
    ap.add_argument("--expect-cache-outside")
    args = ap.parse_args()
    import torch.multiprocessing as mp

    import shmcoll
    from shmcoll import jit
    where, cache = os.path.realpath(shmcoll.__file__), jit.cache_dir()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init_file = tempfile.mktemp(prefix="shmcoll-wheel-check-")
    procs = [ctx.Process(target=_rank, args=(r, init_file, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    report = {"shmcoll": where, "numba_cache": cache,
              "init_plus_first_all_reduce_s": round(max(r[2] for r in results), 2),
              "correct": all(r[1] for r in results)}
    print(json.dumps(report))
    problems = []
    if not report["correct"]:
        problems.append("wrong all_reduce result")
    if args.expect_prefix and not where.startswith(os.path.realpath(args.expect_prefix)):
        problems.append(f"shmcoll imported from {where}, not from {args.expect_prefix}")
    if args.expect_cache_outside and cache and os.path.realpath(cache).startswith(
            os.path.realpath(args.expect_cache_outside)):
        problems.append(f"numba cache {cache} is inside {args.expect_cache_outside}")
    if any(p.exitcode for p in procs):
        problems.append(f"rank exit codes {[p.exitcode for p in procs]}")
    for p in problems:
        print(f"wheel check: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
