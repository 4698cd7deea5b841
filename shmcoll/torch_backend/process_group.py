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

Direct construction like gloo's: ProcessGroupShm(store, rank, size, opts | timeout=).
"""

import copy
import datetime
import re
import threading
import time
import weakref

import numpy as np
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

from .. import config as _config
from ..errors import CollectiveTimeoutError, GroupAbortedError
from ..kernels import reduce_into
from ..ops import ReduceOp, dtype_of, reduce_spec
from . import checks
from . import sparse as _sparse
from .convert import as_array, reduce_op, timeout_s, to_seconds
from .fast import (all_gather_single_inline, allreduce_inline, broadcast_inline,
                   reduce_scatter_single_inline)
from .monitored_barrier import monitored_barrier_peer, monitored_barrier_root
from .p2p import P2PMixin
from .executor import Executor
from .work import CompletedWork, Job, ShmWork, torch_error

__all__ = ["EngineProcessGroup", "ProcessGroupShm", "ShmOptions"]

DEFAULT_TIMEOUT_S = 1800.0  # torch's default_pg_timeout for non-NCCL backends


def _tensor_list(x):
    return [x] if isinstance(x, torch.Tensor) else list(x)


def _nested(lists):
    return [list(x) for x in lists]


def _gloo_value(output_lists):
    """gloo's returnFutureWithOutput: [] for none, flat for one list, nested for several."""
    if len(output_lists) == 0:
        return []
    if len(output_lists) == 1:
        return list(output_lists[0])
    return [list(x) for x in output_lists]


def _is_op(x):
    return isinstance(x, (dist.ReduceOp, dist.ReduceOp.RedOpType))


def _set_timeout(opts, timeout):
    if timeout is not None:
        opts.timeout = timeout if isinstance(timeout, datetime.timedelta) else \
            datetime.timedelta(seconds=float(timeout))
    return opts


def _as_op(op):
    return op if isinstance(op, dist.ReduceOp) else dist.ReduceOp(op)


class ShmOptions:
    """ProcessGroupGloo._Options look-alike: `_timeout` takes seconds (float) or a timedelta
    and reads back as a timedelta; `_threads`, `_devices`, `group_name` are kept (the engine
    needs no thread pool: ops run in order on one executor per group).

    `pg.options` is bound to its group: reading `_timeout` gives the current default timeout,
    assigning it changes the group's default (like `_set_default_timeout`)."""

    def __init__(self, timeout=None, threads=2, group_name="", devices=None):
        self._pg = None
        self._timeout_s = DEFAULT_TIMEOUT_S if timeout is None else to_seconds(timeout)
        self._threads = threads
        self.group_name = group_name
        self._devices = list(devices or [])
        self.global_ranks_in_group = []
        self.group_desc = ""

    @property
    def _timeout(self):
        s = self._pg.group.timeout_s if self._pg is not None else self._timeout_s
        return datetime.timedelta(seconds=s)

    @_timeout.setter
    def _timeout(self, value):
        if self._pg is not None:
            self._pg._set_default_timeout(value)
        else:
            self._timeout_s = to_seconds(value)

    timeout = _timeout

    @property
    def threads(self):
        return self._threads

    @threads.setter
    def threads(self, value):
        self._threads = value

    @classmethod
    def coerce(cls, options):
        """An unbound ShmOptions from ours, from another backend's options object (gloo's
        _Options, NCCL's Options: `_timeout`, `group_name`, `_threads` are taken) or None."""
        if isinstance(options, cls):
            return options._unbound()
        new = cls()
        if options is not None:
            timeout = getattr(options, "_timeout", None)
            if timeout is not None:
                new._timeout = timeout
            new.group_name = str(getattr(options, "group_name", "") or "")
            new._threads = getattr(options, "_threads", new._threads)
            new.global_ranks_in_group = list(getattr(options, "global_ranks_in_group", []))
        return new

    def _unbound(self):
        new = copy.copy(self)
        new._timeout_s = self._timeout.total_seconds()
        new._pg = None
        new._devices = list(self._devices)
        new.global_ranks_in_group = list(self.global_ranks_in_group)
        return new

    def __deepcopy__(self, memo):
        return self._unbound()

    def __repr__(self):
        return (f"ShmOptions(timeout={self._timeout}, threads={self._threads}, "
                f"group_name={self.group_name!r})")


