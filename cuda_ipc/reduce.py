"""The reduction on device tensors: torch element-wise kernels in a fixed order.

out = post * fold(op, pre * src_0, ..., pre * src_{K-1}), folded in rank order, exactly the
definition of shmcoll.native.reducers.reduce_into, so every rank that reduces the same slots gets
bitwise-identical bytes (element-wise kernels are deterministic). float16 / bfloat16 are
accumulated in float32 and rounded once: with two sources and no scaling torch's own
half-precision kernels already compute in float32 and round once; otherwise the sum runs
in a float32 temporary. `src` tensors are typed views of the slots; `out` is the caller's
(contiguous) tensor chunk, which never aliases a slot.

Why torch kernels: they run on the caller's stream with no extra launch machinery and
work unchanged on the simulated device (CPU tensors). A fused n-ary kernel would read
`out` once instead of K-1 times for K > 2 sources; the GPU benchmark decides whether it
is worth one (scripts/gpu_check.sh).
"""

import torch

from shmcoll.native.op_codes import OP_BAND, OP_BOR, OP_BXOR, OP_MAX, OP_MIN, OP_PRODUCT, OP_SUM

__all__ = ["reduce_into"]

_BINARY = {OP_SUM: torch.add, OP_PRODUCT: torch.mul, OP_MIN: torch.minimum,
           OP_MAX: torch.maximum, OP_BAND: torch.bitwise_and, OP_BOR: torch.bitwise_or,
           OP_BXOR: torch.bitwise_xor}
_HALF = ("float16", "bfloat16")


def reduce_into(out, srcs, spec):
    """out[:] = the reduction (ops.ReduceSpec `spec`) of `srcs` in order (see module doc)."""
    fold = _BINARY[spec.op]
    scaled = spec.pre != 1.0 or spec.post != 1.0
    if spec.kind in _HALF and (len(srcs) > 2 or scaled):
        acc = _fold(fold, [s.float() for s in srcs], spec.pre, None)
        if spec.post != 1.0:
            acc.mul_(spec.post)
        out.copy_(acc)
        return
    _fold(fold, srcs, spec.pre, out)
    if spec.post != 1.0:
        out.mul_(spec.post)


def _fold(fold, srcs, pre, out):
    """fold over srcs (each scaled by pre) into `out` (None: a new tensor); returns it."""
    if pre != 1.0:
        srcs = [s * pre for s in srcs]
    if len(srcs) == 1:
        if out is None:
            return srcs[0].clone()
        out.copy_(srcs[0])
        return out
    if out is None:
        out = fold(srcs[0], srcs[1])
    else:
        fold(srcs[0], srcs[1], out=out)
    for s in srcs[2:]:
        fold(out, s, out=out)
    return out
