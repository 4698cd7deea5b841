"""Reduce ops, supported dtypes, and the (op, dtype) -> kernel spec table."""

import enum
from typing import NamedTuple

import numpy as np

from . import compiled
from .op_codes import OP_BAND, OP_BOR, OP_BXOR, OP_MAX, OP_MIN, OP_PRODUCT, OP_SUM

__all__ = ["ReduceOp", "DTYPES", "DType", "ReduceSpec", "reduce_spec", "dtype_of"]


class ReduceOp(enum.IntEnum):
    """Reduction ops, spelled as torch.distributed.ReduceOp."""

    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5
    BOR = 6
    BXOR = 7
    PREMUL_SUM = 8


class DType(NamedTuple):
    """One element type: its name, numpy storage dtype, kernel kind and fingerprint code.
    (This and ReduceSpec are NamedTuples, not frozen dataclasses: ~0.1 ms each to define
    instead of ~1.4 ms, at every process's first group; config.Config says why.)"""

    name: str
    storage: np.dtype
    kind: str
    code: int


DTYPES = {d.name: d for d in (
    DType("float16", np.dtype(np.uint16), "float16", 1),
    DType("bfloat16", np.dtype(np.uint16), "bfloat16", 2),
    DType("float32", np.dtype(np.float32), "float", 3),
    DType("float64", np.dtype(np.float64), "float", 4),
    DType("complex64", np.dtype(np.complex64), "complex", 5),
    DType("complex128", np.dtype(np.complex128), "complex", 6),
    DType("int8", np.dtype(np.int8), "int", 7),
    DType("uint8", np.dtype(np.uint8), "int", 8),
    DType("int16", np.dtype(np.int16), "int", 9),
    DType("int32", np.dtype(np.int32), "int", 10),
    DType("int64", np.dtype(np.int64), "int", 11),
    DType("bool", np.dtype(np.uint8), "bool", 12),
)}
DTYPE_BY_CODE = {d.code: d for d in DTYPES.values()}

# numpy dtype -> DType, for arrays passed without a dtype override (hashing a dtype is
# cheap; reading dtype.name is not, and this runs on every collective).
_BY_NUMPY = {np.dtype(n): DTYPES[n] for n in ("float16", "float32", "float64", "complex64",
                                               "complex128", "int8", "uint8", "int16", "int32",
                                               "int64", "bool")}

_OPS_BY_KIND = {
    "float": {ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX,
              ReduceOp.PREMUL_SUM},
    "complex": {ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.PREMUL_SUM},
    "int": {ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND,
            ReduceOp.BOR, ReduceOp.BXOR},
    "bool": {ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND,
             ReduceOp.BOR, ReduceOp.BXOR},
}
_OPS_BY_KIND["float16"] = _OPS_BY_KIND["bfloat16"] = _OPS_BY_KIND["float"]

_KERNEL_OP = {
    ReduceOp.SUM: OP_SUM, ReduceOp.AVG: OP_SUM,
    ReduceOp.PREMUL_SUM: OP_SUM, ReduceOp.PRODUCT: OP_PRODUCT,
    ReduceOp.MIN: OP_MIN, ReduceOp.MAX: OP_MAX, ReduceOp.BAND: OP_BAND,
    ReduceOp.BOR: OP_BOR, ReduceOp.BXOR: OP_BXOR,
}
# bool reduces as logical ops on 0/1 bytes: SUM/MAX are "any", PRODUCT/MIN are "all".
_BOOL_OP = {ReduceOp.SUM: OP_BOR, ReduceOp.MAX: OP_BOR,
            ReduceOp.PRODUCT: OP_BAND, ReduceOp.MIN: OP_BAND}


class ReduceSpec(NamedTuple):
    """Everything a reduction kernel call needs: kind, kernel op code, pre/post scales and
    fn, the address of the dtype's compiled reducer (kernels.reducer)."""

    kind: str
    op: int
    pre: float = 1.0
    post: float = 1.0
    fn: int = 0


def dtype_of(array, dtype=None):
    """The DType of a numpy array; `dtype` names an override (e.g. 'bfloat16' over uint16)."""
    if dtype is not None:
        d = DTYPES.get(str(dtype))
        if d is None:
            raise TypeError(f"dtype {dtype} is not supported (supported: {', '.join(DTYPES)})")
        if array.dtype.itemsize != d.storage.itemsize:
            raise TypeError(f"dtype {dtype} needs {d.storage.itemsize}-byte elements, "
                            f"the array has {array.dtype.itemsize}-byte {array.dtype}")
        return d
    d = _BY_NUMPY.get(array.dtype)
    if d is None:
        raise TypeError(f"dtype {array.dtype.name} is not supported (supported: "
                        f"{', '.join(DTYPES)})")
    return d


_SPECS = {}


def reduce_spec(op, dtype, world_size, collective="all_reduce", premul=1.0):
    """Map (op, dtype) to a ReduceSpec, or raise TypeError naming the supported ops. The
    first spec of a dtype compiles its reducer (or loads it from numba's cache)."""
    key = (op, dtype.code, world_size, premul)
    spec = _SPECS.get(key)
    if spec is None:
        spec = _make_spec(op, dtype, world_size, collective, premul)
        if len(_SPECS) < 4096:  # premul factors are user floats: bound the cache
            _SPECS[key] = spec
    return spec


def _make_spec(op, dtype, world_size, collective, premul):
    op = ReduceOp(op)
    allowed = _OPS_BY_KIND[dtype.kind]
    if op not in allowed:
        names = ", ".join(o.name for o in sorted(allowed))
        raise TypeError(f"{collective}: op {op.name} is not supported for dtype {dtype.name} "
                        f"(supported: {names})")
    if dtype.kind == "bool":
        kop = _BOOL_OP.get(op, _KERNEL_OP[op])
        return ReduceSpec("bool", kop,
                          fn=compiled.kernels.reducer(dtype.storage, "bool", kop))
    pre = float(premul) if op == ReduceOp.PREMUL_SUM else 1.0
    post = 1.0 / world_size if op == ReduceOp.AVG else 1.0
    kop = _KERNEL_OP[op]
    return ReduceSpec(dtype.kind, kop, pre, post,
                      compiled.kernels.reducer(dtype.storage, dtype.kind, kop))
