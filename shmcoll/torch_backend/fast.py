"""The latency path: synchronous calls on dense contiguous CPU tensors, handed straight to
the engine (`dist.all_reduce(t)`: 6-9 us of adapter Python in a rank process, measured
2026-11-28 with the kernel stubbed, instead of the general path's Job and closure). It
takes all_reduce, broadcast, the single-tensor gathers and reduce_scatters, and their list
forms of one input (`dist.all_gather(outs, t)`, `dist.reduce_scatter(out, ins)`), and
all_to_all_single, all_to_all of one dtype, and gather and scatter.

torch's front end calls `pg.allreduce([t], opts)` with `opts.asyncOp = False` and waits on
the Work at once. The general path (process_group.py) validates with gloo's wording, builds
a Job and a closure, and costs ~15 us of Python before the engine starts. Here the same
call is recognized with a few attribute reads (each ~0.1 us; `opts.reduceOp == SUM` is a
cheap pybind compare, whereas hashing a ReduceOp costs ~2 us) and handed straight to the
engine on the calling thread. Anything unusual (lists of several inputs, tensors of
unequal sizes, strided or bf16/complex tensors, bitwise ops, requires_grad, coalescing, a
poisoned group) returns None and takes the general path, which owns every argument check
and error text: this path never raises a check error of its own.
"""

import datetime

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

from ..native.ops import ReduceOp
from .compat import OPTIONS_HAVE_ASYNC_OP
from .convert import plain_array, row_counts

__all__ = ["allreduce_inline", "broadcast_inline", "all_gather_single_inline",
           "all_gather_inline", "reduce_scatter_single_inline", "reduce_scatter_inline",
           "all_to_all_single_inline", "all_to_all_inline", "gather_inline", "scatter_inline"]

_OPTIONS = dist.AllreduceOptions
_BCAST_OPTIONS = dist.BroadcastOptions
_GATHER_OPTIONS = _c10d.AllgatherOptions
_RS_OPTIONS = dist.ReduceScatterOptions
_A2A_OPTIONS = dist.AllToAllOptions
_GATHER_ROOTED_OPTIONS = dist.GatherOptions
_SCATTER_OPTIONS = dist.ScatterOptions
_STRIDED = torch.strided
_ZERO = datetime.timedelta(0)

# dtypes whose plain numpy view is the engine's own view (bf16 needs a uint16 view, complex
# a kind check): value = reductions valid for the dtype, in the order they are tried.
_D = dist.ReduceOp
_REAL_OPS = ((_D.SUM, ReduceOp.SUM), (_D.MAX, ReduceOp.MAX), (_D.MIN, ReduceOp.MIN),
             (_D.PRODUCT, ReduceOp.PRODUCT))
_FLOAT_OPS = ((_D.SUM, ReduceOp.SUM), (_D.AVG, ReduceOp.AVG)) + _REAL_OPS[1:]
_FAST_DTYPES = {torch.float32: _FLOAT_OPS, torch.float64: _FLOAT_OPS,
                torch.float16: _FLOAT_OPS, torch.int32: _REAL_OPS, torch.int64: _REAL_OPS,
                torch.int16: _REAL_OPS, torch.int8: _REAL_OPS, torch.uint8: _REAL_OPS,
                torch.bool: _REAL_OPS}


# dtypes numpy views directly (byte-moving collectives take any of them).
_COMPLEX = {torch.complex64, torch.complex128}
_NUMPY_DTYPES = set(_FAST_DTYPES) | _COMPLEX

_array = plain_array  # the tensor's memory as numpy (lab/adapter_ab.py swaps it)


def _plain(t):
    """A dense contiguous CPU tensor whose memory holds its values (no lazy negation) and
    that needs no detach."""
    return type(t) is torch.Tensor and t.layout is _STRIDED and t.is_cpu \
        and not t.requires_grad and t.is_contiguous() and not t.is_neg()


def _bytes_plain(t):
    """_plain, of a dtype moved as bytes, not lazily conjugated."""
    return _plain(t) and t.dtype in _NUMPY_DTYPES and not (t.dtype in _COMPLEX and t.is_conj())


def _ready(pg, opts):
    """Synchronous, not coalescing, group healthy: the inline path may run (a poisoned
    group takes the general path, which words the "aborted after an earlier failure"
    error). On a torch whose options cannot say "synchronous" (compat) it never runs."""
    return OPTIONS_HAVE_ASYNC_OP and not opts.asyncOp and pg._coalescing is None \
        and pg.group.poisoned is None and pg._inline_ok


