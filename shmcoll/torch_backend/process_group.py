"""EngineProcessGroup: a torch.distributed ProcessGroup over an engine Group (gloo drop-in).

Every collective validates its arguments with gloo's wording (checks.py) on the calling
thread (a bad call raises there, consumes no sequence number and leaves the group usable),
then queues a job on the group's Executor and returns a Work at once. Jobs run in issue
order; tensors are read and written in place through numpy views (no copies for contiguous
tensors, a temporary for strided ones). Each process group has its own Executor, so an
operation that only some ranks issued on one group never blocks another group.

Work/future values follow ProcessGroupGloo: the future holds the output tensors as a flat
list when the op has one output list, a list of lists when it has several (allgather with
n > 1 inputs per rank, allgather_coalesced) and [] when it has none (non-root gather,
barrier). After a failure that poisons the group (timeout, lost peer, abort) every later
operation fails with a DistBackendError saying the group was aborted and why.

The concrete "shm" groups (ProcessGroupShm, gloo-style direct construction, and
HierProcessGroup) are in hier_pg.py, with the factory that chooses between them.

The methods are spread over mixins by kind: reductions.py (ReduceMixin), movement.py
(MovementMixin: broadcast, all-gathers, all-to-all), gather_scatter.py (GatherScatterMixin),
p2p.py (P2PMixin), barriers.py (BarrierMixin: barrier, monitored_barrier); this module keeps
the plumbing, coalescing, split and lifecycle; pg_args.py the Options and the argument
coercions.
"""

import logging
import threading
import weakref

import torch
import torch.distributed as dist

from .. import config as _config
from ..errors import GroupAbortedError
from . import checks, lane
from .barriers import BarrierMixin
from .convert import timeout_s, to_seconds
from .executor import Executor
from .gather_scatter import GatherScatterMixin
from .movement import MovementMixin
from .p2p import P2PMixin
from .pg_args import ShmOptions
from .reductions import ReduceMixin
from .work import CompletedWork, Job, ShmWork, torch_error

__all__ = ["EngineProcessGroup", "ShmOptions"]

log = logging.getLogger("shmcoll")


