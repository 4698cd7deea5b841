"""Run from an installed shmcoll (scripts/wheel_check.sh): a 2-rank all_reduce, checked,
plus where the package and numba's kernel cache are, and what numba compiled.

    python wheel_check.py [--mode import|autoload|numpy] [--expect-prefix DIR]
                          [--expect-cache-outside DIR] [--expect-no-compile]
                          [--workload] [--threads N]

--mode import (default): each rank imports shmcoll, then init_process_group("shm").
--mode autoload: the ranks never import shmcoll; `import torch` must have registered "shm"
    (the wheel's torch.backends entry point) without loading numba, and the first group
    loads the engine.
--mode numpy: no torch at all (it must not be installed): the engine's numpy API over a
    FileStore, `import shmcoll` loading neither torch nor numba.
--workload (torch modes): after the first all_reduce, every collective a first job meets
    (`workload`): all_reduce of every dtype with every op it supports, then at sizes that
    take each algorithm (one step, streamed, single copy, several slots); broadcast,
    all_gather (tensor and list), reduce_scatter, reduce, gather, scatter, all_to_all,
    barrier and send/recv, small and large. --threads N runs the same in N rank threads
    (threaded_pg.spawn) in this process too.
Exits non-zero if a result is wrong, if shmcoll was imported from outside --expect-prefix
(a stray editable install or the source tree on sys.path), if the kernel cache is inside
--expect-cache-outside (read-only site-packages), or, with --expect-no-compile, if numba
compiled anything in a rank (or the thread run) or no shipped kernel was loaded: a fresh
install must load the kernels the wheel ships (shmcoll/native/prebuilt.py), not compile them.
Compiles are counted by numba's compile events (every function numba compiles: ours,
cfuncs and numba's own overloads alike), from the first group on.
"""

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time

_ENGINE = ("numba", "shmcoll.engine.group", "shmcoll.torch_backend.process_group")

_MIB = 1 << 20


def _cases(torch, dist):
    """(dtype, ops) of every all_reduce op a dtype supports (shmcoll.native.ops)."""
    floats = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
    ints = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]
    R = dist.ReduceOp
    float_ops = [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX, "PREMUL_SUM"]
    table = [(d, float_ops) for d in floats]
    # torch refuses PRODUCT on complex tensors before the backend sees it
    table += [(d, [R.SUM, R.AVG, "PREMUL_SUM"]) for d in (torch.complex64, torch.complex128)]
    table += [(d, [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]) for d in ints]
    return table


def _value(torch, rank, dtype, n):
    if dtype == torch.bool:
        return torch.full((n,), rank == 0, dtype=dtype)
    if dtype.is_complex:
        return torch.full((n,), complex(rank + 1, 1), dtype=dtype)
    return torch.full((n,), rank + 1, dtype=dtype)


def _expected(torch, dist, world, dtype, op, n):
    s = torch.stack([_value(torch, r, dtype, n) for r in range(world)])
    R = dist.ReduceOp
    if dtype == torch.bool:
        return {R.SUM: s.any(0), R.MAX: s.any(0), R.BOR: s.any(0), R.PRODUCT: s.all(0),
                R.MIN: s.all(0), R.BAND: s.all(0),
                R.BXOR: s.sum(0, dtype=torch.int64) % 2 == 1}[op]
    if op == "PREMUL_SUM":
        return (s * 2).sum(0).to(dtype)
    if op == R.AVG:
        return (s.sum(0) / world).to(dtype)
    fold = {R.SUM: lambda a, b: a + b, R.PRODUCT: lambda a, b: a * b,
            R.MIN: torch.minimum, R.MAX: torch.maximum, R.BAND: torch.bitwise_and,
            R.BOR: torch.bitwise_or, R.BXOR: torch.bitwise_xor}[op]
    out = s[0]
    for r in range(1, world):
        out = fold(out, s[r])
    return out.to(dtype)


