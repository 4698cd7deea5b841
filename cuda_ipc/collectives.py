"""Collectives on device tensors over a DeviceArena (the rules in arena.py).

Every algorithm is called by shmcoll's Group._run, which numbered the collective and wrote
its fingerprint (`host` is the group's protocol.Arena). Each one starts with
`host.exchange()`: one post and one wait on the host, after which every rank is known to
be in the same collective with matching arguments (a mismatch has already raised). Then
it enqueues, chunk by chunk on the caller's stream: claim, copy into my slot, publish,
collect, read the peers' slots, release -- and returns without waiting for the device.
It returns (first chunk, last chunk) for the watchdog; (None, None) when nothing was
enqueued.

Tensors here are flat and contiguous (the caller made them so): `flat` typed for the
reductions, byte views (uint8) for everything that only moves bytes. Cost lines count
device bytes per rank for a message of S bytes among N ranks.
"""

from .reduce import reduce_into

__all__ = ["all_reduce_one_shot", "broadcast_direct", "reduce_direct", "all_gather_direct",
           "reduce_scatter_direct", "gather_direct", "scatter_direct", "all_to_all_direct"]


def _copy(dst, src):
    dst.copy_(src)


def _copy_pairs(pairs):
    for dst, src in pairs:
        dst.copy_(src)


def _chunks(total, per):
    """(start, count) pieces of `total` elements, `per` at a time (none for total 0)."""
    return [(s, min(per, total - s)) for s in range(0, total, per)]


def _typed(slot, dtype, count):
    return slot[:count * dtype.itemsize].view(dtype)


def all_reduce_one_shot(host, d, stream, flat, spec, root=None):
    """Every rank reduces every rank's copy of each chunk, in rank order (with `root`:
    only the root reduces, into its own tensor; the others only publish: reduce).

    Bytes: copy in 2S; read N*S, write S. Steps per chunk: claim, copy in, publish,
    collect, reduce into the caller's tensor, release. Results are bitwise identical on
    every rank (same sources, same order, deterministic kernels).
    """
    host.exchange()
    dev, rank, world = d.dev, d.rank, d.world_size
    per = d.slot_nbytes // flat.element_size()
    first = last = None
    for start, m in _chunks(flat.numel(), per):
        g = d.next_chunk()
        first = g if first is None else first
        last = g
        piece = flat[start:start + m]
        d.claim(stream, g)
        dev.run(stream, _copy, _typed(d.slot(g, rank), flat.dtype, m), piece)
        d.publish(stream, g)
        if root is None or rank == root:
            d.collect(stream, g)
            srcs = [_typed(d.slot(g, r), flat.dtype, m) for r in range(world)]
            dev.run(stream, reduce_into, piece, srcs, spec)
        d.release(stream, g)
    return first, last


def reduce_direct(host, d, stream, flat, root, spec):
    """all_reduce_one_shot whose reduction only the root runs; the others only publish."""
    return all_reduce_one_shot(host, d, stream, flat, spec, root)


def broadcast_direct(host, d, stream, buf, root):
    """The root copies each chunk into its slot; every other rank copies it out.

    Bytes: root 2S; every other rank 2S."""
    host.exchange()
    dev, rank = d.dev, d.rank
    first = last = None
    for start, m in _chunks(buf.numel(), d.slot_nbytes):
        g = d.next_chunk()
        first = g if first is None else first
        last = g
        d.claim(stream, g)
        if rank == root:
            dev.run(stream, _copy, d.slot(g, rank)[:m], buf[start:start + m])
        d.publish(stream, g)
        if rank != root:
            d.collect(stream, g)
            dev.run(stream, _copy, buf[start:start + m], d.slot(g, root)[:m])
        d.release(stream, g)
    return first, last


