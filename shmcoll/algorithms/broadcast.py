"""broadcast algorithms over an Arena (byte-level: dtype-agnostic)."""

import numpy as np

__all__ = ["broadcast_direct", "broadcast_single_copy"]


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


def broadcast_single_copy(arena, buf, root):
    """Every non-root copies the root's buffer straight into its own (Arena.single_copy).

    Steps: 2. Bytes: every non-root reads and writes S; the root moves nothing.
    1. publish my buffer's address; post; wait for all (exchange_buffer).
    2. non-roots copy the root's buffer; post; wait: the root does not return while a
       peer still reads its buffer.
    """
    addrs = arena.exchange_buffer(buf)
    if arena.rank != root:
        arena.gather_peers(np.array([root], np.int64), addrs[root:root + 1],
                           np.array([buf.ctypes.data], np.int64),
                           np.array([buf.nbytes], np.int64))
    arena.exchange()
