"""Group: the engine interface (numpy in, numpy out) — validate, sequence, select, run, poison.

A Group runs one collective at a time, in call order; every rank must call the same
collectives in the same order (a CollectiveMismatchError says when they do not). Timeouts,
lost peers and aborts *poison* the group: every later call re-raises the first such error.
Argument errors and mismatches leave it usable (no shared state changed).
"""

import collections
import copy
import logging
import os
import time

import numpy as np

from . import algorithms
from .errors import CollectiveMismatchError, CollectiveTimeoutError, ShmcollError
from .group_movement import MovementMixin, _local_nothing
from .group_p2p import P2PMixin
from .group_reductions import ReduceMixin
from .ops import DTYPE_BY_CODE, ReduceOp

__all__ = ["Group", "COLLECTIVES"]

log = logging.getLogger("shmcoll")

# Fingerprint codes of the collectives (word 0 of a fingerprint).
COLLECTIVES = ("barrier", "all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter",
               "gather", "scatter", "all_to_all")
_CODE = {name: i + 1 for i, name in enumerate(COLLECTIVES)}
# Device collectives (cuda_ipc) fingerprint as "device <collective>", so a rank that calls
# the host form where its peer calls the device form gets a mismatch, not a hang.
DEVICE_CODE = 64
_CODE.update({f"device {name}": DEVICE_CODE + code for name, code in list(_CODE.items())})
_CODE["device setup"] = DEVICE_CODE
FLIGHT_RECORD_LEN = 64


def describe_fingerprint(fp):
    """Render (collective, dtype, count, root, op, extra) for error messages."""
    coll, dtype, count, root, op, _extra = (list(fp) + [0] * 6)[:6]
    device = ""
    if DEVICE_CODE <= coll <= DEVICE_CODE + len(COLLECTIVES):
        coll, device = coll - DEVICE_CODE, "device "
        if coll == 0:
            return "device setup()"
    name = COLLECTIVES[coll - 1] if 0 < coll <= len(COLLECTIVES) else f"collective#{coll}"
    parts = []
    if dtype in DTYPE_BY_CODE:
        parts.append(DTYPE_BY_CODE[dtype].name)
    parts.append(f"count={count}")
    if name in ("broadcast", "reduce", "gather", "scatter"):
        parts.append(f"root={root}")
    if name in ("all_reduce", "reduce", "reduce_scatter"):
        parts.append(f"op={ReduceOp(op).name if op in ReduceOp._value2member_map_ else op}")
    return f"{device}{name}({', '.join(parts)})"


