"""Failures of a hierarchical group: how every rank learns of one, and what it says.

Inside a node the engine does this already (abort words, pidfds, the peers' step counters
in shared memory). Across nodes the one medium every rank shares is the group's store, so a
hierarchical group keeps a small *board* there (keys under "shmcoll/hier/<gen>/"):

  failed          counter: the rank that brings it to 1 writes `first`
  first           "<ErrorType>|<lost rank>\\n<message>" of the first failure
  lost/<rank>     a rank known to be gone (its node's engine saw its process exit)
  ack/<rank>      written by every rank that has seen the failure (where it was)
  where/<rank>    "<seq>\\n<position>": written by the watchdog once a collective has run
                  longer than report_after_s, and by a failing rank

- A failing rank posts first, then aborts its node's engine group (which wakes its local
  peers), then words its error. Ranks blocked in an inter-node wait look at `failed`
  every POLL_S; ranks blocked in an intra-node wait are woken by their node's abort.
  Every rank that raises acks.
- Lost ranks: the engine names a lost local peer exactly (pidfd). A lost connection to
  another node names the ranks that did not ack within CENSUS_S: a killed rank never does.
- Timeouts: the message says where every rank was (the `where` reports, written before
  the deadline) and "no report" for ranks that wrote none (stopped, lost, or not in the
  collective).

Store calls here never raise: an unreachable store (its host lost) only makes the
messages poorer ("store unreachable").
"""

import threading
import time
import weakref

__all__ = ["Board", "Watchdog", "POLL_S", "CENSUS_S"]

POLL_S = 0.05  # how often a rank blocked across nodes looks at the board
CENSUS_S = 1.0  # how long a rank that lost a connection waits for the others' acks
WATCH_AFTER_S = 0.1  # the watchdog looks at the board for collectives running this long,
WATCH_EVERY_S = 0.2  # this often (one store check; a rank in an engine wait cannot)
REPORT_AFTER_S = 1.0  # a collective running this long reports where it is (capped below)


class Board:
    """The failure board of one hierarchical group (see the module docstring)."""

    def __init__(self, store, base, layout, rank):
        self._store = store
        self._base = base
        self._layout = layout
        self._rank = rank
        self.unreachable = None  # the store error, once a call failed

    def _key(self, *parts):
        return "/".join((self._base,) + tuple(str(p) for p in parts))

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # the store's host is gone, or its own timeout
            self.unreachable = self.unreachable or f"{type(e).__name__}: {e}"
            return None

    def post(self, type_name, text):
        """Record a failure; True if it is the group's first."""
        n = self._call(self._store.add, self._key("failed"), 1)
        if n == 1:
            self._call(self._store.set, self._key("first"), f"{type_name}\n{text}")
        return n == 1

    def failure(self, wait_s=0.0):
        """(type name, message) of the group's first failure, or None. `wait_s`: how long
        to wait for the message of a failure whose counter is already up."""
        if not self._call(self._store.check, [self._key("failed")]):
            return None
        deadline = time.monotonic() + wait_s
        while True:
            if self._call(self._store.check, [self._key("first")]):
                value = self._call(self._store.get, self._key("first"))
                if value is not None:
                    type_name, _, text = _text(value).partition("\n")
                    return type_name, text
            if time.monotonic() >= deadline:
                return "ShmcollError", "another rank failed (its message is not on the board)"
            time.sleep(0.005)

    def post_lost(self, rank, text):
        """A rank known to be gone (its node's engine saw its process exit)."""
        self._call(self._store.set, self._key("lost", rank), text)

    def is_lost(self, rank):
        """Whether `rank` was posted as lost."""
        return bool(self._call(self._store.check, [self._key("lost", rank)]))

    def lost(self):
        """[(rank, message)] of the ranks posted as lost."""
        found = []
        for r in range(self._layout.world_size):
            if self._call(self._store.check, [self._key("lost", r)]):
                value = self._call(self._store.get, self._key("lost", r))
                if value is not None:
                    found.append((r, _text(value)))
        return found

    def ack(self, position):
        self._call(self._store.set, self._key("ack", self._rank), position)

    def where(self, seq, position):
        self._call(self._store.set, self._key("where", self._rank), f"{seq}\n{position}")

    def census(self, wait_s):
        """Ranks that have not acked after up to `wait_s` seconds (ascending)."""
        deadline = time.monotonic() + wait_s
        missing = [r for r in range(self._layout.world_size) if r != self._rank]
        while missing:
            missing = [r for r in missing
                       if not self._call(self._store.check, [self._key("ack", r)])]
            if not missing or time.monotonic() >= deadline or self.unreachable:
                break
            time.sleep(0.02)
        return missing

    def positions(self):
        """{rank: (seq, position)} of every rank that reported where it is."""
        found = {}
        for r in range(self._layout.world_size):
            key = self._key("where", r)
            if self._call(self._store.check, [key]):
                value = self._call(self._store.get, key)
                if value is not None:
                    seq, _, text = _text(value).partition("\n")
                    found[r] = (int(seq), text)
        return found

    def where_text(self, seq):
        """'rank 0 (node 0, a): seq 5 ...; rank 2 (node 1, b): no report ...' for messages."""
        found = self.positions()
        parts = []
        for r in range(self._layout.world_size):
            who = self._layout.describe(r)
            if r in found and found[r][0] >= seq:
                parts.append(f"{who}: {found[r][1]}")
            elif r in found:
                parts.append(f"{who}: no report for seq {seq} (last: seq {found[r][0]}, "
                             f"{found[r][1]})")
            else:
                parts.append(f"{who}: no report (stopped, lost, or not in a collective)")
        if self.unreachable:
            parts.append(f"store unreachable ({self.unreachable})")
        return "; ".join(parts)


