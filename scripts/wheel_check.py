"""Run from an installed shmcoll (scripts/wheel_check.sh): a 2-rank all_reduce, checked,
plus where the package and numba's kernel cache are.

    python wheel_check.py [--mode import|autoload|numpy] [--expect-prefix DIR]
                          [--expect-cache-outside DIR]

--mode import (default): each rank imports shmcoll, then init_process_group("shm").
--mode autoload: the ranks never import shmcoll; `import torch` must have registered "shm"
    (the wheel's torch.backends entry point) without loading numba, and the first group
    loads the engine.
--mode numpy: no torch at all (it must not be installed): the engine's numpy API over a
    FileStore, `import shmcoll` loading neither torch nor numba.
Exits non-zero if the result is wrong, if shmcoll was imported from outside
--expect-prefix (a stray editable install or the source tree on sys.path), or if the
kernel cache is inside --expect-cache-outside (read-only site-packages).
"""

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time

_ENGINE = ("numba", "shmcoll.group", "shmcoll.torch_backend.process_group")


def _loaded(names):
    return sorted(m for m in sys.modules if m in names or m.split(".")[0] in names)


def _torch_rank(rank, init_file, mode, queue):
    problems = []
    import torch
    import torch.distributed as dist

    if mode == "autoload":
        if "SHM" not in dist.Backend._plugins:
            problems.append("import torch did not register 'shm' (entry point)")
        if _loaded(_ENGINE):
            problems.append(f"import torch loaded {_loaded(_ENGINE)}")
    else:
        import shmcoll  # noqa: F401  (registers "shm")
    torch.set_num_threads(1)
    t = time.perf_counter()
    dist.init_process_group("shm", init_method=f"file://{init_file}", rank=rank,
                            world_size=2)
    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x)
    took = time.perf_counter() - t
    if not bool((x == 3.0).all()):
        problems.append("wrong all_reduce result")
    dist.destroy_process_group()
    queue.put((rank, problems, took))


def _numpy_rank(rank, store_path, mode, queue):
    problems = []
    import shmcoll
    if _loaded(("torch", "numba")):
        problems.append(f"import shmcoll loaded {_loaded(('torch', 'numba'))}")
    import numpy as np
    t = time.perf_counter()
    group = shmcoll.new_shm_group(shmcoll.FileStore(store_path), rank, 2)
    x = np.full(1000, rank + 1.0, dtype=np.float32)
    group.all_reduce(x)
    took = time.perf_counter() - t
    group.close()
    if not bool((x == 3.0).all()):
        problems.append("wrong all_reduce result")
    if "torch" in sys.modules:
        problems.append("the engine imported torch")
    queue.put((rank, problems, took))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("import", "autoload", "numpy"), default="import")
    ap.add_argument("--expect-prefix")
    ap.add_argument("--expect-cache-outside")
    args = ap.parse_args()
    problems = []
    if args.mode == "numpy":
        import importlib.util
        if importlib.util.find_spec("torch") is not None:
            problems.append("torch is installed: --mode numpy checks an install without it")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    target = _numpy_rank if args.mode == "numpy" else _torch_rank
    with tempfile.TemporaryDirectory(prefix="shmcoll-wheel-check-") as tmp:
        rendezvous = os.path.join(tmp, "rendezvous")  # file:// init, or the FileStore
        procs = [ctx.Process(target=target, args=(r, rendezvous, args.mode, queue))
                 for r in range(2)]
        for p in procs:
            p.start()
        results = sorted(queue.get(timeout=600) for _ in procs)
        for p in procs:
            p.join(60)

    import shmcoll
    from shmcoll import jit
    where, cache = os.path.realpath(shmcoll.__file__), jit.cache_dir()
    report = {"mode": args.mode, "shmcoll": where, "numba_cache": cache,
              "init_plus_first_all_reduce_s": round(max(r[2] for r in results), 2),
              "correct": not any(r[1] for r in results)}
    print(json.dumps(report))
    problems += [f"rank {r[0]}: {p}" for r in results for p in r[1]]
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
