"""DTensor tensor parallelism, distributed checkpoint save/load with resharding, pipeline
schedules.

Bitwise against gloo: the tensor-parallel partial sums are one addition a + b at 2 ranks,
checkpoints and pipelines move bytes only (object collectives, send/recv).
"""

import inspect
import os

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

try:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
except ImportError:  # torch < 2.5: DTensor's API is private (torch.distributed._tensor)
    from torch.distributed._tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from . import program
from .common import batches, build, mlp, params, snapshot

STEPS = 3


@program("dtensor_tensor_parallel")
def tensor_parallel(rank, world_size, workdir):
    """Megatron-style MLP: the first Linear column-parallel, the second row-parallel (its
    output an all-reduced partial sum); every rank feeds the same batch."""
    mesh = init_device_mesh("cpu", (world_size,))
    model = build(lambda: nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outputs = []
    for x, y in batches(0, STEPS):
        opt.zero_grad()
        out = model(x)
        nn.functional.mse_loss(out, y).backward()
        opt.step()
        outputs.append(out.detach())
    full = {n: snapshot(p.full_tensor()) for n, p in model.named_parameters()}
    return {**full, "outputs": torch.stack(outputs)}


@program("dcp_save_load_resharding")
def checkpoint_resharding(rank, world_size, workdir):
    """Save DTensors sharded one way (rows; a replicated bias), load them into DTensors
    sharded another way (columns; the bias sharded), and check they hold the saved values."""
    mesh = init_device_mesh("cpu", (world_size,))
    weight, bias, step = build(lambda: (torch.randn(8, 6), torch.randn(6), torch.arange(3.0)))
    saved = {"weight": distribute_tensor(weight, mesh, [Shard(0)]),
             "bias": distribute_tensor(bias, mesh, [Replicate()]), "step": step}
    path = os.path.join(workdir, "checkpoint")
    dcp.save(saved, checkpoint_id=path)
    loaded = {"weight": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(1)]),
              "bias": distribute_tensor(torch.zeros(6), mesh, [Shard(0)]),
              "step": torch.zeros(3)}
    dcp.load(loaded, checkpoint_id=path)
    if not (torch.equal(loaded["weight"].full_tensor(), weight)
            and torch.equal(loaded["bias"].full_tensor(), bias)
            and torch.equal(loaded["step"], step)):
        raise AssertionError("the resharded checkpoint does not hold the saved values")
    return {"weight_shard": snapshot(loaded["weight"]), "bias_shard": snapshot(loaded["bias"]),
            "step": loaded["step"].clone()}


MICROBATCHES = 4


def _stage(layers, per, rank, world_size, first_input):
    """This rank's PipelineStage. torch 2.4's requires the stage's input (`input_args`, an
    example micro-batch); later torch infers the shapes, exchanging them between the stages
    (send/recv), when it is left out, as here."""
    stage_module = nn.Sequential(*layers[rank * per:(rank + 1) * per])
    needs_input = inspect.signature(PipelineStage.__init__).parameters["input_args"].default \
        is inspect.Parameter.empty
    if not needs_input:
        return stage_module, PipelineStage(stage_module, rank, world_size, torch.device("cpu"))
    example = first_input.chunk(MICROBATCHES)[0]
    with torch.no_grad():
        for layer in layers[:rank * per]:
            example = layer(example)
    return stage_module, PipelineStage(stage_module, rank, world_size, torch.device("cpu"),
                                       example)


def _pipeline(schedule_cls):
    def run(rank, world_size, workdir):
        """The MLP cut in `world_size` stages; 4 micro-batches per step."""
        layers = list(mlp(depth=4))
        per = -(-len(layers) // world_size)
        data = batches(0, STEPS)
        stage_module, stage = _stage(layers, per, rank, world_size, data[0][0])
        schedule = schedule_cls(stage, n_microbatches=MICROBATCHES,
                                loss_fn=nn.functional.mse_loss)
        opt = torch.optim.SGD(stage_module.parameters(), lr=0.05)
        losses = []
        for x, y in data:
            opt.zero_grad()
            if rank == 0:
                schedule.step(x)
            elif rank == world_size - 1:
                step_losses = []
                schedule.step(target=y, losses=step_losses)
                losses.append(torch.stack([loss.detach() for loss in step_losses]))
            else:
                schedule.step()
            opt.step()
        out = params(stage_module, f"stage{rank}.")
        if losses:
            out["losses"] = torch.stack(losses)
        return out
    return run


program("pipeline_gpipe")(_pipeline(ScheduleGPipe))
program("pipeline_1f1b", same_as=(
    "pipeline_gpipe", "the same micro-batches, their gradients accumulated in the same order: "
    "the same parameters and losses. gloo cannot run torch 2.4's Schedule1F1B, which waits "
    "for the last Work of each batch_isend_irecv only, and a gloo send nobody waits for is "
    "lost (the peer's recv times out)"))(_pipeline(Schedule1F1B))
