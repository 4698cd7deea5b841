"""The compiled latency path: a Lane (_lane.c, a C extension) in front of a process group's
all_reduce, broadcast, all_gather_into_tensor, reduce_scatter_tensor and
all_to_all_single.

fast.py's latency path hands a synchronous call on plain tensors straight to the engine,
but still spends ~10 us of Python per call between torch and the kernel (its checks, the
numpy views, Group's plan lookup and record, Arena's slot bookkeeping, numba's dispatcher)
against ~4-5 us of kernel at 64 KiB on 2 ranks, and every us of it costs two at 4 ranks on
2 cores. The Lane does that part in C: the same checks as fast.py, a plan cache keyed by
(collective, dtype, shape, root or reduction), and the one-step kernel called through its C
entry (protocol.kernels.one_step_entry) with the GIL released as numba's dispatcher does.

What it runs: exactly the calls that fast.py would run inline AND that the one-step
kernel runs whole (Group.one_step_plan: up to a slot, by algorithms.select); everything
else -- a larger size, lists, strided or device tensors, async ops, coalescing, a poisoned
group, bad arguments -- goes to the group's Python method, unchanged, which owns every
check error. The Lane writes no state but the process group's sequence number (as fast.py
does); after a clean pass the arena's clock records the step (its one_step, as
Arena.one_step calls it) and the engine the pass (Group.lane_done: seq, flight record); a
pass the kernel did not finish (a late peer, a mismatch, an abort) goes on in Python where
the Python path goes on (`_resume`: Group.lane_resume, Arena.one_step_resume), so errors,
deadlines and records are the Python path's. Under
Executor.run_inline, as fast.py: queued async ops run first, shutdown from another thread
aborts the call.

Installed by EngineProcessGroup at creation as instance attributes (torch's trampolines
find them; DeferredProcessGroup forwards them: LaneCall objects, not builtin methods,
which pybind11 would take for the base class's own), armed by the group's first
latency-path call (`arm`: the C entry's address, which the warm-up has loaded with the
one-step kernel; group creation itself loads no numba): until then every call takes the
Python method. Off with SHMCOLL_LANE=0, where the
extension was not built (no compiler at install), on a torch whose options cannot say
"synchronous" (compat), for rank threads (threaded_pg) and simulated devices.
"""

import torch
import torch.distributed as dist

from ..engine import warmup
from ..engine.group import Group
from ..engine.group_args import as_bytes
from ..native.ops import ReduceOp
from . import fast
from .compat import OPTIONS_HAVE_ASYNC_OP
from .convert import plain_array

try:
    from . import _lane
except ImportError:  # built without a C compiler: the Python latency path only
    _lane = None
else:  # groups' warm-up loads the kernel entry with the one-step kernel, off the first call
    warmup.load_with_first("one-step C entry", Group.lane_entry)

__all__ = ["available", "build", "arm", "METHODS"]

# The Lane's collectives, in its op order (_lane.c's OP_*): the engine's names, and the
# process group's methods each takes over, its Python one first (the Lane's fallback).
NAMES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")
METHODS = (("allreduce",), ("broadcast",), ("all_gather_single", "_allgather_base"),
           ("reduce_scatter_single", "_reduce_scatter_base"),
           ("all_to_all_single", "alltoall_base"))
OP_ALL_REDUCE, OP_BROADCAST, OP_ALL_GATHER, OP_REDUCE_SCATTER, OP_ALL_TO_ALL = range(5)

# opts.reduceOp compared (==, as torch compares) with these, in order; the plan keeps its
# index (hashing a ReduceOp costs ~2 us)
REDUCE_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN,
              dist.ReduceOp.PRODUCT)

# _lane.c's dtype flags: the element size, then DT_BYTES (moved as bytes: fast's
# _NUMPY_DTYPES), DT_REDUCE (reduced inline: fast's _FAST_DTYPES), DT_COMPLEX (a lazily
# conjugated tensor takes the Python path)
_DT_BYTES, _DT_REDUCE, _DT_COMPLEX = 0x100, 0x200, 0x400
_DTYPES = {d: d.itemsize | _DT_BYTES
           | (_DT_REDUCE if d in fast._FAST_DTYPES else 0)
           | (_DT_COMPLEX if d in fast._COMPLEX else 0) for d in fast._NUMPY_DTYPES}
