"""The latency path: `dist.all_reduce(t)` on one dense contiguous CPU tensor, in ~2 us.

torch's front end calls `pg.allreduce([t], opts)` with `opts.asyncOp = False` and waits on
the Work at once. The general path (process_group.py) validates with gloo's wording, builds
a Job and a closure, and costs ~15 us of Python before the engine starts. Here the same
call is recognized with a few attribute reads (each ~0.1 us; `opts.reduceOp == SUM` is a
cheap pybind compare, whereas hashing a ReduceOp costs ~2 us) and handed straight to the
engine on the calling thread. Anything unusual (a list, strided or bf16/complex tensors,
bitwise ops, requires_grad, coalescing, a poisoned group) returns None and takes the general
path, which owns every argument check and error text: this path never raises a check error
of its own.
"""

import datetime

import torch
import torch.distributed as dist

from ..ops import ReduceOp

__all__ = ["allreduce_inline"]

_OPTIONS = dist.AllreduceOptions
_STRIDED = torch.strided
_ZERO = datetime.timedelta(0)

# dtypes whose tensor.numpy() is the engine's own view (bf16 needs a uint16 view, complex
# a kind check): value = reductions valid for the dtype, in the order they are tried.
_D = dist.ReduceOp
_REAL_OPS = ((_D.SUM, ReduceOp.SUM), (_D.MAX, ReduceOp.MAX), (_D.MIN, ReduceOp.MIN),
             (_D.PRODUCT, ReduceOp.PRODUCT))
_FLOAT_OPS = ((_D.SUM, ReduceOp.SUM), (_D.AVG, ReduceOp.AVG)) + _REAL_OPS[1:]
_FAST_DTYPES = {torch.float32: _FLOAT_OPS, torch.float64: _FLOAT_OPS,
                torch.float16: _FLOAT_OPS, torch.int32: _REAL_OPS, torch.int64: _REAL_OPS,
                torch.int16: _REAL_OPS, torch.int8: _REAL_OPS, torch.uint8: _REAL_OPS,
                torch.bool: _REAL_OPS}


def allreduce_inline(pg, tensors, opts):
    """Run pg.allreduce(tensors, opts) here and return the completed Work, or None when the
    call is not the plain synchronous single-tensor case (the caller then takes the
    general path)."""
    if type(opts) is not _OPTIONS or opts.asyncOp or type(tensors) is not list \
            or len(tensors) != 1 or pg._coalescing is not None:
        return None
    t = tensors[0]
    if type(t) is not torch.Tensor or t.layout is not _STRIDED or not t.is_cpu \
            or t.requires_grad or not t.is_contiguous():
        return None
    ops = _FAST_DTYPES.get(t.dtype)
    if ops is None:
        return None
    want = opts.reduceOp
    for theirs, op in ops:
        if want == theirs:
            break
    else:
        return None
    group = pg.group
    if group.poisoned is not None:
        return None  # the general path words the "aborted after an earlier failure" error
    timeout = opts.timeout
    t_s = timeout.total_seconds() if timeout >= _ZERO else group.timeout_s
    array = t.numpy()
    with pg._lock:
        pg._seq += 1
    pg._executor.run_inline(group.all_reduce, array, op, None, t_s)
    return pg._completed_work
