"""In-process regions for one group of rank threads, and the protocol.Arena over them.

Vocabulary as in shmcoll/protocol/__init__.py: a *region* is one rank's header + control block +
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

from shmcoll.engine.group import describe_fingerprint, is_oversubscribed
from shmcoll.native.atomics import write_release
from shmcoll.protocol import LINE_NBYTES, Arena, write_header
from shmcoll.native.single_copy import IN_PROCESS, NONE

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
        # The rank threads' shared "Python turn" word (protocol_kernels._gil_leave): 0 free, else
        # the holder's global rank + 1. On its own 128-byte line.
        self._turn = _aligned_zeros(LINE_NBYTES).view(np.int64)

    def gil_turn(self, global_rank):
        """(address of the turn word, this rank thread's id) for protocol.Arena(gil_turn=...)."""
        return self._turn.ctypes.data, global_rank + 1

    def _give_up_turn(self, global_rank):
        # Only the holder ever changes the word away from its own id, so check-then-store
        # is race-free here; a finished or failed thread must never keep the turn.
        if self._turn[0] == global_rank + 1:
            write_release(self._turn.ctypes.data, 0)

    def is_alive(self, global_rank):
        """True until the rank's thread finished or failed (also before it started)."""
        return not (self._finished[global_rank] or self._failed[global_rank])

    def mark_failed(self, global_rank):
        self._failed[global_rank] = True
        self._give_up_turn(global_rank)
        self.failure.set()

    def mark_finished(self, global_rank):
        self._finished[global_rank] = True
        self._give_up_turn(global_rank)

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


def new_thread_arena(regions, rank, states, global_ranks, spin="auto", single_copy="auto"):
    """protocol.Arena for group rank `rank` over `regions`; peer p is spawn rank
    global_ranks[p] in `states`. spin: SHMCOLL_SPIN ("auto", "spin" or "yield");
    single_copy: SHMCOLL_SINGLE_COPY ("auto": rank threads read each other's buffers in
    place, single_copy.IN_PROCESS; "off": through the slots)."""
    single_copy = IN_PROCESS if single_copy != "off" else NONE
    return Arena(regions.regions, rank, regions.layout, thread_liveness(states, global_ranks),
                 describe_fingerprint, oversubscribed=is_spin_off(spin, regions.world_size),
                 gil_turn=states.gil_turn(global_ranks[rank]), single_copy=single_copy)
