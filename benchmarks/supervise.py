"""The parent's side of a run of ranks: their events, deadlines, stragglers and leftovers.

Rank 0 appends events (ready, begin, row, op_error, done, fatal) to <rundir>/events.jsonl;
_EventLog follows that file and _supervise enforces --init-timeout, --stall-timeout,
--timeout and --fail-grace on it. Shared by the torch ranks (benchmarks/ranks.py) and the
mpi4py peer under mpirun (benchmarks/peers.py).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from benchmarks import device as device_mod
from benchmarks.rows import Reporter

__all__ = ["_free_port", "_shm_entries", "_summarize", "_stop", "_EventLog", "_supervise",
           "_read_fatals", "_warn_shm_leaks", "_rank_cfg"]


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
        fresh_inputs=getattr(args, "fresh_inputs", False),
        inject_error=args.inject_error, device=args.device,
        env=device_mod.rank_env(args.device, backend)), **extra}
