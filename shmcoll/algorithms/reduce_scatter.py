"""reduce_scatter algorithms over an Arena."""

from ..native import compiled

__all__ = ["reduce_scatter_direct", "reduce_scatter_single_copy"]


def reduce_scatter_direct(arena, blocks, out, spec):
    """Rank r ends with the reduction over ranks of everyone's block r.

    `blocks[j]`: my contribution to rank j (1-D, typed; lengths may differ per j but are the
    same on every rank), or one 1-D array of world_size equal blocks; `out`: my result,
    len(blocks[rank]) elements.
    Steps per chunk: 1. Bytes: write S (one piece of every block), read N*S/N.
    1. copy piece c of every block j into sub-slot j of my slot; post.
    2. wait for all; reduce sub-slot[rank] of every slot, in rank order, into my output.
    """
    world, rank = arena.world_size, arena.rank
    itemsize = out.itemsize
    per = arena.slot_nbytes // (itemsize * world)  # elements of each block per chunk
    if not isinstance(blocks, list):
        # One array of world_size equal blocks (reduce_scatter_tensor) that fits a slot:
        # lay the slot out like the input (block j at j * size), one copy-in for all.
        if blocks.size and blocks.nbytes <= arena.slot_nbytes:
            size = blocks.size // world
            i = arena.next_slot()
            arena.claim(i)
            arena.exchange(i, blocks, 0, blocks.nbytes)
            compiled.kernels.reduce_unchecked(out, arena.slot_addrs(i) + rank * size * itemsize,
                                              spec.fn, spec.op, spec.pre, spec.post)
            return
        blocks = list(blocks.reshape(world, -1)) if blocks.size else [blocks] * world
    longest = max(b.size for b in blocks)
    for start in range(0, longest, per):
        i = arena.next_slot()
        mine = arena.claim(i).view(out.dtype)
        for j, block in enumerate(blocks):
            n = max(0, min(per, block.size - start))
            mine[j * per:j * per + n] = block[start:start + n]
        arena.post(i)
        arena.wait_all()
        n = max(0, min(per, out.size - start))
        if n:
            compiled.kernels.reduce_unchecked(out[start:start + n],
                                              arena.slot_addrs(i) + rank * per * itemsize,
                                              spec.fn, spec.op, spec.pre, spec.post)


def reduce_scatter_single_copy(arena, blocks, out, spec):
    """One input array of world_size equal blocks (reduce_scatter_tensor): rank r reduces
    block r of every rank's input straight from the peers' buffers (Arena.single_copy)
    into its output. A list of blocks takes reduce_scatter_direct.

    Steps: 2. Bytes per rank: read S/N from every rank (CMA: plus the scratch copy),
    write S/N.
    1. publish my input's address; post; wait for all (exchange_buffer).
    2. reduce block[rank] of every rank's input, in rank order, into my output; post;
       wait: nobody returns while a peer still reads its input.
    """
    if isinstance(blocks, list) or not blocks.size:
        reduce_scatter_direct(arena, blocks, out, spec)
        return
    addrs = arena.exchange_buffer(blocks)
    arena.reduce_peers(addrs, out, arena.rank * out.nbytes, spec)
    arena.exchange()
