"""gather algorithms over an Arena (byte-level)."""

__all__ = ["gather_direct"]


def gather_direct(arena, inp, outs, root):
    """Every rank publishes its input; the root copies every slot out.

    `outs[j]` (root only): where rank j's bytes go. Steps per chunk: 1.
    1. copy my chunk into my slot; post.
    2. wait for all; root copies chunk j of rank j's slot into outs[j].
    """
    per = arena.slot_nbytes
    for start in range(0, inp.size, per):
        n = min(per, inp.size - start)
        i = arena.next_slot()
        arena.claim(i)[:n] = inp[start:start + n]
        arena.post(i)
        arena.wait_all()
        if arena.rank == root:
            for j, out in enumerate(outs):
                out[start:start + n] = arena.slot(i, j)[:n]
