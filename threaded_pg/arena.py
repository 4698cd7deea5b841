"""In-process regions for one group of rank threads, and the protocol.Arena over them.

Vocabulary as in shmcoll/protocol.py: a *region* is one rank's header + control block +
slots, laid out by protocol.RegionLayout. Here every region is a zeroed numpy uint8 buffer
in this process instead of a POSIX segment; the header is written with
protocol.write_header exactly as shm.py does, and the Arena is protocol.Arena itself, so the
threaded engine runs the production post/wait/fingerprint protocol and the production
algorithms (shmcoll.algorithms), never a second implementation.

Lifetime: the buffers belong to the ThreadRegions object; every rank's Arena holds views of
all of them, so a rank that finished early can never pull memory from under a peer that is
still reading its slot (the GC frees them after the last Arena is gone).

Liveness: a peer is alive while its rank thread has not finished and has not failed
(RankStates, one per spawn); the Arena polls this only on its slow path.
"""

import os
import secrets
import threading

import numpy as np

from shmcoll.group import describe_fingerprint, is_oversubscribed
from shmcoll.protocol import LINE_NBYTES, Arena, write_header

__all__ = ["ThreadRegions", "RankStates", "new_thread_arena", "thread_liveness", "is_spin_off",
           "REGION_ALIGN_NBYTES"]

# Regions start on a page boundary, like an mmap'ed segment: the control words then sit
# on their own 128-byte lines exactly as the layout intends (numpy only aligns to 16-64 B).
REGION_ALIGN_NBYTES = 4096


def _aligned_zeros(nbytes):
    """A zeroed uint8 array of `nbytes` whose first byte is page aligned (calloc: pages
    are only touched when used, so large slot areas cost nothing until a collective
    needs them)."""
    raw = np.zeros(nbytes + REGION_ALIGN_NBYTES, np.uint8)
    offset = -raw.ctypes.data % REGION_ALIGN_NBYTES
    return raw[offset:offset + nbytes]


class ThreadRegions:
    """The `world_size` regions of one group instance, headers written, all zero else."""

    def __init__(self, layout, world_size):
        self.layout = layout
        self.world_size = world_size
        self.token = secrets.token_bytes(16)
        self.regions = [_aligned_zeros(layout.nbytes) for _ in range(world_size)]
        for rank, region in enumerate(self.regions):
            write_header(region, layout, self.token, world_size, rank, os.getpid())


class RankStates:
    """Per-spawn liveness of the rank threads: finished / failed flags, by global rank.

    `failure` is the shared per-spawn failure flag: set on the first failure of any rank.
    """

    def __init__(self, world_size):
        self.world_size = world_size
        self._finished = [False] * world_size
        self._failed = [False] * world_size
        self.failure = threading.Event()
        # One word per rank thread, on its own 128-byte line: 1 while the thread is inside a
        # compiled collective (not wanting the GIL), 0 while it runs Python (protocol
        # _gil_leave). A finished or failed thread never competes again: 1.
        self._gil = _aligned_zeros(world_size * LINE_NBYTES).view(np.int64)

    def gil_words(self, global_rank):
        """(this rank thread's word address, int64 addresses of every other rank thread's
        word) for protocol.Arena(gil_words=...)."""
        base, stride = self._gil.ctypes.data, LINE_NBYTES
        others = np.array([base + g * stride for g in range(self.world_size)
                           if g != global_rank], np.int64)
        return base + global_rank * stride, others

    def _leave_gil_race(self, global_rank):
        self._gil[global_rank * (LINE_NBYTES // 8)] = 1

    def is_alive(self, global_rank):
        """True until the rank's thread finished or failed (also before it started)."""
        return not (self._finished[global_rank] or self._failed[global_rank])

    def mark_failed(self, global_rank):
        self._failed[global_rank] = True
        self._leave_gil_race(global_rank)
        self.failure.set()

    def mark_finished(self, global_rank):
        self._finished[global_rank] = True
        self._leave_gil_race(global_rank)

    def failed_ranks(self):
        return [r for r, failed in enumerate(self._failed) if failed]


def thread_liveness(states, global_ranks):
    """is_alive(peer) for group rank `peer`, which is spawn rank global_ranks[peer]."""
    def is_alive(peer):
        return states.is_alive(global_ranks[peer])
    return is_alive


def is_spin_off(spin, world_size):
    """True when waits must skip the spin tier: spin "yield", or "auto" with more rank
    threads than cores (a spinning thread would take the core a peer needs)."""
    return {"spin": False, "yield": True}.get(spin, is_oversubscribed(world_size))


def new_thread_arena(regions, rank, states, global_ranks, spin="auto"):
    """protocol.Arena for group rank `rank` over `regions`; peer p is spawn rank
    global_ranks[p] in `states`. spin: SHMCOLL_SPIN ("auto", "spin" or "yield")."""
    return Arena(regions.regions, rank, regions.layout, thread_liveness(states, global_ranks),
                 describe_fingerprint, oversubscribed=is_spin_off(spin, regions.world_size),
                 gil_words=states.gil_words(global_ranks[rank]))
