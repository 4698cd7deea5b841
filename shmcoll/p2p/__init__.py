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

Where the code is: this module posts, sends, receives and matches, checks deadlines and
peers, and fails, aborts and closes (P2PEngine: the rings, queues, requests, their lock and
the failure state; Request); p2p/cells.py holds the cell kernels (rules 1-3) and their
kernel sets; p2p/progress.py the progress thread (ProgressLoop: it owns the thread, its stop
flag, its wake event and its waits, and calls the engine's progress, check_pending, fail
and fail_all), as gloo splits tcp::Pair from tcp::Loop.
"""

import collections
import copy
import logging
import threading
import time

import numpy as np

from ..native import jit
from . import compiled
from ..errors import CollectiveMismatchError, CollectiveTimeoutError, GroupAbortedError, \
    PeerLostError, ShmcollError
from .progress import SPIN_NS, ProgressLoop
from ..protocol import LINE_NBYTES, STATE_ABORTED, STATE_CLOSED, STATE_LIVE, W_STATE
from .layout import _CELL_KERNELS, _NEVER, ANY_SOURCE

__all__ = ["P2PEngine", "Request", "ANY_SOURCE", "ensure_kernels", "ensure_progress_wait"]


def ensure_kernels():
    """Load the cell kernels (p2p_cells.ensure_kernels; imported on first use: compiled.py)."""
    compiled.p2p_cells.ensure_kernels()


def ensure_progress_wait():
    """Load the progress thread's wait (p2p_cells.ensure_progress_wait)."""
    compiled.p2p_cells.ensure_progress_wait()


