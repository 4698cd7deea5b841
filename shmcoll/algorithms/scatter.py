"""scatter algorithms over an Arena (byte-level)."""

__all__ = ["scatter_direct"]


def scatter_direct(arena, ins, out, root):
    """The root lays out one piece per rank in its slot; rank j copies piece j.

    `ins[j]` (root only): the bytes for rank j, all of len(out). Steps per chunk: 1.
    1. root: copy piece c of ins[j] into sub-slot j of my slot; post. Others: post.
    2. wait for all; rank j copies sub-slot j of the root's slot into its output.
    """
    world, rank = arena.world_size, arena.rank
    per = arena.slot_nbytes // world
    for start in range(0, out.size, per):
        n = min(per, out.size - start)
        i = arena.next_slot()
        if rank == root:
            mine = arena.claim(i)
            for j, piece in enumerate(ins):
                mine[j * per:j * per + n] = piece[start:start + n]
            arena.post(i)
        else:
            arena.post()
        arena.wait_all()
        out[start:start + n] = arena.slot(i, root)[rank * per:rank * per + n]
