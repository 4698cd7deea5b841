"""Hierarchical data movement: broadcast, all_gather, gather, scatter, all_to_all, barrier.

Buffers here are flat uint8 arrays (bytes). "Contact" of a rooted collective: the local
rank that talks to other nodes for it, on every node: the root's local rank when every
node has one (it is < S), else 0; the root's node moves the data between the root and
its contact inside the node (an intra-node broadcast, or point-to-point).

- broadcast: root's node broadcasts inside the node; the contacts pass it on over their
  channel; the other nodes broadcast inside. Nodes of equal size, from shard_min_nbytes:
  every local rank l passes shard l over channel l, the other nodes all-gather the shards.
- all_gather: nodes of equal size: local rank l all-gathers its own input over channel l
  (the inputs of local rank l of every node), then the node all-gathers those; from
  ALL_GATHER_SPLIT_MIN_NBYTES the node first gathers its own blocks while the first round
  is in flight, and after the exchange gathers only the other nodes' blocks (straight into
  the output where they lie in order). Otherwise the leaders gather their node, exchange
  node blocks, and broadcast inside the node.
- gather / scatter: through the contacts (node blocks padded to the largest node).
- all_to_all: pairs on one node through shared memory, pairs across nodes in one
  all_to_all over the world channel.
- barrier: intra-node barrier, the leaders' first round, intra-node barrier.
Every inter-node part opens with the first round (wire.py): collective, sizes and root
are compared across nodes before anything sized by them moves.
"""

import numpy as np

from . import wire

__all__ = ["broadcast", "all_gather", "gather", "scatter", "all_to_all", "barrier"]

_P2P_TAG = 1  # intra-node point-to-point of the contact: the engine group's only p2p user
# all_gather on nodes of equal size takes _all_gather_split from this input size per rank.
# lab/hier_ab.py, 2 namespaced hosts x 2 ranks on the 2-core VM, split / one intra
# step after the exchange, two runs each: 2 KiB 1.04, 1.10; 8 KiB 0.97, 1.02; 32 KiB 1.07,
# 0.86; 64 KiB 0.86, 0.90; 256 KiB 0.74, 0.78; 1 MiB 0.68, 0.69; 4 MiB 0.66, 0.68; 16 MiB
# 0.63, 0.64.
ALL_GATHER_SPLIT_MIN_NBYTES = 64 << 10


def _contact(g, root):
    lr = g.layout.local_rank(root)
    return lr if lr < g.layout.shards else 0


def _sharded(g, nbytes):
    return g.layout.even and g.layout.shards > 1 and nbytes >= g.shard_min_nbytes


def broadcast(call, buf, root):
    g = call.g
    if _sharded(g, buf.nbytes):
        _broadcast_sharded(call, buf, root)
        return
    root_node, lr, c = g.layout.node_of[root], g.layout.local_rank(root), _contact(g, root)
    n = buf.nbytes
    early = call.start_frame(g.channel) if g.local == c and n > wire.INLINE_NBYTES else None
    if g.node == root_node:
        call.intra("intra-node broadcast from the root", g.intra.broadcast, buf, lr)
    if g.local == c:
        if early is None:
            rows = call.frame_round(g.channel, buf if g.node == root_node else None,
                                    "inter-node broadcast (first round)")
            if g.node != root_node:
                buf[:] = rows[root_node, :n]
        else:
            call.finish_frame(early, "inter-node broadcast (first round)")
            call.move("inter-node broadcast", g.channel.broadcast, buf, root_node)
    if g.node != root_node:
        call.intra("intra-node broadcast from the contact", g.intra.broadcast, buf, c)


