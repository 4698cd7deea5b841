"""Point-to-point messages (send / recv / recv from any rank) through per-pair mailboxes.

Mailboxes follow Open MPI's fast-box rules (DESIGN_NOTES §5, §7 item 10). In rank s's
region (protocol.RegionLayout, P2P area; K = p2p_cells, C = p2p_cell_nbytes):

    CONSUMED[r]    r = 0..ws-1, one i64 per 128-byte line: cells from rank r that s has
                   consumed (only s writes it, with a release store)
    RING[d][k]     d = 0..ws-1 (s itself included), k = 0..K-1: s's mailbox to rank d
        +0    SEQ      cell number n = 1, 2, 3, ... of the pair (s -> d); written LAST
        +8    MSG      message number of the pair (1, 2, ...)
        +16   TAG      the user's tag
        +24   TOTAL    message size in bytes
        +32   OFFSET   byte offset of this chunk in the message
        +40   NBYTES   chunk size (<= C; the first cell of a 0-byte message carries 0)
        +128  payload  C bytes

Rules (pair s -> d; every cell word only grows or is overwritten by its one writer):
1. Cell n lives in RING[d][(n - 1) % K]. s writes it only once load_acquire(d's
   CONSUMED[s]) >= n - K, i.e. d has copied out the cell's previous occupant n - K.
2. s writes the payload and MSG..NBYTES with plain stores, then store_release(SEQ, n):
   a receiver that sees SEQ >= n sees the whole cell (the header/sequence goes last).
3. d takes s's cells strictly in order: once load_acquire(SEQ) >= n it reads and checks
   the header (a peer's region is input, not truth: chunk sizes, offsets and message
   numbers must continue the current message), copies the payload out, then
   store_release(CONSUMED[s], n).
4. A message is max(1, ceil(TOTAL / C)) consecutive cells, and s streams its messages to
   d in issue order, so messages from s arrive in send order (FIFO per (src, tag)).

Matching (MPI rules): an arriving message (its first cell) goes to the oldest posted
receive naming its source, or any source, and its tag; otherwise it is buffered privately
as *unexpected* and a later receive takes the oldest matching one (a receive posted while
such a message is still streaming takes over the rest of the stream). Sizes must agree:
otherwise the receive fails with CollectiveMismatchError and the message is dropped.

Progress: one daemon thread per group drains every incoming ring and streams queued sends,
so a send waits only for free cells, which the receiver's thread always frees, never for
a matching receive: "both send first", batch_isend_irecv in any order and self-sends
cannot deadlock. Callers post under the engine lock and do the first steps themselves
(a send that fits in the free cells, or a receive whose message already arrived, completes
at once); the cell copies run in compiled kernels with the GIL released. The thread waits
in tiers: while ops are pending, pause-spin (not when oversubscribed) then sched_yield
(atomics.wait_any_ge), then sleeps of 20 us doubling to 1 ms; with nothing pending the
sleeps go on doubling to 8 ms (idle cost ~0.3 % of a core); a post wakes it at once.
Between waits it checks deadlines, peer liveness and the abort/close word: a timeout, a
lost peer or an abort fails every pending op, marks our region aborted and poisons the
group (on_fatal). close() joins the thread before the regions are unmapped.
P2P never touches POSTED, SEQ or fingerprints, so it interleaves freely with collectives.
"""

import collections
import copy
import logging
import threading
import time

import numba
import numpy as np

from . import jit
from .atomics import (copy_bytes, load_acquire, read_acquire, store_release, wait_any_ge,
                      write_release)
from .atomics import warm_up as atomics_warm_up
from .errors import (CollectiveMismatchError, CollectiveTimeoutError, GroupAbortedError,
                     PeerLostError, ShmcollError)
from .protocol import (LINE_NBYTES, SLEEP_MAX_S, SLEEP_MIN_S, SPINS, STATE_ABORTED,
                       STATE_CLOSED, STATE_LIVE, W_STATE, YIELD_NS)

__all__ = ["P2PEngine", "Request", "ANY_SOURCE", "ensure_kernels"]

log = logging.getLogger("shmcoll")

