"""all_gather algorithms over an Arena (byte-level)."""

from .all_reduce import STREAM_NBYTES

__all__ = ["all_gather_direct"]


def all_gather_direct(arena, inp, outs):
    """Every rank publishes its input; every rank copies every rank's input out.

    `inp`: my input bytes; `outs`: where rank j's bytes go, either one byte array of
    world_size * inp.size bytes (rank j's at j * inp.size, all_gather_into_tensor's
    layout) or a list (outs[j], all of inp's length).
    One output array: the whole collective is one streamed call (Arena.exchange_gather:
    sub-chunks through a 2-sub-slot ring, so the slot stays in cache; my own bytes are
    copied from inp). Steps per sub-chunk: 1. Bytes: write S, read N*S.
    A list: chunks of a slot; steps per chunk: 1.
    1. copy my chunk into my slot; post (one exchange call).
    2. wait for all; copy chunk j from rank j's slot into outs[j].
    """
    if not isinstance(outs, list):
        i = arena.next_slot()
        arena.claim(i)
        arena.exchange_gather(i, inp, outs, STREAM_NBYTES)
        return
    per = arena.slot_nbytes
    for start in range(0, inp.size, per):
        n = min(per, inp.size - start)
        i = arena.next_slot()
        arena.claim(i)
        arena.exchange(i, inp, start, n)
        for j, out in enumerate(outs):
            out[start:start + n] = arena.slot(i, j)[:n]