def workload(rank, world):
    """Every collective a first job meets, each checked; returns how many ran."""
    import warnings

    import torch
    import torch.distributed as dist
    # torch 2.13: all_gather_into_tensor / reduce_scatter_tensor "deprecated", still the API
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch")

    def same(got, want, what):
        if not torch.equal(got, want):
            raise AssertionError(f"rank {rank} {what}: got {got[:4].tolist()}, want "
                                 f"{want[:4].tolist()}")

    done = 0
    for dtype, ops in _cases(torch, dist):
        for op in ops:
            t = _value(torch, rank, dtype, 1000)
            if op == "PREMUL_SUM":
                dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))
            else:
                dist.all_reduce(t, op=op)
            same(t, _expected(torch, dist, world, dtype, op, 1000), f"all_reduce {dtype} {op}")
            done += 1
    for nbytes in (64 << 10, _MIB, 4 * _MIB, 16 * _MIB):  # streamed, single copy, slots
        for dtype in (torch.float32, torch.bfloat16):
            n = nbytes // dtype.itemsize
            t = _value(torch, rank, dtype, n)
            dist.all_reduce(t)
            same(t, _expected(torch, dist, world, dtype, dist.ReduceOp.SUM, n),
                 f"all_reduce {dtype} {nbytes} B")
            done += 1
    for n in (256, 4 * _MIB // 4):
        t = torch.full((n,), float(rank + 1))
        dist.broadcast(t, src=world - 1)
        same(t, torch.full((n,), float(world)), f"broadcast {n}")
        out = torch.empty(world * n)
        dist.all_gather_into_tensor(out, torch.full((n,), float(rank)))
        same(out, torch.arange(world).float().repeat_interleave(n), f"all_gather {n}")
        outs = [torch.empty(n) for _ in range(world)]
        dist.all_gather(outs, torch.full((n,), float(rank)))
        same(torch.cat(outs), torch.arange(world).float().repeat_interleave(n),
             f"all_gather list {n}")
        out = torch.empty(n)
        dist.reduce_scatter_tensor(out, torch.full((world * n,), float(rank + 1)))
        same(out, torch.full((n,), float(world * (world + 1) // 2)), f"reduce_scatter {n}")
        t = torch.full((n,), float(rank + 1))
        dist.reduce(t, dst=0)
        if rank == 0:
            same(t, torch.full((n,), float(world * (world + 1) // 2)), f"reduce {n}")
        done += 5
    t = torch.full((4,), float(rank))
    gathered = [torch.empty(4) for _ in range(world)] if rank == 0 else None
    dist.gather(t, gathered, dst=0)
    if rank == 0:
        same(torch.cat(gathered), torch.arange(world).float().repeat_interleave(4), "gather")
    out = torch.empty(4)
    dist.scatter(out, [torch.full((4,), float(r)) for r in range(world)] if rank == 0
                 else None, src=0)
    same(out, torch.full((4,), float(rank)), "scatter")
    out = torch.empty(world * 4)
    dist.all_to_all_single(out, torch.full((world * 4,), float(rank)))
    same(out, torch.arange(world).float().repeat_interleave(4), "all_to_all_single")
    dist.barrier()
    for n in (256, _MIB // 4):
        peer = rank ^ 1
        if peer < world:
            t = torch.full((n,), float(rank))
            if rank % 2 == 0:
                dist.send(t, peer)
                dist.recv(t, peer)
            else:
                got = torch.empty(n)
                dist.recv(got, peer)
                dist.send(t, peer)
                t = got
            same(t, torch.full((n,), float(peer)), f"send/recv {n}")
    return done + 7


def _loaded(names):
    return sorted(m for m in sys.modules if m in names or m.split(".")[0] in names)


class _Recorder:
    """Every function numba compiles from now on: its type inference pass, as
    shmcoll.native.prebuilt.CompileRecorder counts them, without importing shmcoll (--mode
    autoload: the first group must load it). Imports numba: after the import checks."""

    def __init__(self):
        from numba.core import event
        self.compiled = []
        recorder = self

        class Listener(event.Listener):
            def on_start(self, ev):
                pass

            def on_end(self, ev):
                if ev.data["name"].startswith("nopython_type_inference"):
                    recorder.compiled.append(f"{ev.data['module']}.{ev.data['qualname']}")

        self._listener = Listener()
        event.register("numba:run_pass", self._listener)

    def close(self):
        from numba.core import event
        event.unregister("numba:run_pass", self._listener)


def _counts():
    from shmcoll.native import prebuilt
    return prebuilt.counts()


def _torch_rank(rank, init_file, mode, full, queue):
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
    recorder = _Recorder()
    torch.set_num_threads(1)
    t = time.perf_counter()
    dist.init_process_group("shm", init_method=f"file://{init_file}", rank=rank,
                            world_size=2)
    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x)
    took = time.perf_counter() - t
    if not bool((x == 3.0).all()):
        problems.append("wrong all_reduce result")
    if full:
        try:
            workload(rank, 2)
        except Exception as e:  # noqa: BLE001 -- reported by the parent
            problems.append(f"{type(e).__name__}: {e}")
    dist.destroy_process_group()
    queue.put((rank, problems, took, recorder.compiled, _counts()))


def _numpy_rank(rank, store_path, mode, full, queue):
    problems = []
    import shmcoll
    if _loaded(("torch", "numba")):
        problems.append(f"import shmcoll loaded {_loaded(('torch', 'numba'))}")
    import numpy as np
    recorder = _Recorder()
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
    queue.put((rank, problems, took, recorder.compiled, _counts()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("import", "autoload", "numpy"), default="import")
    ap.add_argument("--expect-prefix")
    ap.add_argument("--expect-cache-outside")
    ap.add_argument("--expect-no-compile", action="store_true")
    ap.add_argument("--workload", action="store_true", help="every collective, not one")
    ap.add_argument("--threads", type=int, default=0, help="also the workload in N threads")
    args = ap.parse_args()
    problems = []
    if args.mode == "numpy":
        import importlib.util
        if importlib.util.find_spec("torch") is not None:
            problems.append("torch is installed: --mode numpy checks an install without it")
        if args.workload or args.threads:
            problems.append("--workload and --threads need torch")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    target = _numpy_rank if args.mode == "numpy" else _torch_rank
    with tempfile.TemporaryDirectory(prefix="shmcoll-wheel-check-") as tmp:
        rendezvous = os.path.join(tmp, "rendezvous")  # file:// init, or the FileStore
        procs = [ctx.Process(target=target, args=(r, rendezvous, args.mode, args.workload,
                                                  queue))
                 for r in range(2)]
        for p in procs:
            p.start()
        results = sorted(queue.get(timeout=600) for _ in procs)
        for p in procs:
            p.join(60)

    import shmcoll
    from shmcoll.native import jit, prebuilt
    where, cache = os.path.realpath(shmcoll.__file__), jit.cache_dir()
    shipped = prebuilt.status()
    report = {"mode": args.mode, "shmcoll": where, "numba_cache": cache,
              "shipped_kernels": str(shipped.path or shipped.reason),
              "init_plus_first_all_reduce_s": round(max(r[2] for r in results), 2),
              "correct": not any(r[1] for r in results),
              "compiled_in_ranks": [len(r[3]) for r in results],
              "loaded_in_ranks": [r[4] for r in results]}
    compiled = [name for r in results for name in r[3]]
    loaded = sum(r[4]["shipped"] for r in results)
    if args.threads and args.mode != "numpy":
        import threaded_pg
        recorder = _Recorder()
        t = time.perf_counter()
        try:
            threaded_pg.spawn(workload, args.threads, timeout=300)
        except Exception as e:  # noqa: BLE001 -- a failed rank thread: reported below
            problems.append(f"threads: {type(e).__name__}: {e}")
        recorder.close()
        report.update(threads=args.threads, compiled_in_threads=len(recorder.compiled),
                      loaded_in_threads=_counts(),
                      threads_s=round(time.perf_counter() - t, 2))
        compiled += recorder.compiled
        loaded += _counts()["shipped"]
        if not os.path.realpath(threaded_pg.__file__).startswith(
                os.path.realpath(args.expect_prefix or "/")):
            problems.append(f"threaded_pg imported from {threaded_pg.__file__}")
    print(json.dumps(report))
    problems += [f"rank {r[0]}: {p}" for r in results for p in r[1]]
    if args.expect_prefix and not where.startswith(os.path.realpath(args.expect_prefix)):
        problems.append(f"shmcoll imported from {where}, not from {args.expect_prefix}")
    if args.expect_cache_outside and cache and os.path.realpath(cache).startswith(
            os.path.realpath(args.expect_cache_outside)):
        problems.append(f"numba cache {cache} is inside {args.expect_cache_outside}")
    if args.expect_no_compile:
        if compiled:
            problems.append(f"numba compiled {len(compiled)} functions (the shipped kernels "
                            f"should have been loaded): {sorted(set(compiled))}")
        if not loaded:
            problems.append(f"no shipped kernel was loaded: {shipped.reason}")
    if any(p.exitcode for p in procs):
        problems.append(f"rank exit codes {[p.exitcode for p in procs]}")
    for p in problems:
        print(f"wheel check: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
