"""torch.distributed.checkpoint (DCP) on backend "shm": save a sharded model, resume from it.

    torchrun --nproc-per-node 2 examples/dcp_checkpoint.py --backend shm \
        --checkpoint DIR --out result.pt

Two CPU ranks train a model sharded with FSDP2 (`fully_shard`): each rank holds half of
every parameter and of Adam's state. After STEPS steps they save model and optimizer with
`dcp.save` (each rank writes its shards; the ranks agree on the plan through object
collectives), train on, then build a fresh sharded model, `dcp.load` the checkpoint into it
and train the same steps again: the resumed run must end where the first one did, bit for
bit (checked here). Rank 0 saves the final full parameters and the losses to --out; with
--backend gloo they are the same bit for bit (2 ranks: every reduce-scatter element is one
addition a + b; the all-gathers and the checkpoint move bytes).
"""

import argparse

import shmcoll  # noqa: F401  (registers "shm")
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6: FSDP2 was a private prototype
    raise SystemExit("dcp_checkpoint.py needs torch >= 2.6 (FSDP2's public fully_shard); "
                     f"this is torch {torch.__version__}") from None

STEPS = 3


def sharded_model(mesh):
    torch.manual_seed(0)  # the same initial model on every rank (then each keeps its shard)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train(model, opt, batches):
    losses = []
    for x in batches:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin())
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def full_params(model):
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="shm")
    p.add_argument("--out", required=True)
    p.add_argument("--checkpoint", required=True, help="directory all ranks can write")
    a = p.parse_args()

    dist.init_process_group(a.backend)  # env:// under torchrun
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(100 + rank)  # this rank's data
    batches = [torch.randn(8, 8, generator=g) for _ in range(2 * STEPS)]

    model, opt = sharded_model(mesh)
    train(model, opt, batches[:STEPS])
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=a.checkpoint)
    losses = train(model, opt, batches[STEPS:])

    resumed, resumed_opt = sharded_model(mesh)  # as a restarted job would
    model_state, optim_state = get_state_dict(resumed, resumed_opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=a.checkpoint)  # into the fresh shards, in place
    set_state_dict(resumed, resumed_opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    resumed_losses = train(resumed, resumed_opt, batches[STEPS:])

    params, again = full_params(model), full_params(resumed)
    if not (torch.equal(losses, resumed_losses)
            and all(torch.equal(params[n], again[n]) for n in params)):
        raise AssertionError(f"rank {rank}: the run resumed from the checkpoint differs")
    if rank == 0:
        torch.save({"params": params, "losses": losses}, a.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