def _timeout_s(pg, opts):
    timeout = opts.timeout
    return timeout.total_seconds() if timeout >= _ZERO else pg.group.timeout_s


def _run(pg, fn, *args):
    with pg._lock:
        pg._seq += 1
    pg._executor.run_inline(fn, *args)
    if pg._lane_unarmed:  # the group's first latency-path call: its kernels are loaded
        pg._arm_lane()
    return pg._completed_work


def _op_for(dtype, want):
    ops = _FAST_DTYPES.get(dtype)
    if ops is not None:
        for theirs, op in ops:
            if want == theirs:
                return op
    return None


def broadcast_inline(pg, tensors, opts):
    """pg.broadcast([t], opts) of dist.broadcast(t, src), or None (general path)."""
    if type(opts) is not _BCAST_OPTIONS or type(tensors) is not list or len(tensors) != 1 \
            or not _ready(pg, opts):
        return None
    t = tensors[0]
    root = opts.rootRank
    if not _bytes_plain(t) or opts.rootTensor != 0 or not 0 <= root < pg.group.world_size:
        return None
    return _run(pg, pg.group.broadcast, _array(t), root, _timeout_s(pg, opts))


def all_gather_single_inline(pg, output, input, opts):
    """pg.all_gather_single(out, in, opts) of dist.all_gather_into_tensor, or None."""
    if type(opts) is not _GATHER_OPTIONS or not _ready(pg, opts) or not _bytes_plain(output) \
            or not _bytes_plain(input) or output.dtype is not input.dtype \
            or output.numel() != input.numel() * pg.group.world_size:
        return None
    return _run(pg, pg.group.all_gather, _array(output), _array(input), _timeout_s(pg, opts))


def all_to_all_single_inline(pg, output, input, output_split_sizes, input_split_sizes, opts):
    """pg.alltoall_base(out, in, out_splits, in_splits, opts) of dist.all_to_all_single,
    or None: both tensors of one dtype, with at least one dimension, split along dim 0
    into world_size pieces equally (no splits; same sizes) or by the splits given for
    both, which gloo's checks (worded by the general path) all pass."""
    n = pg.group.world_size
    if type(opts) is not _A2A_OPTIONS or not _ready(pg, opts) or not _bytes_plain(output) \
            or not _bytes_plain(input) or output.dtype is not input.dtype \
            or not input.dim() or not output.dim():
        return None
    if not output_split_sizes and not input_split_sizes:
        if output.numel() != input.numel() or input.shape[0] % n or output.shape[0] % n:
            return None
        return _run(pg, pg.group.all_to_all_single, _array(output), _array(input), None, None,
                    _timeout_s(pg, opts))
    counts = []
    for t, splits in ((output, output_split_sizes), (input, input_split_sizes)):
        rows = t.shape[0]
        if not splits or len(splits) != n or sum(splits) != rows or min(splits) < 0:
            return None
        counts.append(row_counts(t, splits))
    return _run(pg, pg.group.all_to_all_single, _array(output), _array(input), counts[0],
                counts[1], _timeout_s(pg, opts))


def all_to_all_inline(pg, outputs, inputs, opts):
    """pg.alltoall(outs, ins, opts) of dist.all_to_all(outs, ins), or None: world_size
    tensors each, all of one dtype (sizes may differ per pair, as in the general path: the
    engine checks them against the peers')."""
    n = pg.group.world_size
    if type(opts) is not _A2A_OPTIONS or type(inputs) is not list or len(inputs) != n \
            or type(outputs) is not list or len(outputs) != n or not _ready(pg, opts):
        return None
    if not _bytes_plain(inputs[0]):
        return None
    dtype = inputs[0].dtype
    for t in inputs + outputs:
        if not _bytes_plain(t) or t.dtype is not dtype:
            return None
    return _run(pg, pg.group.all_to_all, [_array(t) for t in outputs],
                [_array(t) for t in inputs], _timeout_s(pg, opts))


