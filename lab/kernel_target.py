"""What the shipped kernels' target CPU costs in reduction speed: each reducer loaded from a
build for a target CPU against the same reducer compiled for this CPU, in one process,
alternating in blocks of calls.

    python -m lab.kernel_target                         # x86-64-v3 and generic
    python -m lab.kernel_target --cpus generic --sizes 64K,1M --blocks 40
    python -m lab.kernel_target --engine                # the protocol kernels

The shmcoll package is copied into a temporary directory and its reducers built there for
every --cpus (shmcoll.tools.build_kernels.build, unchecked: whatever the loader would pick). This
process then loads each reducer from every build, as the shipped-kernel loader reads
them, and compiles it for this CPU (kernels.reducer in this tree, which ships none), and
times them through the engine's Python call (kernels.reduce_unchecked) over two sources
of 1s, alternating. Per case and size: the median time per call of each, its ratio over
this CPU's (above 1: slower) and the share of blocks it won.

--engine: the shipped protocol kernels (one-step, streaming), as the loader picks them,
against the same compiled for this CPU (their Python functions jitted again without a
cache, swapped into shmcoll.protocol, whose Arena calls them, between blocks) in the same
2 rank processes of an engine group, Group.all_reduce of float32 on torch-allocated
buffers, slowest rank per block; the reducer is the shipped one in both.

Uses shmcoll internals (the reducers' Python bodies, the loader's cache class, the
drivers' kernel names): a measurement tool, like the tests.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["main"]

_HERE = Path(__file__).resolve().parent.parent

# (kind, storage dtype, kernel op): the sums of the usual dtypes, one ordered op
_CASES = (("float", np.float32, 0), ("bfloat16", np.uint16, 0), ("float16", np.uint16, 0),
          ("float", np.float64, 0), ("float", np.float64, 3), ("int", np.int8, 0),
          ("int", np.int64, 0), ("complex", np.complex64, 0))


def _parse_size(text):
    mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1].upper(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


def _loaded(cpu_dir, cf):
    """Address of `cf`'s reducer as built in `cpu_dir` (kept alive with its library)."""
    from numba.core.registry import cpu_target

    from shmcoll.native import prebuilt
    manifest = json.loads((cpu_dir / prebuilt.MANIFEST).read_text())
    cache = prebuilt._ShippedCache(cf.__wrapped__, prebuilt.Status(cpu_dir, manifest=manifest))
    cres = cache.load_overload(cf._sig, cpu_target.target_context)
    if cres is None:
        raise RuntimeError(f"{cpu_dir} holds no {cf.__qualname__} for these sources")
    return cres.library.get_pointer_to_function(cres.fndesc.llvm_cfunc_wrapper_name), cres


