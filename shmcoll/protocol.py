"""The collective protocol: region layout, step counters, fingerprints and slot reuse rules.

Every rank owns one *region* (a POSIX segment for processes, see shm.py; a plain numpy buffer
for threads, see threaded_pg). Every rank maps every peer's region. Vocabulary: *region* = one
rank's memory; *slot* = one of the region's data buffers; *chunk* = the part of a collective
that fits in a slot; *step* = one post/wait round; *seq* = the collective sequence number.

Region layout (all offsets in bytes; every control word on its own 128-byte line so that two
ranks' writers never share a cache line, nor do adjacent-line prefetches pair them):

    0      +-------------------------------------------------------------+
           | header (HEADER_NBYTES = 4096)                               |
           |   0 magic u64 'SHMCOLL\\x01'   8 layout version u64          |
           |  16 group token (16 B)        32 world_size  40 rank         |
           |  48 owner pid  56 region nbytes  64 slot nbytes  72 nslots   |
           |  80 p2p cells  88 p2p cell nbytes                            |
           |  96 address of this region in the owner's address space      |
           |     (single_copy.probe reads the header back through it)     |
    4096   +-------------------------------------------------------------+
           | control block: CTRL_LINES lines x 128 B, one i64 per line    |
           |   line 0  POSTED  monotonic step counter (only owner writes) |
           |   line 1  STATE   0 = live, 1 = aborted, 2 = closed          |
           |   line 2  SEQ     seq of the collective the owner is in      |
           |   line 3  BUF     address, nbytes of the owner's user buffer |
           |           in its own address space (single-copy paths)       |
           |   line 4+k FP[k]  fingerprint of seq with seq % FP_RING == k |
           |           (words: seq, step, collective, dtype, count, root,  |
           |            op, extra)                                         |
           |   line 8  SLEEPERS peers asleep on my POSTED (rule 5; peers  |
           |           add and subtract, atomically)                      |
    DATA   +-------------------------------------------------------------+
           | slot 0 | slot 1 | ... (nslots x slot_nbytes, 4 KiB aligned)  |
    P2P    +-------------------------------------------------------------+
           | point-to-point area (p2p.py has the protocol; absent when     |
           | p2p_cells == 0), 4 KiB aligned:                               |
           |   CONSUMED[s]: world_size lines x 128 B, one i64 per line:    |
           |     cells from rank s this rank has consumed (owner writes)   |
           |   RING[d][k]: world_size x p2p_cells cells of 128 B header +  |
           |     p2p_cell_nbytes payload: this rank's mailbox to rank d    |
           |     (header word 0 = cell sequence, release-stored last)      |
           +-------------------------------------------------------------+

Rules (each rank, for every collective, in the same order on every rank):
1. begin(seq, fp): write FP[seq % FP_RING] and SEQ (plain stores; published by rule 2),
   at the latest just before the collective's first post.
2. post(): store_release(POSTED, POSTED + 1). Everything written before (slot data,
   fingerprint) is visible to a peer that load_acquires POSTED >= that value.
   exchange() is copy-in + rules 1-4 in one compiled call (the small-message path): the
   same stores, loads and order, without a Python round trip between them. one_step()
   goes further for collectives that are a single step through one slot (small
   all_reduce, broadcast, all_gather, reduce_scatter): begin, claim (rule 6), copy-in,
   rules 1-4 and the consume are one compiled call, and Python only runs when a wait is
   not met at once.
3. wait_all(t): load_acquire every peer's POSTED until >= t. Counters only grow, so the
   predicate is `>=`, never `==`: a fast peer that already moved on cannot be missed (the
   DeepSpeed #4048 bug class), and no word is ever reset.
4. The first wait of every collective waits for ALL peers and then compares fingerprints: a
   mismatch raises CollectiveMismatchError on every rank before any peer data is read. All
   ranks posted exactly once for it, so counters stay aligned and the group stays usable
   (the slots it published are released again: nobody read them). The same check refuses
   to complete a collective when a peer's STATE says ABORTED and its SEQ is not past this
   one (it failed this or an earlier collective), so a late rank fails at the same
   collective as its peers. A rank that fails collective s stores SEQ = s before STATE
   (abort_at), so a peer whose SEQ is past mine finished mine and failed a later one: mine
   completes (its data stays put by rule 6) and the next one fails.
5. A wait that does not complete at once checks, between short sleeps, its own STATE
   (abort()), every missing peer's liveness (pidfd) and STATE (CLOSED / ABORTED), and the
   deadline: a dead or closed peer -> PeerLostError naming its rank and pid; an aborted one
   -> GroupAbortedError; the deadline -> CollectiveTimeoutError listing the missing ranks
   and their last seq. Each sleep is a futex wait on the first missing peer's POSTED,
   bounded by the sleep's length, so the peer's post ends it at once: the sleeper adds 1
   to the peer's SLEEPERS (seq_cst), re-reads POSTED and sleeps only if it is still below
   the target (the kernel re-checks that value atomically), then subtracts 1; every post
   is store_release(POSTED), a full fence, and a futex wake if SLEEPERS is non-zero. The
   fences on both sides make at least one side see the other's store, so a sleeper is
   never missed; the bound makes even a missed wake cost no more than the sleep did.
6. Slot reuse: a rank reads a peer's slot only between wait_all(t) and its own next post. A
   slot published at step s (last written before post s) is therefore free again once every
   peer has posted s + 1; claim(i) waits for that. Slots rotate in claim order, which is the
   same on every rank because chunk counts derive from fingerprint-checked arguments.
   Streamed collectives (Arena._stream) cycle sub-chunks through two sub-slots of one
   claimed slot, one step each: sub-chunk k is written into sub-slot k % 2 only after the
   wait for k - 1, and every peer posted k - 1 only after it consumed k - 2, the previous
   contents of that sub-slot; so the rule above holds with no extra wait.

Point-to-point messages (send/recv) use only the P2P area and never touch POSTED, SEQ or
the fingerprints, so they interleave freely with collectives; their rules are in p2p.py.

Memory ordering: POSTED is the only synchronizing word of collectives; it is written with a
release store and read with an acquire load (atomics.py), so data and fingerprint stores
before a post happen-before a peer's reads after its wait. STATE is advisory (abort/close
notification), read on the slow path and once per collective at the fingerprint check. Peers' regions are input, not truth: the header is
validated on attach (shm.py) and fingerprints are compared, never used as lengths.
"""

import errno
import time

import numba
import numpy as np

from .atomics import HAVE_FUTEX, add_seq_cst, cas_acq_rel, copy_bytes, cpu_pause, \
    fence_seq_cst, futex_wait, futex_wake, load_acquire, monotonic_ns, read_acquire, \
    sched_yield, store_release, wait_all_ge, write_release
from .atomics import warm_up as atomics_warm_up
from . import jit
from .kernels import call_reduce
from .single_copy import CMA, NONE, PIECE_NBYTES, errno_text, gather_from_peers, \
    reduce_from_peers
from .errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    GroupAbortedError,
    PeerLostError,
    ShmcollError,
)

__all__ = [
    "MAGIC",
    "LAYOUT_VERSION",
    "HEADER_NBYTES",
    "RegionLayout",
    "write_header",
    "read_header",
    "Arena",
    "STATE_LIVE",
    "STATE_ABORTED",
    "STATE_CLOSED",
    "ONE_STEP_REDUCE",
    "ONE_STEP_BROADCAST",
    "ONE_STEP_GATHER",
    "ONE_STEP_REDUCE_SCATTER",
]

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

