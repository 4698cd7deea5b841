"""The reference arithmetic the collective checks compare against, written once.

The engine's documented arithmetic (kernels.py): reduce in rank order, pre-scale every source
by the PREMUL_SUM factor, post-scale by 1/world_size for AVG, in the tensor's own precision;
float16/bfloat16 accumulate in float32 and round once (round to nearest even). bool: SUM/MAX
are "or", PRODUCT/MIN "and". bfloat16 travels as its uint16 bits (numpy has no bfloat16).

Used by cases.py (the collective sweeps), the fuzz scenarios (_scenarios_fuzz.py) and
test_kernels.py.
"""

import numpy as np

from shmcoll import ReduceOp

_O = ReduceOp
PREMUL = -1.5  # dyadic: pre-scaling stays exact


def bf16_widen(bits):
    """bfloat16 bits (uint16) -> float32, exactly."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def bf16_rne(f32):
    """float32 -> bfloat16 bits, round to nearest even in numpy integer arithmetic; a NaN
    stays a NaN (quieted)."""
    f32 = np.asarray(f32, np.float32)
    x = np.ascontiguousarray(f32).view(np.uint32).astype(np.uint64)
    r = (x + 0x7FFF + ((x >> 16) & 1)) >> 16
    nan = np.isnan(f32)
    if nan.any():
        r[nan] = (x[nan] >> 16) | 0x40
    return r.astype(np.uint16)


_FOLD = {
    _O.SUM: np.add, _O.AVG: np.add, _O.PREMUL_SUM: np.add, _O.PRODUCT: np.multiply,
    _O.MIN: np.minimum, _O.MAX: np.maximum, _O.BAND: np.bitwise_and, _O.BOR: np.bitwise_or,
    _O.BXOR: np.bitwise_xor,
}
_BOOL_FOLD = {
    _O.SUM: np.logical_or, _O.MAX: np.logical_or, _O.BOR: np.logical_or,
    _O.PRODUCT: np.logical_and, _O.MIN: np.logical_and, _O.BAND: np.logical_and,
    _O.BXOR: np.logical_xor,
}


def reference_reduce(inputs, dtype, op, world_size, premul=PREMUL):
    """op over `inputs` (one 1-D array per rank, in rank order) with the engine's arithmetic.
    `op` is a ReduceOp or its name."""
    op = ReduceOp[op] if isinstance(op, str) else ReduceOp(op)
    if dtype == "bool":
        acc = inputs[0].copy()
        for x in inputs[1:]:
            acc = _BOOL_FOLD[op](acc, x)
        return acc
    if dtype == "float16":
        xs, scalar = [x.astype(np.float32) for x in inputs], np.float32
    elif dtype == "bfloat16":
        xs, scalar = [bf16_widen(x) for x in inputs], np.float32
    else:
        xs, scalar = list(inputs), np.dtype(dtype).type
    if op == _O.PREMUL_SUM:
        xs = [x * scalar(premul) for x in xs]
    acc = xs[0].copy()
    for x in xs[1:]:
        acc = _FOLD[op](acc, x)
    if op == _O.AVG and world_size != 1:
        acc = acc * scalar(1.0 / world_size)
    if dtype == "float16":
        return acc.astype(np.float16)  # IEEE conversion: round to nearest even, once
    if dtype == "bfloat16":
        return bf16_rne(acc)
    return acc.astype(dtype, copy=False)
