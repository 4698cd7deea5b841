"""PyTorch Lightning on backend "shm": DDPStrategy(process_group_backend="shm").

    python examples/lightning_ddp.py --backend shm --strategy ddp --out params.pt
    python examples/lightning_ddp.py --backend shm --strategy ddp_spawn --out params.pt

Two CPU ranks train a small regression model for a few steps; rank 0 saves the final
parameters and the last all-reduced loss to --out. With --backend gloo the same run gives
the same numbers bit for bit (each reduced element is one addition of two ranks' values).

Strategy "ddp" starts the other ranks by running this script again; "ddp_spawn" starts
them with torch.multiprocessing ("spawn"), which imports this file again. Either way each
rank must know the name "shm" before the Trainer initialises the process group: torch
>= 2.5 loads shmcoll's `torch.backends` entry point by itself, so this script never imports
shmcoll; on torch 2.4 (or with TORCH_DEVICE_BACKEND_AUTOLOAD=0) put `import shmcoll` at its
top.
"""

import argparse

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset


class Regression(L.LightningModule):
    def __init__(self, out):
        super().__init__()
        self.out = out
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)  # an all_reduce over the backend
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def on_train_end(self):
        if self.trainer.is_global_zero:
            torch.save({"params": {n: p.detach().clone() for n, p in self.named_parameters()},
                        "loss": self.trainer.callback_metrics["loss"].clone()}, self.out)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="shm")
    p.add_argument("--strategy", default="ddp", choices=["ddp", "ddp_spawn"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    L.seed_everything(0, verbose=False)  # the same initial model on every rank
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True).sin())
    # strategy="ddp" / "ddp_spawn" with the backend named: DDPStrategy's start methods
    start_method = "spawn" if a.strategy == "ddp_spawn" else "popen"
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=a.steps,
        strategy=DDPStrategy(process_group_backend=a.backend, start_method=start_method),
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False)
    trainer.fit(Regression(a.out), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    main()
