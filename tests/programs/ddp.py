"""DistributedDataParallel: every comm hook torch ships, no_sync, Join, unused parameters,
static graph, and ZeroRedundancyOptimizer.

Bitwise against gloo: at 2 ranks every reduced element is one IEEE addition a + b, which is
commutative, so any correct backend yields the same bits (fp16: both add in float32 and
round the sum once). Everything else is the same deterministic CPU code.
"""

import torch
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from . import program
from .common import batches, build, mlp, params

STEPS = 5


def _train(ddp, data, lr=0.05, opt=None):
    opt = opt or torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def _ddp_program(hook=None, state_fn=None, bucket_cap_mb=0.001, **ddp_kwargs):
    """STEPS steps of SGD on DDP(mlp(), **ddp_kwargs), with comm hook `hook` if given."""
    def run(rank, world_size, workdir):
        model = mlp()
        ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, **ddp_kwargs)
        if hook is not None:
            ddp.register_comm_hook(state_fn() if state_fn else None, hook)
        losses = _train(ddp, batches(rank, STEPS))
        return {**params(model), "losses": losses}
    return run


POWERSGD_START = 2  # iterations of plain all_reduce before PowerSGD compresses


def _powersgd_state():
    return lambda: powersgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=POWERSGD_START,
        min_compression_rate=0.5, use_error_feedback=True, warm_start=True, random_seed=0)


def _powersgd_program(hook):
    """PowerSGD also returns the losses up to the first compressed step."""
    run_ddp = _ddp_program(hook, _powersgd_state(), bucket_cap_mb=25)

    def run(rank, world_size, workdir):
        out = run_ddp(rank, world_size, workdir)
        out["losses_uncompressed"] = out["losses"][:POWERSGD_START + 1].clone()
        return out
    return run


_POWERSGD_RNG = (
    "PowerSGD draws its random projection inside the hook from torch's global generator "
    "(fork_rng, manual_seed, randn). Rank threads share that generator and interleave the "
    "draws, so the projection differs from the one in gloo's processes; the parameters still "
    "agree across ranks, and the losses before compression match bitwise",
    ("losses_uncompressed",))


# Tiny buckets (several allreduces per backward) for the hooks without nested collectives.
# The PowerSGD hooks issue collectives from future callbacks: with several buckets those
# would race the next bucket's hook issued from the autograd thread (any backend), so this
# model's parameters go in one bucket.
program("ddp_hook_allreduce")(_ddp_program(default_hooks.allreduce_hook))
program("ddp_hook_fp16_compress")(_ddp_program(default_hooks.fp16_compress_hook))
# DDP refuses the hook unless torch was built with CUDA and NCCL >= 2.10: a CPU-only torch
# refuses it on any group, a CUDA build (the GPU machine's) accepts it on gloo's as on ours.
program("ddp_hook_bf16_compress", torch_fails="" if torch.version.cuda else (
        "bf16_compress_hook requires CUDA 11+ with NCCL 2.10+ (or XPU): a CPU-only torch "
        "refuses it"))(
    _ddp_program(default_hooks.bf16_compress_hook))
program("ddp_hook_noop")(_ddp_program(debugging_hooks.noop_hook))
program("ddp_hook_powerSGD", threads_rng=_POWERSGD_RNG)(
    _powersgd_program(powersgd.powerSGD_hook))
program("ddp_hook_batched_powerSGD", torch_fails="torch 2.13's batched_powerSGD_hook hands "
        "its 2-D Q matrix to _orthogonalize, which now asserts a 3-D batch")(
    _powersgd_program(powersgd.batched_powerSGD_hook))
program("ddp_hook_fp16_powerSGD", threads_rng=_POWERSGD_RNG)(
    _powersgd_program(default_hooks.fp16_compress_wrapper(powersgd.powerSGD_hook)))
_QUANTIZE = ("the quantization hooks index dist.all_gather's future value as NCCL's (a list "
             "holding the output list); gloo's, like shm's, is the output list itself, so "
             "they index a tensor once too often (IndexError)")
program("ddp_hook_quantize_per_tensor", torch_fails=_QUANTIZE)(_ddp_program(
    quantization_hooks.quantization_pertensor_hook))
program("ddp_hook_quantize_per_channel", torch_fails=_QUANTIZE)(_ddp_program(
    quantization_hooks.quantization_perchannel_hook))


@program("ddp_no_sync")
def ddp_no_sync(rank, world_size, workdir):
    """Gradient accumulation: two micro-batches under no_sync, the third synchronises."""
    model = mlp()
    ddp = DDP(model, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    data = batches(rank, 6)
    for step in range(2):
        opt.zero_grad()
        micro = data[3 * step:3 * step + 3]
        with ddp.no_sync():
            for x, y in micro[:2]:
                nn.functional.mse_loss(ddp(x), y).backward()
        x, y = micro[2]
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return params(model)


@program("ddp_join_uneven_inputs")
def ddp_join(rank, world_size, workdir):
    """Uneven inputs: rank r trains on 3 + 2r batches inside Join."""
    model = mlp()
    ddp = DDP(model, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    with Join([ddp]):
        losses = _train(ddp, batches(rank, 3 + 2 * rank), opt=opt)
    return {**params(model), "losses": losses}


class _Branchy(nn.Module):
    """A branch used on even steps only: its parameters get no gradient on odd steps."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.even = nn.Linear(16, 4)
        self.odd = nn.Linear(16, 4)

    def forward(self, x, step):
        h = self.trunk(x)
        return self.even(h) if step % 2 == 0 else self.odd(h)


@program("ddp_find_unused_parameters")
def ddp_find_unused(rank, world_size, workdir):
    model = build(_Branchy)
    ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step, (x, y) in enumerate(batches(rank, 4)):
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x, step), y).backward()
        opt.step()
    return params(model)


program("ddp_static_graph")(_ddp_program(static_graph=True))
program("ddp_gradient_as_bucket_view")(_ddp_program(gradient_as_bucket_view=True))


@program("zero_redundancy_optimizer")
def zero(rank, world_size, workdir):
    """ZeRO-1: each rank steps its shard of Adam's state, then broadcasts its parameters;
    the consolidated optimizer state comes back to rank 0."""
    model = mlp()
    ddp = DDP(model, bucket_cap_mb=0.001)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    losses = _train(ddp, batches(rank, STEPS), opt=opt)
    opt.consolidate_state_dict(to=0)
    out = {**params(model), "losses": losses}
    if rank == 0:
        state = opt.state_dict()["state"]
        out.update({f"exp_avg.{k}": v["exp_avg"].clone() for k, v in state.items()})
    return out
