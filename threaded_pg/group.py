"""Rendezvous of the rank threads of one spawn, and new_threaded_group -> shmcoll Group.

A Rendezvous is created per spawn and shared by its rank threads only (no class-level or
module-level registry: two spawns never see each other's groups). Every rank that creates
group `name` gets the same ThreadRegions. Group names can repeat (a group destroyed and
created again under the same name, e.g. the default group after destroy_process_group), so
instances are keyed by (name, generation), where a rank's generation of `name` counts how
often it joined `name` before; all ranks create groups in the same order, so the k-th join
of every rank meets the same instance.

Ranks never wait for each other here: the first rank to arrive allocates all regions (zeroed,
headers written), and a rank that starts a collective before a peer has joined simply waits
for the peer's step counter like it would for a slow process.
"""

import threading
import time

from shmcoll import config as _config
from shmcoll.errors import CollectiveTimeoutError, GroupAbortedError
from shmcoll.engine.group import Group
from shmcoll.p2p import P2PEngine
from shmcoll.protocol import RegionLayout

from .arena import RankStates, ThreadRegions, is_spin_off, new_thread_arena, thread_liveness

__all__ = ["Rendezvous", "new_threaded_group", "GroupRecord", "Turn"]


class GroupRecord:
    """One rank's membership in one group instance (for abort and hang diagnostics)."""

    __slots__ = ("name", "global_rank", "global_ranks", "group", "arena")

    def __init__(self, name, global_rank, global_ranks, arena):
        self.name = name
        self.global_rank = global_rank
        self.global_ranks = global_ranks
        self.arena = arena  # None for world size 1
        self.group = None


class _Instance:
    __slots__ = ("regions", "world_size", "left")

    def __init__(self, regions, world_size):
        self.regions = regions
        self.world_size = world_size
        self.left = 0


