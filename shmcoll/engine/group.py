"""Group: the engine interface (numpy in, numpy out) — validate, sequence, select, run, poison.

A Group runs one collective at a time, in call order; every rank must call the same
collectives in the same order (a CollectiveMismatchError says when they do not). Timeouts,
lost peers and aborts *poison* the group: every later call re-raises the first such error.
Argument errors and mismatches leave it usable (no shared state changed).

One class, one state (seq, poison, plans, flight record, the arena and closers), in
sections: state; running a collective (the kernel gate, _run, _run_one_step, poisoning, the
flight record, plans); the reductions (all_reduce, reduce, reduce_scatter); data movement
(broadcast, all_gather, gather, scatter, all_to_all) and its list helpers; barrier;
point-to-point (send / recv over the P2PEngine of p2p.py, which owns the mailboxes and the
progress thread); lifecycle. Each collective validates its arguments, derives (or takes
from the plan cache) its fingerprint, reduction and algorithm, and runs through _run or
_run_one_step. group_args.py holds the argument helpers (flat views, checks, fingerprint
words); the world_size == 1 forms are at the end of this module.
"""

import collections
import copy
import logging
import os
import time

import numpy as np

from .. import algorithms
from ..protocol import ONE_STEP_ALL_TO_ALL, Arena
from ..native import compiled
from ..errors import CollectiveMismatchError, CollectiveTimeoutError, ShmcollError
from .group_args import BYTES, all_to_all_args, all_to_all_single_counts, as_bytes, \
    check_arrays, dtype_code, Flat, pieces, shape_word, unaliased
from ..native.ops import DTYPE_BY_CODE, ReduceOp, dtype_of, reduce_spec

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


