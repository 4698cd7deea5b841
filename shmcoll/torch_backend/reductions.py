"""The reductions of EngineProcessGroup (a mixin): allreduce (dense, sparse, coalesced),
reduce, reduce_scatter and its single-tensor and coalesced forms, with gloo's checks."""

import numpy as np
import torch
import torch.distributed as dist

from ..native import compiled
from ..native.ops import ReduceOp, dtype_of, reduce_spec
from . import checks
from . import sparse as _sparse
from .convert import as_array, reduce_op
from .fast import allreduce_inline, reduce_scatter_inline, reduce_scatter_single_inline
from .pg_args import (REDUCIBLE, allreduce_opts, as_op, coalesced_opts, is_op, rs_opts,
                      set_timeout, tensor_list)

__all__ = ["ReduceMixin"]


class ReduceMixin:
    """Reductions of EngineProcessGroup (uses its _submit, _op_timeout, _on_device,
    _device_path, group and size())."""

    # -- reductions ----------------------------------------------------------------------

    def _prepare_reduce(self, name, tensors, op):
        # reduce_spec below may load a reducer: not while the group's warm-up runs (Group's
        # kernel gate says why)
        self.group.wait_kernels()
        arrays = [as_array(t) if t.dtype in REDUCIBLE else None for t in tensors]
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
        tensors = tensor_list(tensors)
        opts = allreduce_opts(opts, op, timeout)
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
        tensors = tensor_list(tensors)
        opts = opts if isinstance(opts, dist.AllreduceCoalescedOptions) else \
            coalesced_opts(opts)
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
        tensors = tensor_list(tensors)
        if not isinstance(opts, dist.ReduceOptions):
            root = 0 if opts is None else int(opts)
            opts = dist.ReduceOptions()
            opts.rootRank = root
            if op is not None:
                opts.reduceOp = as_op(op)
        set_timeout(opts, timeout)
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
        if timeout is None and op is None:
            work = reduce_scatter_inline(self, output_tensors, input_lists, opts)
            if work is not None:
                return work
        name = "reduce_scatter"
        if isinstance(output_tensors, torch.Tensor):  # convenience overload
            output_tensors, input_lists = [output_tensors], [list(input_lists)]
        if not isinstance(opts, dist.ReduceScatterOptions):
            op = opts if is_op(opts) else op
            opts = dist.ReduceScatterOptions()
            if op is not None:
                opts.reduceOp = as_op(op)
        set_timeout(opts, timeout)
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
        opts = opts if isinstance(opts, dist.ReduceScatterOptions) else rs_opts(opts)
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
        opts = opts if isinstance(opts, dist.ReduceScatterOptions) else rs_opts(opts)
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


def _local_reduce(arrays, op):
    """Reduce a rank's tensor list into its first array, in list order (gloo semantics)."""
    first, dtype = arrays[0]
    d = dtype_of(first, dtype)
    spec = reduce_spec(ReduceOp.SUM if op in (ReduceOp.AVG, ReduceOp.PREMUL_SUM) else op,
                       d, 1, "allreduce")
    flats = [np.ascontiguousarray(a).reshape(-1).view(d.storage) for a, _ in arrays]
    out = np.ascontiguousarray(first).reshape(-1).view(d.storage).copy()
    compiled.kernels.reduce_into(out, np.array([f.ctypes.data for f in flats], np.int64),
                                 spec.op, spec.kind)
    first[...] = out.view(first.dtype).reshape(first.shape)