def all_gather_direct(host, d, stream, src, outs, root=-1):
    """outs[r] receives rank r's `src` (bytes); root >= 0 makes it a gather: only the root
    reads (the others pass outs=[]). Bytes: copy in 2S; each reader copies N*S out."""
    host.exchange()
    dev, rank, world = d.dev, d.rank, d.world_size
    reads = root < 0 or rank == root
    first = last = None
    for start, m in _chunks(src.numel(), d.slot_nbytes):
        g = d.next_chunk()
        first = g if first is None else first
        last = g
        d.claim(stream, g)
        dev.run(stream, _copy, d.slot(g, rank)[:m], src[start:start + m])
        d.publish(stream, g)
        if reads:
            d.collect(stream, g)
            dev.run(stream, _copy_pairs, [(outs[r][start:start + m], d.slot(g, r)[:m])
                                          for r in range(world)])
        d.release(stream, g)
    return first, last


def gather_direct(host, d, stream, src, outs, root):
    return all_gather_direct(host, d, stream, src, outs, root)


def _parts(d, g, r, count, dtype):
    """Rank r's slot for chunk g as world_size parts of `count` elements (rows)."""
    world, part = d.world_size, d.part_nbytes()
    rows = d.slot(g, r)[:part * world].view(world, part)
    return rows[:, :count * dtype.itemsize].view(dtype)


def reduce_scatter_direct(host, d, stream, blocks, out, spec):
    """out = the reduction over ranks of their blocks[rank] (blocks: a [world, B] typed
    view). Each chunk carries a slice of every block, one part per destination.

    Bytes: copy in 2S; read S (my part of every slot); write S/N."""
    host.exchange()
    dev, rank, world = d.dev, d.rank, d.world_size
    per = d.part_nbytes() // blocks.element_size()
    first = last = None
    for start, m in _chunks(out.numel(), per):
        g = d.next_chunk()
        first = g if first is None else first
        last = g
        d.claim(stream, g)
        dev.run(stream, _copy, _parts(d, g, rank, m, blocks.dtype), blocks[:, start:start + m])
        d.publish(stream, g)
        d.collect(stream, g)
        srcs = [_parts(d, g, r, m, blocks.dtype)[rank] for r in range(world)]
        dev.run(stream, reduce_into, out[start:start + m], srcs, spec)
        d.release(stream, g)
    return first, last


def scatter_direct(host, d, stream, pieces, out, root):
    """Rank r's `out` receives the root's pieces[r] (pieces: [world, B] bytes on the root,
    None elsewhere). Bytes: root copies S in; every rank copies S/N out."""
    host.exchange()
    dev, rank = d.dev, d.rank
    first = last = None
    for start, m in _chunks(out.numel(), d.part_nbytes()):
        g = d.next_chunk()
        first = g if first is None else first
        last = g
        d.claim(stream, g)
        if rank == root:
            dev.run(stream, _copy, _parts(d, g, rank, m, out.dtype), pieces[:, start:start + m])
        d.publish(stream, g)
        if rank != root:
            d.collect(stream, g)
        dev.run(stream, _copy, out[start:start + m], _parts(d, g, root, m, out.dtype)[rank])
        d.release(stream, g)
    return first, last


def all_to_all_direct(host, d, stream, ins, outs, longest):
    """outs[j] receives rank j's ins[rank] (byte tensors; sizes may differ per pair, and
    `longest`, the group's largest piece, was agreed on the host). Each chunk carries a
    slice of every piece, one part per destination.

    Bytes: copy in 2S; copy out 2S."""
    dev, rank = d.dev, d.rank
    per = d.part_nbytes()
    first = last = None
    for start, _ in _chunks(longest, per):
        g = d.next_chunk()
        first = g if first is None else first
        last = g
        d.claim(stream, g)
        mine = d.slot(g, rank)
        dev.run(stream, _copy_pairs, [(mine[j * per:j * per + n], piece[start:start + n])
                                      for j, piece in enumerate(ins)
                                      for n in [max(0, min(per, piece.numel() - start))] if n])
        d.publish(stream, g)
        d.collect(stream, g)
        dev.run(stream, _copy_pairs, [(o[start:start + n], d.slot(g, j)[rank * per:rank * per + n])
                                      for j, o in enumerate(outs)
                                      for n in [max(0, min(per, o.numel() - start))] if n])
        d.release(stream, g)
    return first, last
