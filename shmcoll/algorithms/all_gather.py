"""all_gather algorithms over an Arena (byte-level)."""

__all__ = ["all_gather_direct"]


def all_gather_direct(arena, inp, outs):
    """Every rank publishes its input; every rank copies every slot out.

    `inp`: my input bytes; `outs[j]`: where rank j's bytes go (all the same length).
    Steps per chunk: 1. Bytes: write S, read N*S.
    1. copy my chunk into my slot; post.
    2. wait for all; copy chunk j from rank j's slot into outs[j].
    """
    per = arena.slot_nbytes
    for start in range(0, inp.size, per):
        n = min(per, inp.size - start)
        i = arena.next_slot()
        arena.claim(i)[:n] = inp[start:start + n]
        arena.post(i)
        arena.wait_all()
        for j, out in enumerate(outs):
            out[start:start + n] = arena.slot(i, j)[:n]
