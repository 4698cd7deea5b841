"""all_reduce algorithms over an Arena.

Both reduce every element over ranks 0..N-1 in rank order in one kernel call (fp16/bf16
accumulate in fp32 and round once), so every rank ends with bitwise-identical bytes.
"""

from ..kernels import reduce_unchecked as reduce_into

__all__ = ["all_reduce_one_shot", "all_reduce_two_shot", "STREAM_NBYTES"]

# One-shot chunks stream through the slot in sub-chunks of this size (one step each; see
# Arena.exchange_reduce). Measured at world size 2, interleaved A/B in one run (busbw GB/s,
# sub-chunk 512K / 4M = no streaming): 16 MiB 6.19 / 6.43, 64 MiB 4.52 / 4.16, 256 MiB
# 4.39 / 4.13; 32-64K sub-chunks lost 10-15% everywhere (one cross-core handoff each).
STREAM_NBYTES = 512 << 10


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
    arena.exchange_reduce(i, buf, 0, buf.size, spec, STREAM_NBYTES)


def all_reduce_two_shot(arena, buf, spec):
    """Reduce-scatter then all-gather through the slots (bandwidth-optimal for large N*S).

    Steps per chunk: 2. Bytes per rank per chunk of S bytes: copy in S, read S (N slices of
    S/N), write S/N, read S (gather).
    1. copy the chunk into my slot; post.
    2. wait for all; reduce slice[rank] of every slot into slice[rank] of my own slot (peers
       read other slices of my slot meanwhile: disjoint); post.
    3. wait for all; copy slice[j] of rank j's slot into my buffer, for every j.
    """
    itemsize, rank, world = buf.itemsize, arena.rank, arena.world_size
    per = arena.slot_nbytes // itemsize
    for start in range(0, buf.size, per):
        n = min(per, buf.size - start)
        i = arena.next_slot()
        mine = arena.claim(i)[:n * itemsize].view(buf.dtype)
        arena.exchange(i, buf, start * itemsize, n * itemsize)
        lo, hi = n * rank // world, n * (rank + 1) // world
        if hi > lo:
            reduce_into(mine[lo:hi], arena.slot_addrs(i) + lo * itemsize,
                        spec.op, spec.kind, spec.pre, spec.post)
        arena.post(i)
        arena.wait_all()
        for j in range(world):
            lo, hi = n * j // world, n * (j + 1) // world
            buf[start + lo:start + hi] = arena.slot(i, j)[lo * itemsize:hi * itemsize].view(buf.dtype)
