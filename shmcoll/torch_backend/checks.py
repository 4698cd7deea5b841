"""Argument checks with ProcessGroupGloo's wording, raised on the calling rank at call time.

Every message is "ProcessGroupShm::<op>: <gloo's text> (<what we saw>)", so a test written
for gloo (`assertRaisesRegex(RuntimeError, "invalid tensor type")`) passes unchanged and the
user still sees the offending values. Order follows gloo where the tests pin it: root rank,
then list shapes (scatter checks its outputs before its inputs, gather its inputs before its
outputs, allgather emptiness before lengths), then layout, dtype, size and device.
Nothing here touches shared state, so a failed check leaves the group usable and consumes no
sequence number.
"""

import torch

__all__ = ["ArgumentError", "fail", "root_rank", "root_tensor", "non_empty", "layout_match",
           "type_match", "size_match", "type_and_size_match", "tensors", "dense", "cpu",
           "dense_cpu", "single", "same_type", "same_size"]

PREFIX = "ProcessGroupShm"


class ArgumentError(RuntimeError, ValueError):
    """A bad argument: a RuntimeError like gloo's (torch's tests expect that), and a ValueError."""


def fail(name, what):
    raise ArgumentError(f"{PREFIX}::{name}: {what}")


def root_rank(name, root, size):
    if not 0 <= root < size:
        fail(name, f"invalid root rank: {root} (group size {size})")


def root_tensor(name, index, count):
    if not 0 <= index < count:
        fail(name, f"invalid root tensor: {index} (tensor list size {count})")


def non_empty(name, tensors, what="tensor list"):
    if len(tensors) == 0:
        fail(name, f"requires non-empty {what}")


def single(name, items, what):
    if len(items) != 1:
        fail(name, f"requires a single-element {what} (got {len(items)} elements)")


def tensors(name, items):
    """Every element is a torch.Tensor (TypeError otherwise, like pybind's overload check)."""
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{PREFIX}::{name}: expected a Tensor at index {i}, got "
                            f"{type(t).__name__}")


def layout_match(name, items, ref=None):
    ref = items[0] if ref is None else ref
    for i, t in enumerate(items):
        if t.layout != ref.layout:
            fail(name, f"invalid tensor layout at index {i} (expected {ref.layout}, got "
                       f"{t.layout})")


def _type_str(t):
    return f"{t.device.type} {t.dtype}"


def type_match(name, items, ref=None):
    ref = items[0] if ref is None else ref
    for i, t in enumerate(items):
        if t.dtype != ref.dtype or t.device.type != ref.device.type:
            fail(name, f"invalid tensor type at index {i} (expected {_type_str(ref)}, got "
                       f"{_type_str(t)})")


def size_match(name, items, ref=None):
    ref = items[0] if ref is None else ref
    for i, t in enumerate(items):
        if t.shape != ref.shape:
            fail(name, f"invalid tensor size at index {i} (expected {list(ref.shape)}, got "
                       f"{list(t.shape)})")


def type_and_size_match(name, items, ref=None):
    """gloo's assertTypeAndSizesMatch: per element, type first, then size."""
    ref = items[0] if ref is None else ref
    for i, t in enumerate(items):
        if t.dtype != ref.dtype or t.device.type != ref.device.type:
            fail(name, f"invalid tensor type at index {i} (expected {_type_str(ref)}, got "
                       f"{_type_str(t)})")
        if t.shape != ref.shape:
            fail(name, f"invalid tensor size at index {i} (expected {list(ref.shape)}, got "
                       f"{list(t.shape)})")


# gloo checks each element's type then size; keep the old names for callers.
same_type = type_match
same_size = size_match


def dense(name, items):
    """Strided tensors whose memory holds their values: a lazily conjugated or negated
    view (`z.conj()`, `z.conj().imag`) keeps the original values in memory plus a flag."""
    for i, t in enumerate(items):
        if t.layout != torch.strided:
            fail(name, f"only supports dense tensors (got {t.layout} at index {i})")
        if t.is_conj() or t.is_neg():
            fail(name, f"the tensor at index {i} is a lazily "
                       f"{'conjugated' if t.is_conj() else 'negated'} view; its memory does "
                       f"not hold its values (call .resolve_conj() / .resolve_neg() first)")


def cpu(name, items):
    for i, t in enumerate(items):
        if t.device.type != "cpu":
            fail(name, f"unsupported device type {t.device.type} at index {i}")
        if t.is_meta:
            fail(name, f"unsupported device type meta at index {i}")


def dense_cpu(name, items):
    """Tensors, dense (strided), on the CPU with real storage."""
    tensors(name, items)
    dense(name, items)
    cpu(name, items)


def coalesced_pairs(name, outputs, inputs, world_size, gather, on_device=False):
    """(output, input) pairs of the *_tensor_coalesced ops: equal list lengths, dense (and on
    the CPU unless `on_device`: cuda_ipc checks its own device), same dtype per pair, and
    the gathered side world_size times the other (the output for all-gathers, the input
    for reduce-scatters)."""
    if len(outputs) != len(inputs):
        fail(name, f"requires input/output tensor lists to have the same length "
                   f"({len(inputs)} inputs, {len(outputs)} outputs)")
    tensors(name, outputs + inputs)
    dense(name, outputs + inputs)
    if not on_device:
        cpu(name, outputs + inputs)
    big, small = ("output", "input") if gather else ("input", "output")
    for i, (o, t) in enumerate(zip(outputs, inputs)):
        if o.dtype != t.dtype:
            fail(name, f"invalid tensor type at index {i} (output {o.dtype}, input {t.dtype})")
        n_big, n_small = (o.numel(), t.numel()) if gather else (t.numel(), o.numel())
        if n_big != n_small * world_size:
            fail(name, f"invalid tensor size at index {i}: the {big} tensor must have world "
                       f"size times the elements of the {small} tensor (output {o.numel()}, "
                       f"input {t.numel()}, world size {world_size})")
