"""The watchdog of a device arena: deadlines and lost peers for work the host no longer waits for.

A collective on device tensors returns once its chunks are enqueued; the waits of its
stream (arena rules 1 and 3) then depend on peers the host is not watching. The watchdog
is one thread per arena that runs only while such work is outstanding: it reads the
rank's MINE word, retires collectives whose last chunk is done, and looks at the oldest
unfinished one. After CHECK_AFTER_S it asks which peers hold the stream (their READY or
DONE short of what it waits for); one that exited, closed or aborted fails the group at
once (PeerLostError / GroupAbortedError), and the collective's deadline fails it with
CollectiveTimeoutError naming the peers it waits for (or, when none is short, saying that
the stream itself has not reached the collective: the device is busy with earlier work).

A failure poisons the group (every later call raises it), announces the abort to the
peers (their hosts and watchdogs fail too), and then keeps storing release values into
the words the stream may still wait on until the stream has drained: no stream is left
waiting on a peer that will never come, so the device stays usable. The values are
re-stored every RELEASE_EVERY_S because a live peer's stream may still overwrite its
own word with an older count.
"""

import collections
import threading
import time

from shmcoll.errors import CollectiveTimeoutError, GroupAbortedError

from .device import at_or_past, word_add

__all__ = ["Watchdog", "CHECK_AFTER_S"]

POLL_MIN_S = 50e-6
POLL_MAX_S = 1e-3
CHECK_AFTER_S = 5e-3  # below this a wait is normal progress: no liveness syscalls yet
RELEASE_EVERY_S = 1e-3
EXIT_JOIN_S = 5.0


class _Entry:
    __slots__ = ("g_first", "g_last", "seq", "name", "deadline", "timeout_s", "since")

    def __init__(self, g_first, g_last, seq, name, timeout_s):
        self.g_first, self.g_last, self.seq, self.name = g_first, g_last, seq, name
        self.timeout_s = timeout_s
        self.since = time.monotonic()
        self.deadline = self.since + timeout_s


class Watchdog:
    """See the module docstring. `watch()` is called by the issuing thread; the rest runs
    on the watchdog's own thread, started on first need."""

    def __init__(self, arena):
        self._arena = arena
        self._entries = collections.deque()
        self._cv = threading.Condition()
        self._thread = None
        self._stopping = False  # close(): finish outstanding work, then exit
        self._exit = False  # the thread must return now (set last by stop())
        self.error = None
        self._last_g = None  # last chunk any watched collective enqueued

    def watch(self, g_first, g_last, seq, name, timeout_s):
        """Collective `seq` enqueued chunks g_first..g_last on the stream."""
        if self._arena.is_done(g_last) and self.error is None:
            return  # inline streams: already complete
        with self._cv:
            self._entries.append(_Entry(g_first, g_last, seq, name, timeout_s))
            self._last_g = g_last
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name=f"cuda_ipc-watchdog-{self._arena.rank}")
                self._thread.start()
            self._cv.notify_all()

    def outstanding(self):
        with self._cv:
            return len(self._entries)

    def _loop(self):
        sleep_s = POLL_MIN_S
        while True:
            with self._cv:
                while not self._entries and not self._stopping and self.error is None \
                        and not self._exit:
                    self._cv.wait()
                if self._exit or (self._stopping and not self._entries):
                    return
            if self.error is not None:
                self._release_until_drained()
                return
            if self._retire():
                sleep_s = POLL_MIN_S
                continue
            err = self._check()
            if err is not None:
                self._fail(err)
                continue
            time.sleep(sleep_s)
            sleep_s = min(sleep_s * 2, POLL_MAX_S)

    def _retire(self):
        """Drop finished collectives; True if any was."""
        done = False
        with self._cv:
            while self._entries and self._arena.is_done(self._entries[0].g_last):
                self._entries.popleft()
                done = True
            if done:
                self._cv.notify_all()
        return done

    def _check(self):
        with self._cv:
            if not self._entries:
                return None
            head = self._entries[0]
        now = time.monotonic()
        if now - head.since < CHECK_AFTER_S and not self._stopping:
            return None
        arena = self._arena
        done = arena.done()
        if at_or_past(done, head.g_last):
            return None  # finished since _retire looked: nothing is stuck
        stuck = word_add(done, 1)  # the chunk my stream works on
        entry = self._entry_of(stuck) or head
        short = arena.short_peers(stuck)
        err = arena.peer_failure(short, entry.name, entry.seq)
        if err is not None:
            return err
        if now > entry.deadline:
            ms = int(round(entry.timeout_s * 1000))
            if short:
                who = f"ranks {short} to reach it"
            else:
                who = ("its own stream to reach it (no peer is behind: the device is busy with "
                       "work enqueued before this collective)")
            return CollectiveTimeoutError(
                f"[Rank {arena.rank}] {entry.name} (cuda, seq {entry.seq}): Timed out waiting "
                f"{ms}ms for {who}")
        return None

    def _entry_of(self, g):
        with self._cv:
            for e in self._entries:
                # cyclic g_first <= g <= g_last
                if ((g - e.g_first) & 0xFFFFFFFF) <= ((e.g_last - e.g_first) & 0xFFFFFFFF):
                    return e
        return None

    def _fail(self, err):
        """Poison the group with `err`, tell the peers, release the stream."""
        with self._cv:
            if self.error is None:
                self.error = err
            seq = self._entries[0].seq if self._entries else self._arena.group.seq
        self._arena.group.poison(err, seq)
        self._release_until_drained()

    def _release_until_drained(self, deadline=None):
        arena = self._arena
        while not self._exit:
            with self._cv:
                last = self._last_g
            if last is None or arena.is_done(last):
                with self._cv:
                    self._entries.clear()
                    self._cv.notify_all()
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            arena.release_all(last, word_add(last, -arena.nslots))
            time.sleep(RELEASE_EVERY_S)
        return False

    def abort(self, err):
        """Fail with `err` (from any thread, without blocking): the watchdog's thread then
        releases whatever the stream still waits on."""
        with self._cv:
            if self.error is None:
                self.error = err
            if self._entries and self._thread is not None:
                self._cv.notify_all()

    def detach(self):
        """After stop(): forget the arena (no reference cycle keeps its memory mapped)."""
        self._arena = None

    def stop(self, deadline):
        """At close: wait for outstanding work (until `deadline`), releasing the stream if it
        does not drain. Returns (exited, error): when `exited` the thread is gone and the
        arena may unmap the words it reads; `error`: the watchdog's error or None."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            thread = self._thread
        while self.outstanding() and time.monotonic() < deadline and self.error is None:
            time.sleep(1e-3)
        if self.outstanding():
            if self.error is None:
                self._fail(GroupAbortedError(
                    f"cuda_ipc group {self._arena.group.name!r} rank {self._arena.rank}: closed "
                    f"while its stream still had collectives to finish"))
            self._release_until_drained(deadline + 1.0)
        with self._cv:
            self._exit = True
            self._cv.notify_all()
        if thread is not None:
            thread.join(EXIT_JOIN_S)  # every loop of the thread checks _exit within ~1 ms
            if thread.is_alive():
                return False, self.error
        return True, self.error
