"""Argument checks with ProcessGroupGloo's wording, raised on the calling rank at call time.

Order follows gloo where the tests pin it: root rank, then list shapes (scatter checks its
outputs before its inputs, gather its inputs before its outputs, allgather emptiness before
lengths), then dtype, then size. Nothing here touches shared state, so a failed check leaves
the group usable and consumes no sequence number.
"""

import torch

__all__ = ["ArgumentError", "fail", "root_rank", "root_tensor", "non_empty", "same_type",
           "same_size", "dense_cpu", "single"]


class ArgumentError(RuntimeError, ValueError):
    """A bad argument: a RuntimeError like gloo's (torch's tests expect that), and a ValueError."""


def fail(name, what):
    raise ArgumentError(f"ProcessGroupShm::{name}: {what}")


def root_rank(name, root, size):
    if not 0 <= root < size:
        fail(name, f"invalid root rank: {root}")


def root_tensor(name, index, count):
    if not 0 <= index < count:
        fail(name, f"invalid root tensor: {index}")


def non_empty(name, tensors, what="tensor list"):
    if len(tensors) == 0:
        fail(name, f"requires non-empty {what}")


def same_type(name, tensors, ref=None):
    ref = tensors[0] if ref is None else ref
    for i, t in enumerate(tensors):
        if t.dtype != ref.dtype:
            fail(name, f"invalid tensor type at index {i} (expected {ref.dtype}, got {t.dtype})")


def same_size(name, tensors, ref=None):
    ref = tensors[0] if ref is None else ref
    for i, t in enumerate(tensors):
        if t.shape != ref.shape:
            fail(name, f"invalid tensor size at index {i} (expected {list(ref.shape)}, got "
                       f"{list(t.shape)})")


def dense_cpu(name, tensors):
    """Our tensors must be dense, on the CPU, with real storage (not meta)."""
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ProcessGroupShm::{name}: expected a Tensor at index {i}, got "
                            f"{type(t).__name__}")
        if t.layout != torch.strided:
            fail(name, f"invalid tensor layout at index {i} (expected strided, got {t.layout})")
        if t.device.type != "cpu":
            fail(name, f"unsupported device type {t.device.type} at index {i} (this group "
                       f"moves CPU tensors; CUDA tensors go through cuda_ipc)")


def single(name, tensors, what):
    if len(tensors) != 1:
        fail(name, f"requires a single-element {what}")
