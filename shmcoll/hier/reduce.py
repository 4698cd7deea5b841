"""Hierarchical reductions: all_reduce, reduce_scatter, reduce.

Reduction order (the same in every algorithm here, so every rank, and every algorithm,
gets the same bits): first inside each node, over its ranks in rank order (the engine's
own order; fp16/bf16 accumulate in fp32 and round once to the node's partial), then over
the nodes' partials in node order (nodes are numbered by their lowest rank; fp16/bf16
again accumulate in fp32 and round once). AVG divides the total once, at the end;
PREMUL_SUM multiplies every rank's input before the node sum. So for float SUM at 2 nodes
of 2 ranks: ((x0 + x1) + (x2 + x3)), rounded to the dtype after each level.

Algorithms (all sizes are per rank):
- leaders (small, or nodes of unequal sizes): intra-node reduce to local rank 0 (an
  intra-node all_reduce up to INTRA_ALL_REDUCE_MAX_NBYTES); the leaders exchange their
  node's partial and each reduces all of them; intra-node broadcast. Only one rank per
  node talks to other nodes.
- sharded (nodes of equal size L > 1, from shard_min_nbytes): intra-node reduce-scatter
  (local rank l holds shard l of the node's partial); local rank l of every node exchanges
  shard l over channel l (L exchanges in parallel, 1/L of the bytes each); intra-node
  all-gather.
The exchange itself (exchange_reduce): a first round carrying the partial when it fits
(wire.py), else an all_gather of the partials (one transport call; at 2 nodes it moves as
few bytes as anything can) or, from 3 nodes and RS_MIN_NBYTES, a reduce-scatter
(all_to_all) + all_gather, which moves 2(M-1)/M of the partial instead of M-1.
"""

import numpy as np

from ..native import compiled
from ..native.ops import ReduceOp, reduce_spec
from . import wire

__all__ = ["all_reduce", "reduce_scatter", "reduce", "exchange_reduce", "level_ops",
           "HIER_SHARD_MIN_NBYTES", "RS_MIN_NBYTES"]

# Leaders vs sharded (all_reduce, broadcast, reduce_scatter_tensor; config
# hier_shard_min_nbytes): sharding trades one exchange of the whole partial for L parallel
# exchanges of 1/L of it, and pays an intra-node reduce-scatter + all-gather for it.
# lab/hier_ab.py, 2 namespaced hosts x 2 ranks on the 2-core VM (one machine: the
# "network" costs CPU like everything else), sharded / leaders time, two runs (load 7-10):
# 64 KiB 1.22, 1.55; 256 KiB 0.99, 1.28; 1 MiB 0.93, 0.99; 4 MiB 1.11, 1.13; 16 MiB 0.93,
# 0.92; 64 MiB 0.87. With a NIC per local rank (GPU nodes) sharding pays far earlier.
HIER_SHARD_MIN_NBYTES = 16 << 20
# Up to this size the leaders algorithm's intra-node step is the engine's all_reduce, not
# its reduce: the same sum in the same rank order (so the same bits), but the engine's
# latency path (plan cached, one compiled step), where reduce takes the general one; the
# other local ranks' extra reads are a few cache lines. 2 namespaced hosts x 2 ranks,
# same-process toggle (12 blocks): see docs/MULTINODE.md.
INTRA_ALL_REDUCE_MAX_NBYTES = 1024
# From 3 nodes, a partial this large is reduce-scattered + all-gathered across nodes
# instead of all-gathered whole (2(M-1)/M vs M-1 times its bytes on each link).
RS_MIN_NBYTES = 256 << 10


def level_ops(op, dt, world_size, premul):
    """(op, premul) of the intra-node step and the ReduceSpec of the inter-node step.
    AVG runs as PREMUL_SUM(1.0) inside nodes (exact, and distinct from SUM in the
    engine's fingerprint, so ranks mixing SUM and AVG still mismatch) and divides once."""
    if op == ReduceOp.AVG:
        return ReduceOp.PREMUL_SUM, 1.0, reduce_spec(ReduceOp.AVG, dt, world_size)
    if op == ReduceOp.PREMUL_SUM:
        return op, premul, reduce_spec(ReduceOp.SUM, dt, world_size)
    return op, 1.0, reduce_spec(op, dt, world_size)


