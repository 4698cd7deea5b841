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
           |           and, in its next word, 1 + the CPU it last posted  |
           |           from (the waiters' spin tier: atomics.wait_all_ge) |
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
   to the peer's SLEEPERS and fences, re-reads POSTED and sleeps only if it is still below
   the target (the kernel re-checks that value atomically), then subtracts 1; every post
   is store_release(POSTED), a full fence, and a futex wake if SLEEPERS is non-zero. The
   fences on both sides make at least one side see the other's store, so a sleeper is
   never missed. A STATE change (abort, close) wakes the sleepers on every POSTED word of
   the group, so only a peer that dies is seen no sooner than the sleep's bound.
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
notification), read on the slow path and once per collective at the fingerprint check.
Peers' regions are input, not truth: the header is validated on attach (shm.py) and
fingerprints are compared, never used as lengths.

Where the code is: this module holds the Arena (framing, slots, post/wait, the compiled
drivers, single copy, lifecycle: one class in sections, over its views and addresses of the
regions) and re-exports the names of the others: protocol/layout.py (the numbers of the
layout above and of the compiled steps, RegionLayout, the header), protocol/kernels.py (the
steps as compiled kernels, and the kernel sets that load them on first use; reached through
compiled.py when first needed, so that importing this module and making an Arena import no
numba; its names are not re-exported), protocol/steps.py (the Arena's
bookkeeping, each in an object that alone writes it: StepClock, the steps and slots of
rules 2, 3 and 6; Frame, the collective in progress: seq, name, deadline, fingerprint) and
protocol/waits.py (PeerWatch: the wait tiers, the Python slow wait of rule 5 and every
error; it writes nothing and returns the fingerprint check's verdict).
"""

import time

import numpy as np

from ..native import jit
from . import compiled
from ..errors import CollectiveMismatchError, ShmcollError
from .layout import (  # noqa: F401  (re-exported: shm.py, p2p.py, threaded_pg, cuda_ipc)
    _CFG_VERIFY,
    _EXCHANGE,
    _PEER_PID,
    _NO_BYTES,
    _SINGLE_COPY,
    _STREAM,
    _TWO_SHOT,
    A2A_PLAN_SLOT,
    A2A_TABLE_WORDS,
    GIL_LEAVE_NS,
    ONE_STEP_ALL_TO_ALL,
    ONE_STEP_BROADCAST,
    ONE_STEP_CLOSE,
    ONE_STEP_GATHER,
    ONE_STEP_NOT_CONSUMED,
    ONE_STEP_REDUCE,
    ONE_STEP_REDUCE_SCATTER,
    a2a_head_nbytes,
    STREAM_BROADCAST,
    STREAM_GATHER,
    STREAM_REDUCE,
    STREAM_RING,
    _BUF_ADDR,
    _BUF_NBYTES,
    CTRL_LINES,
    DATA_ALIGN,
    FP_LINE0,
    FP_RING,
    FP_WORDS,
    HEADER_NBYTES,
    HEADER_PROBE_NBYTES,
    LAYOUT_VERSION,
    LINE_NBYTES,
    LINE_WORDS,
    MAGIC,
    STATE_ABORTED,
    STATE_CLOSED,
    STATE_LIVE,
    W_BUF,
    W_POSTED,
    W_SEQ,
    W_SLEEPERS,
    W_STATE,
    RegionLayout,
    _header_pid,
    read_header,
    write_header,
)
from .steps import Frame, StepClock
from .waits import (  # noqa: F401  (re-exported: p2p.py, shm_group.py)
    SLEEP_MAX_S,
    SLEEP_MIN_S,
    SLOW_YIELD_NS,
    SPIN_NS,
    YIELD_NS,
    PeerWatch,
)
from ..native.single_copy import CMA, NONE, PIECE_NBYTES

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
    "ONE_STEP_ALL_TO_ALL",
    "A2A_TABLE_WORDS",
    "a2a_head_nbytes",
]

_NO_FP = [0] * FP_WORDS


class Arena:
    """The seam algorithms talk to: slot views, post/wait, fingerprints, deadlines.

    `regions[r]` is rank r's region as a uint8 array (all mapped in this address space).
    `is_alive(peer)` reports whether the peer's process/thread still runs; `describe(fp)`
    renders a fingerprint tuple for error messages. `gil_turn` (rank threads of one
    process only) = (address of their shared "Python turn" word, this thread's non-zero id
    in it): see _gil_leave. `single_copy` (single_copy.NONE / IN_PROCESS / CMA): how a
    peer's user buffer can be read where it lies (exchange_buffer, reduce_peers,
    gather_peers); NONE: only through the slots. `load_kernels`: load (or compile) the
    atomics and the one-step kernel now; False: the owner does it before the first
    collective (new_shm_group: Group's kernel gate, warmup.ensure). Not thread-safe: the
    owning group runs one collective at a time.

    Its state: the views and addresses of the regions (set here, never changed), the
    rule-4 switch and the single-copy scratch. Its collaborators own the rest
    (protocol/steps.py, protocol/waits.py): `_clock` (StepClock: my step, what every peer
    posted, the slot rotation), `frame` (Frame: the collective in progress; read by
    cuda_ipc) and `_watch` (PeerWatch: the slow wait and the errors).
    """

    # -- state -----------------------------------------------------------------------------

    def __init__(self, regions, rank, layout, is_alive, describe=None, oversubscribed=False,
                 pids=None, gil_turn=None, single_copy=NONE, yield_ns=YIELD_NS,
                 load_kernels=True):
        if load_kernels:  # under the compile lock before any first use (cheap when done)
            compiled.atomics.warm_up()
            compiled.protocol_kernels.warm_up_one_step()
        self.rank = rank
        self.world_size = len(regions)
        self.layout = layout
        self.slot_nbytes = layout.slot_nbytes
        self.nslots = layout.nslots
        self._regions = regions
        self._is_alive = is_alive
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
        peers = [p for p in range(self.world_size) if p != rank]
        self._peer_posted = np.array(
            [ctrl[p].ctypes.data + W_POSTED * LINE_WORDS * 8 for p in peers], np.int64)
        self._posted_addrs = [c.ctypes.data + W_POSTED * LINE_WORDS * 8 for c in ctrl]
        state_addrs = [c.ctypes.data + W_STATE * LINE_WORDS * 8 for c in ctrl]
        seq_addrs = [c.ctypes.data + W_SEQ * LINE_WORDS * 8 for c in ctrl]
        self._peer_state = np.array(
            [ctrl[p].ctypes.data + W_STATE * LINE_WORDS * 8 for p in peers], np.int64)
        self._seq_addr = seq_addrs[rank]
        fp_line = [[c.ctypes.data + (FP_LINE0 + k) * LINE_NBYTES for c in ctrl]
                   for k in range(FP_RING)]
        self._fp_addrs = [line[rank] for line in fp_line]
        self._peer_fp_addrs = [np.array([line[p] for p in peers], np.int64)
                               for line in fp_line]
        # _slots[i][r]: rank r's slot i as uint8; _slot_addrs[i]: int64 addresses of slot i.
        self._slots = [
            [reg[layout.data_offset + i * layout.slot_nbytes:
                 layout.data_offset + (i + 1) * layout.slot_nbytes] for reg in regions]
            for i in range(layout.nslots)]
        self._slot_addrs = [np.array([s.ctypes.data for s in row], np.int64) for row in self._slots]
        self._slot_addr_mine = [int(a[rank]) for a in self._slot_addrs]
        # mine: only I write my POSTED, so my clock starts where it stands
        self._clock = StepClock(int(self._mine[W_POSTED * LINE_WORDS]), layout.nslots)
        self.frame = Frame()  # the collective in progress
        self._watch = PeerWatch(rank, ctrl, self._peer_posted, self._posted_addrs,
                                state_addrs, seq_addrs, self._pids, is_alive,
                                describe or (lambda fp: repr(fp)))
        self._spin_ns = 0 if oversubscribed else SPIN_NS
        self._yield_ns = yield_ns  # the yield tier (a shorter one: shm_group.new_shm_group)
        # Ranks that are threads of one process: (address of their "Python turn" word, my
        # id in it); see _gil_leave. (0, 0): no turn-taking (ranks that are processes).
        self._gil_addr, self._gil_me = gil_turn if gil_turn is not None else (0, 0)
        self.threads = gil_turn is not None  # ranks are threads of this process
        # The constants of the one-step kernel (_one_step_kernel), one array so that
        # the compiled call takes few arguments (each costs ~50 ns of dispatch): my words'
        # addresses, wait tiers, GIL turn, rule-4 switch; and one row per kind of peer word.
        self._cfg = np.array([rank, self._spin_ns, yield_ns, self._posted_addr, self._state_addr,
                              self._seq_addr, self._gil_addr, self._gil_me, 1,
                              self._fp_addrs[0], single_copy], np.int64)
        peer_pids = [self._pid_arr[p] for p in range(self.world_size) if p != rank]
        self._peer_tab = np.array([self._peer_posted, self._peer_state]
                                  + self._peer_fp_addrs + [peer_pids], np.int64).reshape(
                                      _PEER_PID + 1, self.world_size - 1)
        self._verify = True

    @property
    def verify(self):
        """Rule 4 (fingerprint check) on; False only lets a benchmark measure its cost."""
        return self._verify

    @verify.setter
    def verify(self, on):
        self._verify = bool(on)
        self._cfg[_CFG_VERIFY] = int(self._verify)

    @property
    def step(self):
        """My last posted step."""
        return self._clock.step

    @property
    def pids(self):
        """Each rank's process id, by rank, as its region's header says (a copy)."""
        return list(self._pids)

    # -- collective framing ------------------------------------------------------------

    def begin(self, seq, op_name, fp, timeout_s):
        """Open collective `seq`: record its fingerprint (ints) and its deadline.

        The fingerprint reaches shared memory with the collective's first post (post() or
        exchange()), which is all rule 1 needs: peers read it only after that post.
        """
        clock = self._clock
        self.frame.open(seq, op_name, fp, timeout_s, clock.step, clock.next_slot)

    def _write_fp(self):
        frame = self.frame
        line = (FP_LINE0 + frame.seq % FP_RING) * LINE_WORDS
        self._mine[line:line + FP_WORDS] = frame.fp
        self._mine[W_SEQ * LINE_WORDS] = frame.seq
        frame.written()

    def _fp_args(self):
        """(fingerprint words, my FP line address, peers' FP line addresses) for a kernel:
        address 0 once the fingerprint is out (the kernel then neither writes nor checks)."""
        frame = self.frame
        if frame.unwritten:
            k = frame.seq % FP_RING
            return frame.fp, self._fp_addrs[k], self._peer_fp_addrs[k]
        return _NO_FP, 0, self._peer_fp_addrs[0]

    def _check_fingerprints(self):
        """Rule 4 (PeerWatch gives the verdict): raise on a mismatch -- after undoing this
        collective's slot rotation, so that the group stays usable -- or on a peer that
        aborted at or before this collective."""
        frame = self.frame
        frame.checked()
        if not self._verify:
            return
        error = self._watch.fingerprint_verdict(frame)
        if error is not None:
            if type(error) is CollectiveMismatchError:
                self._clock.rewind(frame.slot_at_begin)
            raise error

    # -- slots ---------------------------------------------------------------------------

    def next_slot(self):
        """Index of the slot the next chunk uses (same rotation on every rank)."""
        return self._clock.take_slot()

    def claim(self, i):
        """My slot i as uint8, after every peer has finished reading its previous contents."""
        self.wait_all(self._clock.free_at[i])
        return self._slots[i][self.rank]

    def slot(self, i, rank):
        """Rank `rank`'s slot i (uint8 view). Read peers' slots only after a wait."""
        return self._slots[i][rank]

    def slot_addrs(self, i):
        """int64 addresses of slot i of ranks 0..world_size-1 (for kernels.reduce_into)."""
        return self._slot_addrs[i]

    def sub_nbytes(self, itemsize, want):
        """Sub-chunk size for the STREAM_RING sub-slots of a slot: at most `want` bytes and
        a sub-slot, whole elements, at least one."""
        sub = max(itemsize, min(want, self.slot_nbytes // STREAM_RING))
        return sub - sub % itemsize

    # -- post / wait -----------------------------------------------------------------------

    def post(self, published_slot=None):
        """Publish everything written so far; returns the new step value.

        NOTE: order matters: data and fingerprint stores precede this release store, so a
        peer that observes the new value also observes them.
        """
        if self.frame.unwritten:
            self._write_fp()
        clock = self._clock
        step = clock.step + 1
        clock.posted(step, published_slot)
        compiled.protocol_kernels.post_wake(self._posted_addr, step)
        return step

    def exchange(self, i=None, src=None, byte_offset=0, nbytes=0):
        """Copy `nbytes` of 1-D array `src` from `byte_offset` into my slot i (claimed),
        post, and wait for every peer to post too: post(i) + wait_all() in one compiled
        call. Without a slot (i None) it is post() + wait_all(): nothing is published.

        On the first post of a collective the kernel also writes the fingerprint and checks
        the peers' (rule 4); anything but a clean pass (a slow peer, a mismatch, an abort)
        is finished by the Python code of wait_all, which owns the slow path and the errors.
        """
        pk = compiled.protocol_kernels
        jit.once(_EXCHANGE, pk._warm_exchange)
        if i is None:
            src, dst, nbytes = _NO_BYTES, 0, 0
        else:
            src, dst = src.view(np.uint8), self._slot_addr_mine[i]  # kernels move bytes
        fp, fp_addr, peer_fp = self._fp_args()
        clock = self._clock
        step = clock.step + 1
        r = pk._exchange_kernel(src, byte_offset, nbytes, dst, fp_addr,
                                fp[0], fp[1], fp[2], fp[3], fp[4], fp[5], fp[6], fp[7],
                                self._seq_addr, self.frame.seq, self._posted_addr, step,
                                self._peer_posted, peer_fp, self._peer_state, self._spin_ns,
                                self._yield_ns, self._state_addr, self._verify, self._gil_addr,
                                self._gil_me)
        clock.posted(step, i)
        if fp_addr:
            self.frame.written()
        self._finish_wait(step, r, fp_addr != 0)

    def _finish_wait(self, step, r, checked):
        """After a kernel posted `step` and returned wait code r (checked: it compared the
        fingerprints): slow-wait if peers are missing, then raise what the kernel saw."""
        if r == -1:  # everyone arrived, fingerprints (if checked) match, nobody aborted
            self._clock.arrived(step)
            if checked:
                self.frame.checked()
            return
        if r >= 0 or r == -2:  # not all there within the fast tiers, or my abort word
            self._watch.wait(step, r, self.frame)
        self._clock.arrived(step)
        if self.frame.pending:
            self._check_fingerprints()  # raises on the mismatch/abort the kernel saw

    def wait_all(self, target=None):
        """Wait until every peer has posted >= target (default: my own step)."""
        clock = self._clock
        if target is None:
            target = clock.step
        if clock.known_min < target:
            pk = compiled.protocol_kernels
            jit.once(_EXCHANGE, pk._warm_exchange)
            r = pk._wait_kernel(self._peer_posted, target, self._spin_ns, self._yield_ns,
                                self._state_addr, self._gil_addr, self._gil_me)
            if r != -1:
                self._watch.wait(target, r, self.frame)
            clock.arrived(target)
        frame = self.frame
        if frame.pending and target > frame.begin_step:
            # the first wait after this collective's first post: peers' fingerprints for
            # this seq are published (claim() waits before that post do not qualify)
            self._check_fingerprints()

    # -- compiled drivers --------------------------------------------------------------------

    def exchange_reduce(self, i, buf, start, n, spec, sub_nbytes):
        """buf[start:start + n] = the reduction (ops.ReduceSpec `spec`) of every rank's
        buf[start:start + n], in rank order, through my slot i (claimed): the one-shot
        all_reduce as one compiled call when nobody is late (see _stream)."""
        size = buf.itemsize
        self._stream(i, STREAM_REDUCE, buf.view(np.uint8), size, start * size, n * size,
                     sub_nbytes, spec, _NO_BYTES)

    def exchange_broadcast(self, i, buf, root, sub_nbytes):
        """buf (uint8) = rank `root`'s buf, through the root's slot i (every rank claims
        its slot i; only the root's is written), streamed like exchange_reduce: the root
        copies sub-chunk k + 1 in while the others copy sub-chunk k out of its sub-slot."""
        self._stream(i, STREAM_BROADCAST, buf, 1, 0, buf.size, sub_nbytes, None, _NO_BYTES,
                     root)

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
        ONE_STEP_ALL_TO_ALL: step 1 of all_to_all_direct where my messages (the pieces of
            `src`, in rank order, sizes in the plan) ride with the table; when every rank's
            table agrees and every rank's messages rode, rank j's message to me lands in
            `out` (pieces in rank order). With slot bytes 0 in the plan (all_to_all_read),
            the table carries my pieces' addresses instead, and when every rank's messages
            are to be read, the kernel reads mine from the peers' buffers and one_step
            closes with one more step (exchange: nobody returns while a peer still reads
            its buffer). Otherwise the work after the wait is the caller's: one_step
            returns slot i, as the general path left it after step 1
            (algorithms.all_to_all_finish).

        `plan`: int64 [collective code, dtype code, count, root, op, shape word, kernel op,
        reducer] (fingerprint words 2-7, then the reduction: ops.ReduceSpec's op and fn);
        ONE_STEP_ALL_TO_ALL's goes on: [slot bytes, my N send sizes, my N receive sizes]
        (layout.A2A_PLAN_*); pre/post as in ops.ReduceSpec. `src` and `out` are uint8 arrays.
        Anything but a clean pass (a late peer, a mismatch, an abort) is finished by the same
        Python as the general path (_finish_wait), which owns the slow tiers and errors.
        Returns None when the collective is done, else the slot of its step 1 (above).

        The kernel frames the collective itself (its seq and fingerprint go straight to
        shared memory), so the Frame is opened only where Python takes over: a slot to
        wait for, or a clean pass that did not come (one method call less per collective
        on the latency path; nothing reads the frame between collectives).
        """
        if out is None:  # all_reduce, broadcast: typed like the gathers' for one compilation
            out = _NO_BYTES
        deadline = time.monotonic() + timeout_s
        clock = self._clock
        i = clock.next_slot
        publishes = root < 0 or root == self.rank  # broadcast: only the root fills a slot
        if publishes and clock.known_min < clock.free_at[i]:  # rare: a peer may still read it
            self.frame.open_compiled(seq, op_name, timeout_s, deadline)
            self.wait_all(clock.free_at[i])
        step = clock.step + 1
        srcs = self._slot_addrs[i]
        pk = compiled.protocol_kernels
        r = pk._one_step_kernel(mode, src, out, self._cfg, self._peer_tab, srcs, plan, pre,
                                post, seq, step, root)
        if r == -1:
            clock.one_step(i, step, publishes, True)
            return None
        return self.one_step_resume(seq, op_name, mode, plan, pre, post, src, out, root,
                                    timeout_s, deadline, i, step, publishes, r)

    def one_step_resume(self, seq, op_name, mode, plan, pre, post, src, out, root, timeout_s,
                        deadline, i, step, publishes, r):
        """The rest of one_step after its kernel returned `r` (not -1) for collective `seq`
        through slot i, posting `step` (publishing slot i when `publishes`); also where a
        lane (torch_backend/_lane.c: the kernel called from C) hands such a call back.
        Returns what one_step returns."""
        if out is None:
            out = _NO_BYTES
        clean = r == ONE_STEP_NOT_CONSUMED or r == ONE_STEP_CLOSE
        self._clock.one_step(i, step, publishes, clean)
        # The kernel posted (with the fingerprint) but did not finish: the general path's
        # state for this collective, as begin() would have left it, then its slow wait.
        self.frame.reopen(seq, op_name, timeout_s, deadline,
                          [seq, step - 1, *plan[:FP_WORDS - 2].tolist()], step - 1, i)
        if clean:
            self._finish_wait(step, -1, True)
            if r == ONE_STEP_CLOSE:  # all_to_all's reads of the peers' buffers are done:
                self.exchange()      # nobody returns while a peer still reads its buffers
                return None
            return i
        self._finish_wait(step, r, True)
        r = compiled.protocol_kernels._one_step_consume(mode, src, out, self._slot_addrs[i],
                                                        self.rank, root, plan, pre, post)
        return None if r == -1 else i

    def lane_constants(self):
        """What a lane's C calls of the one-step kernel take from this arena, fixed for its
        life: (cfg, peer table, slot address arrays, clock); the arrays stay referenced by
        the arena (and by the lane) while it is open. A lane does what one_step does
        around its kernel: it reads the clock, and records a clean pass with
        `clock.one_step(i, step, publishes, True)`; any other pass it hands back to
        one_step_resume."""
        return self._cfg, self._peer_tab, self._slot_addrs, self._clock

    @staticmethod
    def lane_entry():
        """The address of the one-step kernel's C entry (kernels.one_step_entry)."""
        return compiled.protocol_kernels.one_step_entry()

    def exchange_gather(self, i, inp, out, sub_nbytes):
        """out[j * inp.size: (j + 1) * inp.size] = rank j's `inp`, for every rank j (uint8
        arrays; all_gather into one buffer), through my slot i (claimed), streamed like
        exchange_reduce: my own bytes are copied from `inp` (still in cache from the
        copy-in), each peer's from its sub-slot."""
        self._stream(i, STREAM_GATHER, inp, 1, 0, inp.size, sub_nbytes, None, out, -1)

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
        pk = compiled.protocol_kernels
        jit.once(_TWO_SHOT, pk._warm_two_shot)
        nbytes, size = buf.nbytes, buf.itemsize
        sub = self.sub_nbytes(size, self.slot_nbytes)
        nphase = 2 * max(1, -(-nbytes // sub))
        step0 = self._clock.step
        self._clock.hold(i, step0 + nphase + 1)
        srcs, dst = self._slot_addrs[i], self._slot_addr_mine[i]
        buf = buf.view(np.uint8)  # kernels move bytes; the reducer knows the dtype
        fn, op, pre, post = spec.fn, spec.op, spec.pre, spec.post
        p = 0
        while True:
            fp, fp_addr, peer_fp = self._fp_args()
            done, r = pk._two_shot_kernel(
                buf, size, sub, p, dst, fp_addr, fp[0], fp[1], fp[2], fp[3], fp[4], fp[5],
                fp[6], fp[7], self._seq_addr, self.frame.seq, self._posted_addr, step0,
                self._peer_posted, peer_fp, self._peer_state, self._spin_ns, self._yield_ns,
                self._state_addr, self._verify, srcs, self.rank, fn, op, pre, post,
                self._gil_addr, self._gil_me)
            if fp_addr:
                self.frame.written()
            if self._settle(step0, nphase, done, r, fp_addr):
                return
            pk._two_shot_consume(done, buf, size, sub, srcs, self.rank, fn, op, pre, post)
            p = done + 1
            if p >= nphase:
                self._clock.posted(step0 + nphase)
                return

    def _stream(self, i, mode, src, itemsize, byte_offset, nbytes, sub_nbytes, spec, out,
                root=-1):
        """One collective's data through slot i in sub-chunks, one step each: copy the
        sub-chunk in, post, wait for every peer, then consume every rank's copy of it
        (mode STREAM_REDUCE: reduce into src with ops.ReduceSpec `spec`; STREAM_GATHER:
        copy into out; STREAM_BROADCAST: rank `root` copies in, the others copy its copy
        out into src), `src` and `out` being bytes of `itemsize`-byte elements, all in one
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
        pk = compiled.protocol_kernels
        jit.once(_STREAM, pk._warm_stream)
        sub = self.sub_nbytes(itemsize, sub_nbytes)
        nsub = max(1, -(-nbytes // sub))
        step0 = self._clock.step
        self._clock.hold(i, step0 + nsub + 1)
        srcs, dst = self._slot_addrs[i], self._slot_addr_mine[i]
        fn, op, pre, post = (0, 0, 1.0, 1.0) if spec is None else \
            (spec.fn, spec.op, spec.pre, spec.post)
        k = 0
        while True:
            fp, fp_addr, peer_fp = self._fp_args()
            done, r = pk._stream_kernel(
                mode, src, byte_offset, nbytes, sub, k, dst, fp_addr,
                fp[0], fp[1], fp[2], fp[3], fp[4], fp[5], fp[6], fp[7],
                self._seq_addr, self.frame.seq, self._posted_addr, step0, self._peer_posted,
                peer_fp, self._peer_state, self._spin_ns, self._yield_ns, self._state_addr,
                self._verify, srcs, self.rank, root, fn, op, pre, post, out, self._gil_addr,
                self._gil_me)
            if fp_addr:
                self.frame.written()
            if self._settle(step0, nsub, done, r, fp_addr):
                return
            pk._consume(mode, src, byte_offset + done * sub, min(sub, nbytes - done * sub),
                        srcs, done % STREAM_RING * sub, self.rank, root, fn, op, pre, post,
                        out, done * sub, nbytes)
            k = done + 1
            if k >= nsub:
                self._clock.posted(step0 + nsub)
                return

    def exchange_all_to_all(self, i, ins, sends, outs, recvs, ring0, sub, nsub):
        """all_to_all's pieces after its table step, streamed through slot i (the table
        step's: its first ring0 bytes, the table, stay for the peers to read): step k
        carries bytes [k * sub, (k + 1) * sub) of every piece, packed by receiver into a
        ring of STREAM_RING sub-slots of world_size x sub bytes, so that each is read from
        the writer's cache, as in _stream. `ins` / `outs`: int64 addresses of my pieces
        (sends[d] / recvs[j] bytes, in my address space); nsub: the group's longest piece
        over sub (the same on every rank: from the table)."""
        pk = compiled.protocol_kernels
        jit.once(_STREAM, pk._warm_stream)
        step0 = self._clock.step
        self._clock.hold(i, step0 + nsub + 1)
        srcs, dst = self._slot_addrs[i], self._slot_addr_mine[i]
        _, _, peer_fp = self._fp_args()
        k = 0
        while True:
            done, r = pk._a2a_stream_kernel(
                ins, sends, outs, recvs, sub, nsub, k, dst, ring0, self._seq_addr,
                self.frame.seq, self._posted_addr, step0, self._peer_posted, peer_fp,
                self._peer_state, self._spin_ns, self._yield_ns, self._state_addr, srcs,
                self.rank, self._gil_addr, self._gil_me, _NO_BYTES)
            if self._settle(step0, nsub, done, r, 0):
                return
            pk._a2a_stream_consume(done, ins, outs, recvs, sub, srcs, ring0, self.rank)
            k = done + 1
            if k >= nsub:
                self._clock.posted(step0 + nsub)
                return

    def _settle(self, step0, nsteps, done, r, fp_addr):
        """After a multi-step kernel (_stream, exchange_reduce_two_shot) returned (done, r):
        True when all `nsteps` steps were exchanged and consumed (r == -1). Else step
        `done` is posted but not every peer has posted it: finish that wait in Python
        (slow tiers, errors) and return False; the caller then does that step's work and
        resumes the kernel after it. The kernel wrote and checked the fingerprint at step 0."""
        if r == -1:
            self._clock.reached(step0 + nsteps)
            if fp_addr:
                self.frame.checked()
            return True
        step = step0 + done + 1
        self._clock.posted(step)
        self._finish_wait(step, r, fp_addr != 0 and done == 0)
        if fp_addr and done > 0:
            self.frame.checked()
        return False

    # -- single copy (see single_copy.py) --------------------------------------------------

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
                    f"{self.frame.name} (seq {self.frame.seq}): rank {p} published a buffer of "
                    f"{int(c[_BUF_NBYTES])} bytes, rank {self.rank} one of {arr.nbytes} (a "
                    f"corrupt control block?)")
            addrs[p] = c[_BUF_ADDR]
        return addrs

    def reduce_peers(self, addrs, out, offset, spec):
        """out[i] = the reduction (ops.ReduceSpec) in rank order of every rank's element
        at addrs[p] + offset + i * itemsize (addrs from exchange_buffer; mine may be `out`
        itself)."""
        jit.once(_SINGLE_COPY, compiled.protocol_kernels._warm_single_copy)
        piece = max(1, PIECE_NBYTES // out.itemsize) * out.itemsize
        scratch = self._scratch_for(piece)
        peer, err = compiled.single_copy.reduce_from_peers(
            self.single_copy, self._pid_arr, addrs, self.rank, out.view(np.uint8), offset,
            scratch, piece, spec.fn, spec.op, spec.pre, spec.post)
        if peer >= 0:
            raise self._watch.read_error(peer, err, self.frame)

    def gather_peers(self, peers, remote, local, nbytes):
        """Copy nbytes[k] bytes at remote[k] in rank peers[k]'s address space to local[k]
        (int64 arrays; the ranges were published with exchange_buffer)."""
        jit.once(_SINGLE_COPY, compiled.protocol_kernels._warm_single_copy)
        peer, err = compiled.single_copy.gather_from_peers(
            self.single_copy, self._pid_arr, self.rank, peers, remote, local, nbytes)
        if peer >= 0:
            raise self._watch.read_error(peer, err, self.frame)

    def _scratch_for(self, piece_nbytes):
        need = piece_nbytes * max(1, self.world_size - 1) if self.single_copy == CMA else 64
        if self._scratch is None or self._scratch.nbytes < need:
            raw = np.empty(need + 4096, np.uint8)
            start = -raw.ctypes.data % 4096
            self._scratch = raw[start:start + need]
        return self._scratch

    # -- lifecycle -------------------------------------------------------------------------

    def peer_states(self):
        """(rank, posted, seq, state) of every rank, for diagnostics."""
        return [(r, int(c[W_POSTED * LINE_WORDS]), int(c[W_SEQ * LINE_WORDS]),
                 int(c[W_STATE * LINE_WORDS])) for r, c in enumerate(self._ctrl)]

    def set_state(self, state):
        """Announce abort/close to peers (and wake my own waiter on abort)."""
        atomics = compiled.atomics
        atomics.warm_up()  # a group may close (or abort) before its first call loaded them
        atomics.write_release(self._state_addr, state)
        self._wake_sleepers()

    def abort_at(self, seq):
        """Announce that I failed collective `seq`: SEQ first, then STATE = ABORTED, so a
        peer that reads ABORTED also sees which collective failed (rule 4). A failure before
        the collective's first post would otherwise leave SEQ at the previous one."""
        atomics = compiled.atomics
        atomics.warm_up()
        atomics.write_release(self._seq_addr, seq)
        atomics.write_release(self._state_addr, STATE_ABORTED)
        self._wake_sleepers()

    def _wake_sleepers(self):
        """After a STATE change (rule 5): wake the peers asleep on my POSTED, so they see it
        now, and whoever sleeps on a peer's (my own waiter among them, when another thread
        aborts): a sleeper woken for nothing re-checks and sleeps again."""
        wake_sleepers = compiled.atomics.wake_sleepers
        for addr in self._posted_addrs:
            wake_sleepers(addr)

    def is_peer_alive(self, peer):
        return self._is_alive(peer)
