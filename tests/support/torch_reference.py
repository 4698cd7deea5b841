"""Inputs and expected values of the torch-level tests (test_torch_backend*.py): small
integers, exact in every dtype, so expected values are plain torch arithmetic; the
engine-level tests (cases.py, support/reference.py) cover rounding bit for bit."""

import torch

ALL_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
              torch.complex128, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
              torch.bool]


def small_ints(rank, numel, dtype, salt=0):
    """Rank `rank`'s input: small integers (or their truth values), exact in every dtype."""
    v = (torch.arange(numel, dtype=torch.int64) * 7 + rank * 3 + salt) % 5 - 1
    if dtype == torch.bool:
        return v > 1
    if dtype.is_complex:
        return torch.complex(v.double(), (v - rank).double()).to(dtype)
    return v.to(dtype)


def sum_of(tensors):
    """The SUM of `tensors` in their dtype ("any" for bool), computed wide."""
    if tensors[0].dtype == torch.bool:
        return torch.stack(tensors).any(0)
    wide = torch.complex128 if tensors[0].dtype.is_complex else torch.float64
    return torch.stack([t.to(wide) for t in tensors]).sum(0).to(tensors[0].dtype)


def assert_same(got, expected, what):
    """Same dtype and equal values."""
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype}, expected {expected.dtype}"
    assert torch.equal(got, expected), f"{what}: got {got}, expected {expected}"


def world_pg():
    """The ProcessGroup object init_process_group made."""
    import torch.distributed as dist
    return dist.group.WORLD
