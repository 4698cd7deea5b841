"""Hugging Face Accelerate on backend "shm": create the process group first.

    torchrun --nproc-per-node 2 examples/accelerate_cpu.py --backend shm --out result.pt

Accelerate chooses the backend itself on CPU (gloo, or mpi when torch has it) and refuses
any other name: `Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="shm")])`
raises "Your assigned backend shm is not available, please use gloo". It does use a
default process group that already exists, so initialise it before the Accelerator. (Its
`state.backend` still reads "gloo": that is its label, `dist.get_backend()` is the truth.)

Two CPU ranks train a small model through `accelerator.prepare` (DDP, sharded DataLoader,
Accelerate's RNG synchronisation: a broadcast) and gather the losses; rank 0 saves the
parameters and the gathered losses to --out. With --backend gloo the numbers are the same
bit for bit. Launch it with torchrun: `accelerate launch --cpu` runs one process (several
CPU processes need its MPI launcher).
"""

import argparse

import shmcoll  # noqa: F401  (registers "shm")
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="shm")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    dist.init_process_group(a.backend)  # env:// under torchrun; before the Accelerator
    accelerator = Accelerator(cpu=True)
    assert dist.get_backend() == a.backend, dist.get_backend()

    set_seed(0)  # the same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8,
                        shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)

    losses = []
    for x, y in loader:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)  # DDP's gradient all_reduce
        opt.step()
        losses.append(accelerator.gather(loss.detach()[None]))  # an all_gather
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        params = accelerator.unwrap_model(model).named_parameters()
        torch.save({"params": {n: t.detach().clone() for n, t in params},
                    "losses": torch.stack(losses)}, a.out)
    accelerator.wait_for_everyone()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
