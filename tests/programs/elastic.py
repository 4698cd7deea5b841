"""Elastic training under torchrun with restarts: a worker crashes, torchrun restarts the
job, and training resumes from its last checkpoint.

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 2 \\
        tests/programs/elastic.py --out DIR --backends gloo,shm

Each backend in turn trains a DDP model for STEPS steps, checkpointing after every step
(rank 0 saves, all wait). Attempt k (TORCHELASTIC_RESTART_COUNT) crashes rank 1 with
os._exit in the middle of backend k's training, after its CRASH_AT-th step: the surviving
rank's next collective fails (a lost peer), the agent restarts both workers, and backend k
resumes from its checkpoint. So every backend lives through one restart, in one torchrun
job. Each backend's final parameters go to DIR/<backend>/final.pt (rank 0); the test
compares them bitwise (2 ranks: each reduced element is one addition a + b).

Rendezvous: torchrun's agent keeps one store for all attempts, and env:// uses it without a
per-attempt prefix (where torchrun shares it with the workers, TORCHELASTIC_USE_AGENT_STORE;
torch 2.4's does not, and rank 0 hosts the job's store at MASTER_ADDR:MASTER_PORT, as env://
does then: job_store). After a restart, a gloo rank can read its peer's address from the dead
attempt before the peer rewrote it (a race: "Gloo connectFullMesh failed ... Connection
refused" in 2 of 3 runs here, torch 2.13, 60 s timeout; "shm" restarts fine, its rendezvous
keys carry a fresh token). So every (attempt, backend) gets a PrefixStore of its own over
the agent's store, as a user would do; it also keeps gloo's and shm's keys apart.
"""

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from programs.common import batches, mlp  # noqa: E402

STEPS = 5
CRASH_AT = 3


TIMEOUT = datetime.timedelta(seconds=60)


def job_store():
    """The attempt's store: torchrun's agent store where torchrun shares it with the workers,
    else one that rank 0 hosts (torch's env:// rendezvous decides the same way)."""
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                         is_master=not shared and rank == 0, timeout=TIMEOUT)


def train(backend, out, attempt, crash, job):
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ckpt = os.path.join(out, backend, "checkpoint.pt")
    final = os.path.join(out, backend, "final.pt")
    if os.path.exists(final):
        return  # finished in an earlier attempt
    os.makedirs(os.path.dirname(ckpt), exist_ok=True)
    store = dist.PrefixStore(f"attempt{attempt}/{backend}", job)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=TIMEOUT)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    ddp = DDP(model, bucket_cap_mb=0.001)
    data = batches(rank, STEPS)
    for step in range(start, STEPS):
        x, y = data[step]
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        if rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "step": step + 1}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()
        if crash and rank == 1 and step + 1 == CRASH_AT:
            print(f"{backend}: rank 1 crashes after step {step + 1}", flush=True)
            os._exit(17)
    if rank == 0:
        torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                    "resumed_from": start}, final)
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--backends", default="gloo,shm")
    a = p.parse_args()
    import shmcoll  # noqa: F401  (registers "shm")

    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    job = job_store()
    for index, backend in enumerate(a.backends.split(",")):
        train(backend, a.out, attempt, crash=(index == attempt), job=job)
    print(f"rank {os.environ['RANK']} done in attempt {attempt}", flush=True)
    # a store rank 0 hosts goes with its process: it leaves after everyone is done with it
    key = f"attempt{attempt}/finished"
    finished = job.add(key, 1)
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    while int(os.environ["RANK"]) == 0 and finished < int(os.environ["WORLD_SIZE"]):
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0: the other ranks did not finish with the job's store")
        time.sleep(0.05)
        finished = job.add(key, 0)


if __name__ == "__main__":
    main()