def _broadcast_sharded(call, buf, root):
    g = call.g
    root_node, nlocal, n = g.layout.node_of[root], g.layout.shards, buf.nbytes
    per = -(-n // nlocal)
    early = call.start_frame(g.channel)
    if g.node == root_node:
        call.intra("intra-node broadcast from the root", g.intra.broadcast, buf,
                   g.layout.local_rank(root))
    lo, hi = min(g.local * per, n), min((g.local + 1) * per, n)
    if g.node == root_node and hi - lo == per:
        shard = buf[lo:hi]
    else:
        shard = g.scratch("shard", per)
        if g.node == root_node:
            shard[:hi - lo] = buf[lo:hi]
            shard[hi - lo:] = 0
    call.finish_frame(early, f"inter-node broadcast of shard {g.local} (first round)")
    if per:
        call.move(f"inter-node broadcast of shard {g.local}", g.channel.broadcast, shard,
                  root_node)
    if g.node != root_node:
        full = buf if per * nlocal == n else g.scratch("full", per * nlocal)
        call.intra("intra-node all-gather of the shards", g.intra.all_gather, full, shard)
        if full is not buf:
            buf[:] = full[:n]


def _node_block(g, out, node, n):
    """out's bytes of `node`'s ranks when they are consecutive ranks (torchrun's layout),
    else None."""
    ranks = g.layout.nodes[node]
    if ranks[-1] - ranks[0] + 1 != len(ranks):
        return None
    return out[ranks[0] * n:(ranks[-1] + 1) * n]


def _all_gather_split(call, src, out, step):
    """all_gather on nodes of equal size, for large inputs: the node's own blocks are
    gathered inside the node while the first round is in flight, then every local rank
    exchanges its input over its channel and the node all-gathers what came in. Written
    straight into `out` where the blocks lie in order (consecutive ranks per node; at 2
    nodes the other node's blocks too), else through scratch."""
    g = call.g
    layout, n = g.layout, src.nbytes
    members, nlocal, me = layout.num_nodes, layout.shards, g.node
    early = call.start_frame(g.channel)
    own = _node_block(g, out, me, n)
    node_buf = own if own is not None else g.scratch("node", nlocal * n)
    call.intra("intra-node all-gather", g.intra.all_gather, node_buf, src)
    if own is None:
        for l, r in enumerate(layout.nodes[me]):
            out[r * n:(r + 1) * n] = node_buf[l * n:(l + 1) * n]
    call.finish_frame(early, step + " (first round)")
    others = [m for m in range(members) if m != me]
    far = _node_block(g, out, others[0], n) if members == 2 else None
    direct = far is not None
    if direct:
        r_other = layout.rank_of(others[0], g.local)
        recv = out[r_other * n:(r_other + 1) * n]
    else:
        recv = g.scratch("recv", (members - 1) * n)
        far = g.scratch("far", nlocal * (members - 1) * n)
    call.move(step, g.channel.exchange, recv, src)
    call.intra("intra-node all-gather of the other nodes' blocks", g.intra.all_gather, far,
               recv)
    if not direct:
        for l in range(nlocal):
            for k, m in enumerate(others):
                r = layout.rank_of(m, l)
                at = (l * (members - 1) + k) * n
                out[r * n:(r + 1) * n] = far[at:at + n]


def all_gather(call, src, out):
    """out (W * src.nbytes, global rank order) <- every rank's src."""
    g = call.g
    layout, n = g.layout, src.nbytes
    if layout.even and layout.shards > 1:
        members, nlocal = layout.num_nodes, layout.shards
        step = f"inter-node all_gather over channel {g.local}"
        if n >= ALL_GATHER_SPLIT_MIN_NBYTES:
            _all_gather_split(call, src, out, step)
            return
        if n <= wire.INLINE_NBYTES:
            rows = call.frame_round(g.channel, src, step + " (first round)")
            mine = np.ascontiguousarray(rows[:, :n]).reshape(-1)
        else:
            call.finish_frame(call.start_frame(g.channel), step + " (first round)")
            mine = g.scratch("mine", members * n)
            call.move(step, g.channel.all_gather, mine, src)
        node = g.scratch("node", nlocal * members * n)
        call.intra("intra-node all-gather", g.intra.all_gather, node, mine)
        order = [layout.rank_of(m, l) for l in range(nlocal) for m in range(members)]
        out.reshape(g.world_size, n)[order] = node.reshape(nlocal * members, n)
        return
    largest = max(len(m) for m in layout.nodes)
    mine = layout.nodes[g.node]
    block = np.zeros(largest * n, np.uint8) if g.local == 0 else None
    early = call.start_frame(g.channel) if g.local == 0 and largest * n > \
        wire.INLINE_NBYTES else None
    call.intra("intra-node gather to the leader", g.intra.gather, src,
               block[:len(mine) * n] if block is not None else None, 0)
    if g.local == 0:
        rows = _exchange_blocks(call, g.channel, block, early, "inter-node all_gather "
                                "(leaders)")
        for m, ranks in enumerate(layout.nodes):
            for j, r in enumerate(ranks):
                out[r * n:(r + 1) * n] = rows[m, j * n:(j + 1) * n]
    call.intra("intra-node broadcast from the leader", g.intra.broadcast, out, 0)


def _exchange_blocks(call, channel, block, early, step):
    """All-gather equal `block`s over `channel`: (members, block.nbytes) rows."""
    n = block.nbytes
    if early is None:
        return call.frame_round(channel, block, step + " (first round)")[:, :n]
    call.finish_frame(early, step + " (first round)")
    rows = np.empty(channel.size * n, np.uint8)
    call.move(step, channel.all_gather, rows, block)
    return rows.reshape(channel.size, n)


def gather(call, src, out, root):
    """root's out (W * src.nbytes, global rank order) <- every rank's src."""
    g = call.g
    layout, n = g.layout, src.nbytes
    root_node, lr, c = layout.node_of[root], layout.local_rank(root), _contact(g, root)
    largest = max(len(m) for m in layout.nodes)
    mine = layout.nodes[g.node]
    block = np.zeros(largest * n, np.uint8) if g.local == c else None
    inline = layout.num_nodes * largest * n <= wire.INLINE_NBYTES
    early = call.start_frame(g.channel) if g.local == c and not inline else None
    call.intra("intra-node gather to the contact", g.intra.gather, src,
               block[:len(mine) * n] if block is not None else None, c)
    full = None
    if g.local == c:
        step = "inter-node gather"
        if inline:
            rows = call.frame_round(g.channel, block, step + " (first round)")[:, :largest * n]
        else:
            call.finish_frame(early, step + " (first round)")
            at_root = g.node == root_node
            rows = np.empty(layout.num_nodes * largest * n if at_root else 0, np.uint8)
            to = [largest * n if m == root_node else 0 for m in range(layout.num_nodes)]
            call.move(step, g.channel.all_to_all, rows, block,
                      [largest * n if at_root else 0] * layout.num_nodes, to)
            rows = rows.reshape(-1, largest * n) if at_root else rows
        if g.node == root_node:
            full = out if g.rank == root else np.empty(g.world_size * n, np.uint8)
            for m, ranks in enumerate(layout.nodes):
                for j, r in enumerate(ranks):
                    full[r * n:(r + 1) * n] = rows[m, j * n:(j + 1) * n]
            if g.rank != root:
                call.intra("intra-node send to the root", g.intra.send, full, lr, _P2P_TAG)
    if g.rank == root and g.local != c:
        call.intra("intra-node receive from the contact", g.intra.recv, out, c, _P2P_TAG)


def scatter(call, out, src, root):
    """Rank j's out <- root's src[j * out.nbytes:(j + 1) * out.nbytes]."""
    g = call.g
    layout, n = g.layout, out.nbytes
    root_node, lr, c = layout.node_of[root], layout.local_rank(root), _contact(g, root)
    largest = max(len(m) for m in layout.nodes)
    members = layout.num_nodes
    inline = members * largest * n <= wire.INLINE_NBYTES
    early = call.start_frame(g.channel) if g.local == c and not inline else None
    full = src if g.rank == root else None
    if g.node == root_node and g.local == c and g.rank != root:
        full = np.empty(g.world_size * n, np.uint8)
        call.intra("intra-node receive from the root", g.intra.recv, full, lr, _P2P_TAG)
    elif g.rank == root and g.local != c:
        call.intra("intra-node send to the contact", g.intra.send, src, c, _P2P_TAG)
    pieces = None
    if g.local == c:
        blocks = None
        if g.node == root_node:  # every node's block, padded to the largest node
            blocks = np.zeros((members, largest * n), np.uint8)
            for m, ranks in enumerate(layout.nodes):
                for j, r in enumerate(ranks):
                    blocks[m, j * n:(j + 1) * n] = full[r * n:(r + 1) * n]
        step = "inter-node scatter"
        if inline:
            rows = call.frame_round(g.channel, blocks, step + " (first round)")
            mine = rows[root_node, :members * largest * n].reshape(members, -1)[g.node]
        else:
            call.finish_frame(early, step + " (first round)")
            mine = np.empty(largest * n, np.uint8)
            sends = [largest * n if g.node == root_node else 0] * members
            got = [largest * n if m == root_node else 0 for m in range(members)]
            call.move(step, g.channel.all_to_all, mine,
                      blocks.reshape(-1) if blocks is not None else np.empty(0, np.uint8),
                      got, sends)
        pieces = [mine[j * n:(j + 1) * n] for j in range(len(layout.nodes[g.node]))]
    call.intra("intra-node scatter from the contact", g.intra.scatter, out, pieces, c)


def all_to_all(call, outs, ins):
    """outs[j] <- rank j's ins[rank] (flat uint8 arrays; sizes may differ per pair)."""
    g = call.g
    layout = g.layout
    here = layout.nodes[g.node]
    early = call.start_frame(g.channel) if g.channel is not None else None
    call.intra("intra-node all_to_all", g.intra.all_to_all, [outs[r] for r in here],
               [ins[r] for r in here])
    if early is not None:
        call.finish_frame(early, "inter-node all_to_all (first round)")
    away = [layout.node_of[r] != g.node for r in range(g.world_size)]
    send = [ins[r].nbytes if away[r] else 0 for r in range(g.world_size)]
    recv = [outs[r].nbytes if away[r] else 0 for r in range(g.world_size)]
    src = np.concatenate([ins[r] for r in range(g.world_size) if away[r]] or
                         [np.empty(0, np.uint8)])
    got = np.empty(sum(recv), np.uint8)
    call.move("inter-node all_to_all", g.transport.world.all_to_all, got, src, recv, send)
    offset = 0
    for r in range(g.world_size):
        if away[r]:
            outs[r][:] = got[offset:offset + recv[r]]
            offset += recv[r]


def barrier(call):
    g = call.g
    call.intra("intra-node barrier (entry)", g.intra.barrier)
    if g.local == 0:
        call.frame_round(g.channel, None, "inter-node barrier (leaders)")
    call.intra("intra-node barrier (exit)", g.intra.barrier)
