"""broadcast algorithms over an Arena (byte-level: dtype-agnostic)."""

__all__ = ["broadcast_direct"]


def broadcast_direct(arena, buf, root):
    """The root writes each chunk into its slot; everyone else copies it out.

    Steps per chunk: 1. Bytes: root writes S; every other rank reads S.
    1. root: copy the chunk into my slot; post. Others: post (the "done reading the
       previous chunk" signal that lets the root reuse its slot).
    2. wait for all; non-roots copy the chunk out of the root's slot.
    """
    per = arena.slot_nbytes
    for start in range(0, buf.size, per):
        n = min(per, buf.size - start)
        i = arena.next_slot()
        if arena.rank == root:
            arena.claim(i)
            arena.exchange(i, buf, start, n)
        else:
            arena.exchange()
            buf[start:start + n] = arena.slot(i, root)[:n]
