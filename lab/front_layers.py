"""Where a synchronous dist.* call's time goes, layer by layer, in the same two rank
processes: the engine call, the adapter's latency path (fast.py's inline functions), torch's
C++ ProcessGroup method (which dispatches into the adapter) and the dist.* front end.

    python -m lab.front_layers                          # 8 B and 64 KiB, all three ops
    python -m lab.front_layers --sizes 8,64K,1M --ops all_gather --blocks 16
    python -m lab.front_layers --world-size 4 --ops all_to_all --sizes 64K,1M

Per op and size, each layer is one callable; the layers alternate in blocks of `--calls`
calls (each block timed as a whole on rank 0, after a barrier; the order reverses every
block), and the median over blocks is printed with each layer's increment over the one
below it; the line below it ("cpu") is rank 0's process CPU time per call the same way
(waits included: with more ranks than cores, wall time ~ the ranks' CPU / the cores). The
ranks run in lock step, so an increment is what that layer adds to a call, not its CPU
time alone. Buffers are torch float32 tensors (4 KiB pages); sizes are per
rank (all_gather: the input). Nothing is verified beyond each layer's last call (the
values are checked once per op and size): this measures overhead, benchmarks.bench
measures collectives.
"""

import argparse
import statistics
import sys
import tempfile
import time
import warnings

from benchmarks.sizes import parse_size

__all__ = ["main"]

OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")
LAYERS = ("engine", "adapter inline", "C++ ProcessGroup", "dist.*")


def _layers(op, pg, default, t, out):
    """The four callables of `op` on tensor `t` (and `out` for all_gather, reduce_scatter
    and all_to_all)."""
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d

    from shmcoll.torch_backend import fast
    from shmcoll.torch_backend.convert import plain_array
    g = pg.group
    a = plain_array(t)

    def waited(work):
        if work is not None:
            work.wait()

    if op == "all_reduce":
        opts = c10d.AllreduceOptions()
        opts.asyncOp = False
        return (lambda: g.all_reduce(a), lambda: fast.allreduce_inline(pg, [t], opts),
                lambda: waited(default.allreduce([t], opts)), lambda: dist.all_reduce(t))
    if op == "broadcast":
        opts = c10d.BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.asyncOp = 0, 0, False
        return (lambda: g.broadcast(a, 0), lambda: fast.broadcast_inline(pg, [t], opts),
                lambda: waited(default.broadcast([t], opts)), lambda: dist.broadcast(t, 0))
    o = plain_array(out)
    if op == "reduce_scatter":  # t: the input (world x out)
        opts = c10d.ReduceScatterOptions()
        opts.asyncOp = False
        return (lambda: g.reduce_scatter(o, a),
                lambda: fast.reduce_scatter_single_inline(pg, out, t, opts),
                lambda: waited((getattr(default, "reduce_scatter_single", None)
                                or default._reduce_scatter_base)(out, t, opts)),
                lambda: (getattr(dist, "reduce_scatter_single", None)
                         or dist.reduce_scatter_tensor)(out, t))
    if op == "all_to_all":
        opts = c10d.AllToAllOptions()
        opts.asyncOp = False
        return (lambda: g.all_to_all_single(o, a),
                lambda: fast.all_to_all_single_inline(pg, out, t, [], [], opts),
                lambda: waited(default.alltoall_base(out, t, [], [], opts)),
                lambda: dist.all_to_all_single(out, t))
    opts = c10d.AllgatherOptions()
    opts.asyncOp = False
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return (lambda: g.all_gather(o, a),
            lambda: fast.all_gather_single_inline(pg, out, t, opts),
            lambda: waited(default.all_gather_single(out, t, opts)),
            lambda: gather(out, t))


def _rank(rank, world, store, args, queue):
    import torch
    import torch.distributed as dist
    warnings.simplefilter("ignore")  # all_gather_into_tensor's deprecation, once per call
    torch.set_num_threads(1)
    dist.init_process_group("shm", init_method=f"file://{store}", rank=rank, world_size=world)
    default = dist.distributed_c10d._get_default_group()
    pg = default._get_backend(torch.device("cpu")).made()  # the group itself (deferred.py)
    rows = []
    for op in args.ops:
        for nbytes in args.sizes:
            n = max(1, nbytes // 4)
            n -= n % world if op == "all_to_all" and n >= world else 0
            t = torch.full((n * world if op == "reduce_scatter" else n,), float(rank + 1))
            out = torch.empty(n if op in ("reduce_scatter", "all_to_all") else n * world)
            layers = _layers(op, pg, default, t, out)
            for f in layers:
                for _ in range(args.calls):
                    f()
            t.fill_(float(rank + 1))
            layers[-1]()  # the values, once: every layer ran the same collective
            want = {"all_reduce": world * (world + 1) / 2, "broadcast": 1.0,
                    "reduce_scatter": world * (world + 1) / 2}.get(op)
            got = [float(out[0])] if op == "reduce_scatter" else \
                [float(out[j * n]) for j in range(world)] if op == "all_gather" else \
                [float(out[j * (n // world)]) for j in range(world)] if op == "all_to_all" \
                else [float(t[0])]
            ok = got == ([want] if want is not None else [j + 1.0 for j in range(world)])
            times = {name: [] for name in LAYERS}
            cpu = {name: [] for name in LAYERS}
            for block in range(args.blocks):
                order = list(zip(LAYERS, layers))
                for name, f in (order if block % 2 == 0 else order[::-1]):
                    pg.group.barrier()
                    t0, c0 = time.perf_counter(), time.process_time()
                    for _ in range(args.calls):
                        f()
                    times[name].append((time.perf_counter() - t0) / args.calls * 1e6)
                    cpu[name].append((time.process_time() - c0) / args.calls * 1e6)
            rows.append((op, nbytes, ok, {k: statistics.median(v) for k, v in times.items()},
                         {k: statistics.median(v) for k, v in cpu.items()}))
    dist.destroy_process_group()
    if rank == 0:
        queue.put(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lab.front_layers",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--sizes", default="8,64K")
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--world-size", type=int, default=2)
    args = ap.parse_args(argv)
    args.ops = [o for o in args.ops.split(",") if o]
    args.sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    bad = [o for o in args.ops if o not in OPS]
    if bad:
        ap.error(f"unknown ops {bad}; known: {', '.join(OPS)}")
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_rank, args=(args.world_size, tempfile.mktemp(prefix="shmcoll-front-"), args,
                          queue), nprocs=args.world_size)
    rows = queue.get()
    print(f"{'op':11s} {'bytes':>8s}  " + "  ".join(f"{k:>22s}" for k in LAYERS))
    wrong = 0
    for op, nbytes, ok, med, cpu in rows:
        for label, values in (("", med), ("cpu", cpu)):
            cells, below = [], None
            for k in LAYERS:
                cells.append(f"{values[k]:8.1f} us" + (f" (+{values[k] - below:5.1f})"
                                                       if below is not None else " " * 9))
                below = values[k]
            print(f"{op if not label else '  ' + label:11s} {nbytes:8d}  "
                  + "  ".join(f"{c:>22s}" for c in cells)
                  + ("" if ok or label else "  WRONG VALUES"))
        wrong += not ok
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
