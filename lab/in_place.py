"""all_gather in place (the input a view of its own block of the output, as FSDP2 and
ZeRO call all_gather_into_tensor) against out of place, for shmcoll's engine and Open
MPI (MPI_IN_PLACE), alternating in blocks in the same rank processes (under mpirun).

    python -m lab.in_place                         # 2 ranks: 64 KiB, 1, 4, 16 MiB outputs
    python -m lab.in_place --ranks 4 --sizes 1M,4M --seconds 8

Buffers are allocated by torch (4 KiB pages, as dist.*'s tensors). Prints, per size, the
median per-call time of each variant over the blocks (rank 0) and the median over blocks
of the in-place / out-of-place ratios; every output is checked at the end.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

__all__ = ["main"]


def _rank(store, nbytes, seconds):
    import numpy as np
    import torch
    from mpi4py import MPI

    import shmcoll
    comm = MPI.COMM_WORLD
    r, n = comm.Get_rank(), comm.Get_size()
    g = shmcoll.new_shm_group(shmcoll.FileStore(store), r, n)
    per = nbytes // 4 // n
    inp = torch.full((per,), float(r + 1)).numpy()
    outs = [torch.zeros(per * n).numpy() for _ in range(4)]
    for o in outs[1:]:
        o[r * per:(r + 1) * per] = r + 1
    mine = outs[1][r * per:(r + 1) * per]
    calls = {"shm": lambda: g.all_gather(outs[0], inp),
             "shm in place": lambda: g.all_gather(outs[1], mine),
             "mpi": lambda: comm.Allgather(inp, outs[2]),
             "mpi in place": lambda: comm.Allgather(MPI.IN_PLACE, outs[3])}
    for call in calls.values():
        for _ in range(10):
            call()
    times = {k: [] for k in calls}
    block = max(5, min(200, (20 << 20) // max(nbytes, 1)))
    end = time.monotonic() + seconds
    while True:
        for k, call in calls.items():
            comm.Barrier()
            t = time.perf_counter()
            for _ in range(block):
                call()
            times[k].append((time.perf_counter() - t) / block * 1e6)
        if comm.bcast(time.monotonic() > end, root=0):
            break
    want = np.repeat(np.arange(1, n + 1, dtype=np.float32), per)
    wrong = [k for k, o in zip(calls, outs) if not np.array_equal(o, want)]
    g.close()
    if wrong:
        raise AssertionError(f"rank {r}: wrong all_gather results: {wrong}")
    if r == 0:
        t = {k: np.array(v) for k, v in times.items()}
        print(f"{nbytes >> 10:>7} KiB  " + "  ".join(f"{k} {np.median(v):7.0f}"
                                                    for k, v in t.items())
              + f"  | in place / out of place: shm {np.median(t['shm in place'] / t['shm']):.2f}"
              f" mpi {np.median(t['mpi in place'] / t['mpi']):.2f}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lab.in_place",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", default="64K,1M,4M,16M", help="output bytes (suffixes K, M)")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rank-of", nargs=3, help=argparse.SUPPRESS)  # store nbytes seconds
    args = ap.parse_args(argv)
    if args.rank_of:
        _rank(args.rank_of[0], int(args.rank_of[1]), float(args.rank_of[2]))
        return 0
    from benchmarks.sizes import parse_size
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        sys.exit("mpirun not found (pip install -e '.[peers]')")
    print(f"all_gather, {args.ranks} ranks, us per call (median over blocks, rank 0)")
    with tempfile.TemporaryDirectory(prefix="shmcoll-in-place-") as tmp:
        for i, size in enumerate(s for s in args.sizes.split(",") if s):
            subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-n",
                            str(args.ranks), "--bind-to", "none", "--mca", "pml", "ob1",
                            "--mca", "btl", "self,sm", sys.executable, "-m", "lab.in_place",
                            "--rank-of", os.path.join(tmp, f"store{i}"),
                            str(parse_size(size)), str(args.seconds)], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