class EngineProcessGroup(ReduceMixin, MovementMixin, GatherScatterMixin, P2PMixin, BarrierMixin,
                         dist.ProcessGroup):
    """torch ProcessGroup whose collectives run on a shmcoll engine Group."""

    BACKEND_NAME = "shm"
    Options = ShmOptions
    _Options = ShmOptions
    supports_splitting = True
    supports_shrinking = False
    supports_time_estimate = False
    executor_class = Executor  # hook: threaded_pg swaps in an executor suited to rank threads

    def __init__(self, group, backend_name="shm", *, store=None, options=None):
        super().__init__(group.rank, group.world_size)
        self.group = group
        self._backend_name = backend_name
        self._store = store
        opts = options._unbound() if options is not None else \
            ShmOptions(timeout=group.timeout_s, group_name=group.name)
        opts.bind(self)
        self._options = opts
        self._executor = self.executor_class(f"{backend_name}-{group.name or 'pg'}",
                                             on_abort=group.abort)
        self._cfg = _config.from_env()
        self._device_sim = bool(self._cfg.cuda_sim)  # tests: CPU tensors take cuda_ipc's path
        self._inline_ok = not self._device_sim  # fast.py's latency path (host tensors only)
        self._device = None  # cuda_ipc's DevicePath, built by the first device collective
        self._closed = False
        self._lock = threading.Lock()  # seq and coalescing state (ops may come from threads)
        self._seq = 0
        self._coalescing = None
        self._monitored_barriers = 0
        self._split_count = 0
        # `del pg` without shutdown (and interpreter exit, PG-53/55): stop the executor and
        # release the shared memory once the group object is gone.
        self._finalizer = weakref.finalize(self, _release, self._executor, group)
        # the Works torch's C++ may still call, where it does not keep them alive itself
        # (compat.Work); they go with this object
        self._works_held = set()
        self._last_job = None  # jobs run in issue order: this one done = nothing pending
        done = Job("sync", lambda: None, [])
        done.execute()
        done.complete()
        self._completed_work = CompletedWork(self._executor, done)  # returned by sync ops
        # The compiled latency path (lane.py), where it can run: it takes over the methods
        # of its five collectives (instance attributes, found first by torch's trampolines)
        # and is armed by the first latency-path call (_arm_lane).
        self._lane = lane.build(self)
        self._lane_unarmed = self._lane is not None
        if self._lane is not None:
            for op, names in enumerate(lane.METHODS):
                method = self._lane.call(op)
                for name in names:
                    setattr(self, name, method)

    # -- plumbing ------------------------------------------------------------------------

    def _arm_lane(self):
        """Give the lane its kernel entry (fast._run, after the first latency-path call: the
        group's kernels are loaded by then). Where that fails, the lane stays off and every
        call keeps the Python path."""
        self._lane_unarmed = False
        try:
            lane.arm(self._lane, self.group)
        except Exception as e:  # noqa: BLE001 - the Python path still works
            self._lane.disable()
            log.warning("shmcoll: the compiled latency path is off for group %r (%s: %s); "
                        "calls take the Python path", self.group.name, type(e).__name__, e)

    def _submit(self, name, fn, value, count_seq=True, opts=None):
        """Queue `fn` (runs in issue order); the Work's future gets `value`."""
        rank = self.rank()

        def run():
            poison = self.group.poisoned
            if poison is not None:
                raise GroupAbortedError(
                    f"[Rank {rank}] {name}: the process group was aborted after an earlier "
                    f"failure, so this operation did not run (create a new process group); "
                    f"first failure: {poison}")
            return fn()

        # asyncOp is False only when the torch front end will wait at once (async_op=False)
        # and drop the Work: run the op right here, with no Job, no worker wake-up and a
        # shared already-completed Work (the latency path of dist.all_reduce(t)).
        run_here = opts is not None and not getattr(opts, "asyncOp", True)
        if run_here and self._coalescing is None:
            with self._lock:
                if count_seq:
                    self._seq += 1
            self._executor.run_inline(run)
            return self._completed_work
        with self._lock:
            job = self._executor.submit(Job(name, run, value))
            self._last_job = job
            if count_seq:
                self._seq += 1
            work = ShmWork(self._executor, job, self._works_held)
            if self._coalescing is not None:
                self._coalescing.append(work)
        return work

    def _op_timeout(self, opts):
        return timeout_s(getattr(opts, "timeout", None), self.group.timeout_s)

    def getBackendName(self):
        return self._backend_name

    def name(self):
        return self._backend_name

    def _get_backend_name(self):
        return self._backend_name

    @property
    def options(self):
        return self._options

    def set_timeout(self, timeout):
        self._set_default_timeout(timeout)

    def _set_default_timeout(self, timeout):
        self.group.timeout_s = to_seconds(timeout)

    def _get_sequence_number_for_group(self):
        """Collectives issued on this group (equal on every rank; +1 per collective call;
        a call rejected by argument checks does not count)."""
        return self._seq

    def _set_sequence_number_for_group(self):
        pass  # our sequence numbers start at 0 on every rank by construction

    def _get_backend(self, device=None):
        """The group is its own (only) backend, for every device type."""
        return self

    def get_group_store(self):
        if self._store is None:
            raise RuntimeError(f"{self._backend_name}: this process group was built without "
                               f"a store")
        return self._store

    # ProcessGroup keeps its name and description on its C++ backends, and a Python group
    # has none registered ("ProcessGroup name not set"): keep them here.
    def _set_group_name(self, name):
        self._group_name = name
        self._options.group_name = name

    @property
    def group_name(self):
        name = getattr(self, "_group_name", None)
        if name is None:
            raise RuntimeError("ProcessGroup name not set")
        return name

    def _set_group_desc(self, desc):
        self._group_desc = desc
        self._options.group_desc = desc

    @property
    def group_desc(self):
        return getattr(self, "_group_desc", "undefined")

    def comm_split_count(self):
        return self._split_count

    def eager_connect_single_device(self, device=None):
        pass  # segments are mapped at construction

    def perform_nocolor_split(self, device=None):
        pass

    def supports_tensor_alloc(self, device=None):
        return False

    # -- device tensors (cuda_ipc) --------------------------------------------------------

    def _device_checks(self, tensors):
        """Whether `tensors` go to cuda_ipc: any is a CUDA tensor, or every tensor does
        (SHMCOLL_CUDA_SIM: the simulated device, tests only)."""
        return self._device_sim or any(isinstance(t, torch.Tensor) and t.is_cuda
                                       for t in tensors)

    def _on_device(self, name, tensors, dense=True):
        """gloo's tensor/layout checks, then True for device tensors (cuda_ipc's path,
        which checks they share this group's device) or False after the CPU check."""
        checks.tensors(name, tensors)
        if dense:
            checks.dense(name, tensors)
        if self._device_checks(tensors):
            return True
        checks.cpu(name, tensors)
        return False

    def _device_path(self, tensors):
        if self._device is None:
            self.group.wait_kernels()  # cuda_ipc may load kernels (see Group's kernel gate)
            import cuda_ipc
            self._device = cuda_ipc.device_path(self, tensors[0].device, self._cfg)
        return self._device

    def _device_rendezvous(self):
        """The control plane of this group's device arena (rank processes: the store)."""
        from cuda_ipc.rendezvous import ProcessRendezvous
        group = self.group
        if self._store is None:
            raise RuntimeError(f"{self._backend_name}: this process group was built without "
                               f"a store, so its ranks cannot exchange device handles")
        return ProcessRendezvous(self._store, group.rank, group.world_size,
                                 group.pids, group.timeout_s, self._cfg.shm_dir)

    # -- coalescing ----------------------------------------------------------------------

    def _start_coalescing(self, device=None):
        """Start collecting the works of the following calls (dist._coalescing_manager).
        A block left by an exception never calls _end_coalescing: starting again simply
        starts over (the collected operations were issued and run anyway)."""
        with self._lock:
            self._coalescing = []

    def _end_coalescing(self, device=None):
        """One Work that completes when every operation since _start_coalescing has; it
        fails with the first of their errors."""
        with self._lock:
            if self._coalescing is None:
                raise RuntimeError("ProcessGroupShm::endCoalescing: not coalescing (call "
                                   "_start_coalescing first)")
            works, self._coalescing = self._coalescing, None

        def run():
            for w in works:
                w.wait()
        return self._submit("coalesced", run, [], count_seq=False)

    # -- groups --------------------------------------------------------------------------

    def split_group(self, ranks, timeout=None, opts=None, group_name=None, group_desc=None,
                    device_types=None):
        """A new group of `ranks` (ranks of this group); every rank of this group calls it
        (in the same order), non-members get None. Used by dist.split_group."""
        ranks = sorted(int(r) for r in ranks)
        count = self._next_split()
        if self.rank() not in ranks:
            return None
        if self._store is None:
            raise RuntimeError(f"{self._backend_name}::split_group: this process group was "
                               f"built without a store, it cannot rendezvous a split")
        name = group_name or f"{self._options.group_name or 'pg'}:split:{count - 1}"
        options = ShmOptions.coerce(opts) if opts is not None else ShmOptions(
            timeout=self.group.timeout_s, group_name=name)
        if timeout is not None:
            options._timeout = timeout
        options.group_name = name
        options.global_ranks_in_group = list(ranks)
        # The rendezvous key must agree across members: torch's hashed group names need
        # not (they are re-hashed against each rank's own registry), the parent's split
        # count and the member list do. One node: a ProcessGroupShm, else hierarchical.
        store = dist.PrefixStore(f"shmcoll_split/{count}/{'_'.join(map(str, ranks))}/",
                                 self._store)
        pg = self._new_split_group(store, ranks.index(self.rank()), len(ranks), options)
        pg._set_group_name(name)
        if group_desc:
            pg._set_group_desc(group_desc)
        return pg

    def _new_split_group(self, store, rank, size, options):
        """The group split_group makes of its members: the concrete classes say which
        (hier_pg: one node or several, as the backend's creator decides)."""
        raise NotImplementedError(f"{type(self).__name__} cannot split")

    def _next_split(self):
        """This group's split count, after counting one more split (every rank of the group
        counts every split, member or not: the count keys the split's rendezvous)."""
        with self._lock:
            self._split_count += 1
            return self._split_count

    def _next_monitored_barrier(self):
        """The number of this monitored barrier (1, 2, ...): it keys the barrier's store
        entries."""
        with self._lock:
            self._monitored_barriers += 1
            return self._monitored_barriers

    # -- lifecycle -----------------------------------------------------------------------

    def _closed_error(self, name):
        return torch_error(GroupAbortedError(
            f"{name}: the process group was "
            f"{getattr(self._executor, '_stop_reason', 'shut down')}; it accepts no new "
            f"operations (create a new process group)"))

    def abort(self):
        """Wake anything blocked in this group (any thread) and fail what is queued; later
        operations raise DistBackendError."""
        self.group.abort()
        self._shutdown(reason="aborted")

    def shutdown(self):
        """Stop the group: abort queued/stuck work, then release the shared memory. Later
        operations raise DistBackendError."""
        self._shutdown(reason="shut down")

    def _shutdown(self, reason):
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # Abort only if an operation is unfinished. The executor's own "busy" test also
        # fires while its thread merely finishes up a completed job, and an abort then would
        # fail a slower peer's last collective, which this rank already completed.
        last = self._last_job
        self._finalizer.detach()
        _release(self._executor, self.group, reason,
                 abort=(last is not None and not last.done) or self._executor.inline_busy)


def _release(executor, group, reason="shut down", abort=True):
    """Stop `executor` (aborting queued/stuck work if `abort`), then close the engine group."""
    if executor.owns_current_thread():
        # a finalizer run by the executor's own thread (GC there) cannot join that thread
        threading.Thread(target=_release, args=(executor, group, reason, abort),
                         daemon=True).start()
        return
    joined = executor.stop(abort_pending=abort, reason=reason)
    if joined:  # never unmap memory a still-running job could touch
        group.close()
