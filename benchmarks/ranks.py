"""The torch ranks of benchmarks.bench: run_config spawns and supervises the ranks of one
(backend, world size), _worker is one rank, _bench_one times one (op, size) on a rank.

Every rank runs every (op, size): warm up, verify, time, verify again. The ranks combine
their medians and wrong counts over a gloo side group, and rank 0 appends the row to the
events file that the parent follows (benchmarks/supervise.py). _bench_one and make_row are
also the mpi4py peer's (benchmarks/mpi_peer.py); the DeepSpeed peer's ranks are these
ranks with DeepSpeed's op as the timed call (benchmarks/deepspeed_peer.py).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks import collectives
from benchmarks import device as device_mod
from benchmarks.peers import run_memcpy, run_mpi_config
from benchmarks import traffic
from benchmarks.rows import DEEPSPEED, MEMCPY, MPI4PY, Reporter, make_row
from benchmarks.sizes import plan_iterations
from benchmarks.supervise import (_EventLog, _free_port, _rank_cfg, _read_fatals,
                                  _shm_entries, _stop, _summarize, _supervise,
                                  _warn_shm_leaks)

__all__ = ["run_config"]

# Backends torch knows without importing shmcoll; any other name needs `import shmcoll`.
_TORCH_BACKENDS = {"gloo", "nccl", "mpi", "ucc", "xccl", "fake", "threaded"}


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
        settle(dist.barrier, lambda flag: _any_rank(flag, meta))
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
                    row = make_row(
                        backend, spec, n, nbytes, count, cfg["dtype"], iters, warm,
                        allv[:, 0].tolist(), allv[:, 1].tolist(), int(allv[:, 2].sum()))
                    algorithm = traffic.algorithm_of(spec.name, nbytes, n) \
                        if peer_call is None else None
                    if algorithm is not None:  # shm: the traffic model's row (traffic.py)
                        row["algorithm"] = algorithm
                    emit(event="row", row=row)
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


# Before its first row every rank pair settles: a fresh group's first 10-20 ms of calls ran
# 2-6x slower here (2 ranks, 64 KiB all_reduce, medians of 300 calls: 79 then 15 us; both
# ranks on one core until the scheduler spreads them, caches and predictors cold), and the
# first row of every run took it whole. Barriers for SETTLE_S, the ranks agreeing when to
# stop through a side channel, for every backend alike (the mpi4py peer too). Measured:
# first 300-call medians after 0.25 s of barriers 15-17 us in 3 of 3 pairs; without, 25-79.
SETTLE_S = 0.25
SETTLE_BATCH = 50


def settle(barrier, any_rank, seconds=SETTLE_S) -> int:
    """Call `barrier()` in batches until some rank has spent `seconds` from the first one's
    return (a group made lazily is made by that one) (`any_rank(flag)`: True on every
    rank when `flag` is True on any, through a channel other than the one measured);
    returns the barriers called, the same on every rank."""
    barrier()
    t0 = time.monotonic()
    calls = 1
    while True:
        for _ in range(SETTLE_BATCH):
            barrier()
        calls += SETTLE_BATCH
        if any_rank(time.monotonic() - t0 >= seconds):
            return calls


def _any_rank(flag, group) -> bool:
    """`flag` of any rank, through the gloo side group `group`."""
    import torch
    import torch.distributed as dist
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item() > 0)


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
        if cfg.get("fresh_inputs") and buf.pristine is None and buf.inp is not buf.out:
            buf.pristine = buf.inp.clone()  # reset() rewrites the input from it every call
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


def run_config(backend: str, world_size: int, args, rep: Reporter) -> None:
    """One (backend, world size): the peers (memcpy, mpi4py) or torch ranks."""
    if backend == MEMCPY:
        run_memcpy(args, rep)
        return
    if backend == MPI4PY:
        run_mpi_config(backend, world_size, args, rep)
        return
    extra = {}
    why = device_mod.nccl_unavailable(args.device, world_size) if backend == "nccl" else None
    if why:
        rep.skip(backend, world_size, why)
        return
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
