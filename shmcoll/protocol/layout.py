"""The byte layout of a region: header fields, control lines and words, rank states,
and `RegionLayout` (where the slots and the point-to-point area lie).

protocol.py's docstring draws the layout and states the rules that use it; this module holds
only the numbers, so that the Arena (protocol.py), its compiled steps
(protocol/kernels.py), the segments (shm.py) and the mailboxes (p2p.py) share them without
importing one another. protocol.py re-exports every name.
"""

import numpy as np

MAGIC = int.from_bytes(b"SHMCOLL\x01", "little")
# 2: p2p area and its header fields; 3: BUF line, header map address; 4: SLEEPERS line
LAYOUT_VERSION = 4
HEADER_NBYTES = 4096
LINE_NBYTES = 128  # two 64-byte lines: defeats the adjacent-line prefetcher pairing lines
LINE_WORDS = LINE_NBYTES // 8
CTRL_LINES = 16
FP_RING = 4  # a peer can be at most one collective ahead (rule 4), so 2 would do
FP_WORDS = 8
DATA_ALIGN = 4096

W_POSTED, W_STATE, W_SEQ, W_BUF = 0, 1, 2, 3
FP_LINE0 = 4
W_SLEEPERS = FP_LINE0 + FP_RING
# from a rank's POSTED word to its SLEEPERS word (the compiled post finds it so)
_SLEEPERS_DELTA = (W_SLEEPERS - W_POSTED) * LINE_NBYTES
_BUF_ADDR, _BUF_NBYTES = W_BUF * LINE_WORDS, W_BUF * LINE_WORDS + 1  # ctrl words of BUF
STATE_LIVE, STATE_ABORTED, STATE_CLOSED = 0, 1, 2

_H_MAGIC, _H_VERSION, _H_TOKEN, _H_WORLD, _H_RANK = 0, 8, 16, 32, 40
_H_PID, _H_NBYTES, _H_SLOT, _H_NSLOTS = 48, 56, 64, 72
_H_P2P_CELLS, _H_P2P_CELL, _H_MAP_ADDR = 80, 88, 96
_H_WORDS_END = 104
HEADER_PROBE_NBYTES = _H_WORDS_END  # what single_copy.probe reads back (token included)


# -- the compiled steps' numbers (protocol/kernels.py; here so that the Arena imports no numba)

# Rank threads only (Arena gil_turn): how long a rank whose wait completed waits (pause
# polls, or yields when oversubscribed) for the Python turn before taking the GIL anyway;
# see _gil_leave. Covers a peer's Python between two collectives (~10-30 us via dist.*).
GIL_LEAVE_NS = 200_000
# Sub-slots the streamed collectives cycle through (Arena._stream): 2 is the smallest ring
# that needs no waits beyond the per-sub-chunk one (rule 6).
STREAM_RING = 2
STREAM_REDUCE, STREAM_GATHER, STREAM_BROADCAST = 0, 1, 2  # what Arena._stream does with
# each sub-chunk (STREAM_BROADCAST: only the root copies in; the others copy the root's out)
# what Arena.one_step does after its wait (algorithms.one_step_mode picks one)
ONE_STEP_REDUCE, ONE_STEP_BROADCAST, ONE_STEP_GATHER, ONE_STEP_REDUCE_SCATTER, \
    ONE_STEP_ALL_TO_ALL = range(5)
# What the one-step kernel returns when its wait was clean but it left the work after it
# to Python (ONE_STEP_ALL_TO_ALL: the tables disagree or a rank's messages did not ride);
# none of _exchange_steps' codes (-1 clean, -2 aborted, -3 mismatch, -4 aborted peer,
# >= 0 late).
ONE_STEP_NOT_CONSUMED = -9
# ... and when it read every peer's message from the peer's own buffer (ONE_STEP_ALL_TO_ALL
# with A2A_PLAN_SLOT 0, single copy) and what is left is the closing step: a post and
# wait, so that no rank returns while a peer still reads its buffers (Arena.exchange).
ONE_STEP_CLOSE = -10
# all_to_all's size table at the start of every rank's slot (algorithms/all_to_all.py and
# the one-step kernel): A2A_TABLE_WORDS int64 per rank of the group (send sizes, receive
# sizes, send addresses), then, from the next line on, the messages that ride with it.
A2A_TABLE_WORDS = 3
# ONE_STEP_ALL_TO_ALL's plan (Arena.one_step's `plan`) after the 8 usual words: the slot's
# bytes, then my send sizes and my receive sizes in bytes (N each). Slot bytes 0: my
# messages stay where they are; the table carries their addresses for the peers to read
# (single copy), as all_to_all_direct's table does for messages that do not ride.
A2A_PLAN_SLOT = 8
A2A_PLAN_SIZES = 9


def a2a_head_nbytes(world):
    """Where all_to_all's messages start in a slot: after the table, a line on."""
    return (A2A_TABLE_WORDS * world * 8 + LINE_NBYTES - 1) // LINE_NBYTES * LINE_NBYTES


# Words of Arena._cfg (the one-step kernel's constants) and rows of Arena._peer_tab.
(_CFG_RANK, _CFG_SPIN_NS, _CFG_YIELD_NS, _CFG_POSTED, _CFG_STATE, _CFG_SEQ, _CFG_GIL,
 _CFG_GIL_ME, _CFG_VERIFY, _CFG_FP0, _CFG_SINGLE_COPY) = range(11)
