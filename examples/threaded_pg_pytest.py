"""Testing distributed code in pytest with threaded_pg: the ranks as threads of one process.

    python -m pytest examples/threaded_pg_pytest.py            # the tests below, on rank threads
    python examples/threaded_pg_pytest.py --backend threaded --out result.pt
    python examples/threaded_pg_pytest.py --backend shm --out result.pt     # 2 processes

`train` is ordinary torch.distributed code (DDP, an all_gather_object). `@threaded_pg.ranks(2)`
runs a test body on two rank threads, each with its own default process group ("threaded":
the same algorithms as "shm"), in milliseconds, without ports or processes. Rank threads
share torch's random generator, so the model is built inside `threaded_pg.rng_lock(seed)`:
the ranks take turns and each reseeds, so every rank gets the model one process builds
(outside a spawn it only seeds: the same code runs on processes). A bare torch.manual_seed
in a rank thread would interleave the ranks' draws; threaded_pg warns about it.

With --backend the same training runs as a program (threads, or two processes on "shm" or
gloo); rank 0 saves the final parameters to --out: the same bit for bit on all three.
"""

import argparse
import os
import tempfile

import shmcoll  # noqa: F401  (registers "shm")
import threaded_pg
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 3


def train(rank, world_size, steps=STEPS):
    """A few DDP steps on this rank's own data; the final parameters."""
    with threaded_pg.rng_lock(seed=0):  # one model, whatever the ranks are
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)  # per-rank data: a generator of its own
    for _ in range(steps):
        x = torch.randn(8, 8, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True).sin()).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# -- the tests: pytest examples/threaded_pg_pytest.py --------------------------------------


@threaded_pg.ranks(2)
def test_every_rank_ends_with_the_same_parameters(rank, world_size):
    params = train(rank, world_size)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, params)
    for other in everyone:
        assert all(torch.equal(params[n], other[n]) for n in params)


@threaded_pg.ranks(2)
def test_training_moves_the_parameters(rank, world_size):
    with threaded_pg.rng_lock(seed=0):
        initial = torch.nn.Linear(8, 16).weight.detach().clone()
    assert not torch.equal(train(rank, world_size, steps=1)["0.weight"], initial)


# -- as a program --------------------------------------------------------------------------


def _process(rank, backend, init_file, out):
    torch.set_num_threads(1)  # as torchrun sets it for each process
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=2)
    params = train(rank, 2)
    if rank == 0:
        torch.save(params, out)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="threaded", help='"threaded", "shm" or "gloo"')
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.backend == "threaded":
        torch.set_num_threads(1)  # one process: the rank threads share its intra-op threads
        torch.save(threaded_pg.spawn(train, 2, timeout=120)[0], a.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_process, args=(a.backend, os.path.join(tmp, "init"), a.out),
                                    nprocs=2)


if __name__ == "__main__":
    main()