def all_reduce(call, flat, dt, op, premul):
    """Reduce `flat` (1-D contiguous, storage dtype) over every rank of the group."""
    g = call.g
    intra_op, intra_premul, inter = level_ops(op, dt, g.world_size, premul)
    if g.layout.even and g.layout.shards > 1 and flat.nbytes >= g.shard_min_nbytes:
        _all_reduce_sharded(call, flat, dt, intra_op, intra_premul, inter)
    else:
        _all_reduce_leaders(call, flat, dt, intra_op, intra_premul, inter)


def _all_reduce_leaders(call, flat, dt, intra_op, intra_premul, inter):
    g = call.g
    early = None
    if g.local == 0 and flat.nbytes > wire.INLINE_NBYTES:
        early = call.start_frame(g.channel)  # the header round overlaps the node's reduce
    if flat.nbytes <= INTRA_ALL_REDUCE_MAX_NBYTES:
        call.intra("intra-node all_reduce", g.intra.all_reduce, flat, intra_op, dt.name,
                   premul=intra_premul)
    else:
        call.intra("intra-node reduce to the leader", g.intra.reduce, flat, 0, intra_op,
                   dt.name, premul=intra_premul)
    if g.local == 0:
        exchange_reduce(call, g.channel, flat, inter, early, "inter-node all_reduce (leaders)")
    call.intra("intra-node broadcast from the leader", g.intra.broadcast, flat, 0)


