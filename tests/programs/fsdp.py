"""FullyShardedDataParallel (FSDP1) and fully_shard (FSDP2) on CPU, with mixed precision and
CPU offload where torch allows them there.

FSDP1 frees each unit's all-gathered parameters with `storage.resize_(0)` after use: the
program that once crashed on "shm" (the adapter pinned storages through Tensor.numpy()).
Bitwise against gloo: 2 ranks, so each reduce-scatter element is one addition a + b (bf16:
both add in float32 and round the sum once), and the all-gathers move bytes.
"""

import functools

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffload, MixedPrecision
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

try:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
except ImportError:  # torch < 2.6: FSDP2 is a private prototype (the programs say `since`)
    CPUOffloadPolicy = MixedPrecisionPolicy = fully_shard = None
_FSDP2 = ((2, 6), "FSDP2's public fully_shard")

from . import program
from .common import batches, mlp, params, snapshot

STEPS = 4


def _train(model, rank, steps=STEPS):
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for x, y in batches(rank, steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def _fsdp1(**kw):
    def run(rank, world_size, workdir):
        model = mlp(depth=4)
        wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                       device_id=torch.device("cpu"), **kw)
        losses = _train(wrapped, rank)
        with FSDP.summon_full_params(wrapped):
            full = params(wrapped)
        return {**full, "losses": losses}
    return run


program("fsdp1_full_shard")(_fsdp1())
program("fsdp1_shard_grad_op")(_fsdp1(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP))
program("fsdp1_mixed_precision_bf16")(_fsdp1(mixed_precision=MixedPrecision(
    param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)))
program("fsdp1_cpu_offload", torch_fails="FSDP1's CPU offload pins the sharded parameters' "
        "memory (pin_memory() needs an accelerator: 'Cannot access accelerator device when "
        "none is available'); FSDP2's CPUOffloadPolicy(pin_memory=False) runs")(
    _fsdp1(cpu_offload=CPUOffload(offload_params=True)))


def _fsdp2(options=dict):
    """options() -> fully_shard's keyword arguments (made when the program runs: the
    policy classes do not exist on a torch older than `_FSDP2`)."""
    def run(rank, world_size, workdir):
        kw = options()
        mesh = init_device_mesh("cpu", (world_size,))
        model = mlp(depth=4)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
        losses = _train(model, rank)
        full = {n: snapshot(p.full_tensor()) for n, p in model.named_parameters()}
        return {**full, "losses": losses}
    return run


program("fsdp2_fully_shard", since=_FSDP2)(_fsdp2())
program("fsdp2_mixed_precision_bf16", since=_FSDP2)(_fsdp2(lambda: dict(
    mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))))
program("fsdp2_cpu_offload", since=_FSDP2)(_fsdp2(lambda: dict(
    offload_policy=CPUOffloadPolicy(pin_memory=False))))
program("fsdp2_reshard_after_forward_false", since=_FSDP2)(_fsdp2(lambda: dict(
    reshard_after_forward=False)))