def is_oversubscribed(ranks_here):
    """True when this host runs more busy ranks than we may use cores (then: never spin)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return ranks_here > cores


class Group(ReduceMixin, MovementMixin, P2PMixin):
    """Collectives among `world_size` ranks over an Arena (None when world_size == 1).

    Arrays are numpy arrays of any supported dtype; pass dtype="bfloat16" for bf16 data held
    as uint16. Results are written in place; strided arrays are supported (only the elements
    of the view are written). Every method takes an optional `timeout_s`. This class holds
    the plumbing (plans, _run, poisoning, flight record, lifecycle) and barrier; the other
    collectives come from ReduceMixin (group_reductions.py), MovementMixin
    (group_movement.py) and P2PMixin (group_p2p.py).
    """

    def __init__(self, arena, rank, world_size, timeout_s=1800.0, direct_max_nbytes=-1,
                 closers=(), name="", aborter=None, single_copy_always=False,
                 small_pages=False, kernels=None):
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.name = name
        self._arena = arena
        self._direct_max = direct_max_nbytes
        self._single_copy = arena.single_copy if arena is not None else 0
        self._single_copy_always = single_copy_always
        self.small_pages = small_pages  # ranks' buffers likely on 4 KiB pages (pages.py)
        self._closers = list(closers)
        self._device_closers = []  # cuda_ipc (attach_device): closed before everything else
        self._aborter = aborter
        self._seq = 0
        self._poison = None
        self._closed = False
        self.flight_record = collections.deque(maxlen=FLIGHT_RECORD_LEN)
        self._plans = {}  # per call shape of the common forms: see _plan
        # The kernel gate: None once the kernels every call needs are loaded, else
        # kernels(timeout_s) -> bool, which loads them or waits for the loader that does
        # (warmup.ensure: new_shm_group returns before its warm-up is done). Every call
        # passes it first, in _usable, before anything that may load a kernel (a thread
        # that did, while numba readies itself in the warm-up, would hold the job's
        # compile lock and keep the peers' loads waiting) and before it takes a seq.
        self._kernels = kernels

    # -- state -----------------------------------------------------------------------

    @property
    def seq(self):
        """Number of collectives issued on this group (equal on every rank)."""
        return self._seq

    @property
    def poisoned(self):
        return self._poison

    def is_peer_alive(self, peer):
        """Whether rank `peer`'s process (or thread) still runs."""
        return self._arena is None or self._arena.is_peer_alive(peer)

    def wait_kernels(self, timeout_s=None):
        """Wait until the kernels this group's calls use are loaded (every call does this
        first; returns at once when they are): at most `timeout_s` (the group's timeout),
        then CollectiveTimeoutError. The group stays usable either way: no seq was taken."""
        ensure = self._kernels
        if ensure is None:
            return
        t = self.timeout_s if timeout_s is None else float(timeout_s)
        if not ensure(t):
            raise CollectiveTimeoutError(
                f"[Rank {self.rank}] group {self.name!r}: Timed out waiting {int(t * 1000)}ms "
                f"for shmcoll's kernels to load (numba's cache: docs/COLD_START.md)")
        self._kernels = None

    def _usable(self, name):
        """Raise if the group cannot run `name` (closed, poisoned); wait for its kernels
        (the gate). The latency paths call it only when one of the three is pending."""
        if self._closed:
            raise ShmcollError(f"{name}: the group was closed")
        if self._poison is not None:
            # The same error (type, message, attributes such as PeerLostError.peer), fresh
            # traceback: a poisoned group fails every call at once, before touching anything.
            try:
                again = copy.copy(self._poison).with_traceback(None)
            except Exception:  # an exception type that cannot be rebuilt from its args
                again = self._poison
            raise again
        if self._kernels is not None:
            self.wait_kernels()

    def _run(self, name, fp, algo, *args, timeout_s=None, nbytes=0):
        """Sequence, frame and run one collective; poison the group on fatal errors."""
        self._seq += 1
        seq = self._seq
        entry = {"seq": seq, "op": name, "nbytes": nbytes, "state": "started",
                 "t_start": time.time(), "t_end": None}
        self.flight_record.append(entry)
        if self._arena is None:  # world_size 1: local semantics, no shared memory
            result = algo(None, *args)
            entry["state"], entry["t_end"] = "completed", time.time()
            return result
        arena = self._arena
        arena.begin(seq, name, (_CODE[name],) + fp, self.timeout_s if timeout_s is None
                    else float(timeout_s))
        step0 = arena.step
        try:
            result = algo(arena, *args)
            if arena.step == step0:
                # Nothing to move (count 0): still one post/wait, so every collective checks
                # fingerprints and a rank whose count is not 0 cannot be left waiting.
                arena.exchange()
        except BaseException as e:
            self._failed(entry, seq, e)
            raise
        entry["state"], entry["t_end"] = "completed", time.time()
        return result

    def run_collective(self, name, fp, algo, *args, timeout_s=None, nbytes=0):
        """Run a collective implemented outside the engine (cuda_ipc's device collectives):
        numbered, fingerprinted ((code of `name`,) + fp), flight-recorded and poisoning like
        every other; `algo(arena, *args)` (arena None at world size 1) starts with a post
        and a wait. Returns algo's result."""
        if self._poison is not None or self._closed or self._kernels is not None:
            self._usable(name)
        return self._run(name, fp, algo, *args, timeout_s=timeout_s, nbytes=nbytes)

    def _run_one_step(self, name, plan, src, out, root, timeout_s):
        """_run for a collective the Arena runs as one compiled call, framing included
        (plan.mode is not None: Arena.one_step); `out` None and `root` -1 unless the
        collective has them."""
        self._seq += 1
        seq = self._seq
        entry = {"seq": seq, "op": name, "nbytes": plan.nbytes, "state": "started",
                 "t_start": time.time(), "t_end": None}
        self.flight_record.append(entry)
        try:
            self._arena.one_step(seq, name, plan.mode, plan.words, plan.pre, plan.post, src,
                                 out, root, self.timeout_s if timeout_s is None
                                 else float(timeout_s))
        except BaseException as e:
            self._failed(entry, seq, e)
            raise
        entry["state"], entry["t_end"] = "completed", time.time()

    def _failed(self, entry, seq, e):
        """Record collective `seq`'s failure `e`; poison the group unless it stays usable (a
        mismatch or an invalid argument changed no shared state)."""
        if isinstance(e, CollectiveMismatchError):
            entry["state"], entry["t_end"] = "mismatch", time.time()
        elif isinstance(e, ValueError):
            entry["state"], entry["t_end"] = "invalid", time.time()
        else:
            entry["state"], entry["t_end"] = "failed", time.time()
            self.poison(e, seq)
            if isinstance(e, CollectiveTimeoutError):
                self.dump_flight_record()

    def poison(self, error, seq):
        """Make every later call raise `error` (the first one wins) and tell the peers that
        collective `seq` failed here (also called by cuda_ipc's watchdog thread)."""
        if self._poison is None:
            self._poison = error
        if self._arena is not None:
            self._arena.abort_at(seq)  # peers waiting for us (at seq or later) fail fast

    def attach_device(self, closer, aborter):
        """cuda_ipc's device arena: closed first, before peers learn that this rank closed
        (it needs peer liveness and the peers' streams may still read its slots), aborted
        with the group."""
        self._device_closers.insert(0, closer)
        previous = self._aborter

        def abort_both():
            aborter()
            if previous is not None:
                previous()
        self._aborter = abort_both

    def dump_flight_record(self, logger=log):
        """Log the last collectives of this rank (seq, op, bytes, state, timestamps)."""
        logger.error("shmcoll group %r rank %d: last %d collectives:", self.name, self.rank,
                     len(self.flight_record))
        for e in self.flight_record:
            took = f"{(e['t_end'] - e['t_start']) * 1e3:.3f} ms" if e["t_end"] else "unfinished"
            started = time.strftime("%H:%M:%S", time.localtime(e["t_start"])) + \
                f".{int(e['t_start'] % 1 * 1e6):06d}"
            logger.error("  seq %d %s %d bytes %s, started %s (%s)", e["seq"], e["op"],
                         e["nbytes"], e["state"], started, took)
        if self._arena is not None:
            for r, posted, seq, state in self._arena.peer_states():
                logger.error("  rank %d: step %d, seq %d, state %d", r, posted, seq, state)

    def _root(self, name, root):
        if not 0 <= root < self.world_size:
            raise ValueError(f"{name}: invalid root rank {root} (world size {self.world_size})")

    def _select(self, name, nbytes):
        return algorithms.select(name, nbytes, self.world_size, self._direct_max,
                                 self._single_copy, self._single_copy_always,
                                 self._arena is not None and self._arena.threads,
                                 self.small_pages)

    def _plan(self, key, name, fp, algo, nbytes, storage, spec=None, view=None):
        """Build and cache a _Plan under `key` (bounded: shapes that never repeat do not
        grow it). `storage`: the element dtype the engine moves (its itemsize sizes the
        sub-chunks); `view`: the dtype each call views the array as, or None (the one-step
        kernel takes bytes: uint8 then)."""
        plan = _Plan()
        plan.fp, plan.algo, plan.nbytes, plan.spec = fp, algo, nbytes, spec
        plan.pre, plan.post = (spec.pre, spec.post) if spec is not None else (1.0, 1.0)
        plan.mode = None if self._arena is None else \
            algorithms.one_step_mode(algo, self._arena, nbytes, storage.itemsize)
        plan.view = view if plan.mode is None else np.dtype(np.uint8)
        plan.words = np.array((_CODE[name],) + fp + (
            (spec.op, spec.fn) if spec is not None else (0, 0)), np.int64)
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    # -- barrier (the other collectives: group_reductions.py, group_movement.py, group_p2p.py)

    def barrier(self, timeout_s=None):
        self._usable("barrier")
        algo = _local_nothing if self._arena is None else self._select("barrier", 0)
        self._run("barrier", (), algo, timeout_s=timeout_s)

    # -- lifecycle -----------------------------------------------------------------------

    def abort(self):
        """Wake any collective blocked in this group (from any thread); poisons the group."""
        if self._arena is not None:
            # Name the collective aborted (protocol rule 4): the one in flight (or already
            # failed), else the next. Idle after completing seq s, a peer still finishing s
            # must complete it, not fail it.
            last = self.flight_record[-1] if self.flight_record else None
            unfinished = last is not None and last["state"] in ("started", "failed")
            self._arena.abort_at(self._seq if unfinished else self._seq + 1)
        if self._aborter is not None:
            self._aborter()
        if self._poison is None:
            from .errors import GroupAbortedError
            self._poison = GroupAbortedError(f"group {self.name!r} was aborted on rank {self.rank}")

    def close(self):
        """Tell peers we left, release every resource; idempotent. Keeps the first error."""
        if self._closed:
            return
        self._closed = True
        first = None
        if self._kernels is not None and self._arena is not None:
            # closed before its first call: let the warm-up finish first (set_state loads
            # the atomics, and would hold the job's compile lock while numba readies itself)
            try:
                self.wait_kernels()
            except Exception as e:
                first = e
        # NOTE: order matters: the device arena drains and closes while this rank still
        # counts as live for its peers (a CLOSED state would fail their streams' waits).
        for closer in self._device_closers:
            try:
                closer()
            except Exception as e:
                first = first or e
        self._device_closers = []
        if self._arena is not None:
            try:
                # A poisoned group stays ABORTED for the peers (a late peer must fail, not
                # complete its collective with our data); a healthy one says CLOSED.
                self._arena.set_state(1 if self._poison is not None else 2)
            except Exception as e:
                first = e
        self._arena = None
        for closer in self._closers:
            try:
                closer()
            except Exception as e:
                first = first or e
        self._closers = []
        self._aborter = None  # may hold objects that hold this group (a cycle)
        if first is not None:
            raise first


class _Plan:
    """What a collective derives from its arguments' dtype, shape, op and root (Group._plan):
    fp (fingerprint words after the collective code), algo, nbytes, spec (ops.ReduceSpec or
    None) with its pre/post, view (dtype to view the array as, or None), mode (the
    Arena.one_step mode, or None: the general path) and words (that call's int64 plan)."""

    __slots__ = ("fp", "algo", "nbytes", "spec", "pre", "post", "view", "mode", "words")


_MAX_PLANS = 256