def _text(value):
    return value.decode() if isinstance(value, bytes) else str(value)


class Watchdog:
    """One daemon thread per process, for collectives that run long (group.watch): it
    wakes a rank blocked in a shared-memory wait when the board shows another rank's
    failure, and reports where the rank is once the collective has run report_after_s
    (so that a timeout can say where every rank was). It runs while an open group is
    registered: a group registers when it is made and unregisters when it closes."""

    _lock = threading.Lock()
    _groups = weakref.WeakSet()
    _thread = None
    PERIOD_S = 0.1

    @classmethod
    def register(cls, group):
        with cls._lock:
            cls._groups.add(group)
            if cls._thread is None or not cls._thread.is_alive():
                cls._thread = threading.Thread(target=cls._loop, name="shmcoll-hier-watchdog",
                                               daemon=True)
                cls._thread.start()

    @classmethod
    def unregister(cls, group):
        """`group` closed: stop watching it (the thread ends at its next tick once no group
        is left, even while the user still holds a closed group's handle)."""
        with cls._lock:
            cls._groups.discard(group)

    @classmethod
    def _loop(cls):
        while True:
            time.sleep(cls.PERIOD_S)
            with cls._lock:
                if not cls._groups:
                    cls._thread = None
                    return
            cls._tick(time.monotonic())

    @classmethod
    def _tick(cls, now):
        """One pass over the open groups. The strong references it takes end with it: a
        reference left in the loop's frame kept the last group watched alive for as long as
        the thread ran, and once the thread ended (its groups closed) the group was freed
        there, in this daemon thread, possibly while the interpreter was exiting; freeing
        its gloo channels then aborted the process ("terminate called without an active
        exception", a rank of a one-rank node after destroy_process_group)."""
        with cls._lock:
            groups = list(cls._groups)
        for g in groups:
            try:
                g.watch(now)
            except Exception:  # a group closing under us: nothing to report
                pass


def report_after_s(timeout_s):
    """When a collective reports its position: REPORT_AFTER_S, or a third of a shorter
    timeout (so that the report is there before the deadline)."""
    return min(REPORT_AFTER_S, timeout_s / 3)
