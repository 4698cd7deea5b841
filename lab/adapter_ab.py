"""A/B of how the torch adapter takes a tensor's memory: `Tensor.numpy()` (the old way, which
pins the tensor's storage: it can never be resized again) against the array interface
(`convert.plain_array` / `convert.tensor_array`, the tensor left as it was).

    python -m lab.adapter_ab                       # 8 B and 1 MiB, 2 ranks, 12 rounds
    python -m lab.adapter_ab --sizes 8,1M,64K --rounds 20 --out results/ab.jsonl

Two ranks (spawned processes, backend "shm", file:// rendezvous) run `dist.all_reduce` of
float32 tensors in blocks of calls. Each round runs, per size and path, one block with
variant "numpy" and one with "interface", the first variant alternating from round to round,
so load changes on a shared machine hit both alike. Path "sync" is `dist.all_reduce(t)` (the
latency path, fast.py); "async" is `dist.all_reduce(t, async_op=True).wait()` (the general
path, reductions.py). A variant is switched by swapping the one function each path takes
the memory with, in both ranks at the same block boundary. Reported per row: the median and
the best of the rounds' per-call times (rank 0's clock; the ranks run in lock step), and
interface / numpy of the medians. Each block ends with one more call whose result is
checked.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["main"]

VARIANTS = ("numpy", "interface")
PATHS = ("sync", "async")


def _numpy_as_array(t, for_reduce=True):
    """The adapter's general-path conversion before the array interface (for variant A)."""
    from shmcoll.torch_backend import convert
    t = t.detach()
    name = convert.SUPPORTED_DTYPES.get(t.dtype)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view("uint16"), name
    return t.numpy(), name


def _use(variant):
    from shmcoll.torch_backend import convert, fast, movement, reductions
    if variant == "numpy":
        fast._array = lambda t: t.numpy()
        reductions.as_array = movement.as_array = _numpy_as_array
    else:
        fast._array = convert.plain_array
        reductions.as_array = movement.as_array = convert.as_array


def _call(t, path):
    if path == "sync":
        dist.all_reduce(t)
    else:
        dist.all_reduce(t, async_op=True).wait()


def _block(t, calls, path, world_size):
    """Per-call ns of `calls` all_reduces of t; then one more, checked."""
    t.zero_()
    dist.barrier()
    start = time.perf_counter_ns()
    for _ in range(calls):
        _call(t, path)
    elapsed = time.perf_counter_ns() - start
    t.fill_(dist.get_rank() + 1.0)
    _call(t, path)
    want = world_size * (world_size + 1) / 2
    if not bool((t == want).all()):
        raise AssertionError(f"wrong result: {t[:4].tolist()} (want {want})")
    return elapsed / calls


def _rank(rank, world_size, init_file, cfg, queue):
    import shmcoll  # noqa: F401  (registers "shm")

    torch.set_num_threads(1)
    dist.init_process_group("shm", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    rows = []
    try:
        tensors = {n: torch.ones(max(n // 4, 1)) for n in cfg["sizes"]}
        for variant in VARIANTS:  # warm both variants (plans, caches, kernels)
            _use(variant)
            for n, t in tensors.items():
                for path in cfg["paths"]:
                    _block(t, 20, path, world_size)
        for rnd in range(cfg["rounds"]):
            order = VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]
            for n, t in tensors.items():
                calls = max(20, min(cfg["calls"], cfg["block_bytes"] // n))
                for path in cfg["paths"]:
                    for variant in order:
                        _use(variant)
                        ns = _block(t, calls, path, world_size)
                        rows.append({"round": rnd, "nbytes": n, "path": path,
                                     "variant": variant, "us": ns / 1000, "calls": calls})
        queue.put((rank, rows, None))
    except BaseException as e:  # reported by the parent
        queue.put((rank, None, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def run(cfg):
    """Spawn the ranks; rank 0's rows."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="shmcoll_ab_") as tmp:
        procs = [ctx.Process(target=_rank, args=(r, cfg["world_size"], f"{tmp}/rdv", cfg, queue))
                 for r in range(cfg["world_size"])]
        for p in procs:
            p.start()
        results = {}
        deadline = time.monotonic() + cfg["timeout_s"]
        while len(results) < len(procs) and time.monotonic() < deadline:
            if not queue.empty():
                rank, rows, error = queue.get()
                if error:
                    raise RuntimeError(f"rank {rank}: {error}")
                results[rank] = rows
            elif any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError(f"a rank died: exit codes {[p.exitcode for p in procs]}")
            else:
                time.sleep(0.05)
        for p in procs:
            p.join(10 if len(results) == len(procs) else 0)
            if p.is_alive():
                p.kill()
        if len(results) < len(procs):
            raise RuntimeError(f"timed out after {cfg['timeout_s']} s")
    return results[0]


def summarize(rows):
    """[(nbytes, path, {variant: (median us, best us)}, ratio)] in input order."""
    keys = []
    for r in rows:
        k = (r["nbytes"], r["path"])
        if k not in keys:
            keys.append(k)
    out = []
    for k in keys:
        stats = {}
        for v in VARIANTS:
            us = [r["us"] for r in rows if (r["nbytes"], r["path"]) == k and r["variant"] == v]
            stats[v] = (statistics.median(us), min(us))
        out.append((k[0], k[1], stats, stats["interface"][0] / stats["numpy"][0]))
    return out


def _size(text):
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if text[-1:] in "KMG" else text) * mult


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8,1M", help="comma list of message sizes (K, M suffixes)")
    p.add_argument("--paths", default="sync,async", help="sync (latency path), async (general)")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--calls", type=int, default=2000, help="calls per block (at most)")
    p.add_argument("--block-bytes", type=int, default=256 << 20,
                   help="caps calls x size per block")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", help="JSON lines: one per block of rank 0")
    a = p.parse_args(argv)
    cfg = {"sizes": [_size(s) for s in a.sizes.split(",")],
           "paths": [x for x in a.paths.split(",") if x in PATHS], "rounds": a.rounds,
           "calls": a.calls, "block_bytes": a.block_bytes, "world_size": a.world_size,
           "timeout_s": a.timeout}
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = run(cfg)
    if a.out:
        with open(a.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print(f"dist.all_reduce float32, {a.world_size} ranks, {a.rounds} rounds, variants "
          f"alternating; per-call us (median of rounds / best)")
    print(f"{'bytes':>9} {'path':>6} {'numpy':>17} {'interface':>17} {'interface/numpy':>16}")
    for n, path, stats, ratio in summarize(rows):
        cells = [f"{stats[v][0]:8.2f} / {stats[v][1]:6.2f}" for v in VARIANTS]
        print(f"{n:>9} {path:>6} {cells[0]:>17} {cells[1]:>17} {ratio:>16.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
