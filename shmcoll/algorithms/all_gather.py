"""all_gather algorithms over an Arena (byte-level)."""

import numpy as np

from .all_reduce import one_shot_sub_nbytes

__all__ = ["all_gather_direct", "all_gather_single_copy"]


def all_gather_direct(arena, inp, outs):
    """Every rank publishes its input; every rank copies every rank's input out.

    `inp`: my input bytes; `outs`: where rank j's bytes go, either one byte array of
    world_size * inp.size bytes (rank j's at j * inp.size, all_gather_into_tensor's
    layout) or a list (outs[j], all of inp's length).
    One output array: the whole collective is one streamed call (Arena.exchange_gather:
    sub-chunks through a 2-sub-slot ring, so the slot stays in cache; my own bytes are
    copied from inp), in the sub-chunks one-shot all_reduce takes (one_shot_sub_nbytes: a
    message up to 1 MiB is one sub-chunk, hence one compiled call, Arena.one_step). Steps
    per sub-chunk: 1. Bytes: write S, read N*S.
    A list: chunks of a slot; steps per chunk: 1.
    1. copy my chunk into my slot; post (one exchange call).
    2. wait for all; copy chunk j from rank j's slot into outs[j].
    """
    if not isinstance(outs, list):
        i = arena.next_slot()
        arena.claim(i)
        arena.exchange_gather(i, inp, outs, one_shot_sub_nbytes(inp.nbytes))
        return
    per = arena.slot_nbytes
    for start in range(0, inp.size, per):
        n = min(per, inp.size - start)
        i = arena.next_slot()
        arena.claim(i)
        arena.exchange(i, inp, start, n)
        for j, out in enumerate(outs):
            out[start:start + n] = arena.slot(i, j)[:n]


def all_gather_single_copy(arena, inp, outs):
    """One output array: every rank copies every peer's input straight from the peer's
    buffer into its output (Arena.single_copy), its own from `inp`. A list of outputs
    takes all_gather_direct.

    Steps: 2. Bytes per rank: read and write N*S.
    1. publish my input's address; post; wait for all (exchange_buffer).
    2. copy my input and every peer's into the output; post; wait: nobody returns while
       a peer still reads its input.
    """
    if isinstance(outs, list):
        all_gather_direct(arena, inp, outs)
        return
    addrs = arena.exchange_buffer(inp)
    rank, size = arena.rank, inp.nbytes
    if outs.ctypes.data + rank * size != addrs[rank]:  # else in place: already there
        outs[rank * size:(rank + 1) * size] = inp
    peers = np.array([p for p in range(arena.world_size) if p != rank], np.int64)
    arena.gather_peers(peers, addrs[peers], outs.ctypes.data + peers * size,
                       np.full(peers.size, size, np.int64))
    arena.exchange()
