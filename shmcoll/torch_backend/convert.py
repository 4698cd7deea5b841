"""torch <-> engine translation: tensors as numpy views, dtypes, reduce ops, timeouts."""

import datetime

import numpy as np
import torch
import torch.distributed as dist

from ..ops import ReduceOp

__all__ = ["as_array", "engine_dtype", "reduce_op", "timeout_s", "to_seconds", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = {
    torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
    torch.float64: "float64", torch.complex64: "complex64", torch.complex128: "complex128",
    torch.int8: "int8", torch.uint8: "uint8", torch.int16: "int16", torch.int32: "int32",
    torch.int64: "int64", torch.bool: "bool",
}
# Element types that move as bytes only (broadcast, gathers, all_to_all): any fixed-size dtype.
_BYTE_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_OPS = {
    dist.ReduceOp.SUM: ReduceOp.SUM, dist.ReduceOp.AVG: ReduceOp.AVG,
    dist.ReduceOp.PRODUCT: ReduceOp.PRODUCT, dist.ReduceOp.MIN: ReduceOp.MIN,
    dist.ReduceOp.MAX: ReduceOp.MAX, dist.ReduceOp.BAND: ReduceOp.BAND,
    dist.ReduceOp.BOR: ReduceOp.BOR, dist.ReduceOp.BXOR: ReduceOp.BXOR,
    dist.ReduceOp.PREMUL_SUM: ReduceOp.PREMUL_SUM,
}


_OPS_BY_TYPE = dict(_OPS)


def engine_dtype(t):
    """The engine dtype name of a tensor, or None when it cannot be reduced."""
    return SUPPORTED_DTYPES.get(t.dtype)


def as_array(t, for_reduce=True):
    """A numpy view sharing the tensor's memory (strides kept) and its engine dtype name.

    bfloat16 (no numpy type) is viewed as uint16 bits; for byte-moving collectives any
    other dtype is viewed as same-width integers.
    """
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    name = SUPPORTED_DTYPES.get(t.dtype)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), name
    if name is None:
        if for_reduce:
            raise TypeError(f"dtype {t.dtype} is not supported for reductions")
        return t.view(_BYTE_VIEW[t.element_size()]).numpy(), None
    return t.numpy(), name


def reduce_op(op):
    """(engine ReduceOp, premul factor) of a torch ReduceOp / RedOpType."""
    kind = getattr(op, "op", op)
    try:
        ours = _OPS_BY_TYPE.get(kind)  # RedOpType hashes by value: one lookup per call
    except TypeError:
        ours = None
    if ours is None:
        raise ValueError(f"unsupported reduction operation {kind}")
    factor = 1.0
    if ours == ReduceOp.PREMUL_SUM:
        f = getattr(op, "factor", 1.0)
        factor = float(f.item() if isinstance(f, torch.Tensor) else f)
    return ours, factor


def to_seconds(value):
    """Seconds (float) of a timedelta or a number of seconds (gloo's `_timeout` takes both)."""
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    return float(value)


def timeout_s(opts_timeout, default_s):
    """Seconds for an op: opts.timeout when set (torch's 'unset' is negative), else default."""
    if isinstance(opts_timeout, datetime.timedelta):
        s = opts_timeout.total_seconds()
        if s >= 0:
            return s
    return default_s
