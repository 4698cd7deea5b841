"""all_to_all algorithms over an Arena (byte-level, uneven splits allowed)."""

import numpy as np

from ..native.single_copy import CMA, NONE
from ..protocol import A2A_TABLE_WORDS, STREAM_RING, a2a_head_nbytes

__all__ = ["all_to_all_direct", "all_to_all_read", "all_to_all_finish", "rides",
           "exchange_split_table"]

MAX_MESSAGE_NBYTES = 1 << 48  # larger than any array this host can hold
# Pieces that do not ride with the table go streamed through the slot (a sub-chunk of
# every piece per step, Arena.exchange_all_to_all) where single copy is off, and with CMA
# up to this many ranks; else they are read from the peers' buffers (single copy).
# Measured 2026-11-29, 2-core VM, 2 ranks, engine level, torch buffers (lab.ab_engine,
# alternating blocks; streamed / the path it replaced): single copy off, against the
# chunked slot steps, 8 MiB 0.66 (one array) and 0.58 (lists), 16 MiB 0.71 and 0.69; with
# CMA, against single copy, 8 MiB 0.93-0.97, 16 MiB 0.95 (lists) and 1.03. Riding stays
# best up to the slot (one array, streamed / riding: 3 MiB 1.62, 4 MiB 1.33). More ranks
# keep single copy (lab.config_ab, one array, streamed / CMA: 3 ranks 8 MiB 1.02, 16 MiB
# 1.05; 4 ranks 1.14 and 1.17).
STREAM_MAX_WORLD = 2
# ... in sub-chunks of at most this many bytes per piece and step. Measured 2026-11-29, 2
# ranks, torch buffers, lab.all_to_all_transport (default: 512 KiB sub-chunks above a 4 MiB
# slot; slot512k: streamed in ~128 KiB), three alternated runs, us: 8 MiB 1157 1067 1421
# vs 913 957 915 (the rows' spread is the machine's: runs were not interleaved); 4 MiB
# (riding vs 128 KiB streamed) 443 318 621 vs 399 407 399. Interleaved (lab.ab_engine, 16
# blocks, this size / 512 KiB time, share of blocks won): all_to_all_single 8 MiB 0.94 (94%),
# 16 MiB 0.94 (88%); the list form 0.98 (50%), 0.95 (94%); 64 KiB: 0.89 (94%), 0.97 (88%).
STREAM_SUB_NBYTES = 128 << 10


def all_to_all_direct(arena, ins, outs):
    """Rank r sends ins[j] to rank j and receives outs[j] from rank j (byte arrays, split
    sizes may differ per pair).

    1. Write the table -- my send sizes, receive sizes and, unless my messages ride with
       it, their addresses (3N int64) -- and, when they fit (rides), my messages to the
       peers, packed in rank order (the one to myself is copied straight from ins[rank]),
       into my slot; post; wait for all. Every rank checks the group's
       whole table, so on a mismatch every rank raises the same ValueError and none is
       left waiting.
    2. Rank j's message to me comes out of its slot where it rode with the table, else
       straight from rank j's buffer (single copy); then a post and wait, so nobody
       returns (and reuses its buffers) while a peer still reads them.
    Where some rank's messages did not fit its slot, without single copy (and with CMA
    at up to STREAM_MAX_WORLD ranks) every message goes again, streamed through the slot
    after the table (_streamed).
    Bytes per rank: read and write (N - 1) / N S twice (through the slots) or once
    (single copy), and S / N once (my own block).

    Messages ride whenever they fit the slot: up to there the two copies through it beat
    one copy from the peers' buffers, which pays a wait more and, on 4 KiB pages, CMA's
    page pinning. Measured 2026-11-29 on the 2-core VM, engine level, all_to_all_single,
    2 ranks, us (riding / single copy): torch buffers (4 KiB pages) 1 MiB 89-93 / 255-295;
    numpy buffers 1 MiB 88 / 255, 2 MiB 177 / 277. Above a slot, single copy against the
    chunked steps: 4 MiB 450-630 / 870-1020, 16 MiB 2.0-3.8 ms / 4.2-4.9 ms; 4 ranks
    4 MiB 2.3-2.7 ms / 3.5-3.8 ms, 16 MiB 7.1-8.7 / 13.9-15.4 ms.
    """
    _direct(arena, ins, outs, rides(arena, [a.size for a in ins]))


def all_to_all_read(arena, ins, outs):
    """all_to_all_direct where every message is read from its sender's buffer (single
    copy), even one that would ride: at 3+ ranks, where the peers' blocks of a large
    message moved twice cost more than CMA's reads (algorithms.SINGLE_COPY_MIN). Its
    equal-block form runs as one compiled call (Group.all_to_all_single: the one-step
    kernel with A2A_PLAN_SLOT 0, then the closing step); either form's table is
    all_to_all_direct's, so ranks may mix them.
    Bytes per rank: read and write S once (my own block too)."""
    _direct(arena, ins, outs, False)


