"""The data movement of EngineProcessGroup (a mixin): broadcast, all-gathers (list,
single-tensor and coalesced forms) and all-to-all, with gloo's checks and future values.
gather and scatter are in gather_scatter.py (GatherScatterMixin)."""

import datetime

import numpy as np
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

from . import checks
from ..engine.group_args import pieces
from .convert import as_array, row_counts
from .fast import all_gather_inline, all_gather_single_inline, all_to_all_inline, \
    all_to_all_single_inline, broadcast_inline
from .pg_args import gloo_value, nested, set_timeout, tensor_list

__all__ = ["MovementMixin"]


class MovementMixin:
    """Data movement of EngineProcessGroup (uses its _submit, _op_timeout, _on_device,
    _device_path, group and size())."""

    # -- data movement -------------------------------------------------------------------

    def broadcast(self, tensors, opts=None, timeout=None, root=None):
        """broadcast(tensors, opts) | broadcast(tensor, root, timeout=None). Every tensor of
        every rank receives root's tensor opts.rootTensor (gloo semantics)."""
        if timeout is None and root is None:
            work = broadcast_inline(self, tensors, opts)
            if work is not None:
                return work
        name = "broadcast"
        tensors = tensor_list(tensors)
        if not isinstance(opts, dist.BroadcastOptions):
            r = root if root is not None else (0 if opts is None else int(opts))
            opts = dist.BroadcastOptions()
            opts.rootRank = r
        set_timeout(opts, timeout)
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
        if timeout is None:
            work = all_gather_inline(self, output_lists, input_tensors, opts)
            if work is not None:
                return work
        name = "allgather"
        if isinstance(input_tensors, torch.Tensor):  # convenience overload
            output_lists, input_tensors = [list(output_lists)], [input_tensors]
            if isinstance(opts, datetime.timedelta):
                opts, timeout = None, opts
        opts = set_timeout(opts or _c10d.AllgatherOptions(), timeout)
        inputs = list(input_tensors)
        output_lists = nested(output_lists)
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
                                                       gloo_value(output_lists))
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
        return self._submit(name, run, gloo_value(output_lists), opts=opts)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """gloo semantics: output_lists[r][i] receives rank r's input_list[i]."""
        name = "allgather_coalesced"
        opts = opts or _c10d.AllgatherOptions()
        inputs = tensor_list(input_list)
        output_lists = nested(output_lists)
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
                                                                 gloo_value(output_lists))
        t_s = self._op_timeout(opts)
        return self._submit(name, self._gather_bytes_job(output_lists, inputs, t_s),
                            gloo_value(output_lists))

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

    def alltoall(self, output_tensors, input_tensors, opts=None):
        name = "alltoall"
        opts = opts or dist.AllToAllOptions()
        work = all_to_all_inline(self, output_tensors, input_tensors, opts)
        if work is not None:
            return work
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
            opts = set_timeout(dist.AllToAllOptions(), opts)
        opts = opts or dist.AllToAllOptions()
        work = all_to_all_single_inline(self, output, input, output_split_sizes,
                                        input_split_sizes, opts)
        if work is not None:
            return work
        device = self._on_device(name, [output, input])
        n = self.size()
        if not output_split_sizes and not input_split_sizes:
            if output.numel() != input.numel() or output.dtype != input.dtype:
                checks.fail(name, f"Tensors are not equal in size or data type (output "
                                  f"{output.dtype} x {output.numel()}, input {input.dtype} x "
                                  f"{input.numel()})")
        else:
            checks.type_match(name, [input], output)
        in_rows = _split_sizes(name, input, input_split_sizes, n)
        out_rows = _split_sizes(name, output, output_split_sizes, n)
        if device:
            ins = list(torch.split(input, in_rows, dim=0))
            outs = list(torch.split(output, out_rows, dim=0))
            return self._device_path([output]).alltoall(outs, ins, opts, [output])
        t_s = self._op_timeout(opts)
        if input.is_contiguous() and output.is_contiguous() and input.dim() and output.dim():
            # the one-array form (one compiled call where my messages ride with the size
            # table); peers may pass other splits or the list form (Group.all_to_all_single)
            src, dst = as_array(input, False)[0], as_array(output, False)[0]
            in_counts, out_counts = row_counts(input, in_rows), row_counts(output, out_rows)

            def run():
                self.group.all_to_all_single(dst, src, out_counts, in_counts, t_s)
            return self._submit(name, run, [output], opts=opts)
        src = _row_pieces(input, in_rows)
        dst = _row_pieces(output, out_rows)

        def run():
            self.group.all_to_all(dst, src, t_s)
        return self._submit(name, run, [output], opts=opts)

    alltoall_base = all_to_all_single


class _StridedChunks:
    """n equal chunks (in logical element order) of a non-contiguous output tensor: written
    into contiguous temporaries, copied back by write_back()."""

    def __init__(self, output, n):
        self._output = output
        self._tmp = torch.empty(output.numel(), dtype=output.dtype, device=output.device)
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


def _write_bytes(dst, src_bytes):
    """Copy raw bytes into the numpy array `dst` (possibly strided) of the same nbytes."""
    if dst.flags.c_contiguous:
        dst.reshape(-1).view(np.uint8)[...] = src_bytes
    else:
        dst[...] = src_bytes.view(dst.dtype).reshape(dst.shape)


def _split_sizes(name, t, splits, n):
    """The rows of each of the n pieces of `t` along dim 0 (equal, or `splits`), checked
    as gloo checks them."""
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
    return splits


def _row_pieces(t, rows):
    """numpy views of the pieces of `t` along dim 0 of `rows` rows each: 1-D slices of
    one view of the whole tensor when it is contiguous (a numpy slice per piece instead of
    a torch view and an array per piece: ~2-4 us a piece), else an array per torch view
    (strided: the engine's Flat copies them)."""
    if t.is_contiguous():
        return pieces(as_array(t, False)[0].reshape(-1), row_counts(t, rows), len(rows))
    return [as_array(p, False)[0] for p in torch.split(t, rows, dim=0)]