# Wait tiers (see DESIGN_NOTES §14), all inside the compiled wait (atomics.wait_all_ge):
# SPINS pause-polls (~10 us): brief, because on a VM a long PAUSE loop can trigger
# pause-loop exits that deschedule the vCPU, and on a loaded host a spinning rank steals the
# core its late peer needs; then sched_yield polls for YIELD_NS, so a peer a few hundred us
# late (GC, a page fault, a descheduled core, a peer thread's Python) is seen at once while
# the core still goes to whoever needs it when ranks outnumber cores. The yield tier is
# bounded by time, not by a count: sched_yield takes from under 1 us (idle core) to a whole
# time slice (loaded host). Only then does Python take over (_wait_slow): sleeps with
# backoff up to SLEEP_MAX_S, checking deadline, abort and peer liveness in between; each
# sleep is a futex wait that the awaited peer's post ends at once (rule 5), or, without
# futexes, a plain sleep followed by SLOW_YIELD_NS of yield-polling. Staying compiled for the whole yield
# tier matters most for rank threads (threaded_pg): a waiting thread back in Python takes
# the GIL from the very peer it waits for (measured: one Python slow wait per collective
# made 2-thread dist.all_reduce ~5x slower).
SPINS = 200
YIELD_NS = 2_000_000
SLOW_YIELD_NS = 100_000
# Rank threads only (Arena gil_turn): how long a rank whose wait completed waits (pause
# polls, or yields when oversubscribed) for the Python turn before taking the GIL anyway;
# see _gil_leave. Covers a peer's Python between two collectives (~10-30 us via dist.*).
GIL_LEAVE_NS = 200_000
# Sub-slots the streamed collectives cycle through (Arena._stream): 2 is the smallest ring
# that needs no waits beyond the per-sub-chunk one (rule 6).
STREAM_RING = 2
STREAM_REDUCE, STREAM_GATHER = 0, 1  # what Arena._stream does with each sub-chunk
# what Arena.one_step does after its wait (algorithms.one_step_mode picks one)
ONE_STEP_REDUCE, ONE_STEP_BROADCAST, ONE_STEP_GATHER, ONE_STEP_REDUCE_SCATTER = range(4)
SLEEP_MIN_S = 20e-6
SLEEP_MAX_S = 1e-3
# Words of Arena._cfg (the one-step kernel's constants) and rows of Arena._peer_tab.
(_CFG_RANK, _CFG_SPINS, _CFG_YIELD_NS, _CFG_POSTED, _CFG_STATE, _CFG_SEQ, _CFG_GIL,
 _CFG_GIL_ME, _CFG_VERIFY, _CFG_FP0) = range(10)
_PEER_POSTED, _PEER_STATE, _PEER_FP0 = 0, 1, 2


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


