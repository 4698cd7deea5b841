"""torchrun with restarts on backend "shm": a store of its own for every attempt.

    torchrun --standalone --nproc-per-node 2 --max-restarts 2 \\
        examples/torchrun_elastic.py --backend shm --out DIR --crash init,step

Two CPU ranks train a DDP model, rank 0 checkpointing after every step. --crash injects
one failure per attempt, in order: "init" kills rank 1 at start-up while rank 0 is already
creating the process group, "step" kills rank 1 after step CRASH_STEP; torchrun restarts
both workers and training resumes from the checkpoint. Rank 0 saves the final parameters
to DIR/final.pt; with --backend gloo they are the same bit for bit.

Why a store per attempt: torchrun's agent keeps one TCPStore for every attempt, and the
workers' env:// rendezvous uses it as it is (the agent prefixes its own rendezvous rounds,
not the workers' keys). So keys from a dead attempt are still there after a restart:
gloo can read a peer's address from the dead attempt ("Connection refused", now and then),
and "shm", which counts its group set-ups per rank in the store, finds the counters apart
after a rank died before it created its group ("init" above) and fails every later attempt
at once, telling you to do this. A PrefixStore named after TORCHELASTIC_RESTART_COUNT
gives each attempt empty keys. (One node: on several, the agents' restart counts can
differ, since a restart for a membership change does not count.)
"""

import argparse
import datetime
import os
import time

import shmcoll  # noqa: F401  (registers "shm")
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 5
CRASH_STEP = 3


def attempt_store(timeout):
    """This attempt's store: the job's store (the agent's under torchrun; rank 0's when
    TORCHELASTIC_USE_AGENT_STORE is off) under a prefix naming the attempt."""
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=not agent_hosts and os.environ["RANK"] == "0",
                          timeout=timeout)
    return dist.PrefixStore(f"attempt{os.environ['TORCHELASTIC_RESTART_COUNT']}", store), store


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="shm")
    p.add_argument("--out", required=True)
    p.add_argument("--crash", default="", help="failures to inject, one per attempt: "
                   "init and/or step, comma-separated")
    a = p.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    crashes = [c for c in a.crash.split(",") if c]
    crash = crashes[attempt] if attempt < len(crashes) else None
    print(f"rank {rank}: attempt {attempt}", flush=True)

    timeout = datetime.timedelta(seconds=60)
    store, job_store = attempt_store(timeout)
    if crash == "init":  # rank 1 dies once rank 0 is inside init_process_group
        if rank == 1:
            job_store.wait([f"attempt{attempt}/rank0-initialising"])
            time.sleep(0.5)
            print(f"rank 1 dies before init in attempt {attempt}", flush=True)
            os._exit(17)
        job_store.set(f"attempt{attempt}/rank0-initialising", "1")
    dist.init_process_group(a.backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = os.path.join(a.out, "checkpoint.pt")
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        print(f"rank {rank}: resumed from step {start}", flush=True)
    ddp = DDP(model)
    g = torch.Generator().manual_seed(100 + rank)  # this rank's data
    batches = [torch.randn(8, 8, generator=g) for _ in range(STEPS)]
    for step in range(start, STEPS):
        x = batches[step]
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True).sin()).backward()
        opt.step()
        if rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "step": step + 1}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()  # the checkpoint of this step is on disk
        if crash == "step" and rank == 1 and step + 1 == CRASH_STEP:
            print(f"rank 1 dies after step {step + 1} in attempt {attempt}", flush=True)
            os._exit(17)
    if rank == 0:
        torch.save({n: t.detach().clone() for n, t in model.named_parameters()},
                   os.path.join(a.out, "final.pt"))
    dist.destroy_process_group()
    print(f"rank {rank}: done in attempt {attempt}", flush=True)


if __name__ == "__main__":
    main()