class EngineProcessGroup(P2PMixin, dist.ProcessGroup):
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
        opts._pg = self
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
        self._last_job = None  # jobs run in issue order: this one done = nothing pending
        done = Job("sync", lambda: None, [])
        done.execute()
        done.complete()
        self._completed_work = CompletedWork(self._executor, done)  # returned by sync ops

    # -- plumbing ------------------------------------------------------------------------

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
            work = ShmWork(self._executor, job)
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
                                 group._arena._pids, group.timeout_s, self._cfg.shm_dir)

    # -- reductions ----------------------------------------------------------------------

    def _prepare_reduce(self, name, tensors, op):
        arrays = [as_array(t) if t.dtype in _REDUCIBLE else None for t in tensors]
        if arrays[0] is None:
            checks.fail(name, f"unsupported dtype {tensors[0].dtype} for reductions")
        try:
            engine_op, premul = reduce_op(op)
        except ValueError as e:
            checks.fail(name, str(e))
        try:
            reduce_spec(engine_op, dtype_of(arrays[0][0], arrays[0][1]), self.size(), name,
                        premul)
        except TypeError as e:
            checks.fail(name, str(e))
        return arrays, engine_op, premul

    def allreduce(self, tensors, opts=None, timeout=None, op=None):
        """allreduce(tensors, opts) | allreduce(tensors, op=SUM, timeout=None) |
        allreduce(tensor, op=SUM, timeout=None). gloo semantics for a list: the reduction
        runs over every tensor of every rank and every tensor receives the result."""
        if timeout is None and op is None:
            work = allreduce_inline(self, tensors, opts)
            if work is not None:
                return work
        name = "allreduce"
        tensors = _tensor_list(tensors)
        opts = _allreduce_opts(opts, op, timeout)
        checks.non_empty(name, tensors)
        checks.tensors(name, tensors)
        checks.layout_match(name, tensors)
        checks.type_and_size_match(name, tensors)
        if self._on_device(name, tensors, dense=False):
            return self._device_path(tensors).allreduce(tensors, opts)
        if tensors[0].layout == torch.sparse_coo:
            return self._allreduce_sparse(tensors, opts)
        checks.dense(name, tensors)
        arrays, op, premul = self._prepare_reduce(name, tensors, opts.reduceOp)
        t_s = self._op_timeout(opts)

        def run():
            first, dtype = arrays[0]
            if len(arrays) > 1:  # gloo semantics: reduce the whole list, result in every tensor
                _local_reduce(arrays, op)
            self.group.all_reduce(first, op, dtype, t_s, premul)
            for a, _ in arrays[1:]:
                a[...] = first
        return self._submit(name, run, tensors, opts=opts)

    def _allreduce_sparse(self, tensors, opts):
        kind = getattr(opts.reduceOp, "op", opts.reduceOp)
        if kind != dist.ReduceOp.SUM:
            checks.fail("allreduce", f"unsupported reduction operation {kind} (allreduce of "
                                     f"sparse tensors only works with ReduceOp.SUM)")
        t_s = self._op_timeout(opts)

        def run():
            _sparse.allreduce_sum(self.group, tensors, t_s)
        return self._submit("allreduce", run, tensors, opts=opts)

    def allreduce_coalesced(self, tensors, opts=None):
        """Element-wise reduction of every list element on its own, one collective."""
        name = "allreduce_coalesced"
        tensors = _tensor_list(tensors)
        opts = opts if isinstance(opts, dist.AllreduceCoalescedOptions) else \
            _coalesced_opts(opts)
        checks.non_empty(name, tensors)
        checks.tensors(name, tensors)
        checks.layout_match(name, tensors)
        for i, t in enumerate(tensors):
            if t.dtype != tensors[0].dtype:
                checks.fail(name, f"tensors must all have the same type (index 0 is "
                                  f"{tensors[0].dtype}, index {i} is {t.dtype})")
        for i, t in enumerate(tensors):
            if t.device != tensors[0].device:
                checks.fail(name, f"tensors must all be on the same device (index 0 is on "
                                  f"{tensors[0].device}, index {i} on {t.device})")
        if tensors[0].layout != torch.strided:
            checks.fail(name, f"unsupported layout {tensors[0].layout}")
        checks.dense(name, tensors)
        if self._on_device(name, tensors):
            return self._device_path(tensors).allreduce_coalesced(tensors, opts)
        arrays, op, premul = self._prepare_reduce(name, tensors, opts.reduceOp)
        t_s = self._op_timeout(opts)

        def run():
            # One flat buffer: one collective (and one fingerprint) for the whole list.
            flat = np.concatenate([a.reshape(-1) for a, _ in arrays]) if len(arrays) > 1 \
                else np.ascontiguousarray(arrays[0][0]).reshape(-1)
            self.group.all_reduce(flat, op, arrays[0][1], t_s, premul)
            offset = 0
            for a, _ in arrays:
                a[...] = flat[offset:offset + a.size].reshape(a.shape)
                offset += a.size
        return self._submit(name, run, tensors, opts=opts)

    def reduce(self, tensors, opts=None, op=None, timeout=None):
        """reduce(tensors, opts) | reduce(tensor, root, op=SUM, timeout=None)."""
        name = "reduce"
        tensors = _tensor_list(tensors)
        if not isinstance(opts, dist.ReduceOptions):
            root = 0 if opts is None else int(opts)
            opts = dist.ReduceOptions()
            opts.rootRank = root
            if op is not None:
                opts.reduceOp = _as_op(op)
        _set_timeout(opts, timeout)
        checks.root_rank(name, opts.rootRank, self.size())
        checks.root_tensor(name, opts.rootTensor, len(tensors))
        checks.single(name, tensors, "tensor list")
        if self._on_device(name, tensors):
            return self._device_path(tensors).reduce(tensors, opts)
        arrays, op, premul = self._prepare_reduce(name, tensors, opts.reduceOp)
        root, t_s = opts.rootRank, self._op_timeout(opts)

        def run():
            a, dtype = arrays[0]
            self.group.reduce(a, root, op, dtype, t_s, premul)
        return self._submit(name, run, tensors, opts=opts)

    def reduce_scatter(self, output_tensors, input_lists, opts=None, timeout=None, op=None):
        """reduce_scatter([out], [[in_0 .. in_{n-1}]], opts) | reduce_scatter(out, [ins],
        op=SUM, timeout=None). Inputs may differ in size per destination (uneven)."""
        name = "reduce_scatter"
        if isinstance(output_tensors, torch.Tensor):  # convenience overload
            output_tensors, input_lists = [output_tensors], [list(input_lists)]
        if not isinstance(opts, dist.ReduceScatterOptions):
            op = opts if _is_op(opts) else op
            opts = dist.ReduceScatterOptions()
            if op is not None:
                opts.reduceOp = _as_op(op)
        _set_timeout(opts, timeout)
        outs = list(output_tensors)
        checks.single(name, outs, "output tensor list")
        checks.single(name, input_lists, "input list")
        ins = list(input_lists[0])
        if len(ins) != self.size():
            checks.fail(name, f"invalid input tensor list size {len(ins)} (expected "
                              f"{self.size()}, the group size)")
        device = self._on_device(name, outs + ins)
        checks.type_match(name, ins, outs[0])
        if ins[self.rank()].numel() != outs[0].numel():
            checks.fail(name, f"invalid tensor size: input {self.rank()} has "
                              f"{ins[self.rank()].numel()} elements, output {outs[0].numel()}")
        if device:
            return self._device_path(outs).reduce_scatter(name, outs[0], ins, opts, outs)
        return self._reduce_scatter(name, outs[0], ins, opts, outs)

    def _reduce_scatter(self, name, out, ins, opts, value):
        [(out_arr, dtype)], op, premul = self._prepare_reduce(name, [out], opts.reduceOp)
        in_arrs = [as_array(t)[0] for t in ins]
        t_s = self._op_timeout(opts)

        def run():
            self.group.reduce_scatter(out_arr, in_arrs, op, dtype, t_s, premul)
        return self._submit(name, run, value, opts=opts)

    def reduce_scatter_single(self, output, input, opts=None):
        """reduce_scatter_tensor: output = reduction of every rank's chunk `rank` of input."""
        work = reduce_scatter_single_inline(self, output, input, opts)
        if work is not None:
            return work
        name = "reduce_scatter_tensor"
        opts = opts if isinstance(opts, dist.ReduceScatterOptions) else _rs_opts(opts)
        device = self._on_device(name, [output, input])
        checks.type_match(name, [input], output)
        if input.numel() != output.numel() * self.size():
            checks.fail(name, f"input tensor must be the same size as output size times world "
                              f"size (input {input.numel()}, output {output.numel()}, world "
                              f"size {self.size()})")
        if device:
            return self._device_path([output]).reduce_scatter_single(name, output, input, opts)
        return self._reduce_scatter(name, output, self._chunks(input), opts, [output])

    _reduce_scatter_base = reduce_scatter_single

    def _chunks(self, t):
        flat = t.reshape(-1)
        n = self.size()
        if flat.numel() == 0:
            return [flat] * n
        return list(flat.chunk(n))

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        """reduce_scatter_tensor over several (output, input) pairs as one operation."""
        name = "reduce_scatter_tensor_coalesced"
        opts = opts if isinstance(opts, dist.ReduceScatterOptions) else _rs_opts(opts)
        outputs, inputs = list(outputs), list(inputs)
        checks.coalesced_pairs(name, outputs, inputs, self.size(), gather=False,
                               on_device=self._device_checks(outputs + inputs))
        if not outputs:
            return self._submit(name, lambda: None, [])
        if self._device_checks(outputs):
            return self._device_path(outputs).reduce_scatter_single_coalesced(
                name, outputs, inputs, opts)
        prepared = [self._prepare_reduce(name, [o], opts.reduceOp) for o in outputs]
        op, premul = prepared[0][1], prepared[0][2]
        t_s = self._op_timeout(opts)
        n = self.size()
        same_dtype = all(o.dtype == outputs[0].dtype for o in outputs)

        def run():
            if not same_dtype:  # one engine collective per pair, still one operation
                for t, p in zip(inputs, prepared):
                    (arr, dtype), = p[0]
                    self.group.reduce_scatter(arr, [as_array(c)[0] for c in self._chunks(t)],
                                              op, dtype, t_s, premul)
                return
            dtype = prepared[0][0][0][1]
            chunks = [self._chunks(t) for t in inputs]
            blocks = [np.concatenate([as_array(chunks[i][r])[0].reshape(-1)
                                      for i in range(len(inputs))]) for r in range(n)]
            out = np.empty(sum(o.numel() for o in outputs), blocks[0].dtype)
            self.group.reduce_scatter(out, blocks, op, dtype, t_s, premul)
            offset = 0
            for (arr, _), in (p[0] for p in prepared):
                arr[...] = out[offset:offset + arr.size].reshape(arr.shape)
                offset += arr.size
        return self._submit(name, run, outputs, opts=opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement -------------------------------------------------------------------

    def broadcast(self, tensors, opts=None, timeout=None, root=None):
        """broadcast(tensors, opts) | broadcast(tensor, root, timeout=None). Every tensor of
        every rank receives root's tensor opts.rootTensor (gloo semantics)."""
        if timeout is None and root is None:
            work = broadcast_inline(self, tensors, opts)
            if work is not None:
                return work
        name = "broadcast"
        tensors = _tensor_list(tensors)
        if not isinstance(opts, dist.BroadcastOptions):
            r = root if root is not None else (0 if opts is None else int(opts))
            opts = dist.BroadcastOptions()
            opts.rootRank = r
        _set_timeout(opts, timeout)
        checks.root_rank(name, opts.rootRank, self.size())
        checks.root_tensor(name, opts.rootTensor, len(tensors))
        device = self._on_device(name, tensors)
        checks.type_and_size_match(name, tensors)
        if device:
            return self._device_path(tensors).broadcast(tensors, opts)
        arrays = [as_array(t, for_reduce=False)[0] for t in tensors]
        root, index, t_s = opts.rootRank, opts.rootTensor, self._op_timeout(opts)

        def run():
            src = arrays[index]
            self.group.broadcast(src, root, t_s)
            for i, a in enumerate(arrays):
                if i != index:
                    a[...] = src
        return self._submit(name, run, tensors, opts=opts)

    def allgather(self, output_lists, input_tensors, opts=None, timeout=None):
        """allgather(output_lists, inputs, opts) | allgather(outputs, input, timeout=None).
        gloo semantics: every output list gets rank r's input j at index r * k + j."""
        name = "allgather"
        if isinstance(input_tensors, torch.Tensor):  # convenience overload
            output_lists, input_tensors = [list(output_lists)], [input_tensors]
            if isinstance(opts, datetime.timedelta):
                opts, timeout = None, opts
        opts = _set_timeout(opts or _c10d.AllgatherOptions(), timeout)
        inputs = list(input_tensors)
        output_lists = _nested(output_lists)
        checks.non_empty(name, inputs, "input tensor list")
        if len(output_lists) != len(inputs):
            checks.fail(name, f"requires input/output tensor lists to have the same length "
                              f"({len(inputs)} inputs, {len(output_lists)} output lists)")
        k = len(inputs)
        for i, outs in enumerate(output_lists):
            if len(outs) != self.size() * k:
                checks.fail(name, f"invalid output tensor list at index {i} (expected length "
                                  f"{self.size() * k}, got {len(outs)})")
        device = self._on_device(name, inputs)
        checks.type_and_size_match(name, inputs)
        for outs in output_lists:
            self._on_device(name, outs)
            checks.type_and_size_match(name, outs, inputs[0])
        if device:
            return self._device_path(inputs).allgather(output_lists, inputs, opts,
                                                       _gloo_value(output_lists))
        srcs = [as_array(t, False)[0] for t in inputs]
        dsts = [[as_array(o, False)[0] for o in outs] for outs in output_lists]
        t_s = self._op_timeout(opts)

        def run():
            first = dsts[0]
            if k == 1:
                self.group.all_gather(first, srcs[0], t_s)
            else:  # one collective: rank r's k inputs travel as one block
                block = np.concatenate([np.ascontiguousarray(s).reshape(-1).view(np.uint8)
                                        for s in srcs])
                gathered = np.empty(block.size * self.size(), np.uint8)
                self.group.all_gather(gathered, block, t_s)
                per = block.size // k
                for idx, dst in enumerate(first):
                    _write_bytes(dst, gathered[idx * per:(idx + 1) * per])
            for other in dsts[1:]:
                for a, b in zip(other, first):
                    a[...] = b
        return self._submit(name, run, _gloo_value(output_lists), opts=opts)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """gloo semantics: output_lists[r][i] receives rank r's input_list[i]."""
        name = "allgather_coalesced"
        opts = opts or _c10d.AllgatherOptions()
        inputs = _tensor_list(input_list)
        output_lists = _nested(output_lists)
        checks.non_empty(name, inputs, "input tensor list")
        if len(output_lists) != self.size():
            checks.fail(name, f"output lists should be equal to world size (got "
                              f"{len(output_lists)}, world size {self.size()})")
        device = self._on_device(name, inputs)
        for outs in output_lists:
            if len(outs) != len(inputs):
                checks.fail(name, f"invalid output size: (expected length {len(inputs)}, got "
                                  f"{len(outs)})")
            self._on_device(name, outs)
            for i, (o, t) in enumerate(zip(outs, inputs)):
                if o.shape != t.shape:
                    checks.fail(name, f"invalid size of output tensor at index {i} (expected "
                                      f"{list(t.shape)}, got {list(o.shape)})")
                if o.dtype != t.dtype:
                    checks.fail(name, f"invalid tensor type at index {i} (expected {t.dtype}, "
                                      f"got {o.dtype})")
        if device:
            return self._device_path(inputs).allgather_coalesced(output_lists, inputs, opts,
                                                                 _gloo_value(output_lists))
        t_s = self._op_timeout(opts)
        return self._submit(name, self._gather_bytes_job(output_lists, inputs, t_s),
                            _gloo_value(output_lists))

    def _gather_bytes_job(self, output_lists, inputs, t_s):
        """One all_gather of every input's bytes; output_lists[r][i] <- rank r's input i."""
        srcs = [as_array(t, False)[0] for t in inputs]
        dsts = [[as_array(o, False)[0] for o in outs] for outs in output_lists]

        def run():
            parts = [np.ascontiguousarray(s).reshape(-1).view(np.uint8) for s in srcs]
            block = np.concatenate(parts) if len(parts) > 1 else parts[0]
            gathered = np.empty(block.size * self.size(), np.uint8)
            self.group.all_gather(gathered, block, t_s)
            for r, outs in enumerate(dsts):
                offset = r * block.size
                for dst, part in zip(outs, parts):
                    _write_bytes(dst, gathered[offset:offset + part.size])
                    offset += part.size
        return run

    def all_gather_single(self, output, input, opts=None):
        """all_gather_into_tensor: output = concatenation of every rank's input."""
        work = all_gather_single_inline(self, output, input, opts)
        if work is not None:
            return work
        name = "all_gather_into_tensor"
        opts = opts or _c10d.AllgatherOptions()
        device = self._on_device(name, [output, input])
        checks.type_match(name, [input], output)
        if output.numel() != input.numel() * self.size():
            checks.fail(name, f"output tensor size must be equal to world_size times input "
                              f"tensor size (output {output.numel()}, input {input.numel()}, "
                              f"world size {self.size()})")
        if device:
            return self._device_path([output]).all_gather_single(output, input, opts)
        t_s = self._op_timeout(opts)
        chunks = self._chunks_of(output)
        job = self._gather_bytes_job([[c] for c in chunks], [input], t_s)

        def run():
            job()
            if isinstance(chunks, _StridedChunks):
                chunks.write_back()
        return self._submit(name, run, [output], opts=opts)

    _allgather_base = all_gather_single

    def _chunks_of(self, output):
        n = self.size()
        flat = output.reshape(-1) if output.is_contiguous() else None
        if flat is None:  # strided output: chunk views along its memory order are not flat
            return _StridedChunks(output, n)
        if flat.numel() == 0:
            return [flat] * n
        return list(flat.chunk(n))

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        """all_gather_into_tensor over several (output, input) pairs as one operation."""
        name = "allgather_into_tensor_coalesced"
        opts = opts or _c10d.AllgatherOptions()
        outputs, inputs = list(outputs), list(inputs)
        checks.coalesced_pairs(name, outputs, inputs, self.size(), gather=True,
                               on_device=self._device_checks(outputs + inputs))
        if not outputs:
            return self._submit(name, lambda: None, [])
        if self._device_checks(outputs):
            return self._device_path(outputs).all_gather_single_coalesced(outputs, inputs, opts)
        t_s = self._op_timeout(opts)
        chunked = [self._chunks_of(o) for o in outputs]
        output_lists = [[c[r] for c in chunked] for r in range(self.size())]
        job = self._gather_bytes_job(output_lists, inputs, t_s)
        fixups = [c for c in chunked if isinstance(c, _StridedChunks)]

        def run():
            job()
            for c in fixups:
                c.write_back()
        return self._submit(name, run, outputs, opts=opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_lists, input_tensors, opts=None, timeout=None):
        """gather(output_lists, inputs, opts) | gather(outputs, input, root, timeout=None)."""
        name = "gather"
        if isinstance(input_tensors, torch.Tensor):  # convenience overload
            root = 0 if opts is None else int(opts)
            opts = dist.GatherOptions()
            opts.rootRank = root
            outs = list(output_lists)
            output_lists = [outs] if (outs or self.rank() == root) else []
            input_tensors = [input_tensors]
        opts = _set_timeout(opts or dist.GatherOptions(), timeout)
        inputs = list(input_tensors)
        output_lists = _nested(output_lists)
        root = opts.rootRank
        checks.root_rank(name, root, self.size())
        checks.single(name, inputs, "input tensor list")
        device = self._on_device(name, inputs)
        outs = []
        if self.rank() == root:
            if len(output_lists) != 1:
                checks.fail(name, f"requires a single-element output list containing a list "
                                  f"with {self.size()} tensors (got {len(output_lists)} lists)")
            if len(output_lists[0]) != self.size():
                checks.fail(name, f"Incorrect output list size {len(output_lists[0])}. Output "
                                  f"list size should be {self.size()}, same as size of the "
                                  f"process group.")
            outs = list(output_lists[0])
            self._on_device(name, outs)
            checks.type_and_size_match(name, outs, inputs[0])
        elif len(output_lists) != 0:
            checks.fail(name, f"requires empty output on non-root (rank {self.rank()}, root "
                              f"{root})")
        if device:
            return self._device_path(inputs).gather(outs, inputs, opts, _gloo_value(output_lists))
        src = as_array(inputs[0], False)[0]
        dsts = [as_array(o, False)[0] for o in outs] or None
        t_s = self._op_timeout(opts)

        def run():
            self.group.gather(src, dsts, root, t_s)
        return self._submit(name, run, _gloo_value(output_lists), opts=opts)

    def scatter(self, output_tensors, input_lists, opts=None, timeout=None):
        """scatter(outputs, input_lists, opts) | scatter(output, inputs, root, timeout=None)."""
        name = "scatter"
        if isinstance(output_tensors, torch.Tensor):  # convenience overload
            root = 0 if opts is None else int(opts)
            opts = dist.ScatterOptions()
            opts.rootRank = root
            ins = list(input_lists)
            input_lists = [ins] if (ins or self.rank() == root) else []
            output_tensors = [output_tensors]
        opts = _set_timeout(opts or dist.ScatterOptions(), timeout)
        outputs = list(output_tensors)
        input_lists = _nested(input_lists)
        root = opts.rootRank
        checks.root_rank(name, root, self.size())
        checks.single(name, outputs, "output tensor list")
        device = self._on_device(name, outputs)
        ins = []
        if self.rank() == root:
            if len(input_lists) != 1:
                checks.fail(name, f"requires a single-element input list containing a list "
                                  f"with {self.size()} tensors (got {len(input_lists)} lists)")
            if len(input_lists[0]) != self.size():
                checks.fail(name, f"Incorrect input list size {len(input_lists[0])}. Input "
                                  f"list size should be {self.size()}, same as size of the "
                                  f"process group.")
            ins = list(input_lists[0])
            self._on_device(name, ins)
            checks.type_and_size_match(name, ins, outputs[0])
        elif len(input_lists) != 0:
            checks.fail(name, f"requires empty input on non-root (rank {self.rank()}, root "
                              f"{root})")
        if device:
            return self._device_path(outputs).scatter(outputs, ins, opts)
        dst = as_array(outputs[0], False)[0]
        srcs = [as_array(t, False)[0] for t in ins] or None
        t_s = self._op_timeout(opts)

        def run():
            self.group.scatter(dst, srcs, root, t_s)
        return self._submit(name, run, outputs, opts=opts)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        name = "alltoall"
        opts = opts or dist.AllToAllOptions()
        outs, ins = list(output_tensors), list(input_tensors)
        for what, lst in (("output", outs), ("input", ins)):
            if len(lst) != self.size():
                checks.fail(name, f"invalid {what} tensor list size {len(lst)} (expected "
                                  f"{self.size()}, the group size)")
        device = self._on_device(name, outs + ins)
        checks.type_match(name, outs + ins)
        if device:
            return self._device_path(outs).alltoall(outs, ins, opts, outs)
        src = [as_array(t, False)[0] for t in ins]
        dst = [as_array(t, False)[0] for t in outs]
        t_s = self._op_timeout(opts)

        def run():
            self.group.all_to_all(dst, src, t_s)
        return self._submit(name, run, outs, opts=opts)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None,
                          opts=None):
        name = "alltoall_base"
        if isinstance(opts, datetime.timedelta):
            opts = _set_timeout(dist.AllToAllOptions(), opts)
        opts = opts or dist.AllToAllOptions()
        device = self._on_device(name, [output, input])
        n = self.size()
        if not output_split_sizes and not input_split_sizes:
            if output.numel() != input.numel() or output.dtype != input.dtype:
                checks.fail(name, f"Tensors are not equal in size or data type (output "
                                  f"{output.dtype} x {output.numel()}, input {input.dtype} x "
                                  f"{input.numel()})")
        else:
            checks.type_match(name, [input], output)
        ins = _split_rows(name, input, input_split_sizes, n)
        outs = _split_rows(name, output, output_split_sizes, n)
        if device:
            return self._device_path([output]).alltoall(outs, ins, opts, [output])
        src = [as_array(t, False)[0] for t in ins]
        dst = [as_array(t, False)[0] for t in outs]
        t_s = self._op_timeout(opts)

        def run():
            self.group.all_to_all(dst, src, t_s)
        return self._submit(name, run, [output], opts=opts)

    alltoall_base = all_to_all_single

    # -- barriers ------------------------------------------------------------------------

    def barrier(self, opts=None, timeout=None):
        """barrier(opts) | barrier(timeout=None). Completes after every operation issued
        before it on this group (ops run in order)."""
        if isinstance(opts, datetime.timedelta):
            opts, timeout = None, opts
        opts = _set_timeout(opts or dist.BarrierOptions(), timeout)
        t_s = self._op_timeout(opts)

        def run():
            try:
                self.group.barrier(t_s)
            except CollectiveTimeoutError as e:
                if dist.get_debug_level() == dist.DebugLevel.DETAIL:
                    missing = re.search(r"for ranks \[([^\]]*)\]", str(e))
                    ranks = missing.group(1) if missing else "?"
                    raise CollectiveTimeoutError(
                        f"{e}; [Rank {self.rank()}] (TORCH_DISTRIBUTED_DEBUG=DETAIL) rank(s) "
                        f"{ranks} failed to pass monitoredBarrier in {int(round(t_s * 1000))} "
                        f"ms") from None
                raise
        return self._submit("barrier", run, [], opts=opts)

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """gloo's monitoredBarrier: rank 0 waits for every other rank (through the store,
        independent of queued collectives) and names the ranks that did not arrive in time:
        "Rank 1 failed to pass monitoredBarrier in 1000 ms" (with wait_all_ranks: every
        such rank, "Ranks 1, 2 failed ..."); the others then fail too. Synchronous.

        Rank 0 checks in gloo's order (ProcessGroupGloo::monitoredBarrier): before waiting
        for each rank, unless wait_all_ranks, the time left in whole ms; none left raises
        "Rank 0 timed out in monitoredBarrier after N ms." naming the ranks processed so
        far. Only rank 0 enforces the timeout (so it reports which rank is late); the
        others wait up to the group's timeout, and fail at once when rank 0 fails."""
        if self._closed:
            raise self._closed_error("monitoredBarrier")
        t_s = self.group.timeout_s if timeout is None else to_seconds(timeout)
        ms = int(round(t_s * 1000))
        with self._lock:
            self._monitored_barriers += 1
            n = self._monitored_barriers
        rank, size = self.rank(), self.size()
        if size == 1:
            return None
        if self._store is None:
            self.barrier(timeout=datetime.timedelta(seconds=t_s)).wait()
            return None
        base = f"shmcoll/monitored_barrier/{n}"
        if rank != 0:
            monitored_barrier_peer(self._store, base, rank, self.group.timeout_s,
                                   self.group.is_peer_alive)
        else:
            try:
                monitored_barrier_root(self._store, base, size, ms, wait_all_ranks,
                                       self.group.is_peer_alive)
            except RuntimeError:
                self._store.set(f"{base}/failed", "1")  # the others fail now, not at timeout
                raise
        return None

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
        with self._lock:
            self._split_count += 1
            count = self._split_count
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
        from .hier_pg import new_process_group
        pg = new_process_group(store, ranks.index(self.rank()), len(ranks), options)
        pg._set_group_name(name)
        if group_desc:
            pg._set_group_desc(group_desc)
        return pg

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


