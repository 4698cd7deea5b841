"""DDP on CPU with backend "shm" trains to exactly the parameters that "gloo" gives.

Same seeds, same per-rank data, same model, N steps of SGD, world size 2, tiny buckets (many
small allreduces per backward, as torch's own DDP parity tests use). The comparison is
torch.equal, not allclose: DDP divides each gradient bucket by the world size (2, exact)
and then all-reduces it with SUM. With two ranks every element of that sum is one IEEE
addition a + b, which is commutative, so any correct backend (gloo's ring, our rank-order
fold) yields the same bits. Everything else (forward, backward, optimizer) is the same
deterministic CPU code in both runs. With three or more ranks the summation order differs
between algorithms and only a tolerance could be asserted.
"""

import pytest
import torch

import harness

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch, pytest.mark.timeout(600)]

STEPS = 5
JOB_TIMEOUT_S = 240


def _train(rank, world_size, steps, seed):
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model(seed)  # identical initial parameters on every rank (DDP checks too)
    ddp = DDP(model, bucket_cap_mb=0.001)  # ~1 KB buckets: one allreduce per layer or so
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(seed * 100 + rank)  # different data per rank
    for _ in range(steps):
        x = torch.randn(8, 16, generator=data)
        y = torch.randn(8, 4, generator=data)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    dist.barrier()
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def test_ddp_shm_matches_gloo(seed):
    shm = harness.run_torch_ranks(_train, 2, "shm", JOB_TIMEOUT_S, args=(STEPS, seed))
    gloo = harness.run_torch_ranks(_train, 2, "gloo", JOB_TIMEOUT_S, args=(STEPS, seed))
    initial = _model(seed).state_dict()
    for rank in range(2):
        assert shm[rank].keys() == gloo[rank].keys()
        for name in shm[rank]:
            assert torch.equal(shm[rank][name], gloo[rank][name]), (
                f"rank {rank} {name}: shm and gloo differ by "
                f"{(shm[rank][name] - gloo[rank][name]).abs().max().item()}")
            # every rank holds the same parameters, and training did move them
            assert torch.equal(shm[rank][name], shm[0][name]), f"rank {rank} {name} diverged"
            assert not torch.equal(shm[rank][name], initial[name]), f"{name} did not train"


def _model(seed):
    import torch.nn as nn
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))