class Arena:
    """The seam algorithms talk to: slot views, post/wait, fingerprints, deadlines.

    `regions[r]` is rank r's region as a uint8 array (all mapped in this address space).
    `is_alive(peer)` reports whether the peer's process/thread still runs; `describe(fp)`
    renders a fingerprint tuple for error messages. `gil_turn` (rank threads of one
    process only) = (address of their shared "Python turn" word, this thread's non-zero id
    in it): see _gil_leave. `single_copy` (single_copy.NONE / IN_PROCESS / CMA): how a
    peer's user buffer can be read where it lies (exchange_buffer, reduce_peers,
    gather_peers); NONE: only through the slots. Not thread-safe: the owning group runs one
    collective at a time.
    """

    def __init__(self, regions, rank, layout, is_alive, describe=None, oversubscribed=False,
                 pids=None, gil_turn=None, single_copy=NONE, yield_ns=YIELD_NS):
        # Compiled or loaded under the compile lock before any first use (cheap when done).
        atomics_warm_up()
        warm_up_one_step()
        self.rank = rank
        self.world_size = len(regions)
        self.layout = layout
        self.slot_nbytes = layout.slot_nbytes
        self.nslots = layout.nslots
        self._regions = regions
        self._is_alive = is_alive
        self._describe = describe or (lambda fp: repr(fp))
        # Owner pid of every region, for error messages only (never trusted for anything else).
        self._pids = list(pids) if pids is not None else [_header_pid(reg) for reg in regions]
        self.single_copy = single_copy
        self._pid_arr = np.array([p or 0 for p in self._pids], np.int64)
        self._scratch = None  # single-copy reductions' pieces, allocated on first use
        ctrl = [reg[layout.ctrl_offset:layout.data_offset].view(np.int64) for reg in regions]
        self._ctrl = ctrl
        self._mine = ctrl[rank]
        self._posted_addr = ctrl[rank].ctypes.data + W_POSTED * LINE_WORDS * 8
        self._state_addr = ctrl[rank].ctypes.data + W_STATE * LINE_WORDS * 8
        self._peers = [p for p in range(self.world_size) if p != rank]
        self._peer_posted = np.array(
            [ctrl[p].ctypes.data + W_POSTED * LINE_WORDS * 8 for p in self._peers], np.int64)
        self._posted_addrs = [c.ctypes.data + W_POSTED * LINE_WORDS * 8 for c in ctrl]
        self._state_addrs = [c.ctypes.data + W_STATE * LINE_WORDS * 8 for c in ctrl]
        self._seq_addrs = [c.ctypes.data + W_SEQ * LINE_WORDS * 8 for c in ctrl]
        self._peer_state = np.array(
            [ctrl[p].ctypes.data + W_STATE * LINE_WORDS * 8 for p in self._peers], np.int64)
        self._seq_addr = self._seq_addrs[rank]
        fp_line = [[c.ctypes.data + (FP_LINE0 + k) * LINE_NBYTES for c in ctrl]
                   for k in range(FP_RING)]
        self._fp_addrs = [line[rank] for line in fp_line]
        self._peer_fp_addrs = [np.array([line[p] for p in self._peers], np.int64)
                               for line in fp_line]
        # _slots[i][r]: rank r's slot i as uint8; _slot_addrs[i]: int64 addresses of slot i.
        self._slots = [
            [reg[layout.data_offset + i * layout.slot_nbytes:
                 layout.data_offset + (i + 1) * layout.slot_nbytes] for reg in regions]
            for i in range(layout.nslots)]
        self._slot_addrs = [np.array([s.ctypes.data for s in row], np.int64) for row in self._slots]
        self._slot_addr_mine = [int(a[rank]) for a in self._slot_addrs]
        self._step = int(read_acquire(self._posted_addr))
        self._known_min = self._step  # every peer has posted at least this much
        self._free_at = [0] * layout.nslots
        self._next_slot = 0
        self._spins = 0 if oversubscribed else SPINS
        self._yield_ns = yield_ns  # the yield tier (a shorter one: shm_group.new_shm_group)
        # Ranks that are threads of one process: (address of their "Python turn" word, my
        # id in it); see _gil_leave. (0, 0): no turn-taking (ranks that are processes).
        self._gil_addr, self._gil_me = gil_turn if gil_turn is not None else (0, 0)
        self.threads = gil_turn is not None  # ranks are threads of this process
        # The constants of the one-step kernel (_one_step_kernel), one array so that
        # the compiled call takes few arguments (each costs ~50 ns of dispatch): my words'
        # addresses, wait tiers, GIL turn, rule-4 switch; and one row per kind of peer word.
        self._cfg = np.array([rank, self._spins, yield_ns, self._posted_addr, self._state_addr,
                              self._seq_addr, self._gil_addr, self._gil_me, 1,
                              self._fp_addrs[0]], np.int64)
        self._peer_tab = np.array([self._peer_posted, self._peer_state]
                                  + self._peer_fp_addrs, np.int64).reshape(
                                      2 + FP_RING, self.world_size - 1)
        self._verify = True
        # per-collective state
        self._seq = 0
        self._op_name = "?"
        self._fp_list = []
        self._fp_unwritten = False
        self._fp_pending = False
        self._deadline = float("inf")
        self._timeout_s = 0.0
        self._slot_at_begin = 0
        self._begin_step = 0

    @property
    def verify(self):
        """Rule 4 (fingerprint check) on; False only lets a benchmark measure its cost."""
        return self._verify

    @verify.setter
    def verify(self, on):
        self._verify = bool(on)
        self._cfg[_CFG_VERIFY] = int(self._verify)

    # -- collective framing ------------------------------------------------------------

    def begin(self, seq, op_name, fp, timeout_s):
        """Open collective `seq`: record its fingerprint (ints) and its deadline.

        The fingerprint reaches shared memory with the collective's first post (post() or
        exchange()), which is all rule 1 needs: peers read it only after that post.
        """
        self._seq = seq
        self._op_name = op_name
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        fp = [seq, self._step, *map(int, fp)]
        if len(fp) < FP_WORDS:
            fp += _FP_PAD[len(fp)]
        self._fp_list = fp
        self._fp_unwritten = True
        self._fp_pending = True
        self._begin_step = self._step
        self._slot_at_begin = self._next_slot

    def _write_fp(self):
        line = (FP_LINE0 + self._seq % FP_RING) * LINE_WORDS
        self._mine[line:line + FP_WORDS] = self._fp_list
        self._mine[W_SEQ * LINE_WORDS] = self._seq
        self._fp_unwritten = False

    @property
    def step(self):
        """My last posted step."""
        return self._step

    # -- slots ---------------------------------------------------------------------------

    def next_slot(self):
        """Index of the slot the next chunk uses (same rotation on every rank)."""
        i = self._next_slot
        self._next_slot = (i + 1) % self.nslots
        return i

    def claim(self, i):
        """My slot i as uint8, after every peer has finished reading its previous contents."""
        self.wait_all(self._free_at[i])
        return self._slots[i][self.rank]

    def slot(self, i, rank):
        """Rank `rank`'s slot i (uint8 view). Read peers' slots only after a wait."""
        return self._slots[i][rank]

    def slot_addrs(self, i):
        """int64 addresses of slot i of ranks 0..world_size-1 (for kernels.reduce_into)."""
        return self._slot_addrs[i]

    # -- post / wait -----------------------------------------------------------------------

    def post(self, published_slot=None):
        """Publish everything written so far; returns the new step value.

        NOTE: order matters: data and fingerprint stores precede this release store, so a
        peer that observes the new value also observes them.
        """
        if self._fp_unwritten:
            self._write_fp()
        self._step += 1
        post_wake(self._posted_addr, self._step)
        if published_slot is not None:
            self._free_at[published_slot] = self._step + 1
        return self._step

    def exchange(self, i=None, src=None, byte_offset=0, nbytes=0):
        """Copy `nbytes` of 1-D array `src` from `byte_offset` into my slot i (claimed),
        post, and wait for every peer to post too: post(i) + wait_all() in one compiled
        call. Without a slot (i None) it is post() + wait_all(): nothing is published.

        On the first post of a collective the kernel also writes the fingerprint and checks
        the peers' (rule 4); anything but a clean pass (a slow peer, a mismatch, an abort)
        is finished by the Python code of wait_all, which owns the slow path and the errors.
        """
        jit.once(_EXCHANGE, _warm_exchange)
        if i is None:
            src, dst, nbytes = _NO_BYTES, 0, 0
        else:
            src, dst = src.view(np.uint8), self._slot_addr_mine[i]  # kernels move bytes
        fp, fp_addr, peer_fp = self._fp_args()
        step = self._step + 1
        if i is not None:
            self._free_at[i] = step + 1
        r = _exchange_kernel(src, byte_offset, nbytes, dst, fp_addr,
                             fp[0], fp[1], fp[2], fp[3], fp[4], fp[5], fp[6], fp[7],
                             self._seq_addr, self._seq, self._posted_addr, step,
                             self._peer_posted, peer_fp, self._peer_state, self._spins,
                             self._yield_ns, self._state_addr, self._verify, self._gil_addr,
                             self._gil_me)
        self._fp_unwritten = False
        self._step = step
        self._finish_wait(step, r, fp_addr != 0)

    def exchange_reduce(self, i, buf, start, n, spec, sub_nbytes):
        """buf[start:start + n] = the reduction (ops.ReduceSpec `spec`) of every rank's
        buf[start:start + n], in rank order, through my slot i (claimed): the one-shot
        all_reduce as one compiled call when nobody is late (see _stream)."""
        size = buf.itemsize
        self._stream(i, STREAM_REDUCE, buf.view(np.uint8), size, start * size, n * size,
                     sub_nbytes, spec, _NO_BYTES)

    def one_step(self, seq, op_name, mode, plan, pre, post, src, out, root, timeout_s):
        """Collective `seq` when it is a single step through one slot, as one compiled call
        -- begin, claim, copy-in, post, wait, fingerprint check, consume -- instead of the
        ~6-8 us of Python between begin(), next_slot(), claim() and the exchange. Same
        slot, step, fingerprint and stores as the general path of the same collective, so
        a peer that takes that path (a strided array, say) matches it. The modes (see
        algorithms.one_step_mode for when each applies):

        ONE_STEP_REDUCE: all_reduce_one_shot of one sub-chunk; `src` (the bytes of a 1-D
            contiguous array) becomes the reduction in rank order of every rank's `src`.
        ONE_STEP_BROADCAST: broadcast_direct of one chunk; the root (rank `root`) copies
            `src` in, every other rank copies the root's slot out into its `src`.
        ONE_STEP_GATHER: all_gather_direct into one array, of one sub-chunk; rank j's `src`
            lands at out[j * src.nbytes:] (uint8 arrays).
        ONE_STEP_REDUCE_SCATTER: reduce_scatter_direct of one input array (world_size equal
            blocks) that fits a slot; `out` (the bytes of my output, one block) becomes the
            reduction in rank order of block[rank] of every rank's `src` (bytes too).

        `plan`: int64 [collective code, dtype code, count, root, op, shape word, kernel op,
        reducer] (fingerprint words 2-7, then the reduction: ops.ReduceSpec's op and fn);
        pre/post as in ops.ReduceSpec. `src` and `out` are uint8 arrays.
        Anything but a clean pass (a late peer, a mismatch, an abort) is finished by the same
        Python as the general path (_finish_wait), which owns the slow tiers and errors.
        """
        if out is None:  # all_reduce, broadcast: typed like the gathers' for one compilation
            out = _NO_BYTES
        self._seq = seq
        self._op_name = op_name
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._fp_pending = False  # the kernel checks this collective's fingerprints itself
        i = self._next_slot
        publishes = root < 0 or root == self.rank  # broadcast: only the root fills a slot
        if publishes and self._known_min < self._free_at[i]:  # rare: a peer may still read it
            self.wait_all(self._free_at[i])
        step = self._step + 1
        srcs = self._slot_addrs[i]
        r = _one_step_kernel(mode, src, out, self._cfg, self._peer_tab, srcs, plan, pre, post,
                             seq, step, root)
        self._next_slot = i + 1 if i + 1 < self.nslots else 0
        if publishes:
            self._free_at[i] = step + 1
        self._step = step
        if r == -1:
            self._known_min = step
            return
        # The kernel posted (with the fingerprint) but did not finish: the general path's
        # state for this collective, as begin() would have left it, then its slow wait.
        self._fp_list = [seq, step - 1, *plan[:FP_WORDS - 2].tolist()]
        self._fp_unwritten = False
        self._fp_pending = True
        self._begin_step = step - 1
        self._slot_at_begin = i
        self._finish_wait(step, r, True)
        _one_step_consume(mode, src, out, srcs, self.rank, root, plan[7], plan[6], pre, post)

    def exchange_gather(self, i, inp, out, sub_nbytes):
        """out[j * inp.size: (j + 1) * inp.size] = rank j's `inp`, for every rank j (uint8
        arrays; all_gather into one buffer), through my slot i (claimed), streamed like
        exchange_reduce: my own bytes are copied from `inp` (still in cache from the
        copy-in), each peer's from its sub-slot."""
        self._stream(i, STREAM_GATHER, inp, 1, 0, inp.size, sub_nbytes, None, out)

    def exchange_reduce_two_shot(self, i, buf, spec):
        """buf = the reduction (ops.ReduceSpec `spec`) of every rank's buf, in rank order,
        as reduce-scatter + all-gather through my slot i (claimed): per sub-chunk two steps
        -- copy in and post; wait; reduce my slice of every rank's sub-slot into buf and my
        sub-slot; post; wait; copy every peer's reduced slice out of its sub-slot -- all in
        one compiled call unless a peer is late (Python then finishes that wait, does the
        step's work and resumes the kernel after it).

        The sub-chunks take turns in STREAM_RING sub-slots, as in _stream: I copy sub-chunk
        k into sub-slot k % 2 only after every peer posted the second step of k - 1, which
        it does after gathering k - 2 (the last read of that sub-slot). The reduce writes
        only my own slice of my sub-slot, which no peer reads until the next step. The
        sub-chunks fill whole sub-slots: nothing overlaps across them, so smaller ones
        would only add waits."""
        jit.once(_TWO_SHOT, _warm_two_shot)
        nbytes, size = buf.nbytes, buf.itemsize
        sub = self.sub_nbytes(size, self.slot_nbytes)
        nphase = 2 * max(1, -(-nbytes // sub))
        step0 = self._step
        self._free_at[i] = step0 + nphase + 1
        srcs, dst = self._slot_addrs[i], self._slot_addr_mine[i]
        buf = buf.view(np.uint8)  # kernels move bytes; the reducer knows the dtype
        fn, op, pre, post = spec.fn, spec.op, spec.pre, spec.post
        p = 0
        while True:
            fp, fp_addr, peer_fp = self._fp_args()
            done, r = _two_shot_kernel(
                buf, size, sub, p, dst, fp_addr, fp[0], fp[1], fp[2], fp[3], fp[4], fp[5],
                fp[6], fp[7], self._seq_addr, self._seq, self._posted_addr, step0,
                self._peer_posted, peer_fp, self._peer_state, self._spins, self._yield_ns,
                self._state_addr, self._verify, srcs, self.rank, fn, op, pre, post,
                self._gil_addr, self._gil_me)
            self._fp_unwritten = False
            if self._settle(step0, nphase, done, r, fp_addr):
                return
            _two_shot_consume(done, buf, size, sub, srcs, self.rank, fn, op, pre, post)
            p = done + 1
            if p >= nphase:
                self._step = step0 + nphase
                return

    def _stream(self, i, mode, src, itemsize, byte_offset, nbytes, sub_nbytes, spec, out):
        """One collective's data through slot i in sub-chunks, one step each: copy the
        sub-chunk in, post, wait for every peer, then consume every rank's copy of it
        (mode STREAM_REDUCE: reduce into src with ops.ReduceSpec `spec`; STREAM_GATHER:
        copy into out), `src` and `out` being bytes of `itemsize`-byte elements, all in one
        compiled call unless a peer is late (Python then finishes that wait, consumes the
        sub-chunk and resumes the kernel after it).

        Each peer reads a sub-chunk from the writer's cache right after it was written
        rather than from memory, and the sub-chunks take turns in a ring of STREAM_RING
        sub-slots at the start of slot i, so the slot memory stays in cache too: only the
        user buffers stream through memory, and nbytes may exceed the slot. A ring of 2
        needs no extra waits: I copy sub-chunk k into sub-slot k % 2 only after seeing
        every peer post sub-chunk k - 1, and a peer posts k - 1 only after it consumed
        k - 2, the last read of that sub-slot.
        """
        jit.once(_STREAM, _warm_stream)
        sub = self.sub_nbytes(itemsize, sub_nbytes)
        nsub = max(1, -(-nbytes // sub))
        step0 = self._step
        self._free_at[i] = step0 + nsub + 1
        srcs, dst = self._slot_addrs[i], self._slot_addr_mine[i]
        fn, op, pre, post = (0, 0, 1.0, 1.0) if spec is None else \
            (spec.fn, spec.op, spec.pre, spec.post)
        k = 0
        while True:
            fp, fp_addr, peer_fp = self._fp_args()
            done, r = _stream_kernel(
                mode, src, byte_offset, nbytes, sub, k, dst, fp_addr,
                fp[0], fp[1], fp[2], fp[3], fp[4], fp[5], fp[6], fp[7],
                self._seq_addr, self._seq, self._posted_addr, step0, self._peer_posted, peer_fp,
                self._peer_state, self._spins, self._yield_ns, self._state_addr, self._verify, srcs,
                self.rank, fn, op, pre, post, out, self._gil_addr, self._gil_me)
            self._fp_unwritten = False
            if self._settle(step0, nsub, done, r, fp_addr):
                return
            _consume(mode, src, byte_offset + done * sub, min(sub, nbytes - done * sub),
                     srcs, done % STREAM_RING * sub, self.rank, fn, op, pre, post, out,
                     done * sub, nbytes)
            k = done + 1
            if k >= nsub:
                self._step = step0 + nsub
                return

    def sub_nbytes(self, itemsize, want):
        """Sub-chunk size for the STREAM_RING sub-slots of a slot: at most `want` bytes and
        a sub-slot, whole elements, at least one."""
        sub = max(itemsize, min(want, self.slot_nbytes // STREAM_RING))
        return sub - sub % itemsize

    def _settle(self, step0, nsteps, done, r, fp_addr):
        """After a multi-step kernel (_stream, exchange_reduce_two_shot) returned (done, r):
        True when all `nsteps` steps were exchanged and consumed (r == -1). Else step
        `done` is posted but not every peer has posted it: finish that wait in Python
        (slow tiers, errors) and return False; the caller then does that step's work and
        resumes the kernel after it. The kernel wrote and checked the fingerprint at step 0."""
        if r == -1:
            self._step = self._known_min = step0 + nsteps
            if fp_addr:
                self._fp_pending = False
            return True
        self._step = step0 + done + 1
        self._finish_wait(self._step, r, fp_addr != 0 and done == 0)
        if fp_addr and done > 0:
            self._fp_pending = False
        return False

    # -- single copy (see single_copy.py) ------------------------------------------------

    def exchange_buffer(self, arr):
        """Publish the address of my 1-D array `arr` (its bytes stay where they are), post
        and wait for every peer (exchange()); return every rank's buffer address, each in
        its owner's address space (int64 array, mine included). Peers' buffers are only
        read through reduce_peers / gather_peers, between this wait and my next post."""
        self._mine[_BUF_ADDR] = arr.ctypes.data
        self._mine[_BUF_NBYTES] = arr.nbytes
        self.exchange()
        addrs = np.empty(self.world_size, np.int64)
        for p, c in enumerate(self._ctrl):
            if p != self.rank and c[_BUF_NBYTES] != arr.nbytes:
                raise ShmcollError(
                    f"{self._op_name} (seq {self._seq}): rank {p} published a buffer of "
                    f"{int(c[_BUF_NBYTES])} bytes, rank {self.rank} one of {arr.nbytes} (a "
                    f"corrupt control block?)")
            addrs[p] = c[_BUF_ADDR]
        return addrs

    def reduce_peers(self, addrs, out, offset, spec):
        """out[i] = the reduction (ops.ReduceSpec) in rank order of every rank's element
        at addrs[p] + offset + i * itemsize (addrs from exchange_buffer; mine may be `out`
        itself)."""
        jit.once(_SINGLE_COPY, _warm_single_copy)
        piece = max(1, PIECE_NBYTES // out.itemsize) * out.itemsize
        scratch = self._scratch_for(piece)
        peer, err = reduce_from_peers(self.single_copy, self._pid_arr, addrs, self.rank,
                                      out.view(np.uint8), offset, scratch, piece, spec.fn,
                                      spec.op, spec.pre, spec.post)
        if peer >= 0:
            raise self._read_error(peer, err)

    def gather_peers(self, peers, remote, local, nbytes):
        """Copy nbytes[k] bytes at remote[k] in rank peers[k]'s address space to local[k]
        (int64 arrays; the ranges were published with exchange_buffer)."""
        jit.once(_SINGLE_COPY, _warm_single_copy)
        peer, err = gather_from_peers(self.single_copy, self._pid_arr, self.rank, peers,
                                      remote, local, nbytes)
        if peer >= 0:
            raise self._read_error(peer, err)

    def _scratch_for(self, piece_nbytes):
        need = piece_nbytes * max(1, self.world_size - 1) if self.single_copy == CMA else 64
        if self._scratch is None or self._scratch.nbytes < need:
            raw = np.empty(need + 4096, np.uint8)
            start = -raw.ctypes.data % 4096
            self._scratch = raw[start:start + need]
        return self._scratch

    def _read_error(self, peer, err):
        """The error of a failed single-copy read from `peer` (-errno `err`)."""
        state = int(self._ctrl[peer][W_STATE * LINE_WORDS])
        if -err == errno.ESRCH or not self._is_alive(peer) or state == STATE_CLOSED:
            return self._lost_error(peer, state)
        return ShmcollError(
            f"{self._op_name} (seq {self._seq}): rank {self.rank} could not read rank "
            f"{peer}'s buffer (pid {self._pids[peer]}): process_vm_readv failed with "
            f"{errno_text(err)}")

    def _fp_args(self):
        """(fingerprint words, my FP line address, peers' FP line addresses) for a kernel:
        address 0 once the fingerprint is out (the kernel then neither writes nor checks)."""
        if self._fp_unwritten:
            k = self._seq % FP_RING
            return self._fp_list, self._fp_addrs[k], self._peer_fp_addrs[k]
        return _NO_FP, 0, self._peer_fp_addrs[0]

    def _finish_wait(self, step, r, checked):
        """After a kernel posted `step` and returned wait code r (checked: it compared the
        fingerprints): slow-wait if peers are missing, then raise what the kernel saw."""
        if r == -1:  # everyone arrived, fingerprints (if checked) match, nobody aborted
            self._known_min = step
            if checked:
                self._fp_pending = False
            return
        if r >= 0 or r == -2:  # not all there within the fast tiers, or my abort word
            self._wait_slow(step, r)
        self._known_min = step
        if self._fp_pending:
            self._check_fingerprints()  # raises on the mismatch/abort the kernel saw

    def wait_all(self, target=None):
        """Wait until every peer has posted >= target (default: my own step)."""
        if target is None:
            target = self._step
        if self._known_min < target:
            jit.once(_EXCHANGE, _warm_exchange)
            r = _wait_kernel(self._peer_posted, target, self._spins, self._yield_ns,
                             self._state_addr, self._gil_addr, self._gil_me)
            if r != -1:
                self._wait_slow(target, r)
            self._known_min = target
        if self._fp_pending and target > self._begin_step:
            # the first wait after this collective's first post: peers' fingerprints for
            # this seq are published (claim() waits before that post do not qualify)
            self._check_fingerprints()

    def _wait_slow(self, target, r):
        """The compiled tiers ran out (or saw my abort word): sleep with backoff, checking
        abort, peer liveness and the deadline before every sleep."""
        jit.once(_EXCHANGE, _warm_exchange)  # wait_all_ge, called from Python below
        sleep_s = SLEEP_MIN_S
        while True:
            if r == -2 or self._mine[W_STATE * LINE_WORDS] != STATE_LIVE:
                raise GroupAbortedError(
                    f"{self._op_name}: rank {self.rank} aborted while waiting at seq {self._seq}")
            self._check_peers(target)
            if time.monotonic() > self._deadline:
                raise self._timeout_error(target)
            if HAVE_FUTEX and r >= 0:
                # asleep until the first missing peer posts (rule 5), then one look: no
                # yield-polling after it, which only burns the cores an oversubscribed
                # machine's other ranks need (2 namespaced hosts x 2 ranks, 8 B all_reduce,
                # A/B in one run: 0.80-0.96x the time of 100 us of yield-polling per sleep)
                sleep_on(self._peer_posted[r], target, int(sleep_s * 1e9))
                yield_ns = 0
            else:
                time.sleep(sleep_s)
                yield_ns = SLOW_YIELD_NS
            sleep_s = min(sleep_s * 2, SLEEP_MAX_S)
            r = wait_all_ge(self._peer_posted, target, 0, yield_ns, self._state_addr)
            if r == -1:
                return

    def _check_peers(self, target):
        """Raise if a peer we still wait for can never arrive.

        Every missing peer is checked, not only the first: with 3+ ranks the first missing
        peer may be alive and itself waiting for the dead one. A lost (dead or closed) peer
        wins over an aborted one, so every survivor names the rank that was lost, not the
        survivor that noticed it first and aborted.
        """
        missing = [p for p in self._peers if self._ctrl[p][W_POSTED * LINE_WORDS] < target]
        if not missing:
            return
        aborted = None
        for peer in missing:
            state = int(self._ctrl[peer][W_STATE * LINE_WORDS])
            if (state == STATE_CLOSED or not self._is_alive(peer)) and self._still_short(
                    peer, target):
                raise self._lost_error(peer, state)
            if state == STATE_ABORTED and aborted is None:
                aborted = peer
        if aborted is not None:
            # The aborting peer may have noticed a loss we have not waited on yet.
            for peer in self._peers:
                state = int(self._ctrl[peer][W_STATE * LINE_WORDS])
                if state == STATE_CLOSED or not self._is_alive(peer):
                    raise self._lost_error(peer, state)
            raise GroupAbortedError(
                f"{self._op_name}: rank {aborted} aborted the group while rank {self.rank} "
                f"waited for it at seq {self._seq}; this group is unusable, create a new one")

    def _still_short(self, peer, target):
        """Re-read the peer's POSTED after seeing it closed or dead: it may have posted
        `target` (then finished and closed) between our first read and the state read. A
        closing peer stores STATE after its last post, and a dead one posts no more, so this
        second read is final."""
        return read_acquire(self._posted_addrs[peer]) < target

    def _lost_error(self, peer, state):
        what = "closed the group" if state == STATE_CLOSED else "exited"
        pid = self._pids[peer] if peer < len(self._pids) else None
        return PeerLostError(
            f"{self._op_name}: rank {peer} (pid {pid}) {what} while rank {self.rank} waited "
            f"for it at seq {self._seq} (peer last seq "
            f"{int(self._ctrl[peer][W_SEQ * LINE_WORDS])}); this group is unusable, create a "
            f"new one", peer=peer)

    def _timeout_error(self, target):
        missing = [p for p in self._peers if self._ctrl[p][W_POSTED * LINE_WORDS] < target]
        seqs = ", ".join(f"rank {p} at seq {int(self._ctrl[p][W_SEQ * LINE_WORDS])}"
                         for p in missing)
        ms = int(round(self._timeout_s * 1000))
        return CollectiveTimeoutError(
            f"[Rank {self.rank}] {self._op_name} (seq {self._seq}): Timed out waiting {ms}ms "
            f"for ranks {missing} to arrive ({seqs})")

    def _check_fingerprints(self):
        self._fp_pending = False
        if not self._verify:
            return
        mine = self._fp_list
        line = (FP_LINE0 + self._seq % FP_RING) * LINE_WORDS
        end = line + len(mine)
        for p in self._peers:
            theirs = self._ctrl[p][line:end].tolist()  # a copy: checked and rendered alike
            if theirs != mine:
                # Undo this collective's slot rotation: no data moved, the group stays usable.
                # Slots published by this collective were read by nobody (every peer raises
                # at this same wait), and every peer has posted >= _known_min, so they are
                # free again now; keeping their "free at step + 1" would make the next
                # collective's claim() wait for a post that comes only after that claim.
                self._next_slot = self._slot_at_begin
                self._free_at = [min(f, self._known_min) for f in self._free_at]
                ours, other = self._describe(tuple(mine[2:])), self._describe(tuple(theirs[2:]))
                if theirs[0] != mine[0]:
                    other += f" at seq {theirs[0]} (ranks are out of step)"
                elif ours == other:
                    other += " with a different shape or split sizes"
                raise CollectiveMismatchError(
                    f"seq {self._seq}: rank {self.rank} called {ours} but rank {p} called {other}")
        # A peer that aborted (timeout, lost peer, abort()) at this collective or an
        # earlier one: do not complete it here with the data it left behind, so that every
        # rank fails at the same collective (a late rank woken by SIGCONT included). One
        # whose SEQ is past mine finished mine (it could not begin the next before), so
        # its abort belongs to a later collective: STATE is read first, and abort_at stores
        # SEQ before STATE. CLOSED is not checked: a peer may finish the last collective
        # and close at once.
        for p in self._peers:
            if (read_acquire(self._state_addrs[p]) == STATE_ABORTED
                    and read_acquire(self._seq_addrs[p]) <= self._seq):
                for q in self._peers:  # name the lost rank the aborting peer noticed
                    if not self._is_alive(q):
                        raise self._lost_error(q, int(self._ctrl[q][W_STATE * LINE_WORDS]))
                raise GroupAbortedError(
                    f"{self._op_name}: rank {p} aborted the group before rank {self.rank} "
                    f"reached seq {self._seq}; this group is unusable, create a new one")

    # -- lifecycle -------------------------------------------------------------------------

    def peer_states(self):
        """(rank, posted, seq, state) of every rank, for diagnostics."""
        return [(r, int(c[W_POSTED * LINE_WORDS]), int(c[W_SEQ * LINE_WORDS]),
                 int(c[W_STATE * LINE_WORDS])) for r, c in enumerate(self._ctrl)]

    def set_state(self, state):
        """Announce abort/close to peers (and wake my own waiter on abort)."""
        write_release(self._state_addr, state)

    def abort_at(self, seq):
        """Announce that I failed collective `seq`: SEQ first, then STATE = ABORTED, so a
        peer that reads ABORTED also sees which collective failed (rule 4). A failure before
        the collective's first post would otherwise leave SEQ at the previous one."""
        write_release(self._seq_addr, seq)
        write_release(self._state_addr, STATE_ABORTED)

    def is_peer_alive(self, peer):
        return self._is_alive(peer)


def warm_up():
    """Compile (or load from numba's cache) every protocol kernel (warmup.py)."""
    for what, build in _KERNEL_SETS:
        jit.once(what, build)


# The protocol kernels, in sets compiled on first use (jit.once), with exactly the argument
# types Arena passes. They move bytes, so one compilation serves every dtype (a reduction
# is a call through ops.ReduceSpec.fn). An Arena loads the one-step kernel when it is made (a group's warm-up does it earlier, during the rendezvous); the others
# load when a collective first needs them (cold: 0.1-0.4 s each, 2-core VM).

def _dummies():
    """Arguments that make each kernel return at once (no peers, nothing to move). `words`
    spans a control block: a post reads the SLEEPERS word _SLEEPERS_DELTA past POSTED."""
    words = np.zeros(CTRL_LINES * LINE_WORDS, np.int64)
    w = words.ctypes.data
    cfg = np.zeros(_CFG_FP0 + 1, np.int64)
    cfg[[_CFG_POSTED, _CFG_STATE, _CFG_SEQ, _CFG_FP0]] = (w + 8, w + 16, w, w + 24)
    return (words, w, np.zeros(0, np.int64), np.array([w], np.int64), cfg,
            np.zeros((2 + FP_RING, 0), np.int64), np.zeros(1, np.uint8), (0,) * FP_WORDS)


def _warm_one_step():
    words, w, none, srcs, cfg, tab, a, fp = _dummies()
    _one_step_kernel(ONE_STEP_REDUCE, a[:0], _NO_BYTES, cfg, tab, srcs, np.zeros(8, np.int64),
                     1.0, 1.0, 0, 0, -1)
    _one_step_consume(ONE_STEP_BROADCAST, a[:0], _NO_BYTES, srcs, 0, 0, 0, 0, 1.0, 1.0)
    post_wake(w + 8, 0)  # Arena.post


def _warm_exchange():
    words, w, none, srcs, cfg, tab, a, fp = _dummies()
    _wait_kernel(none, 0, 0, 0, w + 16, 0, 0)
    wait_all_ge(none, 0, 0, 0, w + 16)
    sleep_on(w + 8, 0, 0)  # Arena._wait_slow
    _exchange_kernel(a, 0, 0, 0, 0, *fp, w, 0, w + 8, 0, none, none, none, 0, 0, w + 16,
                     True, 0, 0)


def _warm_stream():
    words, w, none, srcs, cfg, tab, a, fp = _dummies()
    _stream_kernel(STREAM_REDUCE, a, 0, 0, 64, 0, 0, 0, *fp, w, 0, w + 8, 0, none, none, none,
                   0, 0, w + 16, True, srcs, 0, 0, 0, 1.0, 1.0, _NO_BYTES, 0, 0)
    _consume(STREAM_REDUCE, a, 0, 0, srcs, 0, 0, 0, 0, 1.0, 1.0, _NO_BYTES, 0, 0)


def _warm_two_shot():
    words, w, none, srcs, cfg, tab, a, fp = _dummies()
    _two_shot_kernel(a[:0], 1, 64, 0, 0, 0, *fp, w, 0, w + 8, 0, none, none, none, 0, 0,
                     w + 16, True, srcs, 0, 0, 0, 1.0, 1.0, 0, 0)
    _two_shot_consume(0, a[:0], 1, 64, srcs, 0, 0, 0, 1.0, 1.0)


def _warm_single_copy():
    words, w, none, srcs, cfg, tab, a, fp = _dummies()
    reduce_from_peers(CMA, none, srcs, 0, a[:0], 0, a, 1, 0, 0, 1.0, 1.0)
    gather_from_peers(CMA, none, 0, none, none, none, none)


_ONE_STEP = "shmcoll's one-step kernel"
_EXCHANGE = "shmcoll's exchange and wait kernels"
_STREAM = "shmcoll's streaming kernels"
_TWO_SHOT = "shmcoll's two-shot kernels"
_SINGLE_COPY = "shmcoll's single-copy kernels"
_KERNEL_SETS = ((_ONE_STEP, _warm_one_step), (_EXCHANGE, _warm_exchange),
                (_STREAM, _warm_stream), (_TWO_SHOT, _warm_two_shot),
                (_SINGLE_COPY, _warm_single_copy))


def warm_up_one_step():
    """The one-step kernel (small collectives), once per process."""
    jit.once(_ONE_STEP, _warm_one_step)


_FP_PAD = [[0] * (FP_WORDS - n) for n in range(FP_WORDS + 1)]
_NO_FP = [0] * FP_WORDS
_NO_BYTES = np.zeros(0, np.uint8)
# Arguments of compiled calls between kernels: numba types a literal int argument as its
# own Literal type and compiles the callee once more for it (0.1-0.2 s each when cold);
# numpy scalars type as plain int64.
_ZERO, _DONE = np.int64(0), np.int64(-1)


@numba.njit(nogil=True, cache=True)
def post_wake(posted_addr, step):
    """Rule 2 and the waker's half of rule 5's sleeper handshake: publish `step` in the
    POSTED word at `posted_addr`, then wake the peers asleep on it, if any (a full fence
    first: acquire/release alone lets the SLEEPERS load pass the store)."""
    store_release(posted_addr, step)
    fence_seq_cst()
    if load_acquire(posted_addr + _SLEEPERS_DELTA) != 0:
        futex_wake(posted_addr)


@numba.njit(nogil=True, cache=True)
def sleep_on(posted_addr, target, timeout_ns):
    """The sleeper's half of rule 5: sleep at most `timeout_ns` unless the POSTED word at
    `posted_addr` (a peer's) reaches `target`; its post wakes us at once."""
    add_seq_cst(posted_addr + _SLEEPERS_DELTA, 1)
    fence_seq_cst()
    seen = load_acquire(posted_addr)
    if seen < target:
        futex_wait(posted_addr, seen, timeout_ns)
    add_seq_cst(posted_addr + _SLEEPERS_DELTA, -1)


@numba.njit(nogil=True, cache=True)
def _exchange_kernel(src, byte_offset, nbytes, dst, fp_addr, f0, f1, f2, f3, f4, f5, f6, f7,
                     seq_addr, seq, posted_addr, step, peer_posted, peer_fp, peer_state,
                     spins, yield_ns, abort_addr, verify, gil_addr, gil_me):
    """Arena.exchange's compiled body: _exchange_steps between _gil_enter / _gil_leave."""
    _gil_enter(gil_addr, gil_me)
    r = _exchange_steps(src, byte_offset, nbytes, dst, fp_addr, f0, f1, f2, f3, f4, f5, f6, f7,
                        seq_addr, seq, posted_addr, step, peer_posted, peer_fp, peer_state,
                        spins, yield_ns, abort_addr, verify)
    _gil_leave(gil_addr, gil_me, r, spins)
    return r


@numba.njit(nogil=True, cache=True)
def _one_step_kernel(mode, src, out, cfg, peer_tab, srcs, plan, pre, post, seq, step, root):
    """Arena.one_step's compiled body: _exchange_steps (copy src into my slot of `srcs`
    unless I am a broadcast's non-root, write fingerprint [seq, step - 1, *plan[:6]], post
    `step`, wait, check), then, when that returned -1, _one_step_consume (reducer
    plan[7], op plan[6]). Returns _exchange_steps' code."""
    rank = cfg[_CFG_RANK]
    spins = cfg[_CFG_SPINS]
    _gil_enter(cfg[_CFG_GIL], cfg[_CFG_GIL_ME])
    k = seq % FP_RING
    nbytes = src.nbytes if root < 0 or root == rank else 0
    r = _exchange_steps(src, _ZERO, nbytes, srcs[rank], cfg[_CFG_FP0] + k * LINE_NBYTES,
                        seq, step - 1, plan[0], plan[1], plan[2], plan[3], plan[4], plan[5],
                        cfg[_CFG_SEQ], seq, cfg[_CFG_POSTED], step, peer_tab[_PEER_POSTED],
                        peer_tab[_PEER_FP0 + k], peer_tab[_PEER_STATE], spins,
                        cfg[_CFG_YIELD_NS], cfg[_CFG_STATE], cfg[_CFG_VERIFY] != 0)
    if r == -1:
        _one_step_consume(mode, src, out, srcs, rank, root, plan[7], plan[6], pre, post)
    _gil_leave(cfg[_CFG_GIL], cfg[_CFG_GIL_ME], r, spins)
    return r


@numba.njit(nogil=True, cache=True)
def _one_step_consume(mode, src, out, srcs, rank, root, fn, op, pre, post):
    """The work after Arena.one_step's wait, per mode (every rank's copy is in its slot
    of `srcs`, at offset 0; `fn` reduces). The same work as _consume's for one sub-chunk,
    written out: calling _consume would compile it into the one-step kernel (~0.15 s more
    for a cold first collective)."""
    nbytes = src.nbytes
    if mode == ONE_STEP_REDUCE:
        if nbytes > 0:  # my own contribution from src: see _consume
            call_reduce(fn, src.ctypes.data, srcs.ctypes.data, srcs.shape[0], 0, rank, nbytes,
                        op, pre, post)
    elif mode == ONE_STEP_GATHER:  # rank j's copy to out[j * nbytes:]; mine from src
        for j in range(srcs.shape[0]):
            copy_bytes(out.ctypes.data + j * nbytes, src.ctypes.data if j == rank else srcs[j],
                       nbytes)
    elif mode == ONE_STEP_REDUCE_SCATTER:  # block `rank` of every rank's slot
        if out.nbytes > 0:
            call_reduce(fn, out.ctypes.data, srcs.ctypes.data, srcs.shape[0], rank * out.nbytes,
                        -1, out.nbytes, op, pre, post)
    elif rank != root:
        copy_bytes(src.ctypes.data, srcs[root], nbytes)


@numba.njit(nogil=True, cache=True)
def _wait_kernel(peer_posted, target, spins, yield_ns, abort_addr, gil_addr, gil_me):
    """Arena.wait_all's compiled wait: atomics.wait_all_ge between _gil_enter / _gil_leave
    (rank threads then take the Python turn on the way out, as after an exchange)."""
    _gil_enter(gil_addr, gil_me)
    r = wait_all_ge(peer_posted, target, spins, yield_ns, abort_addr)
    _gil_leave(gil_addr, gil_me, r, spins)
    return r


@numba.njit(nogil=True, cache=True)
def _gil_enter(turn_addr, me):
    """Rank threads (threaded_pg) only: entering compiled code, so give up the Python turn
    if this thread holds it (see _gil_leave)."""
    if turn_addr != 0 and load_acquire(turn_addr) == me:
        store_release(turn_addr, 0)


@numba.njit(nogil=True, cache=True)
def _gil_leave(turn_addr, me, r, spins):
    """Rank threads only, before returning to Python (which takes the GIL back).

    Ranks that are threads of one process run their Python one at a time under the GIL.
    When a wait completes, typically every rank's does at once, and all of them reach for
    the GIL together: one gets it, the others sleep in CPython's GIL wait and need a futex
    wake-up when it is released (tens of us on a VM whose idle vCPU halted), per rank per
    collective. So the rank threads of a spawn also share a "Python turn" word (0 free,
    else the holder's id): a rank whose wait completed first takes the turn here, spinning
    without the GIL while a peer holds it; the holder gives it up when it next enters
    compiled code (_gil_enter), right after releasing the GIL, so the next rank takes an
    uncontended GIL. Only a heuristic, never a lock: after GIL_LEAVE_NS (a holder blocked
    elsewhere, or busy in long Python) the rank goes on without the turn, and a rank whose
    wait did not complete (r != -1: the Python slow path follows) does not take it.
    """
    if turn_addr == 0 or r != -1:
        return
    until = monotonic_ns() + GIL_LEAVE_NS
    polls = 0
    while True:
        v = load_acquire(turn_addr)
        if v == me or (v == 0 and cas_acq_rel(turn_addr, 0, me)):
            return
        polls += 1
        if (spins == 0 or polls % 64 == 0) and monotonic_ns() >= until:
            return
        if spins:
            cpu_pause()
        else:
            sched_yield()


@numba.njit(nogil=True, cache=True)
def _exchange_steps(src, byte_offset, nbytes, dst, fp_addr, f0, f1, f2, f3, f4, f5, f6, f7,
                    seq_addr, seq, posted_addr, step, peer_posted, peer_fp, peer_state,
                    spins, yield_ns, abort_addr, verify):
    """Copy-in and rules 1-4, nothing else.

    Returns -1 when every peer posted `step` (and, with fp_addr != 0 and `verify`, every
    fingerprint matched and no peer is ABORTED); -3 on a fingerprint mismatch, -4 on an aborted peer;
    else wait_all_ge's code (a peer still missing after the fast tiers, or -2: aborted).
    """
    if nbytes > 0:
        copy_bytes(dst, src.ctypes.data + byte_offset, nbytes)
    if fp_addr != 0:  # rule 1: plain stores, published by the release store below
        store_release(fp_addr, f0)
        store_release(fp_addr + 8, f1)
        store_release(fp_addr + 16, f2)
        store_release(fp_addr + 24, f3)
        store_release(fp_addr + 32, f4)
        store_release(fp_addr + 40, f5)
        store_release(fp_addr + 48, f6)
        store_release(fp_addr + 56, f7)
        store_release(seq_addr, seq)
    post_wake(posted_addr, step)  # rule 2
    r = wait_all_ge(peer_posted, step, spins, yield_ns, abort_addr)  # rule 3
    if r != -1 or fp_addr == 0 or not verify:
        return r
    for k in range(peer_fp.shape[0]):  # rule 4
        a = peer_fp[k]
        if (load_acquire(a) != f0 or load_acquire(a + 8) != f1
                or load_acquire(a + 16) != f2 or load_acquire(a + 24) != f3
                or load_acquire(a + 32) != f4 or load_acquire(a + 40) != f5
                or load_acquire(a + 48) != f6 or load_acquire(a + 56) != f7):
            return -3
    for k in range(peer_state.shape[0]):
        if load_acquire(peer_state[k]) == STATE_ABORTED:
            return -4
    return -1


@numba.njit(nogil=True, cache=True)
def _stream_kernel(mode, src, byte_offset, nbytes, sub, k0, dst, fp_addr, f0, f1, f2, f3, f4,
                   f5, f6, f7, seq_addr, seq, posted_addr, step0, peer_posted, peer_fp,
                   peer_state, spins, yield_ns, abort_addr, verify, srcs, rank, fn, op, pre,
                   post, out, gil_addr, gil_me):
    """Arena._stream's body from sub-chunk k0 on: for each sub-chunk k, the
    _exchange_kernel steps (posting step0 + k + 1; the fingerprint with sub-chunk 0), then
    _consume. Returns (k, code): (count, -1) when all are done, else the sub-chunk whose
    wait did not complete cleanly (posted, not consumed) and the wait code."""
    nsub = max(1, (nbytes + sub - 1) // sub)
    _gil_enter(gil_addr, gil_me)
    for k in range(k0, nsub):
        off = k * sub
        ring = k % STREAM_RING * sub  # the sub-slot (see Arena._stream)
        m = min(sub, nbytes - off)
        r = _exchange_steps(src, byte_offset + off, m, dst + ring, fp_addr if k == 0 else 0,
                            f0, f1, f2, f3, f4, f5, f6, f7, seq_addr, seq, posted_addr,
                            step0 + k + 1, peer_posted, peer_fp, peer_state, spins, yield_ns,
                            abort_addr, verify)
        if r != -1:
            _gil_leave(gil_addr, gil_me, r, spins)
            return k, r
        _consume(mode, src, byte_offset + off, m, srcs, ring, rank, fn, op, pre, post, out, off,
                 nbytes)
    _gil_leave(gil_addr, gil_me, _DONE, spins)
    return nsub, -1


@numba.njit(nogil=True, cache=True)
def _two_shot_kernel(buf, size, sub, p0, dst, fp_addr, f0, f1, f2, f3, f4, f5, f6, f7,
                     seq_addr, seq, posted_addr, step0, peer_posted, peer_fp, peer_state,
                     spins, yield_ns, abort_addr, verify, srcs, rank, fn, op, pre, post,
                     gil_addr, gil_me):
    """Arena.exchange_reduce_two_shot's body from step p0 on: step 2k copies sub-chunk k
    into its sub-slot (with the fingerprint at step 0), step 2k + 1 only posts; each step
    waits for every peer, then _two_shot_consume. Returns (count, -1) when all are done,
    else the step whose wait did not complete cleanly (posted, not consumed) and the code."""
    nbytes = buf.nbytes
    nphase = 2 * max(1, (nbytes + sub - 1) // sub)
    _gil_enter(gil_addr, gil_me)
    for p in range(p0, nphase):
        k = p // 2
        off = k * sub
        m = min(sub, nbytes - off) if p % 2 == 0 else 0
        r = _exchange_steps(buf, off, m, dst + k % STREAM_RING * sub, fp_addr if p == 0 else 0,
                            f0, f1, f2, f3, f4, f5, f6, f7, seq_addr, seq, posted_addr,
                            step0 + p + 1, peer_posted, peer_fp, peer_state, spins, yield_ns,
                            abort_addr, verify)
        if r != -1:
            _gil_leave(gil_addr, gil_me, r, spins)
            return p, r
        _two_shot_consume(p, buf, size, sub, srcs, rank, fn, op, pre, post)
    _gil_leave(gil_addr, gil_me, _DONE, spins)
    return nphase, -1


@numba.njit(nogil=True, cache=True)
def _two_shot_consume(p, buf, size, sub, srcs, rank, fn, op, pre, post):
    """The work after step p's wait (`buf`: bytes of `size`-byte elements). Even step
    (sub-chunk k = p // 2 in every sub-slot): reduce my slice of it, in rank order, into
    buf -- my own contribution read from buf, still in cache from the copy-in -- and
    publish the result in my sub-slot. Odd step: copy every peer's reduced slice from its
    sub-slot into buf."""
    k = p // 2
    off = k * sub
    ring = k % STREAM_RING * sub
    n = min(sub, buf.nbytes - off) // size
    base = off // size
    world = srcs.shape[0]
    if p % 2 == 0:
        lo, hi = n * rank // world, n * (rank + 1) // world
        if hi > lo:
            out = buf.ctypes.data + (base + lo) * size
            call_reduce(fn, out, srcs.ctypes.data, world, ring + lo * size, rank,
                        (hi - lo) * size, op, pre, post)
            copy_bytes(srcs[rank] + ring + lo * size, out, (hi - lo) * size)
        return
    for j in range(world):
        lo, hi = n * j // world, n * (j + 1) // world
        if j != rank and hi > lo:
            copy_bytes(buf.ctypes.data + (base + lo) * size, srcs[j] + ring + lo * size,
                       (hi - lo) * size)


@numba.njit(nogil=True, cache=True)
def _consume(mode, src, byte_offset, nbytes, srcs, ring, rank, fn, op, pre, post, out,
             out_offset, stride):
    """Use every rank's copy of one sub-chunk (at srcs[j] + ring: their sub-slots, mine
    included). STREAM_REDUCE: src[chunk] = the reduction (reducer `fn`) of every rank's
    copy, in rank order, reading my own contribution from src itself rather than from my
    sub-slot: the same bytes (I copied them there), but still in cache from the copy-in,
    so only the peers' sub-slots cost a cross-core transfer (one read less per byte from
    memory for large messages). STREAM_GATHER: rank j's copy goes to
    out[j * stride + out_offset:][:nbytes]; mine straight from src, for the same reason."""
    if mode == STREAM_REDUCE:
        if nbytes > 0:
            call_reduce(fn, src.ctypes.data + byte_offset, srcs.ctypes.data, srcs.shape[0],
                        ring, rank, nbytes, op, pre, post)
        return
    base = out.ctypes.data + out_offset
    for j in range(srcs.shape[0]):
        if j == rank:
            copy_bytes(base + j * stride, src.ctypes.data + byte_offset, nbytes)
        else:
            copy_bytes(base + j * stride, srcs[j] + ring, nbytes)