def _rooted_inline(pg, fn, singles, lists, opts, options):
    """Run fn(my array, the root's arrays or None, root, timeout) of a gather or scatter
    in the options form (the one torch's front end uses) inline, or return None: one plain
    tensor here; at the root, world_size plain tensors of its dtype and shape; elsewhere
    no list."""
    if type(opts) is not options or type(singles) is not list or len(singles) != 1 \
            or type(lists) is not list or not _ready(pg, opts):
        return None
    t = singles[0]
    root = opts.rootRank
    if not _bytes_plain(t) or not 0 <= root < pg.group.world_size:
        return None
    theirs = None
    if pg.group.rank == root:
        if len(lists) != 1 or type(lists[0]) is not list \
                or len(lists[0]) != pg.group.world_size:
            return None
        dtype, shape = t.dtype, t.shape
        for o in lists[0]:
            if not _bytes_plain(o) or o.dtype is not dtype or o.shape != shape:
                return None
        theirs = [_array(o) for o in lists[0]]
    elif lists:
        return None
    return _run(pg, fn, _array(t), theirs, root, _timeout_s(pg, opts))


def gather_inline(pg, output_lists, inputs, opts):
    """pg.gather(outs, [t], opts) of dist.gather(t, gather_list, dst), or None."""
    return _rooted_inline(pg, pg.group.gather, inputs, output_lists, opts,
                          _GATHER_ROOTED_OPTIONS)


def scatter_inline(pg, outputs, input_lists, opts):
    """pg.scatter([t], ins, opts) of dist.scatter(t, scatter_list, src), or None."""
    return _rooted_inline(pg, pg.group.scatter, outputs, input_lists, opts, _SCATTER_OPTIONS)


def all_gather_inline(pg, output_lists, inputs, opts):
    """pg.allgather([outs], [t], opts) of dist.all_gather(outs, t), or None: outs are
    world_size tensors of t's dtype and shape (gloo's checks, which the general path words,
    all pass)."""
    if type(opts) is not _GATHER_OPTIONS or type(inputs) is not list or len(inputs) != 1 \
            or type(output_lists) is not list or len(output_lists) != 1 \
            or not _ready(pg, opts):
        return None
    t, outs = inputs[0], output_lists[0]
    if type(outs) is not list or len(outs) != pg.group.world_size or not _bytes_plain(t):
        return None
    dtype, shape = t.dtype, t.shape
    for o in outs:
        if not _bytes_plain(o) or o.dtype is not dtype or o.shape != shape:
            return None
    return _run(pg, pg.group.all_gather, [_array(o) for o in outs], _array(t),
                _timeout_s(pg, opts))


def reduce_scatter_single_inline(pg, output, input, opts):
    """pg.reduce_scatter_single(out, in, opts) of dist.reduce_scatter_tensor, or None."""
    if type(opts) is not _RS_OPTIONS or not _ready(pg, opts) or not _plain(output) \
            or not _plain(input) or output.dtype is not input.dtype \
            or input.numel() != output.numel() * pg.group.world_size:
        return None
    op = _op_for(output.dtype, opts.reduceOp)
    if op is None:
        return None
    return _run(pg, pg.group.reduce_scatter, _array(output), _array(input), op, None,
                _timeout_s(pg, opts))


def allreduce_inline(pg, tensors, opts):
    """pg.allreduce([t], opts) of dist.all_reduce(t): run here and return the completed
    Work, or None (the caller then takes the general path)."""
    if type(opts) is not _OPTIONS or type(tensors) is not list or len(tensors) != 1 \
            or not _ready(pg, opts):
        return None
    t = tensors[0]
    if not _plain(t):
        return None
    op = _op_for(t.dtype, opts.reduceOp)
    if op is None:
        return None
    return _run(pg, pg.group.all_reduce, _array(t), op, None, _timeout_s(pg, opts))


def reduce_scatter_inline(pg, output_tensors, input_lists, opts):
    """pg.reduce_scatter([out], [ins], opts) of dist.reduce_scatter(out, ins), or None: ins
    are world_size tensors of out's dtype and size."""
    if type(opts) is not _RS_OPTIONS or type(output_tensors) is not list \
            or len(output_tensors) != 1 or type(input_lists) is not list \
            or len(input_lists) != 1 or not _ready(pg, opts):
        return None
    out, ins = output_tensors[0], input_lists[0]
    if type(ins) is not list or len(ins) != pg.group.world_size or not _plain(out):
        return None
    dtype, n = out.dtype, out.numel()
    for t in ins:
        if not _plain(t) or t.dtype is not dtype or t.numel() != n:
            return None
    op = _op_for(dtype, opts.reduceOp)
    if op is None:
        return None
    return _run(pg, pg.group.reduce_scatter, _array(out), [_array(t) for t in ins], op, None,
                _timeout_s(pg, opts))