ANY_SOURCE = -1
_H_SEQ, _H_MSG, _H_TAG, _H_TOTAL, _H_OFFSET, _H_NBYTES = range(6)
_HDR = LINE_NBYTES  # a cell's header line; the payload follows
_DISCARD = np.zeros(1, np.uint8)  # buf argument when a dropped message is drained
_NEVER = np.iinfo(np.int64).max
_MAX_TOTAL = 1 << 50  # sanity bound on a size read from a peer's region
_CALLBACK_LOCK = threading.Lock()
# Nothing pending on this rank: polls slow down to this (a 1 kHz poll costs ~2-3 % of a
# core in Python). Only a peer's message larger than the ring waits for it; posts wake
# the thread at once and any arriving cell brings the backoff back to its minimum.
IDLE_SLEEP_MAX_S = 8e-3


def _ncells(nbytes, cell_nbytes):
    """Cells a message takes (a 0-byte message still takes one)."""
    return max(1, -(-nbytes // cell_nbytes))


_CELL_KERNELS = "shmcoll's point-to-point kernels"
_PROGRESS_WAIT = "shmcoll's point-to-point progress wait"


def _warm_progress_wait():
    word = np.zeros(1, np.int64)
    addrs = np.array([word.ctypes.data], np.int64)
    wait_any_ge(addrs, np.zeros(1, np.int64), 0, 0, word.ctypes.data)


def ensure_kernels():
    """Compile (or load from numba's cache) the cell kernels below, once per process, under
    the job's compile lock (jit.py). A group's progress thread runs from its creation, but
    these wait for the first message this process posts or receives: most jobs send none,
    and compiling them (~0.7 s cold) would delay the first collectives."""
    jit.once(_PROGRESS_WAIT, _warm_progress_wait)
    jit.once(_CELL_KERNELS, _warm_kernels)


def _warm_kernels():
    ring = np.zeros(_HDR + 64, np.uint8)
    word = np.zeros(1, np.int64)
    addr, waddr = ring.ctypes.data, word.ctypes.data
    none = np.zeros(0, np.uint8)
    # Arguments that do no work: no cell to write, none ready, none left to take.
    _push_cells(ring, addr, 1, ring.size, 0, 0, waddr, none, 1, 0, 0)
    _peek_cell(ring, addr, 1, ring.size, 0)
    _take_cells(ring, addr, 1, ring.size, 0, waddr, none, False, 0, 0, 0, 1)


# -- cell kernels (rules 1-3): per-cell work in compiled code, GIL released ------------------
# `ring` is one pair's K cells (uint8, K * stride bytes), `ring_addr` its address.

@numba.njit(nogil=True, cache=True)
def _push_cells(ring, ring_addr, K, stride, sent, room, consumed_addr, data, j, msg, tag):
    """Write cells j, j+1, ... of message `msg` (= data) as pair cells sent+1, ... while
    the ring has room. Returns (sent, room, j) after."""
    words = ring.view(np.int64)
    C = stride - _HDR
    total = data.shape[0]
    ncells = max(1, (total + C - 1) // C)
    while j < ncells:
        n = sent + 1
        if n - K > room:
            room = load_acquire(consumed_addr)
            if n - K > room:
                break  # rule 1: cell n - K not consumed yet
        p = ((n - 1) % K) * stride
        off = j * C
        nb = min(C, total - off)
        copy_bytes(ring_addr + p + _HDR, data.ctypes.data + off, nb)
        w = p // 8
        words[w + _H_MSG] = msg
        words[w + _H_TAG] = tag
        words[w + _H_TOTAL] = total
        words[w + _H_OFFSET] = off
        words[w + _H_NBYTES] = nb
        store_release(ring_addr + p, n)  # rule 2: the sequence word goes last
        sent = n
        j += 1
    return sent, room, j


@numba.njit(nogil=True, cache=True)
def _peek_cell(ring, ring_addr, K, stride, taken):
    """(ready, msg, tag, total, offset, nbytes) of pair cell taken+1, without consuming it."""
    p = (taken % K) * stride
    if load_acquire(ring_addr + p) < taken + 1:
        return False, 0, 0, 0, 0, 0
    w = p // 8
    words = ring.view(np.int64)
    return (True, words[w + _H_MSG], words[w + _H_TAG], words[w + _H_TOTAL],
            words[w + _H_OFFSET], words[w + _H_NBYTES])


@numba.njit(nogil=True, cache=True)
def _take_cells(ring, ring_addr, K, stride, taken, consumed_addr, buf, copy, msg, tag, total, j):
    """Consume cells j, j+1, ... of message (msg, tag, total) while present, copying them
    into buf if `copy`. Returns (taken, j, corrupt) after; stops at a bad header."""
    words = ring.view(np.int64)
    C = stride - _HDR
    ncells = max(1, (total + C - 1) // C)
    while j < ncells:
        n = taken + 1
        p = ((n - 1) % K) * stride
        if load_acquire(ring_addr + p) < n:
            break
        w = p // 8
        off = j * C
        nb = min(C, total - off)
        if (words[w + _H_MSG] != msg or words[w + _H_TAG] != tag or
                words[w + _H_TOTAL] != total or words[w + _H_OFFSET] != off or
                words[w + _H_NBYTES] != nb):
            return taken, j, True
        if copy:
            copy_bytes(buf.ctypes.data + off, ring_addr + p + _HDR, nb)
        store_release(consumed_addr, n)  # rule 3: after the copy, frees the cell
        taken = n
        j += 1
    return taken, j, False


class Request:
    """One posted send or receive. wait() returns the sender's rank (None for sends)."""

    __slots__ = ("op", "peer", "tag", "buf", "nbytes", "rank", "timeout_s", "deadline", "source",
                 "error", "cells", "msg", "_event", "_callbacks", "_finish")

    def __init__(self, op, rank, peer, tag, buf, timeout_s, finish=None):
        self.op, self.rank, self.peer, self.tag = op, rank, peer, int(tag)
        self.buf, self.nbytes = buf, buf.nbytes
        self.timeout_s = float(timeout_s)
        self.deadline = time.monotonic() + self.timeout_s
        self.source = -1
        self.error = None
        self.cells = 0  # sends: cells of the message written so far
        self.msg = 0  # sends: message number of the pair
        self._event = threading.Event()
        self._callbacks = []
        self._finish = finish  # recv of a strided array: copy the staging buffer back

    def describe(self):
        where = "any rank" if self.peer == ANY_SOURCE else f"rank {self.peer}"
        way = "to" if self.op == "send" else "from"
        return f"{self.op} {way} {where} (tag {self.tag}, {self.nbytes} bytes)"

    __repr__ = describe

    def is_completed(self):
        return self._event.is_set()

    def wait(self, timeout_s=None):
        """Block until done; raise its error. timeout_s (None = until the op's own
        deadline) passing first raises CollectiveTimeoutError and leaves the op posted."""
        if not self._event.wait(timeout_s):
            ms = int(round(timeout_s * 1000))
            raise CollectiveTimeoutError(f"[Rank {self.rank}] {self.describe()}: Timed out "
                                         f"waiting {ms}ms for the operation to complete")
        if self.error is not None:
            raise self.error
        return self.source if self.op == "recv" else None

    def add_done_callback(self, fn):
        """Call fn(request) once done (at once if already done), from the completing thread."""
        with _CALLBACK_LOCK:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _settle(self, error):
        if error is None and self._finish is not None:
            try:
                self._finish()
            except Exception as e:  # pragma: no cover - write-back of a strided view
                error = e
        self.error = error
        with _CALLBACK_LOCK:
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:
                log.exception("shmcoll p2p: a completion callback of %s failed", self.describe())


class _Incoming:
    """The message rank `src` is streaming to us: where its bytes go."""

    __slots__ = ("msg", "tag", "total", "cells", "buf", "req", "unexpected")

    def __init__(self, msg, tag, total):
        self.msg, self.tag, self.total, self.cells = msg, tag, total, 0
        self.buf = self.req = self.unexpected = None


class _Unexpected:
    __slots__ = ("src", "tag", "buf", "complete")

    def __init__(self, src, tag, total):
        self.src, self.tag, self.complete = src, tag, False
        self.buf = np.empty(total, np.uint8)


class P2PEngine:
    """Mailboxes, matching and the progress thread of one rank of one group."""

    def __init__(self, regions, rank, layout, is_alive, oversubscribed=False, name=""):
        atomics_warm_up()
        self.rank, self.world_size = rank, len(regions)
        self._regions, self._is_alive = regions, is_alive
        self._K, self._C = layout.p2p_cells, layout.p2p_cell_nbytes
        self._stride = layout.p2p_cell_stride
        ws, ring_nbytes = self.world_size, layout.p2p_cells * layout.p2p_cell_stride
        ring = lambda reg, d: reg[layout.cell_offset(d, 0):layout.cell_offset(d, 0) + ring_nbytes]
        word = lambda reg, off: reg[off:off + 8].ctypes.data
        mine = regions[rank]
        self._out = [ring(mine, d) for d in range(ws)]  # my mailbox to d
        self._in = [ring(regions[s], rank) for s in range(ws)]  # s's mailbox to me
        self._out_addr = [r.ctypes.data for r in self._out]
        self._in_addr = [r.ctypes.data for r in self._in]
        self._my_consumed = [word(mine, layout.consumed_offset(s)) for s in range(ws)]
        self._peer_consumed = [word(regions[d], layout.consumed_offset(rank)) for d in range(ws)]
        self._state = [word(reg, layout.ctrl_offset + W_STATE * LINE_NBYTES) for reg in regions]
        self._sent = [0] * ws  # cells written per destination
        self._room = [0] * ws  # last CONSUMED[me] read from each destination
        self._msg_out = [0] * ws
        self._taken = [int(read_acquire(a)) for a in self._my_consumed]
        self._msg_in = [0] * ws
        self._sendq = [collections.deque() for _ in range(ws)]
        self._incoming = [None] * ws
        self._posted = []  # receives in post order
        self._unexpected = []  # _Unexpected in arrival order
        self._done = []  # (request, error) settled after the lock is released
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._bell = np.zeros(1, np.int64)  # bumped on every post: ends the thread's spin early
        self._watch_addrs = np.array(self._in_addr + self._peer_consumed + [self._bell.ctypes.data],
                                     np.int64)
        self._watch_targets = np.full(2 * ws + 1, _NEVER, np.int64)
        self._spins = 0 if oversubscribed else SPINS
        self._failed = None
        self._stopping = False
        self.on_fatal = None  # Group hooks this to poison itself
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"shmcoll-p2p-{name or 'group'}-r{rank}")
        self._thread.start()

    # -- posting (any thread) ------------------------------------------------------------

    def isend(self, data, dst, tag, timeout_s):
        """Queue `data` (flat uint8, C-contiguous) for rank dst; returns a Request."""
        req = Request("send", self.rank, dst, tag, data, timeout_s)
        return self._post(self._post_send, req)

    def irecv(self, buf, src, tag, timeout_s, finish=None):
        """Receive into `buf` (flat uint8) from rank src (None/ANY_SOURCE: any rank)."""
        src = ANY_SOURCE if src is None else src
        req = Request("recv", self.rank, src, tag, buf, timeout_s, finish)
        return self._post(self._post_recv, req)

    def _post(self, fn, req):
        ensure_kernels()
        if req.buf.dtype != np.uint8 or req.buf.ndim != 1 or not req.buf.flags.c_contiguous:
            raise ValueError(f"{req.describe()}: the engine moves flat C-contiguous uint8 "
                             f"buffers, got {req.buf.dtype} {req.buf.shape}")
        with self._lock:
            if self._failed is not None:
                raise _copy_error(self._failed)
            if self._stopping or read_acquire(self._state[self.rank]) != STATE_LIVE:
                raise GroupAbortedError(f"{req.describe()}: the group was aborted or closed on "
                                        f"rank {self.rank}")
            fn(req)
            self._bell[0] += 1
        self._settle_done()
        if not req.is_completed():
            self._wake.set()
        return req

    def _post_send(self, req):
        self._msg_out[req.peer] += 1
        req.msg = self._msg_out[req.peer]
        q = self._sendq[req.peer]
        q.append(req)
        if len(q) == 1:
            self._push(req.peer)

    def _post_recv(self, req):
        self._drain_all()  # earlier arrivals first: they may be what this receive wants
        for i, u in enumerate(self._unexpected):
            if req.peer in (ANY_SOURCE, u.src) and req.tag == u.tag:
                del self._unexpected[i]
                self._take_unexpected(req, u)
                return
        self._posted.append(req)

    def _take_unexpected(self, req, u):
        req.source = u.src
        cur = None if u.complete else self._incoming[u.src]
        if u.buf.nbytes != req.nbytes:
            self._done.append((req, self._size_error(req, u.src, u.buf.nbytes)))
            if cur is not None:
                cur.buf = cur.unexpected = None  # drop the rest of the stream
        elif cur is None:
            req.buf[:] = u.buf
            self._done.append((req, None))
        else:  # still streaming: copy what arrived, the rest goes straight to req.buf
            got = min(cur.cells * self._C, cur.total)
            req.buf[:got] = u.buf[:got]
            cur.buf, cur.req, cur.unexpected = req.buf, req, None

    # -- sending -------------------------------------------------------------------------

    def _push(self, dst):
        """Write queued sends to dst into free cells (rules 1, 2); True if any written."""
        q = self._sendq[dst]
        wrote = False
        while q:
            req = q[0]
            sent, self._room[dst], req.cells = _push_cells(
                self._out[dst], self._out_addr[dst], self._K, self._stride, self._sent[dst],
                self._room[dst], self._peer_consumed[dst], req.buf, req.cells, req.msg, req.tag)
            wrote = wrote or sent != self._sent[dst]
            self._sent[dst] = sent
            if req.cells < _ncells(req.nbytes, self._C):
                break  # the ring is full
            q.popleft()
            self._done.append((req, None))
        return wrote

    # -- receiving -----------------------------------------------------------------------

    def _drain_all(self):
        if not jit.is_done(_CELL_KERNELS):
            if not self._arrived():
                return False
            ensure_kernels()  # the first message reached this process
        did = False
        for src in range(self.world_size):
            for _ in range(self._K):  # bounded, so one busy sender cannot starve the rest
                if not self._take_cell(src):
                    break
                did = True
        return did

    def _arrived(self):
        """Whether the next cell from any source is there (rule 3's test, without a kernel)."""
        return any(read_acquire(self._in_addr[s] + (self._taken[s] % self._K) * self._stride)
                   >= self._taken[s] + 1 for s in range(self.world_size))

    def _take_cell(self, src):
        """Consume the cells from src that are there (rule 3); True if any consumed."""
        cur = self._incoming[src]
        if cur is None:  # the next cell starts a message: match it first
            ready, msg, tag, total, off, nb = _peek_cell(self._in[src], self._in_addr[src],
                                                         self._K, self._stride, self._taken[src])
            if not ready:
                return False
            if msg != self._msg_in[src] + 1 or off != 0 or not 0 <= total <= _MAX_TOTAL:
                raise self._corrupt(src, "a new message", (msg, tag, total, off, nb))
            self._msg_in[src] = msg
            cur = self._incoming[src] = self._start_message(src, msg, tag, total)
        buf = _DISCARD if cur.buf is None else cur.buf
        taken, cells, bad = _take_cells(
            self._in[src], self._in_addr[src], self._K, self._stride, self._taken[src],
            self._my_consumed[src], buf, cur.buf is not None, cur.msg, cur.tag, cur.total,
            cur.cells)
        if bad:
            raise self._corrupt(src, f"message {cur.msg} (tag {cur.tag}, {cur.total} bytes) "
                                f"cell {cells}", "other header words")
        took = taken != self._taken[src]
        self._taken[src], cur.cells = taken, cells
        if cells >= _ncells(cur.total, self._C):
            self._incoming[src] = None
            if cur.req is not None:
                self._done.append((cur.req, None))
            elif cur.unexpected is not None:
                cur.unexpected.complete = True
        return took

    def _start_message(self, src, msg, tag, total):
        cur = _Incoming(msg, tag, total)
        for i, req in enumerate(self._posted):
            if req.peer in (ANY_SOURCE, src) and req.tag == tag:
                del self._posted[i]
                req.source = src
                if req.nbytes == total:
                    cur.buf, cur.req = req.buf, req
                else:  # fail the receive, drop the message (cur.buf stays None)
                    self._done.append((req, self._size_error(req, src, total)))
                return cur
        cur.unexpected = _Unexpected(src, tag, total)
        cur.buf = cur.unexpected.buf
        self._unexpected.append(cur.unexpected)
        return cur

    def _size_error(self, req, src, total):
        return CollectiveMismatchError(
            f"[Rank {self.rank}] {req.describe()}: rank {src} sent a message of {total} bytes "
            f"with tag {req.tag}; sizes must match")

    def _corrupt(self, src, expected, got):
        return ShmcollError(f"[Rank {self.rank}] p2p: cell {self._taken[src] + 1} from rank {src} "
                            f"is corrupt: expected {expected}, found "
                            f"(msg, tag, total, offset, nbytes) = {got}")

    # -- progress thread -----------------------------------------------------------------

    def _pending(self):
        return bool(self._posted or any(self._sendq) or
                    any(c is not None and c.req is not None for c in self._incoming))

    def _progress(self):
        """One pass: drain every ring, push every queue. Returns (did anything, pending)."""
        did = self._drain_all()
        for dst in range(self.world_size):
            if self._sendq[dst] and self._push(dst):
                did = True
        return did, self._pending()

    def _watch(self):
        """Words whose growth means progress: next cell of each source, a free cell for each
        destination with queued sends, the post bell. Returns (addrs, targets)."""
        ws, K = self.world_size, self._K
        addrs, targets = self._watch_addrs, self._watch_targets
        for s in range(ws):
            addrs[s] = self._in_addr[s] + (self._taken[s] % K) * self._stride
            targets[s] = self._taken[s] + 1
            targets[ws + s] = self._sent[s] + 1 - K if self._sendq[s] else _NEVER
        targets[2 * ws] = self._bell[0] + 1
        return addrs, targets

    def _loop(self):
        sleep_s = SLEEP_MIN_S
        suspect = None  # a lost peer seen after an idle pass; fatal if the next pass is idle too
        my_state = self._state[self.rank]
        try:
            jit.once(_PROGRESS_WAIT, _warm_progress_wait)
            while not self._stopping:
                with self._lock:
                    did, pending = self._progress()
                    addrs, targets = self._watch()
                self._settle_done()
                if read_acquire(my_state) != STATE_LIVE:
                    self._fail_all(GroupAbortedError, "the group was aborted or closed on rank "
                                   f"{self.rank}")
                    return
                if did:
                    sleep_s, suspect = SLEEP_MIN_S, None
                    continue
                if pending:
                    with self._lock:
                        error = self._check_pending()
                    if isinstance(error, PeerLostError) and suspect is None:
                        suspect = error  # its last cells may have landed after our pass
                        continue
                    if error is not None:
                        self._fatal(error)
                        return
                sleep_s = self._idle_wait(addrs, targets, pending, sleep_s)
        except BaseException as e:  # a bug or a corrupt peer: fail loudly, never hang
            self._fatal(e if isinstance(e, ShmcollError) else
                        ShmcollError(f"[Rank {self.rank}] p2p progress failed: {e!r}"))

    def _idle_wait(self, addrs, targets, pending, sleep_s):
        """Wait for a watched word, a post or the abort word; returns the next sleep.

        Right after activity (sleep at its minimum) with ops pending: spin/yield polls;
        then sleeps doubling to SLEEP_MAX_S (ops pending: it returns after each sleep to
        check deadlines and peers) or, with nothing pending, on to IDLE_SLEEP_MAX_S without
        full passes. A post wakes it at once; the first arriving cell resets the backoff.
        """
        first = pending and sleep_s == SLEEP_MIN_S
        my_state = self._state[self.rank]
        r = wait_any_ge(addrs, targets, self._spins if first else 0, YIELD_NS if first else 0,
                        my_state)
        while r == -1 and not self._stopping:
            if self._wake.wait(sleep_s):
                self._wake.clear()
                return SLEEP_MIN_S
            sleep_s = min(sleep_s * 2, SLEEP_MAX_S if pending else IDLE_SLEEP_MAX_S)
            if pending:
                return sleep_s
            r = wait_any_ge(addrs, targets, 0, 0, my_state)
        return SLEEP_MIN_S

    def _check_pending(self):
        """The first deadline passed or peer lost among pending ops (caller holds the lock)."""
        reqs = list(self._posted) + [q[0] for q in self._sendq if q]
        reqs += [c.req for c in self._incoming if c is not None and c.req is not None]
        now = time.monotonic()
        for req in reqs:
            if now > req.deadline:
                return CollectiveTimeoutError(
                    f"[Rank {self.rank}] {req.describe()}: Timed out waiting "
                    f"{int(round(req.timeout_s * 1000))}ms {self._progress_note(req)}")
        for req in reqs:
            error = self._check_peers(req)
            if error is not None:
                return error
        return None

    def _progress_note(self, req):
        if req.op == "send":
            sent = min(req.cells * self._C, req.nbytes)
            return f"for rank {req.peer} to take its messages ({sent} of {req.nbytes} bytes sent)"
        cur = next((c for c in self._incoming if c is not None and c.req is req), None)
        if cur is None:
            return "for the message (nothing matching arrived)"
        got = min(cur.cells * self._C, cur.total)
        return f"for the rest of the message ({got} of {cur.total} bytes arrived)"

    def _check_peers(self, req):
        peers = [req.peer] if req.peer != ANY_SOURCE else \
            [p for p in range(self.world_size) if p != self.rank]
        gone = []
        for p in peers:
            if p == self.rank:
                continue
            state = int(read_acquire(self._state[p]))
            if state == STATE_ABORTED:
                return GroupAbortedError(
                    f"[Rank {self.rank}] {req.describe()}: rank {p} aborted the group; this "
                    f"group is unusable, create a new one")
            closed = state == STATE_CLOSED
            if closed or not self._is_alive(p):
                if not closed or req.peer != ANY_SOURCE:
                    what = "closed the group" if closed else "exited"
                    return PeerLostError(
                        f"[Rank {self.rank}] {req.describe()}: rank {p} {what} while rank "
                        f"{self.rank} waited for it; this group is unusable, create a new one",
                        peer=p)
                gone.append(p)
        if peers and req.peer == ANY_SOURCE and len(gone) == len(peers):
            return PeerLostError(f"[Rank {self.rank}] {req.describe()}: every other rank "
                                 f"closed the group", peer=gone[0])
        return None

    # -- completion, failure, lifecycle ---------------------------------------------------

    def _settle_done(self):
        if not self._done:
            return
        with self._lock:
            done, self._done = self._done, []
        for req, error in done:
            req._settle(error)

    def _fatal(self, error):
        """Fail every pending op with `error`, tell peers (STATE aborted), poison the group."""
        with self._lock:
            if self._failed is None:
                self._failed = error
                if read_acquire(self._state[self.rank]) == STATE_LIVE:
                    write_release(self._state[self.rank], STATE_ABORTED)
        if self.on_fatal is not None:
            self.on_fatal(error)
        self._fail_all(None, None)

    def _fail_all(self, cls, why):
        with self._lock:
            reqs = list(self._posted) + [r for q in self._sendq for r in q]
            reqs += [c.req for c in self._incoming if c is not None and c.req is not None]
            self._posted.clear()
            for q in self._sendq:
                q.clear()
            for c in self._incoming:
                if c is not None:
                    c.req = c.buf = c.unexpected = None
            failed = self._failed
        self._settle_done()
        for req in reqs:
            if req.is_completed():
                continue
            req._settle(_copy_error(failed) if cls is None or failed is not None
                        else cls(f"{req.describe()}: {why}"))

    def abort(self):
        """Fail pending ops soon (the thread sees the abort word); callable from any thread."""
        with self._lock:
            if self._stopping:  # closed: the regions may be unmapped already
                return
            if read_acquire(self._state[self.rank]) == STATE_LIVE:
                write_release(self._state[self.rank], STATE_ABORTED)
        self._wake.set()

    def close(self, join_timeout_s=10.0):
        """Stop and join the progress thread (before the regions are unmapped); idempotent."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(join_timeout_s)
        self._fail_all(ShmcollError, f"the group was closed on rank {self.rank}")
        if self._thread.is_alive():
            raise ShmcollError(f"p2p progress thread of rank {self.rank} did not stop within "
                               f"{join_timeout_s} s")
        # drop our views of the regions so their mappings can really be closed
        self._regions = self._out = self._in = self._out_hdr = self._in_hdr = None


def _copy_error(error):
    try:
        return copy.copy(error)
    except Exception:  # pragma: no cover
        return ShmcollError(str(error))
