"""reduce algorithms over an Arena."""

from ..native import compiled

__all__ = ["reduce_direct"]


def reduce_direct(arena, buf, root, spec):
    """Every rank publishes its chunk; the root reduces all slots in rank order.

    Steps per chunk: 1. Bytes: every rank writes S; the root reads N*S and writes S.
    1. copy the chunk into my slot; post.
    2. wait for all; root: reduce the N slots into its buffer (others keep their input).
    """
    itemsize = buf.itemsize
    per = arena.slot_nbytes // itemsize
    for start in range(0, buf.size, per):
        n = min(per, buf.size - start)
        i = arena.next_slot()
        arena.claim(i)[:n * itemsize].view(buf.dtype)[:] = buf[start:start + n]
        arena.post(i)
        arena.wait_all()
        if arena.rank == root:
            compiled.kernels.reduce_unchecked(buf[start:start + n], arena.slot_addrs(i),
                                              spec.fn, spec.op, spec.pre, spec.post)