class ProcessGroupShm(EngineProcessGroup):
    """gloo-style direct construction: ProcessGroupShm(store, rank, size, options | timeout).

    `options` is a ProcessGroupShm.Options (`_timeout` in seconds or a timedelta,
    `group_name`); `timeout=` wins over options._timeout. Works with `group=pg` in dist.*
    without being registered, like c10d.ProcessGroupGloo."""

    def __init__(self, store, rank, size, options=None, timeout=None, group_name=None):
        from ..pages import torch_buffers_small_pages
        from ..shm_group import new_shm_group

        if isinstance(options, datetime.timedelta):
            options, timeout = None, options
        options = ShmOptions.coerce(options)
        if timeout is not None:
            options._timeout = timeout
        if group_name:
            options.group_name = str(group_name)
        # torch's tensors, unlike numpy's large arrays, sit on 4 KiB pages unless torch was
        # told otherwise (pages.py): that bounds where reading peers' buffers pays
        group = new_shm_group(store, rank, size, timeout_s=options._timeout.total_seconds(),
                              name=options.group_name, small_pages=torch_buffers_small_pages())
        super().__init__(group, "shm", store=store, options=options)


class _StridedChunks:
    """n equal chunks (in logical element order) of a non-contiguous output tensor: written
    into contiguous temporaries, copied back by write_back()."""

    def __init__(self, output, n):
        self._output = output
        self._tmp = torch.empty(output.numel(), dtype=output.dtype)
        self._chunks = list(self._tmp.chunk(n)) if output.numel() else [self._tmp] * n

    def __getitem__(self, i):
        return self._chunks[i]

    def __len__(self):
        return len(self._chunks)

    def __iter__(self):
        return iter(self._chunks)

    def write_back(self):
        with torch.no_grad():
            self._output.copy_(self._tmp.view(self._output.shape))