def _time(fns, kernel_op, dt, nbytes, blocks):
    from shmcoll.native import reducers
    n = nbytes // np.dtype(dt).itemsize
    a, b, out = np.ones(n, dt), np.ones(n, dt), np.empty(n, dt)
    srcs = np.array([a.ctypes.data, b.ctypes.data], np.int64)
    calls = max(1, (4 << 20) // nbytes)
    times = {name: [] for name in fns}
    names = list(fns)
    for block in range(blocks):
        for name in names if block % 2 == 0 else names[::-1]:
            fn = fns[name]
            t = time.perf_counter()
            for _ in range(calls):
                reducers.reduce_unchecked(out, srcs, fn, kernel_op)
            times[name].append((time.perf_counter() - t) / calls)
    return times


# One rank of --engine, run from the package copy: {nbytes: {"shipped": [s], "host": [s]}}.
_ENGINE_RANK = r'''
import json, os, sys, time
import numba, torch
import shmcoll
from shmcoll.native import prebuilt
from shmcoll import protocol as drivers
rank, store, sizes, blocks, calls = sys.argv[1], sys.argv[2], *map(json.loads, sys.argv[3:6])
rank = int(rank)
assert prebuilt.status().path is not None, prebuilt.status().reason
torch.set_num_threads(1)
g = shmcoll.new_shm_group(shmcoll.FileStore(store), rank, 2, small_pages=True)
shipped = {k: getattr(drivers, k) for k in ("_one_step_kernel", "_stream_kernel")}
host = {k: numba.njit(nogil=True)(v.py_func) for k, v in shipped.items()}
out = {}
for nbytes in sizes:
    buf = torch.empty(nbytes // 4).numpy()
    times = {"shipped": [], "host": []}
    for block in range(-2, blocks):  # two blocks each to compile, load and touch the pages
        for name in ("shipped", "host") if block % 2 == 0 else ("host", "shipped"):
            for k, v in (shipped if name == "shipped" else host).items():
                setattr(drivers, k, v)
            buf[:] = 1.0
            g.barrier()
            t = time.perf_counter()
            for _ in range(calls):
                g.all_reduce(buf)
            if block >= 0:
                times[name].append((time.perf_counter() - t) / calls)
            assert buf[0] == 2.0 ** calls, (name, nbytes, buf[0])
    out[nbytes] = times
g.close()
print(json.dumps({"times": out, "counts": prebuilt.counts()}))
'''


def _engine(pkg, sizes, blocks, calls=10):
    with tempfile.TemporaryDirectory(prefix="shmcoll-kernel-target-store-") as tmp:
        env = dict(os.environ, PYTHONPATH=str(pkg.parent), NUMBA_CACHE_DIR=tmp)
        procs = [subprocess.Popen([sys.executable, "-c", _ENGINE_RANK, str(r),
                                   os.path.join(tmp, "store"), json.dumps(sizes),
                                   str(blocks), str(calls)], env=env, cwd=pkg.parent,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        results = []
        for p in procs:
            out, err = p.communicate(timeout=3600)
            if p.returncode:
                raise SystemExit(f"an --engine rank failed:\n{err[-3000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    print(f"loaded per rank: {[r['counts'] for r in results]}")
    print(f"{'bytes':>9} {'shipped us':>11} {'this CPU us':>11} {'ratio':>6} {'won':>4}")
    for nbytes in sizes:
        a, b = ([max(x) for x in zip(*(r["times"][str(nbytes)][name] for r in results))]
                for name in ("shipped", "host"))
        won = sum(x < y for x, y in zip(a, b)) / len(a)
        print(f"{nbytes:>9} {statistics.median(a) * 1e6:11.2f} "
              f"{statistics.median(b) * 1e6:11.2f} "
              f"{statistics.median(a) / statistics.median(b):6.2f} {won:4.0%}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lab.kernel_target",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--cpus", default="x86-64-v3,generic")
    ap.add_argument("--sizes", default="4K,64K,1M,16M")
    ap.add_argument("--blocks", type=int, default=30, help="blocks per version and size")
    ap.add_argument("--engine", action="store_true",
                    help="the protocol kernels in an engine group instead (sizes default "
                         "8,64K,1M,16M)")
    args = ap.parse_args(argv)
    cpus = args.cpus.split(",")
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    from shmcoll.tools import build_kernels
    from shmcoll.native import reducers, prebuilt
    with tempfile.TemporaryDirectory(prefix="shmcoll-kernel-target-") as tmp:
        for name in ("shmcoll", "threaded_pg", "cuda_ipc"):  # the copy imports its own
            shutil.copytree(_HERE / name, Path(tmp) / name,
                            ignore=shutil.ignore_patterns("__pycache__", prebuilt.DIR_NAME))
        pkg = Path(tmp) / "shmcoll"
        if args.engine:
            result = build_kernels.build(pkg)
            if "skipped" in result:
                raise SystemExit(result["skipped"])
            _engine(pkg, sizes if "--sizes" in (argv or sys.argv) else
                    [8, 64 << 10, 1 << 20, 16 << 20], args.blocks)
            return 0
        t = time.perf_counter()
        build_kernels.build(pkg, parts=build_kernels.ALL, cpus=cpus, check=False)
        print(f"built for {', '.join(cpus)} in {time.perf_counter() - t:.0f} s", flush=True)
        print(f"{'kind':9} {'dtype':10} {'op':>2} {'bytes':>9} {'this CPU us':>11} " +
              " ".join(f"{cpu + ' us':>13} {'ratio':>5} {'won':>4}" for cpu in cpus))
        keep = []
        for kind, dt, op in _CASES:
            fns = {"host": reducers.reducer(dt, kind, op)}
            cf = reducers._cfuncs[(np.dtype(dt), "same" if kind not in reducers.KINDS_16
                                  else kind, op == reducers.OP_SUM)]
            for cpu in cpus:
                fns[cpu], cres = _loaded(pkg / prebuilt.DIR_NAME / cpu, cf)
                keep.append(cres)
            for nbytes in sizes:
                times = _time(fns, op, dt, nbytes, args.blocks)
                host = statistics.median(times["host"])
                cells = []
                for cpu in cpus:
                    med = statistics.median(times[cpu])
                    won = sum(x < y for x, y in zip(times[cpu], times["host"])) / args.blocks
                    cells.append(f"{med * 1e6:13.2f} {med / host:5.2f} {won:4.0%}")
                print(f"{kind:9} {np.dtype(dt).name:10} {op:>2} {nbytes:>9} "
                      f"{host * 1e6:11.2f} " + " ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