def _direct(arena, ins, outs, ride):
    """all_to_all_direct's steps; `ride`: my messages go in my slot with the table."""
    world, rank = arena.world_size, arena.rank
    head = a2a_head_nbytes(world)
    i = arena.next_slot()
    mine = arena.claim(i)
    sizes = [a.size for a in ins]
    mine[:A2A_TABLE_WORDS * world * 8].view(np.int64)[:] = sizes + [a.size for a in outs] + (
        [0] * world if ride else [a.ctypes.data for a in ins])
    if ride:
        at = head
        for j, a in enumerate(ins):
            if a.size and j != rank:
                mine[at:at + a.size] = a
                at += a.size
    arena.post(i)
    arena.wait_all()
    all_to_all_finish(arena, i, ins, outs)


def all_to_all_finish(arena, i, ins, outs):
    """all_to_all_direct after step 1 (through slot i): also where the one-step kernel
    leaves it (Arena.one_step, ONE_STEP_ALL_TO_ALL) when the tables differ."""
    world, rank = arena.world_size, arena.rank
    head = a2a_head_nbytes(world)
    rows = _checked_table(arena, i)
    rode = [_fits(arena, row[:world], j) and not any(row[2 * world:]) for j, row in
            enumerate(rows)]  # rode: a row without addresses (all_to_all_read's has them)
    everyone_rode = all(rode)
    if not everyone_rode and (arena.single_copy == NONE or arena.single_copy == CMA
                              and world <= STREAM_MAX_WORLD):
        _streamed(arena, i, head, ins, outs, rows)
        return
    peers, remote, local, nbytes = [], [], [], []
    for j, out in enumerate(outs):
        n = out.size
        if j == rank:
            if n:
                out[:] = ins[rank]
        elif rode[j]:
            if n:
                at = head + sum(rows[j][:rank]) - (rows[j][j] if j < rank else 0)
                out[:] = arena.slot(i, j)[at:at + n]
        elif n:
            peers.append(j)
            remote.append(rows[j][2 * world + rank])
            local.append(out.ctypes.data)
            nbytes.append(n)
    if peers:
        arena.gather_peers(np.array(peers, np.int64), np.array(remote, np.int64),
                           np.array(local, np.int64), np.array(nbytes, np.int64))
    if not everyone_rode:
        arena.exchange()  # my reads of peers' buffers are done; theirs of mine too


def rides(arena, sends):
    """Whether messages of `sends` bytes to the ranks (in rank order; a rank's own stays
    out of the slot) ride with the table in step 1."""
    return _fits(arena, sends, arena.rank)


def _fits(arena, sends, sender):
    """Whether rank `sender`'s messages of `sends` bytes (its own left out) fit its slot
    after the table: the one riding rule, for my messages and for a peer's table row (the
    one-step kernel's _a2a_table is its compiled twin)."""
    return a2a_head_nbytes(arena.world_size) + sum(sends) - sends[sender] <= arena.slot_nbytes


def _checked_table(arena, i, words=A2A_TABLE_WORDS):
    """Every rank's table row (N lists of `words` x N ints: sends, receives and, in
    all_to_all_direct's table, addresses) from slot i, checked: the same ValueError on
    every rank if a send size differs from its receiver's expectation, or a size is
    negative or absurd (the table is peers' memory).
    Plain Python: for the world sizes of one machine it is several times faster than
    numpy's calls on arrays this small."""
    world = arena.world_size
    rows = [arena.slot(i, j)[:words * world * 8].view(np.int64).tolist()
            for j in range(world)]
    for a, row in enumerate(rows):
        for b in range(world):
            if row[b] != rows[b][world + a]:
                raise ValueError(f"all_to_all: rank {a} sends {row[b]} bytes to rank {b}, "
                                 f"which expects {rows[b][world + a]}")
    least = min(min(row[:world]) for row in rows)
    most = max(max(row[:world]) for row in rows)
    if least < 0 or most > MAX_MESSAGE_NBYTES:
        raise ValueError(f"all_to_all: corrupt size table in shared memory (sizes from "
                         f"{least} to {most} bytes)")
    return rows


def _streamed(arena, i, head, ins, outs, rows):
    """Every message again (riding ones too), streamed through slot i after its table:
    step k moves bytes [k * sub, (k + 1) * sub) of every piece, packed by receiver into a
    ring of STREAM_RING sub-slots (Arena.exchange_all_to_all), so each piece is read from
    the writer's cache. The step count comes from the group's table, the same on every
    rank. Bytes per rank: read and write S through the slot twice, as riding does."""
    world, rank = arena.world_size, arena.rank
    sub = min(STREAM_SUB_NBYTES,
              (arena.slot_nbytes - head) // (STREAM_RING * world)) // 64 * 64
    longest = max(max(row[:world]) for row in rows)
    arena.exchange_all_to_all(i, np.array([a.ctypes.data for a in ins], np.int64),
                              np.array(rows[rank][:world], np.int64),
                              np.array([o.ctypes.data for o in outs], np.int64),
                              np.array(rows[rank][world:2 * world], np.int64), head, sub,
                              -(-longest // sub))


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
    return max(max(row[:world]) for row in _checked_table(arena, i, 2))