def _all_reduce_sharded(call, flat, dt, intra_op, intra_premul, inter):
    g = call.g
    nshards = g.layout.shards
    count, item = flat.size, flat.itemsize
    per = -(-count // nshards)
    full = flat
    if per * nshards != count:  # pad to equal shards (the pad is reduced and dropped)
        full = g.scratch("full", per * nshards * item, flat.dtype)
        full[:count] = flat
        full[count:] = 0
    shard = g.scratch("shard", per * item, flat.dtype)
    early = call.start_frame(g.channel) if shard.nbytes > wire.INLINE_NBYTES else None
    call.intra("intra-node reduce-scatter", g.intra.reduce_scatter, shard, full, intra_op,
               dt.name, premul=intra_premul)
    exchange_reduce(call, g.channel, shard, inter, early,
                    f"inter-node all_reduce of shard {g.local}")
    call.intra("intra-node all-gather", g.intra.all_gather, full, shard)
    if full is not flat:
        flat[:] = full[:count]


def exchange_reduce(call, channel, flat, spec, early, step):
    """Every member of `channel` ends with the reduction of all members' `flat` (its
    node's partial), taken in node order. `early`: a first round already started."""
    members, n, me = channel.size, flat.nbytes, channel.rank
    if early is None and n <= wire.INLINE_NBYTES:
        rows = call.frame_round(channel, flat, step + " (first round)")
        addrs = rows.ctypes.data + wire.FRAME_NBYTES * np.arange(members, dtype=np.int64)
    else:
        call.finish_frame(early if early is not None else call.start_frame(channel),
                          step + " (first round)")
        if members >= 3 and n >= RS_MIN_NBYTES:
            _exchange_reduce_two_step(call, channel, flat, spec, step)
            return
        others = call.g.scratch("recv", (members - 1) * n)
        if n:
            call.move(step, channel.exchange, others, flat.view(np.uint8))
        # node order, our own partial read where it lies (reduce_into allows out == a src)
        addrs = others.ctypes.data + n * np.array(
            [m if m < me else m - 1 for m in range(members)], np.int64)
        addrs[me] = flat.ctypes.data
    if flat.size:
        compiled.kernels.reduce_into(flat, addrs, spec.op, spec.kind, 1.0, spec.post)


def _exchange_reduce_two_step(call, channel, flat, spec, step):
    """exchange_reduce from 3 members on large partials: all_to_all (member m receives
    piece m of every partial), reduce the pieces in node order, all_gather the pieces."""
    g = call.g
    members, count, item = channel.size, flat.size, flat.itemsize
    per = -(-count // members)
    full = flat
    if per * members != count:
        full = g.scratch("full2", per * members * item, flat.dtype)
        full[:count] = flat
        full[count:] = 0
    pieces = g.scratch("pieces", per * members * item, flat.dtype)
    splits = [per * item] * members
    call.move(step + " (reduce-scatter)", channel.all_to_all, pieces.view(np.uint8),
              full.view(np.uint8), splits, splits)
    mine = g.scratch("mine", per * item, flat.dtype)
    addrs = pieces.ctypes.data + per * item * np.arange(members, dtype=np.int64)
    compiled.kernels.reduce_into(mine, addrs, spec.op, spec.kind, 1.0, spec.post)
    call.move(step + " (all-gather)", channel.all_gather, full.view(np.uint8),
              mine.view(np.uint8))
    if full is not flat:
        flat[:] = full[:count]


def reduce_scatter(call, out, blocks, sizes, dt, op, premul):
    """out = the reduction of every rank's block `rank` (blocks: one array of equal blocks,
    or a list with `sizes`). Nodes of equal size with one array from shard_min_nbytes:
    intra-node reduce-scatter of the blocks regrouped by local rank, then each local rank
    reduce-scatters its node partials over its channel. Otherwise the all_reduce above of
    the whole input (same reduction order), keeping this rank's block."""
    g = call.g
    one = isinstance(blocks, np.ndarray)
    total = sum(sizes) * out.itemsize
    if one and g.layout.even and g.layout.shards > 1 and total >= g.shard_min_nbytes:
        _reduce_scatter_sharded(call, out, blocks, dt, op, premul)
        return
    work = g.scratch("work", total, out.dtype)
    if one:
        work[:] = blocks
    elif blocks:
        np.concatenate(blocks, out=work)
    all_reduce(call, work, dt, op, premul)
    start = sum(sizes[:g.rank])
    out[:] = work[start:start + out.size]


def _reduce_scatter_sharded(call, out, blocks, dt, op, premul):
    g = call.g
    layout = g.layout
    members, nlocal, n, item = layout.num_nodes, layout.shards, out.size, out.itemsize
    intra_op, intra_premul, inter = level_ops(op, dt, g.world_size, premul)
    # local rank l receives, for every node m, its node's partial of rank (m, l)'s block
    order = [layout.rank_of(m, l) for l in range(nlocal) for m in range(members)]
    regrouped = g.scratch("regrouped", g.world_size * n * item, out.dtype)
    np.take(blocks.reshape(g.world_size, n), order, axis=0,
            out=regrouped.reshape(g.world_size, n))
    part = g.scratch("part", members * n * item, out.dtype)
    early = call.start_frame(g.channel) if part.nbytes > wire.INLINE_NBYTES else None
    call.intra("intra-node reduce-scatter", g.intra.reduce_scatter, part, regrouped,
               intra_op, dt.name, premul=intra_premul)
    step = f"inter-node reduce-scatter over channel {g.local}"
    if early is None:
        rows = call.frame_round(g.channel, part, step + " (first round)")
        addrs = rows.ctypes.data + g.node * n * item + \
            wire.FRAME_NBYTES * np.arange(members, dtype=np.int64)
    else:
        call.finish_frame(early, step + " (first round)")
        received = g.scratch("recv", members * n * item, out.dtype)
        splits = [n * item] * members
        call.move(step, g.channel.all_to_all, received.view(np.uint8), part.view(np.uint8),
                  splits, splits)
        addrs = received.ctypes.data + n * item * np.arange(members, dtype=np.int64)
    if n:
        compiled.kernels.reduce_into(out, addrs, inter.op, inter.kind, 1.0, inter.post)


def reduce(call, flat, dt, op, premul, root):
    """reduce = the hierarchical all_reduce, kept by `root` only (other ranks reduce a
    copy: their arrays are not written)."""
    g = call.g
    if g.rank != root:
        work = g.scratch("work", flat.nbytes, flat.dtype)
        work[:] = flat
        flat = work
    all_reduce(call, flat, dt, op, premul)