_REDUCIBLE = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
              torch.complex128, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
              torch.bool}


def _write_bytes(dst, src_bytes):
    """Copy raw bytes into the numpy array `dst` (possibly strided) of the same nbytes."""
    if dst.flags.c_contiguous:
        dst.reshape(-1).view(np.uint8)[...] = src_bytes
    else:
        dst[...] = src_bytes.view(dst.dtype).reshape(dst.shape)


def _allreduce_opts(opts, op, timeout):
    if isinstance(opts, dist.AllreduceOptions):
        return _set_timeout(opts, timeout)
    if _is_op(opts):
        op = opts
    new = dist.AllreduceOptions()
    if op is not None:
        new.reduceOp = _as_op(op)
    return _set_timeout(new, timeout)


def _coalesced_opts(op):
    new = dist.AllreduceCoalescedOptions()
    if _is_op(op):
        new.reduceOp = _as_op(op)
    return new


def _rs_opts(op):
    new = dist.ReduceScatterOptions()
    if _is_op(op):
        new.reduceOp = _as_op(op)
    return new


def _local_reduce(arrays, op):
    """Reduce a rank's tensor list into its first array, in list order (gloo semantics)."""
    first, dtype = arrays[0]
    d = dtype_of(first, dtype)
    spec = reduce_spec(ReduceOp.SUM if op in (ReduceOp.AVG, ReduceOp.PREMUL_SUM) else op,
                       d, 1, "allreduce")
    flats = [np.ascontiguousarray(a).reshape(-1).view(d.storage) for a, _ in arrays]
    out = np.ascontiguousarray(first).reshape(-1).view(d.storage).copy()
    reduce_into(out, np.array([f.ctypes.data for f in flats], np.int64), spec.op, spec.kind)
    first[...] = out.view(first.dtype).reshape(first.shape)


def _split_rows(name, t, splits, n):
    """Split `t` along dim 0 into n pieces (equal, or by `splits` rows)."""
    splits = list(splits or [])
    rows = t.shape[0] if t.dim() else 0
    if not splits:
        if t.dim() == 0 or rows % n:
            checks.fail(name, f"Tensor's dim 0 does not divide equally across group size "
                              f"(dim 0 is {rows}, group size {n})")
        splits = [rows // n] * n
    if len(splits) != n:
        checks.fail(name, f"Number of tensor splits not equal to group size ({len(splits)} "
                          f"splits, group size {n})")
    if sum(splits) != rows or min(splits) < 0:
        checks.fail(name, f"Split sizes doesn't match total dim 0 size (splits {splits}, "
                          f"dim 0 is {rows})")
    return list(torch.split(t, splits, dim=0))
