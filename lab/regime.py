"""How one engine collective's time moves over seconds in the same two rank processes: the
machine's regimes, not the code's.

    python -m lab.regime                                  # all_gather 1 MiB out, 4 s
    python -m lab.regime --op all_reduce --nbytes 4M --seconds 10 --launches 3

Each launch starts two rank processes with one group (this tree), float32 buffers
allocated by torch (4 KiB pages, as dist.*'s tensors), 20 warm-up calls, then blocks of
`--calls` calls for `--seconds`, each block timed as a whole on rank 0 and the result
verified after it. Prints every `--every`-th block's per-call time in µs, then the
launch's min / median / max over all blocks. On the 2-core VM (2026-11-28) all_gather of
1 MiB went from ~60 to ~220 µs and back within one launch, with no thread but the two
ranks' main threads using CPU (docs/notes/2026-11-28-first-call-registries.md): compare
versions only alternated within one run (lab.ab_engine).
"""

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

from benchmarks.sizes import parse_size

__all__ = ["main"]


def _rank(r, store, op, nbytes, seconds, calls, q):
    import numpy as np
    import torch

    import shmcoll
    g = shmcoll.new_shm_group(shmcoll.FileStore(store), r, 2)
    n = nbytes // 4
    if op == "all_gather":
        inp = torch.full((n // 2,), float(r + 1)).numpy()
        out = torch.zeros(n).numpy()
        call = lambda: g.all_gather(out, inp)  # noqa: E731
        want = np.concatenate([np.full(n // 2, 1.0, np.float32), np.full(n // 2, 2.0,
                                                                            np.float32)])
        check = lambda: np.array_equal(out, want)  # noqa: E731
    else:
        buf = torch.zeros(n).numpy()

        def call():
            buf[:] = r + 1
            g.all_reduce(buf)
        check = lambda: bool((buf == 3.0).all())  # noqa: E731
    for _ in range(20):
        call()
    times = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - t) / calls)
        if not check():
            raise AssertionError(f"rank {r}: wrong {op} result")
        end_flag = np.array([time.monotonic() >= end], np.int64)
        g.all_reduce(end_flag)  # both ranks end after the same block
        if end_flag[0]:
            break
    if r == 0:
        q.put(times)
    g.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", choices=("all_gather", "all_reduce"), default="all_gather")
    ap.add_argument("--nbytes", default="1M", help="all_gather: the output; all_reduce: the "
                                                   "buffer (suffixes K/M)")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--launches", type=int, default=2)
    ap.add_argument("--every", type=int, default=10)
    a = ap.parse_args(argv)
    nbytes = parse_size(a.nbytes)
    with tempfile.TemporaryDirectory() as tmp:
        for launch in range(a.launches):
            q = mp.get_context("spawn").Queue()
            store = os.path.join(tmp, f"store{launch}")
            procs = [mp.get_context("spawn").Process(
                target=_rank, args=(r, store, a.op, nbytes, a.seconds, a.calls, q))
                for r in range(2)]
            for p in procs:
                p.start()
            times = q.get(timeout=a.seconds + 120)
            for p in procs:
                p.join(60)
            if any(p.exitcode != 0 for p in procs):
                sys.exit(f"launch {launch}: a rank failed ({[p.exitcode for p in procs]})")
            us = [round(t * 1e6) for t in times]
            print(f"launch {launch}: {a.op} {a.nbytes}, µs per call, every {a.every}th block "
                  f"of {a.calls}: {us[::a.every]}")
            print(f"  min {min(us)}  median {statistics.median(us)}  max {max(us)} "
                  f"over {len(us)} blocks")


if __name__ == "__main__":
    main()
