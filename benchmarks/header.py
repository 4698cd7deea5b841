"""The header of a benchmark run: the machine, the software, the commit and the settings
(make_header, the first JSON line of --out), and the same as printed (format_header).
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

from benchmarks import device as device_mod
from benchmarks.traffic import usable_cores
from benchmarks.peers import find_mpirun
from benchmarks.rows import MEMCPY, MPI4PY
from benchmarks.sizes import human

__all__ = ["git_commit", "make_header", "format_header"]


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


def export_revision(rev: str, into) -> Path:
    """This repository's tree at git revision `rev`, unpacked into directory `into` (the
    older version of an in-run comparison: benchmarks.init_time --base, lab.ab)."""
    repo = Path(__file__).resolve().parent.parent
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev], check=True,
                             capture_output=True).stdout
    tar = Path(into) / "base.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    tar.unlink()
    return Path(into)


def engine_module(tree, name: str) -> str:
    """The dotted name of shmcoll's engine module `name` (warmup, init_phases) in `tree`, a
    copy of this repository: shmcoll.engine.<name> since the layered tree (2026-11-28),
    shmcoll.<name> in the revisions before it (an older version of an in-run comparison)."""
    new = Path(tree) / "shmcoll" / "engine" / f"{name}.py"
    return f"shmcoll.engine.{name}" if new.exists() else f"shmcoll.{name}"


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
        dirs = [git]
        try:  # a linked worktree keeps its refs in the main repository ("commondir")
            dirs.append((git / (git / "commondir").read_text().strip()).resolve())
        except OSError:
            pass
        for where in dirs:
            try:
                return (where / ref).read_text().strip()
            except OSError:
                pass
            try:
                for line in (where / "packed-refs").read_text().splitlines():
                    if line.endswith(" " + ref):
                        return line.split()[0]
            except OSError:
                pass
        return None  # e.g. a branch without commits yet
    return None


def make_header(args) -> dict:
    import torch

    usable = usable_cores()
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
            "fresh_inputs", "timeout", "init_timeout", "stall_timeout")},
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
        f"seed={s['seed']} rounds={s.get('rounds', 1)}"
        + (" inputs=fresh (rewritten before every call)" if s.get("fresh_inputs") else ""),
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
