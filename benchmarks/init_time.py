"""Warm init_process_group: backend "shm" against gloo, with shm's phases.

    python -m benchmarks.init_time                          # 2 ranks, 11 rounds
    python -m benchmarks.init_time --world-sizes 2,4 --rounds 21 \\
        --out docs/results/init_time.jsonl
    python -m benchmarks.init_time --base main              # also shm of another revision

Warm: numba's cache already holds the kernels (`python -m shmcoll.engine.warmup` once, or any
earlier job), Python's bytecode cache holds shmcoll's modules (as after any install; the
ranks run without PYTHONDONTWRITEBYTECODE, after one uncounted run), and every rank is a process that has already imported torch and shmcoll
when the clock starts: what an elastic restart, a test that makes a group, or a job's
start pays after the first one on a machine. Each measurement is a fresh set of processes
(a kernel loaded by an earlier group in the same process would make it hot, not warm):
they import, say they are ready, and start init_process_group (tcp:// or file://)
together when the parent says go. Each rank times

    init          init_process_group alone
    init + first  init_process_group and a first 4 KiB float32 all_reduce (verified)

and a row takes the slowest rank's (a group is ready when its last rank is). Every round
runs each backend once, in an order that alternates between rounds, so all meet the same
machine; the summary gives medians over the rounds and the median (and range) of the
rounds' ratios to gloo.

`--base REV|DIR` adds backend "shm@base": shm from a git revision of this repository
(exported with `git archive`, its kernels warmed first) or a directory holding another
copy, so an old and a new shm meet the same machine in the same run.

For shm each rank also reports the phases of its group's creation (shmcoll.engine.init_phases:
node discovery, segments, kernel loads in the warm-up thread, ...), printed as the median
start and duration of each phase, relative to that rank's start of init_process_group;
"torch and store (rest of init)" is what the phases leave of init_process_group (torch's
rendezvous and c10d set-up; the group's creation runs on its own thread since
torch_backend/deferred.py, so its phases no longer count against init). `--preload` loads the warm-up's kernels before the clock
starts: a diagnostic, init without numba's first use in the process.
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.header import engine_module, export_revision

__all__ = ["main", "run_once"]

_REPO = Path(__file__).resolve().parent.parent
BASE = "shm@base"

_RANK = r'''
import datetime, json, sys, time
r, n, backend, init, preload = sys.argv[1:6]
r, n = int(r), int(n)
import torch, torch.distributed as dist
torch.set_num_threads(1)
t = time.perf_counter()
import shmcoll
import_s = time.perf_counter() - t
import importlib
try:  # shmcoll/engine/ since the layered tree, shmcoll/ before
    init_phases = importlib.import_module("shmcoll.engine.init_phases")
except ImportError:
    try:
        init_phases = importlib.import_module("shmcoll.init_phases")
    except ImportError:  # a revision from before init_phases
        init_phases = None
if preload == "preload":
    try:
        warmup = importlib.import_module("shmcoll.engine.warmup")
    except ImportError:
        warmup = importlib.import_module("shmcoll.warmup")
    warmup.warm_up(warmup.FIRST_REDUCERS)
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter_ns()
dist.init_process_group(backend, init_method=init, rank=r, world_size=n,
                        timeout=datetime.timedelta(seconds=60))
t1 = time.perf_counter_ns()
t = torch.full((1024,), r + 1.0)
dist.all_reduce(t)
t2 = time.perf_counter_ns()
if not bool((t == n * (n + 1) / 2).all()):
    raise AssertionError(f"rank {r}: all_reduce gave {t[:4]}")
phases = [dict(p, start_ns=p["start_ns"] - t0, end_ns=p["end_ns"] - t0)
          for p in (init_phases.take() if init_phases else []) if p["start_ns"] >= t0]
dist.destroy_process_group()
print(json.dumps({"init_s": (t1 - t0) / 1e9, "first_s": (t2 - t0) / 1e9, "phases": phases,
                  "import_s": import_s, "t0_ns": t0}))
'''

# the phases whose sum is shm's backend creator: the rest of init_process_group is torch's
# (when the creator ran them inside init_process_group: since the creation moved to its own
# thread, torch_backend/deferred.py, they overlap what follows init)
_CREATOR = ("node discovery", "ProcessGroupShm")
_THREADS = {"shmcoll-warmup": "warm-up thread", "shmcoll-create": "creation thread"}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tree):
    # Bytecode on, as for an installed package (pip compiles it at install): with
    # PYTHONDONTWRITEBYTECODE (set on this VM) every rank compiled the ~60 modules that
    # init imports from source again, ~90 ms of a 2-rank init here; torch's own modules had
    # their .pyc. main() runs each tree once uncounted first, which writes them.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["PYTHONPATH"] = os.pathsep.join([str(tree)] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def run_once(backend, world_size, rendezvous="tcp", preload=False, tree=_REPO,
             timeout_s=120):
    """One warm init of `backend` in fresh processes importing shmcoll from `tree`: the
    ranks' results (list of dicts)."""
    tmp = tempfile.mkdtemp(prefix="shmcoll-init-time-")
    init = f"tcp://127.0.0.1:{_free_port()}" if rendezvous == "tcp" else \
        f"file://{tmp}/rendezvous"
    argv = [str(world_size), backend, init, "preload" if preload else "-"]
    # cwd: `python -c` puts it first on sys.path, before PYTHONPATH
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r)] + argv, env=_env(tree),
                              cwd=str(tree), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for r in range(world_size)]
    try:
        for r, p in enumerate(procs):
            if p.stdout.readline().strip() != "ready":
                p.wait(timeout_s)
                raise RuntimeError(f"{backend} rank {r} did not start: "
                                   f"{p.stderr.read()[-3000:]}")
        for p in procs:  # go: every rank has imported everything
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=timeout_s)
            if p.returncode != 0:
                raise RuntimeError(f"{backend} rank {r} failed (exit {p.returncode}):\n"
                                   f"{err[-3000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _base_tree(base, into):
    """A directory holding shmcoll of `base` (a directory, or a git revision exported into
    `into`), its kernels in numba's cache."""
    if Path(base).is_dir():
        tree = Path(base)
    else:
        tree = export_revision(base, into)
    subprocess.run([sys.executable, "-m", engine_module(tree, "warmup")], cwd=tree,
                   env=_env(tree), check=True, capture_output=True)
    return tree


def _row(rnd, backend, world_size, ranks):
    row = {"round": rnd, "backend": backend, "world_size": world_size,
           "load": os.getloadavg()[0],
           "init_s": max(r["init_s"] for r in ranks),
           "first_s": max(r["first_s"] for r in ranks),
           "init_s_rank": [r["init_s"] for r in ranks],
           "import_shmcoll_s": max(r["import_s"] for r in ranks)}
    if any(r["phases"] for r in ranks):
        row["phases"] = [r["phases"] for r in ranks]
    return row


def phase_table(rows, world_size):
    """Lines: per phase, the median start and duration (ms) on rank 0 and the last rank."""
    shown = (0, world_size - 1)
    by_key, order = {}, []  # (name, thread) -> {rank: [(start, duration)]}
    for row in rows:
        for r in shown:
            phases = row["phases"][r]
            creator = sum(p["end_ns"] - p["start_ns"] for p in phases
                          if p["name"] in _CREATOR and p["thread"] == "MainThread")
            rest = {"name": "torch and store (rest of init)", "thread": "",
                    "start_ns": 0, "end_ns": int(row["init_s_rank"][r] * 1e9) - creator}
            for p in phases + [rest]:
                key = (p["name"], _THREADS.get(p["thread"], ""))
                if key not in by_key:
                    by_key[key] = {}
                    order.append(key)
                by_key[key].setdefault(r, []).append(
                    (p["start_ns"] / 1e6, (p["end_ns"] - p["start_ns"]) / 1e6))
    lines = [f"{'phase':50} " + " ".join(f"{f'rank {r} start':>13} {'ms':>7}" for r in shown)]
    for key in order:
        cells = []
        for r in shown:
            got = by_key[key].get(r)
            cells.append(f"{statistics.median(s for s, _ in got):13.1f} "
                         f"{statistics.median(d for _, d in got):7.1f}" if got else
                         f"{'-':>13} {'-':>7}")
        name = key[0] + (f" ({key[1]})" if key[1] else "")
        lines.append(f"{name:50} " + " ".join(cells))
    return lines


def summary(rows, backends, sizes):
    """Lines: per world size and measure, each backend's median and its rounds' ratios to
    gloo (median and range)."""
    lines = [f"{'ranks':5} {'measure':24} " + " ".join(f"{b + ' ms':>12}" for b in backends)
             + "   " + "   ".join(f"{b}/gloo (range)" for b in backends if b != "gloo")]
    for ws in sizes:
        for measure, key in (("init", "init_s"), ("init + first all_reduce", "first_s")):
            got = {b: {r["round"]: r[key] for r in rows
                       if r["backend"] == b and r["world_size"] == ws} for b in backends}
            line = f"{ws:5} {measure:24} " + " ".join(
                f"{statistics.median(got[b].values()) * 1e3:12.1f}" for b in backends)
            if "gloo" in got:
                for b in backends:
                    if b != "gloo":
                        ratios = [got[b][k] / got["gloo"][k] for k in got[b]]
                        line += f"   {statistics.median(ratios):5.2f} ({min(ratios):.2f}-" \
                                f"{max(ratios):.2f})"
            lines.append(line)
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.init_time",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--world-sizes", default="2")
    ap.add_argument("--backends", default="shm,gloo")
    ap.add_argument("--base", help="also run shm of this git revision or directory "
                                   "(backend shm@base)")
    ap.add_argument("--rendezvous", choices=("tcp", "file"), default="tcp")
    ap.add_argument("--preload", action="store_true",
                    help="load shm's first kernels before the clock starts (a diagnostic: "
                         "init without numba's first use)")
    ap.add_argument("--out", help="append one JSON line per (round, backend, world size)")
    args = ap.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    sizes = [int(w) for w in args.world_sizes.split(",") if w]
    with tempfile.TemporaryDirectory(prefix="shmcoll-init-base-") as tmp:
        trees = {b: _REPO for b in backends}
        if args.base:
            trees[BASE] = _base_tree(args.base, tmp)
            backends.append(BASE)
        for backend in backends:  # uncounted: writes each tree's .pyc files (_env)
            run_once("shm" if backend == BASE else backend, sizes[0], args.rendezvous,
                     args.preload, trees[backend])
        rows = []
        out = open(args.out, "a") if args.out else None
        load0 = os.getloadavg()
        for rnd in range(args.rounds):
            for ws in sizes:
                order = backends if rnd % 2 == 0 else backends[::-1]
                for backend in order:
                    ranks = run_once("shm" if backend == BASE else backend, ws,
                                     args.rendezvous, args.preload, trees[backend])
                    row = _row(rnd, backend, ws, ranks)
                    row.update(rendezvous=args.rendezvous, preload=args.preload,
                               base=args.base if backend == BASE else None)
                    rows.append(row)
                    print(f"round {rnd + 1} {backend} x{ws}: init {row['init_s'] * 1e3:.1f} "
                          f"ms, init + first all_reduce {row['first_s'] * 1e3:.1f} ms (load "
                          f"{row['load']:.1f})", flush=True)
                    if out:
                        out.write(json.dumps(row) + "\n")
                        out.flush()
        if out:
            out.close()
    load1 = os.getloadavg()
    print(f"\nwarm init, median of {args.rounds} rounds ({args.rendezvous}://"
          f"{', kernels preloaded' if args.preload else ''}; load average {load0[0]:.1f} / "
          f"{load0[1]:.1f} at the start, {load1[0]:.1f} / {load1[1]:.1f} at the end (1 / 5 "
          f"min), {os.cpu_count()} cores)")
    print("\n".join(summary(rows, backends, sizes)))
    for b in backends:
        for ws in sizes:
            got = [r for r in rows if r["backend"] == b and r["world_size"] == ws
                   and "phases" in r]
            if got:
                print(f"\n{b} phases at {ws} ranks (medians over {len(got)} rounds; ms from "
                      f"the rank's start of init_process_group)")
                print("\n".join(phase_table(got, ws)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