def _ncells(nbytes, cell_nbytes):
    """Cells a message takes (a 0-byte message still takes one)."""
    return max(1, -(-nbytes // cell_nbytes))

log = logging.getLogger("shmcoll")
_DISCARD = np.zeros(1, np.uint8)  # buf argument when a dropped message is drained
_MAX_TOTAL = 1 << 50  # sanity bound on a size read from a peer's region
_CALLBACK_LOCK = threading.Lock()


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
    """Mailboxes and matching of one rank of one group, driven by its progress thread (a
    p2p_progress.ProgressLoop it owns)."""

    def __init__(self, regions, rank, layout, is_alive, oversubscribed=False, name="",
                 ready=None):
        # Nothing compiled is called here: a group is created before its kernels are loaded
        # (warmup.py); the progress thread and the first post load what they use. `ready`
        # (new_shm_group: warmup.wait_ready, its warm-up done): ready(timeout_s) -> bool,
        # what the thread waits for before it loads anything. Else it would take the job's
        # compile lock and hold it while numba readies itself, and the peers' loads wait.
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
        # my CONSUMED words: only this rank writes them, so a plain read is exact
        self._taken = [int(mine[layout.consumed_offset(s):][:8].view(np.int64)[0])
                       for s in range(ws)]
        self._msg_in = [0] * ws
        self._sendq = [collections.deque() for _ in range(ws)]
        self._incoming = [None] * ws
        self._posted = []  # receives in post order
        self._unexpected = []  # _Unexpected in arrival order
        self._done = []  # (request, error) settled after the lock is released
        self._lock = threading.Lock()
        self._bell = np.zeros(1, np.int64)  # bumped on every post: ends the thread's spin early
        self._watch_addrs = np.array(self._in_addr + self._peer_consumed + [self._bell.ctypes.data],
                                     np.int64)
        self._watch_targets = np.full(2 * ws + 1, _NEVER, np.int64)
        self._failed = None
        self._closed = False  # close() began: posts are refused, abort does nothing
        self.on_fatal = None  # Group hooks this to poison itself
        self._loop = ProgressLoop(self, self._state[rank], 0 if oversubscribed else SPIN_NS,
                                  ready, f"shmcoll-p2p-{name or 'group'}-r{rank}")
        self._loop.start()

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
        compiled.p2p_cells.ensure_kernels()
        if req.buf.dtype != np.uint8 or req.buf.ndim != 1 or not req.buf.flags.c_contiguous:
            raise ValueError(f"{req.describe()}: the engine moves flat C-contiguous uint8 "
                             f"buffers, got {req.buf.dtype} {req.buf.shape}")
        with self._lock:
            if self._failed is not None:
                raise _copy_error(self._failed)
            if self._closed or \
                    compiled.atomics.read_acquire(self._state[self.rank]) != STATE_LIVE:
                raise GroupAbortedError(f"{req.describe()}: the group was aborted or closed on "
                                        f"rank {self.rank}")
            fn(req)
            self._bell[0] += 1
        self._settle_done()
        if not req.is_completed():
            self._loop.wake()
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
            sent, self._room[dst], req.cells = compiled.p2p_cells._push_cells(
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
            compiled.p2p_cells.ensure_kernels()  # the first message reached this process
        did = False
        for src in range(self.world_size):
            for _ in range(self._K):  # bounded, so one busy sender cannot starve the rest
                if not self._take_cell(src):
                    break
                did = True
        return did

    def _arrived(self):
        """Whether the next cell from any source is there (rule 3's test, without a kernel)."""
        read_acquire = compiled.atomics.read_acquire
        return any(read_acquire(self._in_addr[s] + (self._taken[s] % self._K) * self._stride)
                   >= self._taken[s] + 1 for s in range(self.world_size))

    def _take_cell(self, src):
        """Consume the cells from src that are there (rule 3); True if any consumed."""
        cur = self._incoming[src]
        if cur is None:  # the next cell starts a message: match it first
            ready, msg, tag, total, off, nb = compiled.p2p_cells._peek_cell(
                self._in[src], self._in_addr[src], self._K, self._stride, self._taken[src])
            if not ready:
                return False
            if msg != self._msg_in[src] + 1 or off != 0 or not 0 <= total <= _MAX_TOTAL:
                raise self._corrupt(src, "a new message", (msg, tag, total, off, nb))
            self._msg_in[src] = msg
            cur = self._incoming[src] = self._start_message(src, msg, tag, total)
        buf = _DISCARD if cur.buf is None else cur.buf
        taken, cells, bad = compiled.p2p_cells._take_cells(
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

    # -- the progress loop's interface (p2p_progress.ProgressLoop) ------------------------

    def progress(self):
        """One pass of the progress thread: drain every ring, push every queue, settle what
        completed. Returns (did anything, ops pending, the words whose growth means
        progress and their targets: see _watch)."""
        with self._lock:
            did = self._drain_all()
            for dst in range(self.world_size):
                if self._sendq[dst] and self._push(dst):
                    did = True
            pending = self._pending()
            addrs, targets = self._watch()
        self._settle_done()
        return did, pending, addrs, targets

    def check_pending(self):
        """The first deadline passed or peer lost among pending ops, or None."""
        with self._lock:
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

    def _pending(self):
        return bool(self._posted or any(self._sendq) or
                    any(c is not None and c.req is not None for c in self._incoming))

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
            state = int(compiled.atomics.read_acquire(self._state[p]))
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

    def fail(self, error):
        """Fail every pending op with `error`, tell peers (STATE aborted), poison the group."""
        with self._lock:
            if self._failed is None:
                self._failed = error
                if compiled.atomics.read_acquire(self._state[self.rank]) == STATE_LIVE:
                    compiled.atomics.write_release(self._state[self.rank], STATE_ABORTED)
        if self.on_fatal is not None:
            self.on_fatal(error)
        self.fail_all(None, None)

    def fail_all(self, cls, why):
        """Fail every pending op: with the engine's failure if it has one (or `cls` is
        None), else with cls(why)."""
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
        compiled.atomics.warm_up()  # an abort may come before the group's first call loaded them
        with self._lock:
            if self._closed:  # the regions may be unmapped already
                return
            if compiled.atomics.read_acquire(self._state[self.rank]) == STATE_LIVE:
                compiled.atomics.write_release(self._state[self.rank], STATE_ABORTED)
        self._loop.wake()

    def close(self, join_timeout_s=10.0):
        """Stop and join the progress thread (before the regions are unmapped); idempotent."""
        with self._lock:
            self._closed = True
        self._loop.stop(join_timeout_s)
        self.fail_all(ShmcollError, f"the group was closed on rank {self.rank}")
        if self._loop.is_alive():
            raise ShmcollError(f"p2p progress thread of rank {self.rank} did not stop within "
                               f"{join_timeout_s} s")
        # drop our views of the regions so their mappings can really be closed
        self._regions = self._out = self._in = None


def _copy_error(error):
    try:
        return copy.copy(error)
    except Exception:  # pragma: no cover
        return ShmcollError(str(error))
