"""One rank of benchmarks.ddp_step: the models, their synthetic data, and the training loop
of a DDP or FSDP2 rank (or of the single compute-only process), with its parameter digests.

FSDP2 (`fully_shard`, torch >= 2.6): every layer with parameters is a unit of its own, then
the root, on a 1-D DeviceMesh over the benchmarked group; each step all-gathers each unit's
parameters in forward (and again in backward: reshard_after_forward) and reduce-scatters
its gradients. The final parameters are gathered (full_tensor) after the timed steps.

The parent (benchmarks/ddp_step.py) spawns _worker(rank, cfg). Rank 0 writes result.json
(every rank's timings and final-parameter digest, the replica check) and params.pt (its
final parameters) into cfg['rundir']; any error goes to fatal.rank<r>.txt and exit status 1.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

__all__ = ["MODELS", "WRAPPERS", "NUM_CLASSES", "LR", "build_model", "make_batches",
           "flat_params", "digest", "wrap"]

MODELS = {
    # name: (batch size, input shape without batch, loss)
    "mlp": (32, (1024,), "mse"),
    "convnet": (16, (3, 32, 32), "cross_entropy"),
}
NUM_CLASSES = 10
LR = 0.01
WRAPPERS = ("ddp", "fsdp2")
_TORCH_BACKENDS = {"gloo", "nccl", "mpi", "ucc", "xccl", "fake", "threaded"}


class _Fatal(Exception):
    pass


# ---------------------------------------------------------------------------------------
# models and data (run inside the ranks)
# ---------------------------------------------------------------------------------------
def build_model(name: str, seed: int):
    import torch
    import torch.nn as nn

    torch.manual_seed(seed)
    if name == "mlp":
        return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                             nn.ReLU(), nn.Linear(1024, NUM_CLASSES))
    if name == "convnet":
        return nn.Sequential(nn.Conv2d(3, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Conv2d(64, 64, 3), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, NUM_CLASSES))
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")


def make_batches(name: str, seed: int, rank: int, count: int):
    """`count` (input, target) batches, a deterministic function of (seed, rank)."""
    import torch

    batch, shape, loss = MODELS[name]
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 7_919 * (rank + 1))
    out = []
    for _ in range(count):
        x = torch.randn(batch, *shape, generator=gen)
        if loss == "mse":
            y = torch.randn(batch, NUM_CLASSES, generator=gen)
        else:
            y = torch.randint(0, NUM_CLASSES, (batch,), generator=gen)
        out.append((x, y))
    return out


def flat_params(model):
    """Every parameter, flattened into one tensor (FSDP2's sharded ones gathered whole: a
    collective, so every rank calls it)."""
    import torch

    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                      .reshape(-1) for p in model.parameters()])


def wrap(model, wrapper: str, world_size: int):
    """The model as the training loop calls it: DDP (default bucket settings) or FSDP2."""
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model)
    if wrapper != "fsdp2":
        raise ValueError(f"unknown wrapper {wrapper!r}; known: {', '.join(WRAPPERS)}")
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        raise _Fatal("FSDP2 needs torch >= 2.6 (the public torch.distributed.fsdp."
                     "fully_shard)") from None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.modules():
        if layer is not model and any(True for _ in layer.parameters(recurse=False)):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def digest(model, flat=None) -> dict:
    """sha256 of the raw bytes of all parameters (bitwise identity) + float64 sum."""
    import torch

    flat = (flat_params(model) if flat is None else flat).contiguous()
    return {"sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
            "sum": float(flat.to(torch.float64).sum()),
            "finite": bool(torch.isfinite(flat).all()),
            "numel": int(flat.numel())}


# ---------------------------------------------------------------------------------------
# the rank process
# ---------------------------------------------------------------------------------------
def _worker(rank: int, cfg: dict) -> None:
    """One rank (or the single compute-only process when cfg['backend'] is None).

    Rank 0 writes result.json (timings of all ranks, digests, replica check) and
    params.pt (its final parameters, flattened) into cfg['rundir']. Any error is written
    to fatal.rank<r>.txt and the process exits with status 1.
    """
    rundir = Path(cfg["rundir"])
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist = None
    try:
        import warnings

        import torch
        import torch.nn.functional as F

        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning)
        torch.set_num_threads(1)
        backend, n = cfg["backend"], cfg["world_size"]
        name, seed = cfg["model"], cfg["seed"]
        timeout = datetime.timedelta(seconds=cfg["op_timeout"])

        meta = None
        if backend is not None:
            import torch.distributed as dist

            import_error = None
            try:
                import shmcoll  # noqa: F401  registers the "shm" backend
            except BaseException as e:  # noqa: BLE001 - report it if init fails
                import_error = f"{type(e).__name__}: {e}"
            try:
                dist.init_process_group(backend=backend, init_method=cfg["init_method"],
                                        rank=rank, world_size=n, timeout=timeout)
            except BaseException as e:  # noqa: BLE001
                msg = f"init_process_group(backend={backend!r}) failed: {type(e).__name__}: {e}"
                if import_error and backend.split(":")[-1].lower() not in _TORCH_BACKENDS:
                    msg += f"\n    import shmcoll failed: {import_error}"
                raise _Fatal(msg) from e
            # bookkeeping (timings, digests) never goes through the benchmarked backend
            meta = dist.new_group(backend="gloo", timeout=timeout)

        model = build_model(name, seed)  # identical on every rank and for every backend
        init = digest(model)
        net = wrap(model, cfg["wrapper"], n) if backend is not None else model
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        loss_fn = F.mse_loss if MODELS[name][2] == "mse" else F.cross_entropy
        data_rank = rank if backend is not None else 0
        batches = make_batches(name, seed, data_rank, cfg["warmup"] + cfg["steps"])

        def step(x, y):
            opt.zero_grad()
            loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
            return loss

        for x, y in batches[: cfg["warmup"]]:
            step(x, y)
        if meta is not None:
            dist.barrier(group=meta)
        times = []
        clock = time.perf_counter_ns
        loss = None
        for x, y in batches[cfg["warmup"]:]:
            t0 = clock()
            loss = step(x, y)
            times.append(clock() - t0)
        inject = cfg.get("inject_error")
        if inject == "replica" and rank == n - 1 or inject == "backend":
            with torch.no_grad():  # self-test of the verification: must show up as mismatch
                first = next(model.parameters())  # FSDP2: this rank's shard of it
                (first.to_local() if hasattr(first, "to_local") else first).view(-1)[0] += 1e-3
        final = flat_params(model)  # FSDP2: gathered on every rank
        mine = {"rank": rank, "median_ns": statistics.median(times), "min_ns": min(times),
                "mean_ns": statistics.fmean(times), "final": digest(model, final),
                "loss": float(loss.detach()) if loss is not None else None}

        if meta is not None:
            gathered = [None] * n
            dist.all_gather_object(gathered, mine, group=meta)
        else:
            gathered = [mine]
        if rank == 0:
            hashes = [g["final"]["sha256"] for g in gathered]
            result = {
                "init": init,
                "ranks": gathered,
                "replicas_identical": len(set(hashes)) == 1,
                "diverged_ranks": [g["rank"] for g in gathered if g["final"]["sha256"]
                                   != hashes[0]],
                "finite": all(g["final"]["finite"] for g in gathered),
                "trained": gathered[0]["final"]["sha256"] != init["sha256"],
            }
            torch.save(final.clone(), rundir / "params.pt")
            tmp = rundir / "result.json.tmp"
            tmp.write_text(json.dumps(result))
            tmp.rename(rundir / "result.json")
        if meta is not None:
            dist.barrier(group=meta)  # nobody tears down while rank 0 still writes
            del net
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        text = str(e) if isinstance(e, _Fatal) else traceback.format_exc()
        try:
            (rundir / f"fatal.rank{rank}.txt").write_text(text)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
