"""torch <-> engine translation: tensors as numpy views, dtypes, reduce ops, timeouts."""

import datetime

import numpy as np
import torch
import torch.distributed as dist

from ..native.ops import ReduceOp
from .compat import premul_factor

__all__ = ["as_array", "tensor_array", "plain_array", "engine_dtype", "reduce_op", "timeout_s",
           "to_seconds", "row_counts", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = {
    torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
    torch.float64: "float64", torch.complex64: "complex64", torch.complex128: "complex128",
    torch.int8: "int8", torch.uint8: "uint8", torch.int16: "int16", torch.int32: "int32",
    torch.int64: "int64", torch.bool: "bool",
}
# numpy type strings of the engine's dtypes (bfloat16: its uint16 bits), and the same-width
# integers any other dtype moves as (broadcast, gathers, all_to_all: bytes only).
_TYPESTR = {t: np.dtype(d).str for t, d in {
    torch.float16: np.float16, torch.bfloat16: np.uint16, torch.float32: np.float32,
    torch.float64: np.float64, torch.complex64: np.complex64, torch.complex128: np.complex128,
    torch.int8: np.int8, torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32,
    torch.int64: np.int64, torch.bool: np.bool_}.items()}
_BYTE_TYPESTR = {n: np.dtype(d).str for n, d in
                 {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}.items()}

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
    other dtype is viewed as same-width integers. The tensor is left as it was (see
    tensor_array: no `Tensor.numpy()`).
    """
    name = SUPPORTED_DTYPES.get(t.dtype)
    if name is None and for_reduce:
        raise TypeError(f"dtype {t.dtype} is not supported for reductions")
    typestr = _TYPESTR.get(t.dtype) or _BYTE_TYPESTR[t.element_size()]
    return tensor_array(t, typestr), name


def row_counts(t, rows):
    """The elements of pieces of `rows` rows each along dim 0 of `t` (dim >= 1)."""
    per_row = t.numel() // t.shape[0] if t.shape[0] else 0
    return [r * per_row for r in rows]


def tensor_array(t, typestr):
    """A numpy array over the memory of CPU tensor `t`, elements read as `typestr` (same
    width as t's elements), shape and strides kept; the array holds a reference to `t`.

    Not `t.numpy()`: that marks t's storage non-resizable for good, so after any collective
    a user could never resize the tensor again (FSDP frees its all-gather buffers with
    `storage.resize_(0)`; gloo leaves tensors resizable). numpy reads the address from
    `__array_interface__` instead, and the tensor is left untouched.

    Lifetime: the array's base is a _Memory that references `t`, so the tensor, and with
    it its storage, lives as long as the array (a job holding only arrays of temporary
    views, such as reduce_scatter's input chunks, keeps their memory alive). Resizing or
    freeing the storage while a collective on it is in flight is the caller's error, as
    with every backend (gloo keeps the raw pointer too).
    """
    if t.numel() == 0:
        # nothing to share; an empty tensor's data_ptr() may be 0, which numpy < 2.3
        # refuses in an array interface
        return np.empty(tuple(t.shape), dtype=typestr)
    itemsize = t.element_size()
    m = _Memory()
    m.tensor = t
    m.__array_interface__ = {
        "data": (t.data_ptr(), False), "shape": tuple(t.shape), "typestr": typestr,
        "strides": None if t.is_contiguous() else tuple(s * itemsize for s in t.stride()),
        "version": 3}
    return np.asarray(m)


class _Memory:
    """What numpy reads a tensor's memory from (the array interface protocol, v3)."""

    __slots__ = ("__array_interface__", "tensor")


def plain_array(t):
    """The numpy array over a dense contiguous CPU tensor of a dtype numpy knows (the
    latency path: fast.py), cached by (address, dtype, shape): ~0.3 us instead of ~0.8 us
    for a fresh tensor_array (or ~0.5 us for `t.numpy()`, which would pin the storage).

    Why a cached array is safe: it owns nothing and references no tensor; it is only an
    address range read as a dtype and shape. It is handed out only for a live tensor whose
    memory is exactly that range read exactly that way, for a synchronous call during
    which the caller holds the tensor, and nothing keeps it past that call (the engine's
    plans hold fingerprints, not arrays). An entry whose tensor was freed is unreachable
    until another live tensor occupies the same range with the same dtype and shape, and
    then the range is that tensor's memory.
    """
    if t.numel() == 0:
        return np.empty(tuple(t.shape), dtype=_TYPESTR[t.dtype])  # see tensor_array
    key = (t.data_ptr(), t.dtype, t.shape)
    array = _PLAIN.get(key)
    if array is None:
        if len(_PLAIN) >= _PLAIN_MAX:
            _PLAIN.clear()
        m = _Memory()
        m.tensor = None
        m.__array_interface__ = {"data": (key[0], False), "shape": tuple(t.shape),
                                 "typestr": _TYPESTR[t.dtype], "version": 3}
        array = _PLAIN[key] = np.asarray(m)
    return array


# (data_ptr, dtype, shape) -> array; bounded: a program's collective buffers (DDP buckets,
# benchmark tensors) are few and long-lived, anything else just refills it.
_PLAIN = {}
_PLAIN_MAX = 256


def reduce_op(op):
    """(engine ReduceOp, premul factor) of a torch ReduceOp / RedOpType."""
    kind = getattr(op, "op", op)
    try:
        ours = _OPS_BY_TYPE.get(kind)  # RedOpType hashes by value: one lookup per call
    except TypeError:
        ours = None
    if ours is None:
        raise ValueError(f"unsupported reduction operation {kind}")
    factor = premul_factor(op) if ours == ReduceOp.PREMUL_SUM else 1.0
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
