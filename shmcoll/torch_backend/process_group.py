"""EngineProcessGroup: a torch.distributed ProcessGroup over an engine Group.

Every method validates its arguments with gloo's wording (checks.py) on the calling thread,
then queues a job on the group's Executor and returns a Work at once. Jobs run in issue
order; tensors are read and written in place through numpy views (no copies for contiguous
tensors, a temporary for strided ones).
"""

import datetime

import numpy as np
import torch
import torch.distributed as dist

from ..kernels import reduce_into
from ..ops import ReduceOp, dtype_of, reduce_spec
from . import checks
from .convert import as_array, reduce_op, timeout_s
from .work import Executor, Job, ShmWork

__all__ = ["EngineProcessGroup"]


def _tensors(x):
    return [x] if isinstance(x, torch.Tensor) else list(x)


class _Options:
    """What torch code reads from `pg.options` (`_timeout`, `timeout`, `threads`)."""

    def __init__(self, pg):
        self._pg = pg

    @property
    def _timeout(self):
        return datetime.timedelta(seconds=self._pg.group.timeout_s)

    @_timeout.setter
    def _timeout(self, value):
        self._pg._set_default_timeout(value)

    timeout = _timeout
    threads = 1
    global_ranks_in_group = []
    group_name = ""


class EngineProcessGroup(dist.ProcessGroup):
    """torch ProcessGroup whose collectives run on a shmcoll engine Group."""

    BACKEND_NAME = "shm"

    def __init__(self, group, backend_name="shm"):
        super().__init__(group.rank, group.world_size)
        self.group = group
        self._backend_name = backend_name
        self._executor = Executor(f"{backend_name}-{group.name or 'pg'}", on_abort=group.abort)
        self._closed = False

    # -- plumbing ------------------------------------------------------------------------

    def _submit(self, name, fn, outputs):
        return ShmWork(self._executor, self._executor.submit(Job(name, fn, outputs)))

    def _timeout(self, opts):
        return timeout_s(getattr(opts, "timeout", None), self.group.timeout_s)

    def getBackendName(self):
        return self._backend_name

    def name(self):
        return self._backend_name

    @property
    def options(self):
        return _Options(self)

    def set_timeout(self, timeout):
        self._set_default_timeout(timeout)

    def _set_default_timeout(self, timeout):
        self.group.timeout_s = timeout.total_seconds() if hasattr(timeout, "total_seconds") \
            else float(timeout)

    def _get_sequence_number_for_group(self):
        return self.group.seq

    def _set_sequence_number_for_group(self):
        pass  # our sequence numbers start equal on every rank by construction

    # -- reductions ----------------------------------------------------------------------

    def _prepare_reduce(self, name, tensors, op):
        checks.dense_cpu(name, tensors)
        arrays = [as_array(t) for t in tensors]
        engine_op, premul = reduce_op(op)
        try:
            reduce_spec(engine_op, dtype_of(arrays[0][0], arrays[0][1]), self.size(), name, premul)
        except TypeError as e:
            checks.fail(name, str(e))
        return arrays, engine_op, premul

    def allreduce(self, tensors, opts=None):
        tensors = _tensors(tensors)
        if opts is None or isinstance(opts, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
            opts = dist.AllreduceOptions() if opts is None else _allreduce_opts(opts)
        checks.non_empty("allreduce", tensors)
        if any(t.layout == torch.sparse_coo for t in tensors):
            return self._allreduce_sparse(tensors, opts)
        checks.dense_cpu("allreduce", tensors)
        checks.same_type("allreduce", tensors)
        checks.same_size("allreduce", tensors)
        arrays, op, premul = self._prepare_reduce("allreduce", tensors, opts.reduceOp)
        t_s = self._timeout(opts)

        def run():
            first, dtype = arrays[0]
            if len(arrays) > 1:  # gloo semantics: reduce the whole list, result in every tensor
                _local_reduce(arrays, op)
            self.group.all_reduce(first, op, dtype, t_s, premul)
            for a, _ in arrays[1:]:
                a[...] = first
        return self._submit("allreduce", run, tensors)

    def _allreduce_sparse(self, tensors, opts):
        checks.fail("allreduce", "sparse tensors are not supported yet")

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        tensors = _tensors(tensors)
        checks.non_empty("allreduce_coalesced", tensors)
        for i, t in enumerate(tensors):
            if t.dtype != tensors[0].dtype:
                checks.fail("allreduce_coalesced", "tensors must all have the same type")
            if t.layout != tensors[0].layout:
                checks.fail("allreduce_coalesced", f"invalid tensor layout at index {i}")
        if tensors[0].layout != torch.strided:
            checks.fail("allreduce_coalesced", "unsupported layout")
        checks.dense_cpu("allreduce_coalesced", tensors)
        arrays, op, premul = self._prepare_reduce("allreduce_coalesced", tensors, opts.reduceOp)
        t_s = self._timeout(opts)

        def run():
            # One flat buffer: one collective (and one fingerprint) for the whole list.
            flat = np.concatenate([a.reshape(-1) for a, _ in arrays])
            self.group.all_reduce(flat, op, arrays[0][1], t_s, premul)
            offset = 0
            for a, _ in arrays:
                a[...] = flat[offset:offset + a.size].reshape(a.shape)
                offset += a.size
        return self._submit("allreduce_coalesced", run, tensors)

    def reduce(self, tensors, opts=None):
        tensors = _tensors(tensors)
        opts = opts or dist.ReduceOptions()
        checks.root_rank("reduce", opts.rootRank, self.size())
        checks.root_tensor("reduce", opts.rootTensor, len(tensors))
        checks.single("reduce", tensors, "tensor list")
        arrays, op, premul = self._prepare_reduce("reduce", tensors, opts.reduceOp)
        root, t_s = opts.rootRank, self._timeout(opts)

        def run():
            a, dtype = arrays[0]
            self.group.reduce(a, root, op, dtype, t_s, premul)
        return self._submit("reduce", run, tensors)

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        outs = _tensors(output_tensors)
        checks.single("reduce_scatter", outs, "output tensor list")
        checks.single("reduce_scatter", input_lists, "input list")
        ins = list(input_lists[0])
        if len(ins) != self.size():
            checks.fail("reduce_scatter", f"invalid input tensor list size {len(ins)} "
                                          f"(expected {self.size()})")
        checks.dense_cpu("reduce_scatter", outs + ins)
        checks.same_type("reduce_scatter", ins, outs[0])
        if ins[self.rank()].numel() != outs[0].numel():
            checks.fail("reduce_scatter", f"invalid tensor size: input {self.rank()} has "
                        f"{ins[self.rank()].numel()} elements, output {outs[0].numel()}")
        return self._reduce_scatter("reduce_scatter", outs[0], ins, opts, outs)

    def _reduce_scatter(self, name, out, ins, opts, result):
        [(out_arr, dtype)], op, premul = self._prepare_reduce(name, [out], opts.reduceOp)
        in_arrs = [as_array(t)[0] for t in ins]
        t_s = self._timeout(opts)

        def run():
            self.group.reduce_scatter(out_arr, in_arrs, op, dtype, t_s, premul)
        return self._submit(name, run, result)

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        checks.dense_cpu("reduce_scatter_tensor", [output, input])
        checks.same_type("reduce_scatter_tensor", [input], output)
        if input.numel() != output.numel() * self.size():
            checks.fail("reduce_scatter_tensor", f"input tensor must be the same size as "
                        f"output size times world size (input {input.numel()}, output "
                        f"{output.numel()}, world size {self.size()})")
        ins = list(input.reshape(-1).chunk(self.size())) if input.numel() else \
            [input.reshape(-1)] * self.size()
        return self._reduce_scatter("reduce_scatter_tensor", output, ins, opts, [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else self._submit("reduce_scatter_coalesced", lambda: None, [])

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement -------------------------------------------------------------------

    def broadcast(self, tensors, opts=None):
        tensors = _tensors(tensors)
        if opts is None or isinstance(opts, int):
            root = 0 if opts is None else opts
            opts = dist.BroadcastOptions()
            opts.rootRank = root
        checks.root_rank("broadcast", opts.rootRank, self.size())
        checks.root_tensor("broadcast", opts.rootTensor, len(tensors))
        checks.dense_cpu("broadcast", tensors)
        checks.same_type("broadcast", tensors)
        checks.same_size("broadcast", tensors)
        arrays = [as_array(t, for_reduce=False)[0] for t in tensors]
        root, index, t_s = opts.rootRank, opts.rootTensor, self._timeout(opts)

        def run():
            src = arrays[index]
            self.group.broadcast(src, root, t_s)
            for i, a in enumerate(arrays):
                if i != index:
                    a[...] = src
        return self._submit("broadcast", run, tensors)

    def allgather(self, output_lists, input_tensors, opts=None):
        """gloo semantics: every output list gets rank r's input j at index r * k + j."""
        opts = opts or dist.AllgatherOptions()
        inputs = _tensors(input_tensors)
        checks.non_empty("allgather", inputs, "input tensor list")
        if len(output_lists) != len(inputs):
            checks.fail("allgather", "requires input/output tensor lists to have the same length")
        k = len(inputs)
        for i, outs in enumerate(output_lists):
            if len(outs) != self.size() * k:
                checks.fail("allgather", f"invalid output tensor list at index {i} (expected "
                                         f"length {self.size() * k}, got {len(outs)})")
        checks.dense_cpu("allgather", inputs)
        checks.same_type("allgather", inputs)
        checks.same_size("allgather", inputs)
        for outs in output_lists:
            checks.dense_cpu("allgather", outs)
            checks.same_type("allgather", outs, inputs[0])
            checks.same_size("allgather", outs, inputs[0])
        srcs = [as_array(t, False)[0] for t in inputs]
        dsts = [[as_array(o, False)[0] for o in outs] for outs in output_lists]
        t_s = self._timeout(opts)

        def run():
            first = dsts[0]
            for j, src in enumerate(srcs):
                self.group.all_gather(first[j::k], src, t_s)
            for other in dsts[1:]:
                for a, b in zip(other, first):
                    a[...] = b
        return self._submit("allgather", run, output_lists)

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        return self.allgather(output_lists, input_tensors, opts)

    def all_gather_single(self, output, input, opts=None):
        opts = opts or dist.AllgatherOptions()
        checks.dense_cpu("all_gather_into_tensor", [output, input])
        checks.same_type("all_gather_into_tensor", [input], output)
        if output.numel() != input.numel() * self.size():
            checks.fail("all_gather_into_tensor", f"output tensor size must be equal to "
                        f"world_size times input tensor size (output {output.numel()}, input "
                        f"{input.numel()}, world size {self.size()})")
        src = as_array(input, False)[0]
        dst = as_array(output, False)[0]
        t_s = self._timeout(opts)

        def run():
            self.group.all_gather(dst, src, t_s)
        return self._submit("all_gather_into_tensor", run, [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else self._submit("all_gather_coalesced", lambda: None, [])

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_lists, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        inputs = _tensors(input_tensors)
        root = opts.rootRank
        checks.root_rank("gather", root, self.size())
        checks.single("gather", inputs, "input tensor list")
        if self.rank() == root:
            checks.single("gather", output_lists, "output list")
            if len(output_lists[0]) != self.size():
                checks.fail("gather", f"Incorrect output list size {len(output_lists[0])}. "
                                      f"Output list size should be {self.size()}.")
            outs = list(output_lists[0])
            checks.dense_cpu("gather", inputs + outs)
            checks.same_type("gather", outs, inputs[0])
            checks.same_size("gather", outs, inputs[0])
        elif len(output_lists) != 0:
            checks.fail("gather", "requires empty output on non-root")
        else:
            outs = []
            checks.dense_cpu("gather", inputs)
        src = as_array(inputs[0], False)[0]
        dsts = [as_array(o, False)[0] for o in outs] or None
        t_s = self._timeout(opts)

        def run():
            self.group.gather(src, dsts, root, t_s)
        return self._submit("gather", run, output_lists)

    def scatter(self, output_tensors, input_lists, opts=None):
        opts = opts or dist.ScatterOptions()
        outputs = _tensors(output_tensors)
        root = opts.rootRank
        checks.root_rank("scatter", root, self.size())
        checks.single("scatter", outputs, "output tensor list")
        if self.rank() == root:
            checks.single("scatter", input_lists, "input list")
            if len(input_lists[0]) != self.size():
                checks.fail("scatter", f"Incorrect input list size {len(input_lists[0])}. "
                                       f"Input list size should be {self.size()}.")
            ins = list(input_lists[0])
            checks.dense_cpu("scatter", outputs + ins)
            checks.same_type("scatter", ins, outputs[0])
            checks.same_size("scatter", ins, outputs[0])
        elif len(input_lists) != 0:
            checks.fail("scatter", "requires empty input on non-root")
        else:
            ins = []
            checks.dense_cpu("scatter", outputs)
        dst = as_array(outputs[0], False)[0]
        srcs = [as_array(t, False)[0] for t in ins] or None
        t_s = self._timeout(opts)

        def run():
            self.group.scatter(dst, srcs, root, t_s)
        return self._submit("scatter", run, outputs)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.AllToAllOptions()
        outs, ins = list(output_tensors), list(input_tensors)
        for name, lst in (("output", outs), ("input", ins)):
            if len(lst) != self.size():
                checks.fail("alltoall", f"invalid {name} tensor list size {len(lst)} "
                                        f"(expected {self.size()})")
        checks.dense_cpu("alltoall", outs + ins)
        checks.same_type("alltoall", outs + ins)
        src = [as_array(t, False)[0] for t in ins]
        dst = [as_array(t, False)[0] for t in outs]
        t_s = self._timeout(opts)

        def run():
            self.group.all_to_all(dst, src, t_s)
        return self._submit("alltoall", run, outs)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None,
                          opts=None):
        opts = opts or dist.AllToAllOptions()
        checks.dense_cpu("alltoall_base", [output, input])
        checks.same_type("alltoall_base", [input], output)
        n = self.size()
        ins = _split_rows("alltoall_base", input, input_split_sizes, n)
        outs = _split_rows("alltoall_base", output, output_split_sizes, n)
        src = [as_array(t, False)[0] for t in ins]
        dst = [as_array(t, False)[0] for t in outs]
        t_s = self._timeout(opts)

        def run():
            self.group.all_to_all(dst, src, t_s)
        return self._submit("alltoall_base", run, [output])

    alltoall_base = all_to_all_single

    def barrier(self, opts=None):
        t_s = self._timeout(opts) if opts is not None else self.group.timeout_s

        def run():
            self.group.barrier(t_s)
        return self._submit("barrier", run, [])

    # -- lifecycle -----------------------------------------------------------------------

    def abort(self):
        """Wake anything blocked in this group (any thread) and fail what is queued."""
        self.group.abort()
        self._shutdown(abort=True)

    def shutdown(self):
        """Finish (or, if stuck, abort) queued work, then release the shared memory."""
        self._shutdown(abort=True)

    def _shutdown(self, abort):
        if self._closed:
            return
        self._closed = True
        joined = self._executor.stop(abort_pending=abort)
        if joined:  # never unmap memory a still-running job could touch
            self.group.close()


def _allreduce_opts(op):
    opts = dist.AllreduceOptions()
    opts.reduceOp = op if isinstance(op, dist.ReduceOp) else dist.ReduceOp(op)
    return opts


def _local_reduce(arrays, op):
    """Reduce a rank's tensor list into its first array, in list order (gloo semantics)."""
    first, dtype = arrays[0]
    d = dtype_of(first, dtype)
    spec = reduce_spec(ReduceOp.SUM if op in (ReduceOp.AVG, ReduceOp.PREMUL_SUM) else op,
                       d, 1, "allreduce")
    flats = [np.ascontiguousarray(a).reshape(-1).view(d.storage) for a, _ in arrays]
    out = np.ascontiguousarray(first).reshape(-1).view(d.storage)
    reduce_into(out, np.array([f.ctypes.data for f in flats], np.int64), spec.op, spec.kind)
    first[...] = out.view(first.dtype).reshape(first.shape)


def _split_rows(name, t, splits, n):
    """Split `t` along dim 0 into n pieces (equal, or by `splits` rows)."""
    if not splits:
        if t.dim() == 0 or t.shape[0] % n:
            checks.fail(name, f"tensor's dim 0 ({t.shape[0] if t.dim() else 0}) does not "
                              f"divide equally across group size {n}")
        splits = [t.shape[0] // n] * n
    if len(splits) != n or sum(splits) != t.shape[0] or min(splits) < 0:
        checks.fail(name, f"split sizes {list(splits)} do not match dim 0 ({t.shape[0]}) and "
                          f"group size {n}")
    return list(torch.split(t, list(splits), dim=0))