# Rows of Arena._peer_tab (a column per peer, in rank order): their POSTED and STATE
# words, FP_RING fingerprint lines, then their pids.
_PEER_POSTED, _PEER_STATE, _PEER_FP0 = 0, 1, 2
_PEER_PID = _PEER_FP0 + FP_RING
# The kernel sets (jit.once keys: protocol/kernels.py loads each on its first use).
_ONE_STEP = "shmcoll's one-step kernel"
_EXCHANGE = "shmcoll's exchange and wait kernels"
_STREAM = "shmcoll's streaming kernels"
_TWO_SHOT = "shmcoll's two-shot kernels"
_SINGLE_COPY = "shmcoll's single-copy kernels"
_LANE_ENTRY = "shmcoll's one-step kernel's C entry"
# "no bytes": the source of a step that publishes nothing
_NO_BYTES = np.zeros(0, np.uint8)


class RegionLayout:
    """Byte geometry of one rank's region; identical for every rank of a group.

    `p2p_cells` cells of `p2p_cell_nbytes` per (this rank -> destination) pair make the
    point-to-point area (p2p.py); 0 cells leave it out.
    """

    __slots__ = ("slot_nbytes", "nslots", "ctrl_offset", "data_offset", "nbytes", "world_size",
                 "p2p_cells", "p2p_cell_nbytes", "p2p_offset", "p2p_ring_offset",
                 "p2p_cell_stride")

    def __init__(self, slot_nbytes, nslots, world_size=1, p2p_cells=0, p2p_cell_nbytes=0):
        if slot_nbytes <= 0 or slot_nbytes % 64:
            raise ValueError(f"slot_nbytes must be a positive multiple of 64, got {slot_nbytes}")
        if nslots < 2:
            raise ValueError(f"nslots must be >= 2 (double buffering), got {nslots}")
        if p2p_cells < 0 or (p2p_cells and (p2p_cell_nbytes <= 0 or p2p_cell_nbytes % 64)):
            raise ValueError(f"p2p needs cells >= 0 and cell bytes a positive multiple of 64, "
                             f"got {p2p_cells} cells of {p2p_cell_nbytes} bytes")
        self.slot_nbytes = int(slot_nbytes)
        self.nslots = int(nslots)
        self.world_size = int(world_size)
        self.ctrl_offset = HEADER_NBYTES
        ctrl_end = self.ctrl_offset + CTRL_LINES * LINE_NBYTES
        self.data_offset = _align(ctrl_end, DATA_ALIGN)
        slots_end = self.data_offset + self.slot_nbytes * self.nslots
        self.p2p_cells = int(p2p_cells)
        self.p2p_cell_nbytes = int(p2p_cell_nbytes) if p2p_cells else 0
        self.p2p_offset = _align(slots_end, DATA_ALIGN)
        self.p2p_ring_offset = self.p2p_offset + _align(self.world_size * LINE_NBYTES, DATA_ALIGN)
        self.p2p_cell_stride = LINE_NBYTES + self.p2p_cell_nbytes  # header line + payload
        if self.p2p_cells:
            self.nbytes = self.p2p_ring_offset + \
                self.world_size * self.p2p_cells * self.p2p_cell_stride
        else:
            self.nbytes = slots_end

    def consumed_offset(self, src):
        """Offset of CONSUMED[src] (the owner's count of cells taken from rank src)."""
        return self.p2p_offset + src * LINE_NBYTES

    def cell_offset(self, dst, k):
        """Offset of cell k of the owner's mailbox ring to rank dst (its header line)."""
        return self.p2p_ring_offset + (dst * self.p2p_cells + k) * self.p2p_cell_stride


def _align(n, a):
    return -(-n // a) * a


def write_header(region, layout, token, world_size, rank, pid):
    """Fill the header of a freshly created (zeroed) region."""
    h = region[:HEADER_NBYTES]
    words = h[:_H_WORDS_END].view(np.uint64)
    words[_H_MAGIC // 8] = MAGIC
    words[_H_VERSION // 8] = LAYOUT_VERSION
    h[_H_TOKEN:_H_TOKEN + 16] = np.frombuffer(token, np.uint8)
    words[_H_WORLD // 8] = world_size
    words[_H_RANK // 8] = rank
    words[_H_PID // 8] = pid
    words[_H_NBYTES // 8] = layout.nbytes
    words[_H_SLOT // 8] = layout.slot_nbytes
    words[_H_NSLOTS // 8] = layout.nslots
    words[_H_P2P_CELLS // 8] = layout.p2p_cells
    words[_H_P2P_CELL // 8] = layout.p2p_cell_nbytes
    words[_H_MAP_ADDR // 8] = region.ctypes.data


def read_header(region):
    """Decode a region header into a dict (no validation: shm.verify_header does that)."""
    if region.nbytes < HEADER_NBYTES:
        return None
    words = region[:_H_WORDS_END].view(np.uint64)
    return {
        "magic": int(words[_H_MAGIC // 8]),
        "version": int(words[_H_VERSION // 8]),
        "token": bytes(region[_H_TOKEN:_H_TOKEN + 16]),
        "world_size": int(words[_H_WORLD // 8]),
        "rank": int(words[_H_RANK // 8]),
        "pid": int(words[_H_PID // 8]),
        "nbytes": int(words[_H_NBYTES // 8]),
        "slot_nbytes": int(words[_H_SLOT // 8]),
        "nslots": int(words[_H_NSLOTS // 8]),
        "p2p_cells": int(words[_H_P2P_CELLS // 8]),
        "p2p_cell_nbytes": int(words[_H_P2P_CELL // 8]),
        "map_addr": int(words[_H_MAP_ADDR // 8]),
    }


def _header_pid(region):
    h = read_header(region)
    return h["pid"] if h is not None and h["magic"] == MAGIC else None
