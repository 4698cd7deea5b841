"""The Executor's doorbell: how submitting an async op wakes the group's worker thread
without handing it the GIL.

An async op (dist.all_reduce(t, async_op=True)) is queued for the group's worker thread,
which must run it even if nobody waits for it (a peer may be blocked in that collective).
Most callers wait for it soon after (FSDP's prefetches, `.wait()` on the next line); the
waiting thread then runs it itself (Executor.wait). Woken through a Python condition, the
worker took the GIL on every submission and raced the submitter for the job: two ranks on
two cores measured 190-340 us per async all_reduce of 64 bytes with wait() against 8-10 us
synchronous (2026-11-29, docs/notes/2026-11-29-async-ops.md), most of it GIL hand-overs.

The doorbell is a few words of this process's memory and a futex (_lane.c's bell_*): a
submission counts itself there and wakes nobody; the worker, asleep in bell_wait with the
GIL released, looks every POLL_NS and takes the GIL only for a job that was queued at its
previous look and still is, so a job its submitter waits for within POLL_NS never changes
hands. An async op nobody waits for starts 1-2 POLL_NS late. After IDLE_NS without a
submission the worker parks (no more looks) and the next submission wakes it. Every other
wake-up (completions to complete, a job whose future was asked for, stop) is urgent and
ends a wait at once (one, as a condition's notify(); all at stop).

One writer: the words are written only through this object's methods, which the Executor
calls holding its condition's lock (ring/taken) or before sleeping (wait). Where the C
extension was not built, `create` returns None and the Executor wakes its worker through
its condition, as before.
"""

import numpy as np

try:
    from . import _lane
except ImportError:  # built without a C compiler: the Executor's condition wakes the worker
    _lane = None

__all__ = ["Doorbell", "POLL_NS", "IDLE_NS"]

# The worker's looks while submissions come (an unwaited job starts 1-2 of them late) and
# how long without one before it parks. Chosen, not tuned against other values: a look a
# millisecond is below a 1 MiB async all_reduce's time on this 2-core VM (230-290 us at 2
# ranks, 0.7-1.1 ms at 4) and costs a timer wake-up (no GIL) per ms while a group is in
# use; 50 ms bridges the gaps between a training step's collectives.
POLL_NS = 1_000_000
IDLE_NS = 50_000_000


class Doorbell:
    """The words a group's worker sleeps on (see the module docstring)."""

    def __init__(self, poll_ns=POLL_NS, idle_ns=IDLE_NS):
        self._words = np.zeros(_lane.BELL_WORDS, np.int32)  # owned here; read by bell_wait
        self._address = self._words.ctypes.data
        self.poll_ns, self.idle_ns = poll_ns, idle_ns

    @classmethod
    def create(cls):
        """A Doorbell, or None where the C extension is not available."""
        return cls() if _lane is not None else None

    def snapshot(self):
        """The count of rings for every worker now: what a wait() after it compares
        against (take it holding the lock the rings are made under, so no ring falls
        between the check and the sleep)."""
        return int(self._words[_lane.BELL_ALL])

    def job(self):
        """A job was queued: a worker runs it unless someone takes it first (see above)."""
        _lane.bell_ring(self._address, _lane.RING_JOB)

    def urgent(self, everyone=False):
        """A worker is needed now (completions to complete, a job waited for where it
        cannot run): one wait() returns, as for a condition's notify(); with `everyone`
        (stop), every wait() does."""
        _lane.bell_ring(self._address, _lane.RING_ALL if everyone else _lane.RING_ONE)

    def taken(self, n=1):
        """n queued jobs left the queue (run, or failed at stop)."""
        if n:
            _lane.bell_taken(self._address, n)

    @property
    def pending(self):
        """Jobs queued and not yet taken (tests)."""
        return int(self._words[_lane.BELL_SUBMITTED]) - int(self._words[_lane.BELL_TAKEN])

    @property
    def parked(self):
        """Threads asleep in wait() until a submission (tests)."""
        return int(self._words[_lane.BELL_PARKED])

    @property
    def waiting(self):
        """Threads in wait() (tests)."""
        return int(self._words[_lane.BELL_WAITERS])

    def wait(self, seen, timeout_s=None):
        """Sleep, GIL released, until an urgent ring this wait takes, a ring for everyone
        after `seen` (a snapshot()), or a job queued at one look and still at the next:
        True; False after timeout_s (None: none)."""
        timeout_ns = -1 if timeout_s is None else max(int(timeout_s * 1e9), 0)
        return _lane.bell_wait(self._address, seen, self.poll_ns, self.idle_ns,
                               timeout_ns)
