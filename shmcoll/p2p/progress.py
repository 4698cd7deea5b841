"""The point-to-point progress thread (ProgressLoop): the loop that drives one P2PEngine
(p2p.py), as gloo's tcp::Loop drives its pairs, and its wait tiers (p2p.py's docstring:
Progress).

The loop owns its thread, its stop flag, the event a post wakes it with and its wait
bookkeeping (the sleep backoff, a lost peer it suspects); the engine owns the rings,
queues, requests, their lock and the failure state. Between them, a small interface: the
loop calls the engine's progress() (one pass: drain every ring, push every queue, settle
what completed; it returns what happened and the words to watch), check_pending() (a
passed deadline or a lost peer among pending ops), fail(error) and fail_all(cls, why); the
engine calls the loop's start(), wake() (after a post) and stop() (close).
"""

import threading

from . import compiled
from ..errors import GroupAbortedError, PeerLostError, ShmcollError
from ..protocol import SLEEP_MAX_S, SLEEP_MIN_S, STATE_LIVE, YIELD_NS

__all__ = ["ProgressLoop", "IDLE_SLEEP_MAX_S", "SPIN_NS"]

# The first wait after activity pause-polls this long before its yield tier: short, unlike
# the collectives' (protocol.SPIN_NS), because this thread shares its process's cores with
# the rank's own work (~200 pauses on the 2-core VM, what it spun before the tiers went by
# time).
SPIN_NS = 10_000

# Nothing pending on this rank: polls slow down to this (a 1 kHz poll costs ~2-3 % of a
# core in Python). Only a peer's message larger than the ring waits for it; posts wake
# the thread at once and any arriving cell brings the backoff back to its minimum.
IDLE_SLEEP_MAX_S = 8e-3


class ProgressLoop:
    """The progress thread of one p2p.P2PEngine (see the module docstring).

    `my_state`: the address of this rank's STATE word (an abort or close ends every wait);
    `spin_ns`: pause-polling of the first wait after activity (0 when oversubscribed);
    `ready` (or None): ready(timeout_s) -> bool, what the thread waits for before it loads
    anything (new_shm_group: warmup.wait_ready; see P2PEngine)."""

    def __init__(self, engine, my_state, spin_ns, ready, name):
        self._engine = engine
        self._my_state = my_state
        self._spin_ns = spin_ns
        self._ready = ready
        self._stopping = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)

    def start(self):
        self._thread.start()

    def wake(self):
        """A post happened: end the current sleep at once."""
        self._wake.set()

    def stop(self, join_timeout_s):
        """Stop the thread and join it (unless called from it) for up to join_timeout_s."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(join_timeout_s)

    def is_alive(self):
        return self._thread.is_alive()

    def _run(self):
        engine = self._engine
        sleep_s = SLEEP_MIN_S
        suspect = None  # a lost peer seen after an idle pass; fatal if the next pass is idle too
        try:
            while self._ready is not None and not self._ready(0.05):
                if self._stopping:
                    return
            compiled.p2p_cells.ensure_progress_wait()  # loaded by the warm-up by now (warmup.py)
            read_acquire = compiled.atomics.read_acquire
            while not self._stopping:
                did, pending, addrs, targets = engine.progress()
                if read_acquire(self._my_state) != STATE_LIVE:
                    engine.fail_all(GroupAbortedError, "the group was aborted or closed on rank "
                                    f"{engine.rank}")
                    return
                if did:
                    sleep_s, suspect = SLEEP_MIN_S, None
                    continue
                if pending:
                    error = engine.check_pending()
                    if isinstance(error, PeerLostError) and suspect is None:
                        suspect = error  # its last cells may have landed after our pass
                        continue
                    if error is not None:
                        engine.fail(error)
                        return
                sleep_s = self._idle_wait(addrs, targets, pending, sleep_s)
        except BaseException as e:  # a bug or a corrupt peer: fail loudly, never hang
            engine.fail(e if isinstance(e, ShmcollError) else
                        ShmcollError(f"[Rank {engine.rank}] p2p progress failed: {e!r}"))

    def _idle_wait(self, addrs, targets, pending, sleep_s):
        """Wait for a watched word, a post or the abort word; returns the next sleep.

        Right after activity (sleep at its minimum) with ops pending: spin/yield polls;
        then sleeps doubling to SLEEP_MAX_S (ops pending: it returns after each sleep to
        check deadlines and peers) or, with nothing pending, on to IDLE_SLEEP_MAX_S without
        full passes. A post wakes it at once; the first arriving cell resets the backoff.
        """
        first = pending and sleep_s == SLEEP_MIN_S
        my_state = self._my_state
        wait_any_ge = compiled.atomics.wait_any_ge
        r = wait_any_ge(addrs, targets, self._spin_ns if first else 0, YIELD_NS if first else 0,
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