_OPTION_TYPES = (fast._OPTIONS, fast._BCAST_OPTIONS, fast._GATHER_OPTIONS, fast._RS_OPTIONS,
                 fast._A2A_OPTIONS)


def available():
    """Whether the C extension is importable here."""
    return _lane is not None


def build(pg):
    """A Lane for process group `pg` (not armed), or None where none may run."""
    if _lane is None or not OPTIONS_HAVE_ASYNC_OP or not pg._inline_ok or not pg._cfg.lane:
        return None
    group = pg.group
    # an engine Group of rank processes (not a HierGroup, not rank threads)
    constants = group.lane_constants() if hasattr(group, "lane_constants") else None
    if constants is None:
        return None
    cfg, tab, slot_addrs, clock = constants
    cls = type(pg)
    return _lane.Lane(
        pg, group, clock, pg._executor.run_inline, _plan, _resume, _slow, group.lane_done,
        tuple(getattr(cls, names[0]) for names in METHODS), torch.Tensor, torch.strided,
        _DTYPES, REDUCE_OPS, _OPTION_TYPES, 0, cfg.ctypes.data, cfg.size, tab.ctypes.data,
        tab.shape[0], tab.shape[1], tuple(a.ctypes.data for a in slot_addrs), group.rank,
        group.world_size, (cfg, tab, tuple(slot_addrs)))


def arm(lane, group):
    """Give `lane` the one-step kernel's C entry (loads it: call after a collective)."""
    lane.arm(group.lane_entry())


def _plan(pg, op, out, inp, root, k):
    """The Lane's plan entry for a call shape (asked once per key): (plan, mode, words
    address, words length, pre, post, nbytes, engine name, engine reduce op, in place:
    whether the kernel may run it with the output the input's memory -- all but an
    all_to_all whose blocks are read where they lie), or None where the one-step kernel
    does not run it whole or the call is not valid (the Python method then runs or refuses
    it)."""
    name = NAMES[op]
    eng = ReduceOp.SUM
    if op in (OP_ALL_REDUCE, OP_REDUCE_SCATTER):
        eng = fast._op_for(inp.dtype, REDUCE_OPS[k])
        if eng is None:
            return None
    try:
        plan = pg.group.one_step_plan(name, plain_array(inp),
                                      None if out is None else plain_array(out), root, eng)
    except (ValueError, TypeError):
        return None
    if plan is None:
        return None
    in_place = op != OP_ALL_TO_ALL or not plan.reads
    return (plan, plan.mode, plan.words.ctypes.data, plan.words.size, float(plan.pre),
            float(plan.post), plan.nbytes, name, eng, in_place)


def _resume(pg, op, out, inp, entry, seq, i, step, publishes, r, root, timeout_s, t_start,
            t_mono, src, dst):
    """The rest of a call whose kernel did not finish it, in Python (Group.lane_resume)."""
    pg.group.lane_resume(entry[7], entry[0], seq, i, step, publishes, r,
                         as_bytes(plain_array(inp)),
                         None if out is None else as_bytes(plain_array(out)), root,
                         timeout_s, t_start, t_mono)


def _slow(pg, op, out, inp, entry, root, timeout_s):
    """The whole call through the engine's Python path (inside run_inline already), where
    the Lane found the group unable to take it here: poisoned, closed or loading its
    kernels (the engine raises or waits), or its slot still read by a peer."""
    group, a = pg.group, plain_array(inp)
    if op == OP_ALL_REDUCE:
        group.all_reduce(a, entry[8], None, timeout_s)
    elif op == OP_BROADCAST:
        group.broadcast(a, root, timeout_s)
    elif op == OP_ALL_GATHER:
        group.all_gather(plain_array(out), a, timeout_s)
    elif op == OP_REDUCE_SCATTER:
        group.reduce_scatter(plain_array(out), a, entry[8], None, timeout_s)
    else:
        group.all_to_all_single(plain_array(out), a, None, None, timeout_s)
