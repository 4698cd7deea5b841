"""all_to_all algorithms over an Arena (byte-level, uneven splits allowed)."""

import numpy as np

__all__ = ["all_to_all_direct", "exchange_split_table"]

MAX_MESSAGE_NBYTES = 1 << 48  # larger than any array this host can hold


def all_to_all_direct(arena, ins, outs):
    """Rank r sends ins[j] to rank j and receives outs[j] from rank j.

    Split sizes may differ per pair. Steps: 1 (size exchange) + 1 per chunk.
    1. write my send and receive sizes (2N int64) into my slot; post; wait for all; check
       the whole matrix (every rank raises the same ValueError on a mismatch, so none is
       left waiting) and take the group's largest message as the chunk count.
    2. per chunk: copy piece c of every ins[j] into sub-slot j of my slot; post; wait for
       all; copy sub-slot[rank] of rank j's slot into outs[j].
    """
    world, rank = arena.world_size, arena.rank
    longest = exchange_split_table(arena, [a.size for a in ins], [a.size for a in outs])
    per = arena.slot_nbytes // world
    for start in range(0, longest, per):
        i = arena.next_slot()
        mine = arena.claim(i)
        for j, piece in enumerate(ins):
            n = max(0, min(per, piece.size - start))
            mine[j * per:j * per + n] = piece[start:start + n]
        arena.post(i)
        arena.wait_all()
        for j, out in enumerate(outs):
            n = max(0, min(per, out.size - start))
            out[start:start + n] = arena.slot(i, j)[rank * per:rank * per + n]


def exchange_split_table(arena, sends, recvs):
    """Step 1 of an all_to_all (also cuda_ipc's): publish my send and receive sizes in
    bytes (2N int64) through a slot, check the group's whole matrix and return its largest
    message. Every rank raises the same ValueError on a mismatch, so none is left waiting.
    This is the collective's first post: the fingerprints are compared at its wait."""
    world = arena.world_size
    i = arena.next_slot()
    table = arena.claim(i)[:2 * world * 8].view(np.int64)
    table[:world] = sends
    table[world:] = recvs
    arena.post(i)
    arena.wait_all()
    # Every rank checks the whole send/receive matrix, so all ranks raise together.
    sends = np.stack([arena.slot(i, j)[:world * 8].view(np.int64) for j in range(world)])
    recvs = np.stack([arena.slot(i, j)[world * 8:2 * world * 8].view(np.int64)
                      for j in range(world)])
    bad = np.argwhere(sends != recvs.T)
    if bad.size:
        a, b = (int(v) for v in bad[0])
        raise ValueError(f"all_to_all: rank {a} sends {int(sends[a, b])} bytes to rank {b}, "
                         f"which expects {int(recvs[b, a])}")
    # The table is peers' memory, i.e. input: entries not involving this rank were checked
    # by nobody but their writer, and `longest` sets the chunk count of every rank. Refuse
    # negative or absurd sizes (same table on every rank -> every rank raises together).
    if sends.size and (int(sends.min()) < 0 or int(sends.max()) > MAX_MESSAGE_NBYTES):
        raise ValueError(f"all_to_all: corrupt size table in shared memory (sizes from "
                         f"{int(sends.min())} to {int(sends.max())} bytes)")
    return int(sends.max()) if sends.size else 0