class Rendezvous:
    """Meeting point of one spawn's rank threads: group regions, liveness, abort, and a
    small key-value store (set/get/add, like shmcoll.FileStore) for the ranks' own use."""

    def __init__(self, world_size, cfg=None, timeout_s=1800.0):
        self.world_size = world_size
        self.cfg = cfg or _config.from_env()
        self.timeout_s = timeout_s
        self.states = RankStates(world_size)
        self._lock = threading.Lock()
        self._kv_cv = threading.Condition(self._lock)
        self._kv = {}
        self._objects = {}  # publish/lookup: objects shared by reference (cuda_ipc)
        self._instances = {}  # (name, generation) -> _Instance
        self._generations = {}  # (global_rank, name) -> joins so far
        self._records = []  # live GroupRecords, in creation order
        self._aborted = False
        self.rng_turn = Turn(self)  # threaded_pg.rng_lock

    # -- membership ------------------------------------------------------------------------

    def join(self, name, rank, world_size, global_rank):
        """The ThreadRegions of this rank's next instance of group `name` and its key."""
        with self._lock:
            generation = self._generations.get((global_rank, name), 0)
            self._generations[(global_rank, name)] = generation + 1
            key = (name, generation)
            inst = self._instances.get(key)
            if inst is None:
                layout = _layout(self.cfg, world_size)
                inst = self._instances[key] = _Instance(ThreadRegions(layout, world_size), world_size)
            elif inst.world_size != world_size:
                raise ValueError(f"group {name!r}: rank {rank} joined with world size "
                                 f"{world_size}, but the group was created with {inst.world_size}")
        return key, inst.regions

    def leave(self, key, record):
        """Forget `record`; drop the instance once every rank has left it."""
        with self._lock:
            if record in self._records:
                self._records.remove(record)
            inst = self._instances.get(key)
            if inst is not None:
                inst.left += 1
                if inst.left == inst.world_size:
                    del self._instances[key]

    def track(self, record):
        with self._lock:
            self._records.append(record)
            aborted = self._aborted
        if aborted:  # created after the spawn was aborted: fail its first collective
            record.group.abort()

    def records(self):
        """Live group memberships (snapshot)."""
        with self._lock:
            return list(self._records)

    # -- key-value store -------------------------------------------------------------------

    def set(self, key, value):
        with self._kv_cv:
            self._kv[key] = value if isinstance(value, bytes) else str(value).encode()
            self._kv_cv.notify_all()

    def get(self, key, timeout_s=None):
        """The value of `key`, waiting for it to be set (up to timeout_s, default the
        rendezvous timeout); GroupAbortedError when the spawn is aborted meanwhile."""
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_s
        with self._kv_cv:
            while key not in self._kv:
                if self._aborted:
                    raise GroupAbortedError(f"store get {key!r}: the spawn was aborted")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CollectiveTimeoutError(f"store get {key!r}: Timed out waiting "
                                                 f"{int(round(wait_s * 1000))}ms for the key")
                self._kv_cv.wait(remaining)
            return self._kv[key]

    def add(self, key, amount):
        with self._kv_cv:
            value = int(self._kv.get(key, b"0")) + int(amount)
            self._kv[key] = str(value).encode()
            self._kv_cv.notify_all()
            return value

    def publish(self, key, obj):
        """Make `obj` (any object, shared by reference) the value of `key` (cuda_ipc)."""
        with self._kv_cv:
            self._objects[key] = obj
            self._kv_cv.notify_all()

    def lookup(self, key, timeout_s=None):
        """The object published under `key`, waiting for it like get()."""
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_s
        with self._kv_cv:
            while key not in self._objects:
                if self._aborted:
                    raise GroupAbortedError(f"lookup {key!r}: the spawn was aborted")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CollectiveTimeoutError(f"lookup {key!r}: Timed out waiting "
                                                 f"{int(round(wait_s * 1000))}ms for the object")
                self._kv_cv.wait(remaining)
            return self._objects[key]

    def shared_object(self, key, factory):
        """The object under `key`, made by the first caller's factory()."""
        with self._kv_cv:
            if key not in self._objects:
                self._objects[key] = factory()
            return self._objects[key]

    # -- failure ---------------------------------------------------------------------------

    def abort(self):
        """Wake every rank blocked in any group of this spawn (they raise GroupAbortedError);
        every later collective fails fast. Safe from any thread, idempotent."""
        with self._lock:
            self._aborted = True
            records = list(self._records)
            self._kv_cv.notify_all()
        for record in records:
            try:
                record.group.abort()
            except Exception:  # a group closing concurrently: nothing left to wake
                pass

    @property
    def aborted(self):
        return self._aborted


class Turn:
    """Mutual exclusion among one spawn's rank threads, re-entrant per thread; a wait ends
    in GroupAbortedError when the spawn is aborted, or in CollectiveTimeoutError after the
    rendezvous timeout (naming the rank holding the turn)."""

    _POLL_S = 0.05  # how often a waiter looks at the spawn's abort flag

    def __init__(self, rendezvous):
        self._rendezvous = rendezvous
        self._cv = threading.Condition()
        self._holder = None  # thread
        self._holder_rank = None
        self._depth = 0

    def acquire(self, rank):
        me = threading.current_thread()
        wait_s = self._rendezvous.timeout_s
        deadline = time.monotonic() + wait_s
        with self._cv:
            while self._holder is not None and self._holder is not me:
                if self._rendezvous.aborted:
                    raise GroupAbortedError(f"rank {rank}: threaded_pg.rng_lock: the spawn was "
                                            f"aborted while waiting for the turn")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CollectiveTimeoutError(
                        f"rank {rank}: threaded_pg.rng_lock: Timed out waiting "
                        f"{int(round(wait_s * 1000))}ms for rank {self._holder_rank} to leave "
                        f"its section")
                self._cv.wait(min(remaining, self._POLL_S))
            self._holder, self._holder_rank = me, rank
            self._depth += 1

    def release(self):
        with self._cv:
            self._depth -= 1
            if self._depth == 0:
                self._holder = self._holder_rank = None
                self._cv.notify_all()


