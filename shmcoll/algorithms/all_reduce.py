"""all_reduce algorithms over an Arena.

Both reduce every element over ranks 0..N-1 in rank order in one kernel call (fp16/bf16
accumulate in fp32 and round once), so every rank ends with bitwise-identical bytes.
"""

import numpy as np

__all__ = ["all_reduce_one_shot", "all_reduce_two_shot", "all_reduce_single_copy",
           "STREAM_NBYTES", "UNSPLIT_MAX_NBYTES", "one_shot_sub_nbytes"]

# One-shot chunks stream through the slot in sub-chunks of this size (one step each; see
# Arena.exchange_reduce). Measured at world size 2, interleaved A/B in one run (busbw GB/s,
# sub-chunk 512K / 4M = no streaming): 16 MiB 6.19 / 6.43, 64 MiB 4.52 / 4.16, 256 MiB
# 4.39 / 4.13; 32-64K sub-chunks lost 10-15% everywhere (one cross-core handoff each).
STREAM_NBYTES = 512 << 10
# ... but a one-shot message up to this size goes as one sub-chunk: both ranks' copies fit
# in their L2 either way, and splitting it only adds a cross-core hand-over per sub-chunk.
# Measured at 2 ranks, engine level, interleaved blocks in one run (median us, one sub-chunk
# vs 512K sub-chunks): 1 MiB 147 vs 166, 162 vs 171; 2 MiB 340 vs 351, 4 MiB 632 vs 625
# (within noise, so larger messages keep streaming, which wins from 16 MiB). all_gather into
# one array streams by the same rule (up to 1 MiB it is then one compiled call, not two
# sub-chunks through Python): 2 ranks, torch buffers, lab.ab_engine, one sub-chunk / 512K
# sub-chunks, 2026-11-28: 640 KiB 0.92, 768 KiB 0.82, 1 MiB 0.90 and 0.84 (B won 75-93% of
# the blocks); 256 KiB and 2-4 MiB unchanged (1.00-1.03), as they should be.
UNSPLIT_MAX_NBYTES = 1 << 20


def one_shot_sub_nbytes(nbytes):
    """The sub-chunk size one-shot streams a message of `nbytes` per rank in (a function
    of nbytes alone, so every rank -- whichever path it takes -- makes the same steps)."""
    return nbytes if nbytes <= UNSPLIT_MAX_NBYTES else STREAM_NBYTES


def all_reduce_one_shot(arena, buf, spec):
    """Every rank reduces every rank's data (latency-optimal: one wait per sub-chunk).

    Steps per sub-chunk: 1. Bytes per rank per sub-chunk of S bytes: copy in S, read N*S,
    write S; the sub-chunks cycle through a 2-sub-slot ring in one slot (see
    Arena.exchange_reduce), so any size goes in one call and the slot stays in cache.
    1. copy the sub-chunk into my sub-slot; post.
    2. wait for all peers; reduce all N sub-slots, in rank order, into my buffer.
    """
    i = arena.next_slot()
    arena.claim(i)
    arena.exchange_reduce(i, buf, 0, buf.size, spec, one_shot_sub_nbytes(buf.nbytes))


def all_reduce_two_shot(arena, buf, spec):
    """Reduce-scatter then all-gather through the slots (bandwidth-optimal for large N*S):
    one compiled call for the whole buffer when nobody is late (Arena.exchange_reduce_two_shot).

    Steps per sub-chunk: 2. Bytes per rank per sub-chunk of S bytes: copy in S, read S (N
    slices of S/N), write 2*S/N, read and write (N-1)*S/N (gather).
    1. copy the sub-chunk into my sub-slot; post; wait for all.
    2. reduce slice[rank] of every sub-slot, in rank order, into my buffer and into
       slice[rank] of my sub-slot (peers read other slices of it meanwhile: disjoint);
       post; wait for all.
    3. copy slice[j] of rank j's sub-slot into my buffer, for every peer j.
    """
    i = arena.next_slot()
    arena.claim(i)
    arena.exchange_reduce_two_shot(i, buf, spec)


def all_reduce_single_copy(arena, buf, spec):
    """Reduce-scatter then all-gather straight between the ranks' own buffers
    (Arena.single_copy: peers' buffers are read where they lie, nothing goes through the
    slots; see single_copy.py). Rank r owns elements [n*r/N, n*(r+1)/N).

    Steps: 3. Bytes per rank for S bytes: read S/N from each peer + S/N of mine, write S/N
    (CMA: plus the S/N-per-peer scratch copy, in cache), then read and write (N-1)*S/N.
    1. publish my buffer's address; post; wait for all (exchange_buffer).
    2. reduce my part of every rank's buffer, in rank order, into my buffer; post; wait.
    3. copy every peer's reduced part from its buffer into mine; post; wait: nobody
       returns (and lets its caller overwrite the buffer) while a peer still reads it.
    """
    addrs = arena.exchange_buffer(buf)
    world, rank, n, size = arena.world_size, arena.rank, buf.size, buf.itemsize
    lo, hi = n * rank // world, n * (rank + 1) // world
    arena.reduce_peers(addrs, buf[lo:hi], lo * size, spec)
    arena.exchange()
    peers = np.array([p for p in range(world) if p != rank], np.int64)
    starts = peers * n // world * size
    arena.gather_peers(peers, addrs[peers] + starts, buf.ctypes.data + starts,
                       ((peers + 1) * n // world) * size - starts)
    arena.exchange()
