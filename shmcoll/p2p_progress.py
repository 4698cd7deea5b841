"""The point-to-point progress thread's waits and the engine's failures (ProgressMixin):
the loop that drains every incoming ring and pushes every queued send, its wait tiers
(p2p.py's docstring: Progress), deadlines and peer liveness of pending ops, and the
failure, abort and close paths that settle every pending op.

Part of p2p.P2PEngine (it uses the engine's rings, queues, lock and requests); the
engine's own methods post, send and receive.
"""

import copy
import threading
import time

from .atomics import read_acquire, wait_any_ge, write_release
from .atomics import warm_up as atomics_warm_up
from .errors import CollectiveTimeoutError, GroupAbortedError, PeerLostError, ShmcollError
from .p2p_cells import _NEVER, ANY_SOURCE, ensure_progress_wait
from .protocol import SLEEP_MAX_S, SLEEP_MIN_S, STATE_ABORTED, STATE_CLOSED, STATE_LIVE, \
    YIELD_NS

# Nothing pending on this rank: polls slow down to this (a 1 kHz poll costs ~2-3 % of a
# core in Python). Only a peer's message larger than the ring waits for it; posts wake
# the thread at once and any arriving cell brings the backoff back to its minimum.
IDLE_SLEEP_MAX_S = 8e-3


class ProgressMixin:
    """The progress thread, waits and failures of p2p.P2PEngine (see the module docstring)."""

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
            while self._ready is not None and not self._ready(0.05):
                if self._stopping:
                    return
            ensure_progress_wait()  # loaded by the group's warm-up by now (warmup.py)
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
        atomics_warm_up()  # an abort may come before the group's first call loaded them
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