class _LazyP2P:
    """A p2p.P2PEngine started on this rank's first send/recv.

    Each engine runs a progress thread that polls while idle; ranks that are threads would
    otherwise pay one such thread per rank per group, all contending for the GIL, for
    groups that mostly never send. A rank's engine is only needed once the rank itself
    posts a send or receive (a sender's cells sit in its own region until the receiver's
    engine drains them), so starting it then changes no semantics.
    """

    def __init__(self, start):
        self._start = start
        self._engine = None
        self._lock = threading.Lock()
        self._closed = False
        self.on_fatal = None  # set by Group.attach_p2p; handed to the engine at start

    def _get(self):
        with self._lock:
            if self._engine is None:
                if self._closed:
                    raise GroupAbortedError("p2p: the group was closed on this rank")
                self._engine = self._start()
                self._engine.on_fatal = self.on_fatal
            return self._engine

    def isend(self, *args):
        return self._get().isend(*args)

    def irecv(self, *args):
        return self._get().irecv(*args)

    def abort(self):
        with self._lock:
            engine = self._engine
        if engine is not None:
            engine.abort()

    def close(self):
        with self._lock:
            self._closed = True
            engine = self._engine
        if engine is not None:
            engine.close()


def _layout(cfg, world_size, slot_nbytes=None):
    """The region geometry new_shm_group uses for this world size (same config rules)."""
    return RegionLayout(slot_nbytes or cfg.slot_nbytes, cfg.nslots, world_size,
                        _config.p2p_cells(cfg, world_size), cfg.p2p_cell_nbytes)


def new_threaded_group(rendezvous, rank, world_size, name="", timeout_s=1800.0,
                       global_rank=None, global_ranks=None):
    """A shmcoll Group among rank threads of `rendezvous`.

    rank/world_size are the group's; global_rank is this thread's rank in the spawn and
    global_ranks[p] the spawn rank of group rank p (default: the group is the whole spawn).
    Every member must call this with the same name and world_size, in the same order
    relative to its other groups.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"new_threaded_group: rank {rank} is outside world size {world_size}")
    global_ranks = list(range(world_size)) if global_ranks is None else list(global_ranks)
    if len(global_ranks) != world_size:
        raise ValueError(f"new_threaded_group: {len(global_ranks)} global ranks given for "
                         f"world size {world_size}")
    global_rank = global_ranks[rank] if global_rank is None else global_rank
    cfg = rendezvous.cfg
    if world_size == 1:  # no peers: a private region carries self-sends (as new_shm_group)
        key, layout = None, _layout(cfg, 1, slot_nbytes=64)
        regions = ThreadRegions(layout, 1)
    else:
        key, regions = rendezvous.join(name, rank, world_size, global_rank)
        layout = regions.layout
    arena = None if world_size == 1 else \
        new_thread_arena(regions, rank, rendezvous.states, global_ranks, cfg.spin,
                         cfg.single_copy)
    p2p = _LazyP2P(lambda: P2PEngine(regions.regions, rank, layout,
                                     thread_liveness(rendezvous.states, global_ranks),
                                     oversubscribed=is_spin_off(cfg.spin, world_size), name=name))
    record = GroupRecord(name, global_rank, global_ranks, arena)
    # NOTE: order matters: the p2p thread is joined before the instance is released.
    record.group = Group(arena, rank, world_size, timeout_s, cfg.direct_max_nbytes,
                         closers=[p2p.close, lambda: rendezvous.leave(key, record)],
                         name=name, aborter=p2p.abort,
                         single_copy_always=cfg.single_copy == "always")
    record.group.attach_p2p(p2p)
    rendezvous.track(record)
    return record.group