class Group:
    """Collectives among `world_size` ranks over an Arena (None when world_size == 1).

    Arrays are numpy arrays of any supported dtype; pass dtype="bfloat16" for bf16 data held
    as uint16. Results are written in place; strided arrays are supported (only the elements
    of the view are written). Every method takes an optional `timeout_s`. The sections are
    listed in the module docstring.
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
        self._scratch = np.empty(0, np.uint8)  # the list forms' staging (_staging)
        # The kernel gate: None once the kernels every call needs are loaded, else
        # kernels(timeout_s) -> bool, which loads them or waits for the loader that does
        # (warmup.ensure: new_shm_group returns before its warm-up is done). Every call
        # passes it first, in _usable, before anything that may load a kernel (a thread
        # that did, while numba readies itself in the warm-up, would hold the job's
        # compile lock and keep the peers' loads waiting) and before it takes a seq.
        self._kernels = kernels
        self._p2p = None  # the P2PEngine for send/recv (attach_p2p; new_shm_group wires it)

    # -- state -----------------------------------------------------------------------------

    @property
    def seq(self):
        """Number of collectives issued on this group (equal on every rank)."""
        return self._seq

    @property
    def poisoned(self):
        return self._poison

    @property
    def pids(self):
        """Each rank's process id, by rank (what a control plane beside the group, such as
        cuda_ipc's rendezvous, watches for liveness); world size 1 (no arena): this
        process's. A closed group raises, naming the call."""
        if self._closed:
            raise ShmcollError("pids: the group was closed")
        return [os.getpid()] if self._arena is None else self._arena.pids

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

    # -- running a collective: the gate, sequencing, poisoning, flight record, plans -------

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

    def _run_one_step(self, name, plan, src, out, root, timeout_s, finish=None, words=None):
        """_run for a collective the Arena runs as one compiled call, framing included
        (plan.mode is not None: Arena.one_step); `out` None and `root` -1 unless the
        collective has them. `finish(arena, slot)`: the rest of the collective where the
        kernel leaves it to Python; `words`: the kernel's plan words when not plan.words
        (ONE_STEP_ALL_TO_ALL of uneven pieces: their sizes, per call)."""
        self._seq += 1
        seq = self._seq
        entry = {"seq": seq, "op": name, "nbytes": plan.nbytes if words is None else src.nbytes,
                 "state": "started", "t_start": time.time(), "t_end": None}
        self.flight_record.append(entry)
        try:
            i = self._arena.one_step(seq, name, ONE_STEP_ALL_TO_ALL if words is not None
                                     else plan.mode, plan.words if words is None else words,
                                     plan.pre, plan.post, src, out, root,
                                     self.timeout_s if timeout_s is None else float(timeout_s))
            if i is not None:
                finish(self._arena, i)
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

    def algorithm_name(self, name, nbytes):
        """The name of the algorithm collective `name` of `nbytes` per rank runs with in
        this group (algorithms.select with the group's settings; the benchmarks' traffic
        model), None at world size 1."""
        return None if self._arena is None else self._select(name, nbytes).__name__

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
        plan.view = view if plan.mode is None else BYTES
        plan.words = np.array((_CODE[name],) + fp + (
            (spec.op, spec.fn) if spec is not None else (0, 0)), np.int64)
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def _plan_broadcast(self, key, array):
        """broadcast's plan of a contiguous array (key: its dtype, shape and root)."""
        root = key[3]
        self._root("broadcast", root)
        return self._plan(key, "broadcast", (dtype_code(array), array.size, root, 0,
                                             shape_word(array)),
                          self._select("broadcast", array.nbytes), array.nbytes, BYTES)

    def _plan_all_gather(self, key, src):
        """all_gather's plan into one array, of a contiguous input (key: dtype, shape)."""
        return self._plan(key, "all_gather", (dtype_code(src), src.size, 0, 0, shape_word(src)),
                          self._select("all_gather", src.nbytes), src.nbytes, BYTES)

    # -- the compiled latency path (torch_backend/_lane.c) ---------------------------------

    def lane_constants(self):
        """What a lane's C calls of the one-step kernel need from this group, fixed for its
        life (Arena.lane_constants: cfg, peer table, slot address arrays, clock), or None
        where collectives do not go through an arena of rank processes (one rank; rank
        threads keep the Python path). Loads nothing."""
        arena = self._arena
        if arena is None or arena.threads:
            return None
        return arena.lane_constants()

    @staticmethod
    def lane_entry():
        """The address of the one-step kernel's C entry (Arena.lane_entry), loaded or
        compiled now if not yet in this process (the warm-up loads it where the adapter
        asked: warmup.load_with_first)."""
        return Arena.lane_entry()

    def one_step_plan(self, name, array, out=None, root=-1, op=ReduceOp.SUM):
        """The plan `name` takes for these contiguous arrays (all_reduce and reduce_scatter
        with `op`, broadcast from `root`) when the one-step kernel runs it whole: the same
        plan, under the same key, as the call's own latency path; None when it does not.
        Raises what the call raises for a bad root or an unsupported reduction."""
        if self._arena is None:
            return None
        if name == "all_reduce":
            key = ("all_reduce", array.dtype, array.shape, op, None, 1.0)
            plan = self._plans.get(key) or self._plan_all_reduce(key, array)
        elif name == "broadcast":
            key = ("broadcast", array.dtype, array.shape, root)
            plan = self._plans.get(key) or self._plan_broadcast(key, array)
        elif name == "all_gather":
            key = ("all_gather", array.dtype, array.shape)
            plan = self._plans.get(key) or self._plan_all_gather(key, array)
        elif name == "reduce_scatter":
            key = ("reduce_scatter", array.dtype, array.shape, out.shape, op, None, 1.0)
            plan = self._plans.get(key) or self._plan_reduce_scatter(key, out, array)
        elif name == "all_to_all":
            key = ("all_to_all", array.dtype, array.size)
            plan = self._plans.get(key) or self._plan_all_to_all(key, array)
        else:
            raise ValueError(f"one_step_plan: no one-step form of {name!r}")
        return plan if plan.mode is not None else None

    def lane_done(self, name, nbytes, seq, t_start):
        """A lane ran collective `seq` (`name`, one_step_plan's plan of `nbytes`) through
        the one-step kernel in one clean pass (and recorded its step in the arena's clock,
        Arena.lane_constants): its count and record, as _run_one_step leaves them."""
        self._seq = seq
        self.flight_record.append({"seq": seq, "op": name, "nbytes": nbytes,
                                   "state": "completed", "t_start": t_start,
                                   "t_end": time.time()})

    def lane_resume(self, name, plan, seq, i, step, publishes, r, src, out, root, timeout_s,
                    t_start, t_mono):
        """A lane's one-step kernel returned `r` (not a clean pass) for collective `seq`:
        the rest of it as _run_one_step does it (Arena.one_step_resume, all_to_all's
        finish), its record, and its failure (the group poisoned unless it stays usable).
        `src` and `out`: the uint8 arrays the kernel was given (out None for all_reduce and
        broadcast); `t_mono`: time.monotonic() before the kernel."""
        self._seq = seq
        entry = {"seq": seq, "op": name, "nbytes": plan.nbytes, "state": "started",
                 "t_start": t_start, "t_end": None}
        self.flight_record.append(entry)
        try:
            i = self._arena.one_step_resume(seq, name, plan.mode, plan.words, plan.pre,
                                            plan.post, src, out, root, timeout_s,
                                            t_mono + timeout_s, i, step, publishes, r)
            if i is not None:  # all_to_all: a peer's table differs (see all_to_all_single)
                n = self.world_size
                algorithms.all_to_all_finish(self._arena, i, pieces(src, None, n),
                                             pieces(out, None, n))
        except BaseException as e:
            self._failed(entry, seq, e)
            raise
        entry["state"], entry["t_end"] = "completed", time.time()

    # -- reductions: all_reduce, reduce, reduce_scatter ------------------------------------

    def all_reduce(self, array, op=ReduceOp.SUM, dtype=None, timeout_s=None, premul=1.0):
        """Reduce `array` over all ranks, in place."""
        if self._poison is not None or self._closed or self._kernels is not None:
            self._usable("all_reduce")
        if type(array) is not np.ndarray:
            check_arrays("all_reduce", [array])
        flags = array.flags
        if flags.c_contiguous and flags.writeable:  # the common case: no Flat, plan cached
            key = ("all_reduce", array.dtype, array.shape, op, dtype, premul)
            plan = self._plans.get(key)
            if plan is None:
                plan = self._plan_all_reduce(key, array)
            flat = array if array.ndim == 1 else array.reshape(-1)
            if plan.view is not None:
                flat = flat.view(plan.view)
            if plan.mode is not None:
                self._run_one_step("all_reduce", plan, flat, None, -1, timeout_s)
            else:
                self._run("all_reduce", plan.fp, plan.algo, flat, plan.spec,
                          timeout_s=timeout_s, nbytes=plan.nbytes)
            return array
        dt = dtype_of(array, dtype)
        spec = reduce_spec(op, dt, self.world_size, "all_reduce", premul)
        f = Flat(array, dt.storage)
        flat = f.flat
        algo = _local_reduce if self._arena is None else \
            self._select("all_reduce", flat.nbytes)
        self._run("all_reduce", (dt.code, flat.size, 0, int(op), shape_word(array)), algo,
                  flat, spec, timeout_s=timeout_s, nbytes=flat.nbytes)
        f.write_back()
        return array

    def _plan_all_reduce(self, key, array):
        """What all_reduce of a contiguous array derives from its dtype, shape and op
        (argument checks, fingerprint, reduction, algorithm), once per such key: the
        latency path then does one dict lookup instead of ~2 us of Python per call."""
        _, _, _, op, dtype, premul = key
        dt = dtype_of(array, dtype)
        spec = reduce_spec(op, dt, self.world_size, "all_reduce", premul)
        algo = _local_reduce if self._arena is None else \
            self._select("all_reduce", array.nbytes)
        return self._plan(key, "all_reduce", (dt.code, array.size, 0, int(op), shape_word(array)),
                          algo, array.nbytes, dt.storage, spec,
                          None if array.dtype == dt.storage else dt.storage)

    def _plan_reduce_scatter(self, key, out, ins):
        """_plan_all_reduce for reduce_scatter of one contiguous input of equal blocks."""
        _, _, _, _, op, dtype, premul = key
        dt = dtype_of(out, dtype)
        spec = reduce_spec(op, dt, self.world_size, "reduce_scatter", premul)
        sizes = (out.size,) * self.world_size
        return self._plan(key, "reduce_scatter", (dt.code, sum(sizes), 0, int(op),
                                                  shape_word(None, sizes)),
                          self._select("reduce_scatter", ins.nbytes), ins.nbytes, dt.storage,
                          spec, None if ins.dtype == dt.storage else dt.storage)

    def reduce(self, array, root=0, op=ReduceOp.SUM, dtype=None, timeout_s=None, premul=1.0):
        """Reduce `array` over all ranks into `root`'s array (others keep theirs)."""
        self._usable("reduce")
        self._root("reduce", root)
        check_arrays("reduce", [array])
        dt = dtype_of(array, dtype)
        spec = reduce_spec(op, dt, self.world_size, "reduce", premul)
        f = Flat(array, dt.storage)
        algo = _local_reduce_rooted if self._arena is None else \
            self._select("reduce", f.flat.nbytes)
        self._run("reduce", (dt.code, f.flat.size, root, int(op), shape_word(array)), algo,
                  f.flat, root, spec, timeout_s=timeout_s, nbytes=f.flat.nbytes)
        if self.rank == root:
            f.write_back()
        return array

    def reduce_scatter(self, out, ins, op=ReduceOp.SUM, dtype=None, timeout_s=None, premul=1.0):
        """out = reduction over ranks of their ins[rank]; `ins` is a list of world_size
        arrays (sizes may differ per destination) or one array of world_size * out.size."""
        if self._poison is not None or self._closed or self._kernels is not None:
            self._usable("reduce_scatter")
        if type(ins) is np.ndarray and type(out) is np.ndarray and self._arena is not None \
                and ins.dtype == out.dtype and ins.size == self.world_size * out.size \
                and ins.flags.c_contiguous and out.flags.c_contiguous and out.flags.writeable:
            key = ("reduce_scatter", ins.dtype, ins.shape, out.shape, op, dtype, premul)
            plan = self._plans.get(key)
            if plan is None:
                plan = self._plan_reduce_scatter(key, out, ins)
            if plan.mode is not None:
                src = ins if ins.ndim == 1 else ins.reshape(-1)
                if plan.view is not None:
                    src = src.view(plan.view)
                self._run_one_step("reduce_scatter", plan, src, as_bytes(out), -1, timeout_s)
                return out
        check_arrays("reduce_scatter", [out])
        dt = dtype_of(out, dtype)
        spec = reduce_spec(op, dt, self.world_size, "reduce_scatter", premul)
        if type(ins) is np.ndarray and ins.flags.c_contiguous and ins.dtype == out.dtype \
                and ins.size == self.world_size * out.size:
            # One contiguous input of equal blocks (reduce_scatter_tensor): no split.
            blocks = as_bytes(ins).view(dt.storage)
            sizes = (out.size,) * self.world_size
            nbytes = blocks.nbytes
            form = 0
        else:
            ins = self._split_in("reduce_scatter", ins, out)
            n = out.size
            if self._arena is not None and out.nbytes <= algorithms.LIST_STAGED_MAX_NBYTES \
                    and all(a.size == n for a in ins):
                # Equal blocks, staged into one array for the one-array path (one compiled
                # call) rather than the list steps; as all_gather's list form, by size only.
                staged = self._staging(self.world_size * out.nbytes).view(out.dtype)
                for j, a in enumerate(ins):
                    staged[j * n:(j + 1) * n] = a.reshape(-1)
                return self.reduce_scatter(out, staged, op, dtype, timeout_s, premul)
            blocks = [np.ascontiguousarray(a).reshape(-1).view(dt.storage) for a in ins]
            sizes = tuple(b.size for b in blocks)
            nbytes = sum(b.nbytes for b in blocks)
            form = 1  # the root word: the list form takes other steps (see all_gather)
        f = Flat(out, dt.storage, copy_in=False)
        algo = _local_reduce_scatter if self._arena is None else \
            self._select("reduce_scatter", nbytes if form == 0 else 0)
        self._run("reduce_scatter", (dt.code, sum(sizes), form, int(op), shape_word(None, sizes)),
                  algo, blocks, f.flat, spec, timeout_s=timeout_s, nbytes=nbytes)
        f.write_back()
        return out

    # -- data movement: broadcast, all_gather, gather, scatter, all_to_all -----------------

    def broadcast(self, array, root=0, timeout_s=None):
        """Copy `array` from `root` to every rank, in place."""
        if self._poison is not None or self._closed or self._kernels is not None:
            self._usable("broadcast")
        if type(array) is np.ndarray and self._arena is not None and \
                array.flags.c_contiguous and array.flags.writeable:
            key = ("broadcast", array.dtype, array.shape, root)
            plan = self._plans.get(key)
            if plan is None:
                plan = self._plan_broadcast(key, array)
            if plan.mode is not None:
                self._run_one_step("broadcast", plan, as_bytes(array), None, root,
                                   timeout_s)
                return array
        self._root("broadcast", root)
        check_arrays("broadcast", [array])
        f = Flat(array, array.dtype, copy_in=(self.rank == root))
        self._run("broadcast", (dtype_code(array), f.flat.size, root, 0, shape_word(array)),
                  _local_nothing if self._arena is None else
                  self._select("broadcast", f.flat.nbytes), as_bytes(f.flat), root,
                  timeout_s=timeout_s, nbytes=f.flat.nbytes)
        if self.rank != root:
            f.write_back()
        return array

    def all_gather(self, outs, array, timeout_s=None):
        """outs[j] (list of world_size arrays, or one array of world_size * array.size
        elements) receives rank j's `array`."""
        if self._poison is not None or self._closed or self._kernels is not None:
            self._usable("all_gather")
        if type(array) is not np.ndarray:
            check_arrays("all_gather", [array])
        if type(outs) is np.ndarray and outs.dtype == array.dtype \
                and outs.size == self.world_size * array.size and outs.flags.c_contiguous \
                and outs.flags.writeable:
            # One contiguous output (all_gather_into_tensor): gathered straight into it.
            src = array if array.flags.c_contiguous else np.ascontiguousarray(array)
            if self._arena is not None:  # the latency path: plan cached
                key = ("all_gather", array.dtype, array.shape)
                plan = self._plans.get(key)
                if plan is None:
                    plan = self._plan_all_gather(key, src)
                if plan.mode is not None:
                    self._run_one_step("all_gather", plan, as_bytes(src), as_bytes(outs), -1,
                                       timeout_s)
                    return outs
            self._run("all_gather", (dtype_code(array), src.size, 0, 0, shape_word(array)),
                      _local_all_gather if self._arena is None else
                      self._select("all_gather", src.nbytes),
                      as_bytes(src), as_bytes(outs), timeout_s=timeout_s, nbytes=src.nbytes)
            return outs
        outs, whole = self._split_out("all_gather", outs, array)
        src = np.ascontiguousarray(array)
        if self._arena is not None and src.nbytes <= algorithms.LIST_STAGED_MAX_NBYTES:
            # Gathered by the one-array path (one compiled call) into a reused staging
            # array, then copied out: the list steps below cost a Python step per output.
            # The choice depends on the size only, the same on every rank, and so does the
            # fingerprint (the one-array form's).
            n = src.size
            staged = self._staging(self.world_size * src.nbytes).view(src.dtype)
            self.all_gather(staged, src, timeout_s)
            for j, o in enumerate(outs):
                o[...] = staged[j * n:(j + 1) * n].reshape(o.shape)
            for f in whole:
                f.write_back()
            return outs
        flats = [Flat(o, o.dtype, copy_in=False) for o in outs]
        # root word 1: above the staging limit the list form moves its bytes in other
        # steps than the one-array form (and never single-copy), so a rank calling the
        # other form must mismatch
        self._run("all_gather", (dtype_code(array), src.size, 1, 0, shape_word(array)),
                  _local_all_gather if self._arena is None else self._select("all_gather", 0),
                  as_bytes(src), [as_bytes(f.flat) for f in flats], timeout_s=timeout_s,
                  nbytes=src.nbytes)
        for f in flats + whole:
            f.write_back()
        return outs

    def _staging(self, nbytes):
        """The first `nbytes` of this group's scratch bytes (grown when short, then kept:
        at most world_size x algorithms.LIST_STAGED_MAX_NBYTES)."""
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, np.uint8)
        return self._scratch[:nbytes]

    def gather(self, array, outs=None, root=0, timeout_s=None):
        """Root's outs[j] receives rank j's array; non-roots pass outs=None."""
        src, outs, whole = self._gather_args(array, outs, root)
        flats = [Flat(o, o.dtype, copy_in=False) for o in outs] if self.rank == root else []
        self._run("gather", (dtype_code(array), src.size, root, 0, shape_word(array)),
                  _local_all_gather_rooted if self._arena is None else self._select("gather", 0),
                  as_bytes(src), [as_bytes(f.flat) for f in flats], root, timeout_s=timeout_s,
                  nbytes=src.nbytes)
        for f in flats + whole:
            f.write_back()
        return outs

    def scatter(self, out, ins=None, root=0, timeout_s=None):
        """Rank j's `out` receives root's ins[j]; non-roots pass ins=None."""
        self._usable("scatter")
        self._root("scatter", root)
        check_arrays("scatter", [out])
        pieces = []
        if self.rank == root:
            pieces = [as_bytes(np.ascontiguousarray(a))
                      for a in self._split_in("scatter", ins, out)]
        f = Flat(out, out.dtype, copy_in=False)
        self._run("scatter", (dtype_code(out), f.flat.size, root, 0, shape_word(out)),
                  _local_scatter if self._arena is None else self._select("scatter", 0),
                  pieces, as_bytes(f.flat), root, timeout_s=timeout_s, nbytes=f.flat.nbytes)
        f.write_back()
        return out

    def all_to_all(self, outs, ins, timeout_s=None):
        """outs[j] receives rank j's ins[rank]; sizes may differ per pair (must agree)."""
        self._usable("all_to_all")
        src, flats = all_to_all_args(self.world_size, outs, ins)
        if self._arena is not None:
            sends = [a.size for a in src]
            if sum(sends) <= algorithms.LIST_STAGED_MAX_NBYTES and \
                    algorithms.rides(self._arena, sends):
                # Pieces that ride with the size table: staged through a reused array into
                # the one-array form (one compiled call), then copied out; the same
                # collective, whatever form or sizes the peers pass. Above the staging
                # limit the two extra copies cost more than the Python they save: the
                # pieces ride from where they lie (all_to_all_direct).
                recvs = [f.flat.nbytes for f in flats]
                staged = self._staging(sum(sends) + sum(recvs))
                pieces_in, pieces_out = staged[:sum(sends)], staged[sum(sends):]
                at = 0
                for a in src:
                    pieces_in[at:at + a.size] = a
                    at += a.size
                dt = flats[0].flat.dtype
                size = dt.itemsize
                self.all_to_all_single(pieces_out.view(dt), pieces_in.view(dt),
                                       [r // size for r in recvs], [s // size for s in sends],
                                       timeout_s=timeout_s)
                at = 0
                for f, r in zip(flats, recvs):
                    as_bytes(f.flat)[:] = pieces_out[at:at + r]
                    at += r
                    f.write_back()
                return outs
        dst = [as_bytes(f.flat) for f in flats]
        # peers may read my inputs where they lie while I write my outputs (single copy),
        # or my own later steps read what an earlier one wrote (streamed): an in-place
        # call's inputs are copied first (the staged branch above copied them already)
        src = unaliased(src, dst)
        self._run("all_to_all", (dtype_code(outs[0]) if outs else 0, 0, 0, 0),
                  _local_all_to_all if self._arena is None else self._select("all_to_all", 0),
                  src, dst, timeout_s=timeout_s, nbytes=sum(s.size for s in src))
        for f in flats:
            f.write_back()
        return outs

    def all_to_all_single(self, out, array, out_counts=None, in_counts=None, timeout_s=None):
        """Rank j's piece `rank` of its `array` lands as piece j of my `out`: the flat arrays
        hold world_size pieces each, in rank order, of in_counts[j] / out_counts[j]
        elements (both None: equal pieces). The same collective as all_to_all with those
        pieces as lists: a rank may call either form, and the peers' sizes may differ.
        Where my messages ride with the size table, or (3+ ranks, large equal blocks) are
        read from where they are, it is one compiled call (Arena.one_step; a read closes
        with one more step)."""
        if self._poison is not None or self._closed or self._kernels is not None:
            self._usable("all_to_all")
        n = self.world_size
        out_counts, in_counts = all_to_all_single_counts(n, out, array, out_counts, in_counts)
        if self._arena is not None and array.flags.c_contiguous and out.flags.c_contiguous \
                and out.flags.writeable:
            key = ("all_to_all", array.dtype, array.size if in_counts is None else None)
            plan = self._plans.get(key)
            if plan is None:
                plan = self._plan_all_to_all(key, array)
            if in_counts is None:
                words, sends, recvs = plan.words, None, None
                ride = plan.mode is not None
            else:
                size = array.itemsize
                sends, recvs = [c * size for c in in_counts], [c * size for c in out_counts]
                ride = algorithms.rides(self._arena, sends)
                words = np.array(plan.head + sends + recvs, np.int64)
            if ride:
                if np.may_share_memory(out, array) and (
                        in_counts is not None or plan.reads
                        or out.ctypes.data != array.ctypes.data):
                    # overlapping: my own piece may move within `out` (the kernel keeps
                    # only equal pieces in place), or peers read my buffer where it lies
                    # while I write `out` (unaliased())
                    array = array.copy()
                src, dst = as_bytes(array), as_bytes(out)
                self._run_one_step(
                    "all_to_all", plan, src, dst, -1, timeout_s,
                    lambda arena, i: algorithms.all_to_all_finish(
                        arena, i, pieces(src, sends, n), pieces(dst, recvs, n)), words)
                return out
        f = Flat(out, out.dtype, copy_in=False)
        self.all_to_all(pieces(f.flat, out_counts, n),
                        pieces(np.ascontiguousarray(array).reshape(-1), in_counts, n),
                        timeout_s)
        f.write_back()
        return out

    def _plan_all_to_all(self, key, array):
        """all_to_all_single's plan: the list form's fingerprint; `head`, the one-step
        words before the sizes (the 8 usual, then the slot's bytes); for equal pieces
        (key's size not None) `words` with their sizes and `mode` (None where they neither
        ride nor are read: algorithms.reads_one_step, slot bytes 0 in `words`)."""
        plan = self._plan(key, "all_to_all", (dtype_code(array), 0, 0, 0, 0),
                          self._select("all_to_all", array.nbytes), array.nbytes, BYTES)
        plan.head = plan.words.tolist() + [self._arena.slot_nbytes]
        if key[2] is not None:
            n = self.world_size
            sizes = [array.nbytes // n] * n
            ride = algorithms.rides(self._arena, sizes)
            plan.reads = algorithms.reads_one_step(plan.algo, n, self._arena.single_copy, ride)
            head = plan.head[:-1] + [0] if plan.reads else plan.head  # slot bytes 0: reads
            plan.words = np.array(head + sizes + sizes, np.int64)
            plan.mode = ONE_STEP_ALL_TO_ALL if plan.reads or ride else None
        else:
            plan.reads = False
        return plan

    # -- list helpers ----------------------------------------------------------------------

    def _gather_args(self, array, outs, root):
        """gather's checks, shared with HierGroup: -> (array as a contiguous source, the
        root's output arrays (non-roots: `outs` as given), the root's arrays to write back
        (_split_out's `whole`; [] elsewhere))."""
        self._usable("gather")
        self._root("gather", root)
        check_arrays("gather", [array])
        whole = []
        if self.rank == root:
            outs, whole = self._split_out("gather", outs, array)
        return np.ascontiguousarray(array), outs, whole

    def _split_out(self, name, outs, array):
        """-> (world_size output arrays, [Flat to write back after the collective]).

        One output array is split through a Flat: `reshape(-1)` of a strided array may be
        a copy, and results written into a copy would be lost."""
        whole = []
        if isinstance(outs, np.ndarray):
            if outs.size != self.world_size * array.size:
                raise ValueError(f"{name}: output has {outs.size} elements, expected "
                                 f"{self.world_size} x {array.size}")
            whole = [Flat(outs, outs.dtype, copy_in=False)]
            flat = whole[0].flat
            outs = np.split(flat, self.world_size) if flat.size else [flat] * self.world_size
        if len(outs) != self.world_size:
            raise ValueError(f"{name}: expected {self.world_size} outputs, got {len(outs)}")
        check_arrays(name, [array] + list(outs), same_dtype=True)
        for o in outs:
            if o.nbytes != array.nbytes:
                raise ValueError(f"{name}: output has {o.nbytes} bytes, input {array.nbytes}")
        return outs, whole

    def _split_in(self, name, ins, out):
        if isinstance(ins, np.ndarray):
            if ins.size != self.world_size * out.size:
                raise ValueError(f"{name}: input has {ins.size} elements, expected "
                                 f"{self.world_size} x {out.size}")
            ins = np.split(ins.reshape(-1), self.world_size) if ins.size else \
                [ins.reshape(-1)] * self.world_size
        if len(ins) != self.world_size:
            raise ValueError(f"{name}: expected {self.world_size} inputs, got {len(ins)}")
        check_arrays(name, [out] + list(ins), same_dtype=True)
        if ins[self.rank].size != out.size:
            raise ValueError(f"{name}: input for rank {self.rank} has {ins[self.rank].size} "
                             f"elements, output {out.size}")
        return ins

    # -- barrier ---------------------------------------------------------------------------

    def barrier(self, timeout_s=None):
        self._usable("barrier")
        algo = _local_nothing if self._arena is None else self._select("barrier", 0)
        self._run("barrier", (), algo, timeout_s=timeout_s)

    # -- point-to-point: send / recv through the P2PEngine (p2p.py) ------------------------
    # P2P consumes no seq number and touches no step counter, so it interleaves freely with
    # collectives. Timeouts, lost peers and aborts poison the group as collectives do.

    def attach_p2p(self, engine):
        """Use `engine` (a p2p.P2PEngine; new_shm_group wires it) for send/recv."""
        self._p2p = engine

        def failed(error):
            if self._poison is None:
                self._poison = error
        engine.on_fatal = failed

    def isend(self, array, dst, tag=0, timeout_s=None):
        """Start sending `array` to rank `dst`; returns a p2p.Request (wait() -> None).
        Completes once the data is in the mailbox; do not modify `array` before that."""
        engine = self._p2p_engine("send", dst, "destination")
        data = as_bytes(np.ascontiguousarray(array))
        return engine.isend(data, dst, tag, self._p2p_timeout(timeout_s))

    def irecv(self, array, src=None, tag=0, timeout_s=None):
        """Start receiving into `array` from rank `src` (None: any rank); returns a
        p2p.Request whose wait() returns the sender's rank."""
        engine = self._p2p_engine("recv", src, "source")
        f = Flat(array, array.dtype, copy_in=False)
        return engine.irecv(as_bytes(f.flat), src, tag, self._p2p_timeout(timeout_s),
                            f.write_back if f._copied else None)

    def send(self, array, dst, tag=0, timeout_s=None):
        """Send `array` to rank `dst` (returns once it is in the mailbox, not when received)."""
        self.isend(array, dst, tag, timeout_s).wait()

    def recv(self, array, src, tag=0, timeout_s=None):
        """Receive into `array` from rank `src`; returns src."""
        return self.irecv(array, src, tag, timeout_s).wait()

    def recv_any(self, array, tag=0, timeout_s=None):
        """Receive into `array` from whichever rank sends first with `tag`; returns its rank."""
        return self.irecv(array, None, tag, timeout_s).wait()

    def _p2p_engine(self, name, peer, what):
        self._usable(name)
        engine = self._p2p
        if engine is None:
            raise ShmcollError(f"{name}: this group has no point-to-point engine")
        if peer is not None and not 0 <= peer < self.world_size:
            raise ValueError(f"{name}: invalid {what} rank {peer} (world size {self.world_size})")
        return engine

    def _p2p_timeout(self, timeout_s):
        return self.timeout_s if timeout_s is None else float(timeout_s)

    # -- lifecycle -------------------------------------------------------------------------

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
            from ..errors import GroupAbortedError
            self._poison = GroupAbortedError(f"group {self.name!r} was aborted on rank {self.rank}")

    def close(self):
        """Tell peers we left, release every resource; idempotent. Keeps the first error."""
        if self._closed:
            return
        self._closed = True
        self._scratch = np.empty(0, np.uint8)  # a call in flight keeps its own view of it
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
    Arena.one_step mode, or None: the general path) and words (that call's int64 plan);
    all_to_all's also head (the words before its sizes) and reads (its one-step call reads
    the peers' blocks where they lie, so its output must not be its input's memory:
    Group._plan_all_to_all)."""

    __slots__ = ("fp", "algo", "nbytes", "spec", "pre", "post", "view", "mode", "words",
                 "head", "reads")


_MAX_PLANS = 256


# world_size == 1: the same semantics without any shared memory.
def _local_reduce(arena, flat, spec):
    if flat.size and (spec.pre != 1.0 or spec.post != 1.0):
        compiled.kernels.reduce_into(flat, np.array([flat.ctypes.data], np.int64), spec.op,
                                     spec.kind, spec.pre, spec.post)


def _local_reduce_rooted(arena, flat, root, spec):
    _local_reduce(arena, flat, spec)


def _local_reduce_scatter(arena, blocks, out, spec):
    out[:] = blocks if type(blocks) is np.ndarray else blocks[0]
    _local_reduce(arena, out, spec)


def _local_nothing(arena, *args):
    """barrier and broadcast of a single rank: nothing to wait for or copy."""


def _local_all_gather(arena, src, outs):
    (outs if type(outs) is np.ndarray else outs[0])[:] = src


def _local_all_gather_rooted(arena, src, outs, root):
    outs[0][:] = src


def _local_scatter(arena, pieces, out, root):
    out[:] = pieces[0]


def _local_all_to_all(arena, src, outs):
    outs[0][:] = src[0]
