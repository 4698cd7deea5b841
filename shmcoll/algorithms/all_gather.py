"""all_gather algorithms over an Arena (byte-level)."""

import numba

from ..atomics import copy_bytes

__all__ = ["all_gather_direct", "copy_slots_out"]


def all_gather_direct(arena, inp, outs):
    """Every rank publishes its input; every rank copies every slot out.

    `inp`: my input bytes; `outs`: where rank j's bytes go, either a list (outs[j], all of
    inp's length) or one byte array of world_size * inp.size bytes (rank j's at j * inp.size,
    all_gather_into_tensor's layout: copied out by one compiled call per chunk).
    Steps per chunk: 1. Bytes: write S, read N*S.
    1. copy my chunk into my slot; post (one exchange call).
    2. wait for all; copy chunk j from rank j's slot into outs[j].
    """
    per = arena.slot_nbytes
    whole = not isinstance(outs, list)
    for start in range(0, inp.size, per):
        n = min(per, inp.size - start)
        i = arena.next_slot()
        arena.claim(i)
        arena.exchange(i, inp, start, n)
        if whole:
            copy_slots_out(outs, inp.size, arena.slot_addrs(i), start, n)
        else:
            for j, out in enumerate(outs):
                out[start:start + n] = arena.slot(i, j)[:n]


@numba.njit(nogil=True, cache=True)
def copy_slots_out(out, stride, srcs, start, n):
    """out[j * stride + start: ... + n] = n bytes at srcs[j], for every rank j (one call
    instead of world_size numpy slice copies: ~1 us each for small messages)."""
    base = out.ctypes.data + start
    for j in range(srcs.size):
        copy_bytes(base + j * stride, srcs[j], n)
