"""broadcast algorithms over an Arena (byte-level: dtype-agnostic)."""

import numpy as np

__all__ = ["broadcast_direct", "broadcast_streamed", "broadcast_single_copy",
           "BROADCAST_SUB_NBYTES"]

# broadcast_streamed's sub-chunk: small enough that the readers' copy-out of sub-chunk k
# overlaps most of the root's copy-in of k + 1, large enough that the hand-over per
# sub-chunk (one post and one wait on each side) stays a small part of its copy. Measured
# (2 ranks, engine level, the root's torch buffer rewritten before every call, alternating
# blocks, 2026-11-28, load 3.9; us, direct / 256K / 512K / 1M sub-chunks): 4 MiB 1181 /
# 1048 / 1051 / 1142, 8 MiB 3537 / 3151 / 3088 / 3076, 16 MiB 8689 / 6603 / 6310 / 6005,
# 64 MiB 26146 / 27049 / 24775 / 24320; 64 and 128 KiB lost to 512 KiB at 1, 4 and 16 MiB
# in an earlier run.
BROADCAST_SUB_NBYTES = 512 << 10


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


def broadcast_streamed(arena, buf, root):
    """broadcast_direct in sub-chunks through a 2-sub-slot ring of the root's slot, as one
    compiled call (Arena.exchange_broadcast): the root copies sub-chunk k + 1 in while the
    others copy sub-chunk k out, so the two copies overlap instead of following each other.

    Steps per sub-chunk: 1. Bytes: root writes S; every other rank reads S.
    1. root: copy the sub-chunk into its sub-slot k % 2; everyone posts (a non-root's post
       says it consumed sub-chunk k - 1, which frees sub-slot (k + 1) % 2 for the root).
    2. wait for all; non-roots copy the sub-chunk out of the root's sub-slot.
    """
    i = arena.next_slot()
    arena.claim(i)
    arena.exchange_broadcast(i, buf, root, BROADCAST_SUB_NBYTES)


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
