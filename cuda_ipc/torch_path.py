"""The torch ProcessGroup methods for device tensors (the "shm" backend's CUDA half).

EngineProcessGroup (shmcoll/torch_backend/process_group.py) normalizes each call's
arguments and runs gloo's device-independent checks, then hands device tensors here
(`pg._device_path()`), with the same semantics as its host path: list forms, gloo's
future values, uneven reduce_scatter / all_to_all, strided tensors written in place.

Each method converts its tensors to flat contiguous ones on the group's device (a
temporary, copied back after the collective, for a strided tensor), and enqueues the
collective on the caller's current stream through DeviceGroup. The enqueue runs on the
calling thread after the group's queued host jobs (Executor.run_inline): device and host
collectives keep their issue order on one group. Returns a DeviceWork (work.py).
"""

import torch

from shmcoll.engine.group_args import shape_word as _shape_word
from shmcoll.native.ops import DTYPES, ReduceOp
from shmcoll.torch_backend import checks
from shmcoll.torch_backend.convert import SUPPORTED_DTYPES, reduce_op

from .work import DeviceWork

__all__ = ["DevicePath"]


def _dtype_name(name, t):
    n = SUPPORTED_DTYPES.get(t.dtype)
    if n is None:
        checks.fail(name, f"unsupported dtype {t.dtype} for reductions")
    return n


def _code(t):
    n = SUPPORTED_DTYPES.get(t.dtype)
    return DTYPES[n].code if n is not None else 0


def shape_word(t):
    return _shape_word(None, tuple(t.shape))


def _bytes(t):
    """Flat uint8 view of a contiguous tensor."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else \
        torch.empty(0, dtype=torch.uint8, device=t.device)


def _unaliased(srcs, outs):
    """all_to_all's inputs (contiguous byte tensors), each one that shares memory with one
    of `outs` cloned: the chunks write every output's slice before the next chunk reads
    the inputs, so an in-place call (outs[j] is ins[j] with uneven pieces, one tensor as
    both) would read what it already overwrote."""
    spans = [(o.data_ptr(), o.data_ptr() + o.numel()) for o in outs if o.numel()]
    return [t.clone() if t.numel() and any(a < t.data_ptr() + t.numel() and t.data_ptr() < b
                                           for a, b in spans) else t for t in srcs]


class _Buf:
    """A contiguous flat stand-in for tensor `t`: `t` itself when contiguous, else a
    temporary (filled from `t` when `read`), copied back by write_back() when `written`."""

    __slots__ = ("t", "flat", "_tmp")

    def __init__(self, t, read=True):
        self.t = t
        if t.is_contiguous():
            self._tmp = None
            self.flat = t.view(-1)
        else:
            self._tmp = t.contiguous() if read else torch.empty(t.numel(), dtype=t.dtype,
                                                                device=t.device)
            self.flat = self._tmp.view(-1)

    def write_back(self):
        if self._tmp is not None:
            with torch.no_grad():
                self.t.copy_(self._tmp.view(self.t.shape))


class DevicePath:
    """Device-tensor collectives of one EngineProcessGroup `pg` on device group `dgroup`."""

    def __init__(self, pg, dgroup):
        self.pg = pg
        self.dg = dgroup
        self.dev = dgroup.dev

    # -- plumbing ---------------------------------------------------------------------------

    def check(self, name, tensors):
        """Every tensor on this group's device (gloo-worded error otherwise)."""
        want = self.dev.torch_device
        for i, t in enumerate(tensors):
            if t.device != want and not (want.type == "cuda" and t.device.type == "cuda"
                                         and want.index is None):
                checks.fail(name, f"tensors must all be on this process group's device "
                                  f"{want} (index {i} is on {t.device}; use one device per "
                                  f"rank and process group)")

    def _call(self, name, fn, outputs, opts):
        """Number the op like the host path does, enqueue `fn(stream, t_s)` after the
        group's queued host jobs, return its DeviceWork."""
        pg = self.pg
        t_s = pg._op_timeout(opts)
        stream = self.dev.current_stream()
        with pg._lock:
            pg._seq += 1
        with torch.no_grad():
            last = pg._executor.run_inline(fn, stream, t_s)
        work = DeviceWork(self.dg, last, outputs, stream, t_s, pg._works_held)
        if pg._coalescing is not None:
            pg._coalescing.append(work)
        return work

    # -- reductions -------------------------------------------------------------------------

    def allreduce(self, tensors, opts):
        name = "allreduce"
        self.check(name, tensors)
        dtype = _dtype_name(name, tensors[0])
        op, premul = _reduce_op(name, opts.reduceOp)
        bufs = [_Buf(t) for t in tensors]

        def run(stream, t_s):
            first = bufs[0].flat
            if len(bufs) > 1:  # gloo semantics: the whole list is reduced, every tensor gets it
                local = ReduceOp.SUM if op in (ReduceOp.AVG, ReduceOp.PREMUL_SUM) else op
                self.dg._local_fold(stream, first, [b.flat for b in bufs], dtype, local)
            last = self.dg.all_reduce(first, dtype, op, premul, stream, t_s, shape_word(tensors[0]))
            for b in bufs[1:]:
                b.flat.copy_(first)
            for b in bufs:
                b.write_back()
            return last
        return self._call(name, run, tensors, opts)

    def allreduce_coalesced(self, tensors, opts):
        name = "allreduce_coalesced"
        self.check(name, tensors)
        dtype = _dtype_name(name, tensors[0])
        op, premul = _reduce_op(name, opts.reduceOp)

        def run(stream, t_s):
            flat = torch.cat([t.reshape(-1) for t in tensors])
            last = self.dg.all_reduce(flat, dtype, op, premul, stream, t_s)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view(t.shape))
                offset += t.numel()
            return last
        return self._call(name, run, tensors, opts)

    def reduce(self, tensors, opts):
        name = "reduce"
        self.check(name, tensors)
        dtype = _dtype_name(name, tensors[0])
        op, premul = _reduce_op(name, opts.reduceOp)
        buf, root = _Buf(tensors[0]), opts.rootRank

        def run(stream, t_s):
            last = self.dg.reduce(buf.flat, root, dtype, op, premul, stream, t_s,
                                  shape_word(tensors[0]))
            if self.pg.rank() == root:
                buf.write_back()
            return last
        return self._call(name, run, tensors, opts)

    def reduce_scatter(self, name, out, ins, opts, value):
        """out = reduction over ranks of their ins[rank]; ins may differ in size per
        destination (every rank passes the same sizes): blocks are padded to the largest."""
        self.check(name, [out] + list(ins))
        dtype = _dtype_name(name, out)
        op, premul = _reduce_op(name, opts.reduceOp)
        world = self.pg.size()
        sizes = tuple(t.numel() for t in ins)
        width = max(sizes) if sizes else 0
        even = all(s == width for s in sizes)
        obuf = _Buf(out, read=False)

        def run(stream, t_s):
            blocks = (torch.empty if even else torch.zeros)((world, width), dtype=out.dtype,
                                                              device=out.device)
            for r, t in enumerate(ins):
                blocks[r, :t.numel()].copy_(t.reshape(-1))
            dst = obuf.flat if width == out.numel() else \
                torch.empty(width, dtype=out.dtype, device=out.device)
            last = self.dg.reduce_scatter(dst, blocks, dtype, op, premul, stream, t_s,
                                          _shape_word(None, sizes))
            if dst is not obuf.flat:
                obuf.flat.copy_(dst[:out.numel()])
            obuf.write_back()
            return last
        return self._call(name, run, value, opts)

    def reduce_scatter_single(self, name, output, input, opts):
        self.check(name, [output, input])
        dtype = _dtype_name(name, output)
        op, premul = _reduce_op(name, opts.reduceOp)
        world = self.pg.size()
        ibuf, obuf = _Buf(input), _Buf(output, read=False)

        def run(stream, t_s):
            blocks = ibuf.flat.view(world, -1) if ibuf.flat.numel() else \
                ibuf.flat.view(world, 0)
            last = self.dg.reduce_scatter(obuf.flat, blocks, dtype, op, premul, stream, t_s,
                                          shape_word(output))
            obuf.write_back()
            return last
        return self._call(name, run, [output], opts)

    def reduce_scatter_single_coalesced(self, name, outputs, inputs, opts):
        self.check(name, list(outputs) + list(inputs))
        op, premul = _reduce_op(name, opts.reduceOp)
        world = self.pg.size()
        dtypes = [_dtype_name(name, o) for o in outputs]

        def run(stream, t_s):
            last = None
            groups = [list(range(len(outputs)))] if len(set(dtypes)) == 1 else \
                [[i] for i in range(len(outputs))]
            for idx in groups:  # one collective per dtype group, still one operation
                blocks = torch.cat([inputs[i].reshape(world, -1) for i in idx], dim=1)
                out = torch.empty(blocks.shape[1], dtype=blocks.dtype, device=blocks.device)
                last = self.dg.reduce_scatter(out, blocks.contiguous(), dtypes[idx[0]], op,
                                              premul, stream, t_s) or last
                offset = 0
                for i in idx:
                    o = outputs[i]
                    o.copy_(out[offset:offset + o.numel()].view(o.shape))
                    offset += o.numel()
            return last
        return self._call(name, run, outputs, opts)

    # -- data movement ----------------------------------------------------------------------

    def broadcast(self, tensors, opts):
        name = "broadcast"
        self.check(name, tensors)
        root, index = opts.rootRank, opts.rootTensor
        bufs = [_Buf(t, read=(i == index)) for i, t in enumerate(tensors)]

        def run(stream, t_s):
            src = bufs[index]
            last = self.dg.broadcast(_bytes(src.flat), root, _code(tensors[index]), stream, t_s,
                                     shape_word(tensors[index]))
            for i, b in enumerate(bufs):
                if i != index:
                    b.flat.copy_(src.flat)
                if i != index or self.pg.rank() != root:
                    b.write_back()
            return last
        return self._call(name, run, tensors, opts)

    def allgather(self, output_lists, inputs, opts, value):
        """gloo semantics: every output list gets rank r's input j at index r * k + j."""
        name = "allgather"
        self.check(name, list(inputs) + [o for outs in output_lists for o in outs])
        k = len(inputs)
        return self._gather_bytes(name, [[lst[r * k + j] for j in range(k)]
                                         for r in range(self.pg.size())
                                         for lst in output_lists[:1]],
                                  inputs, opts, value, extra=output_lists[1:])

    def allgather_coalesced(self, output_lists, inputs, opts, value):
        name = "allgather_coalesced"
        self.check(name, list(inputs) + [o for outs in output_lists for o in outs])
        return self._gather_bytes(name, output_lists, inputs, opts, value)

    def all_gather_single(self, output, input, opts):
        name = "all_gather_into_tensor"
        self.check(name, [output, input])
        world = self.pg.size()
        ibuf, obuf = _Buf(input), _Buf(output, read=False)

        def run(stream, t_s):
            rows = _bytes(obuf.flat).view(world, -1)
            last = self.dg.all_gather(list(rows), _bytes(ibuf.flat), _code(input), stream, t_s,
                                      shape_word(input))
            obuf.write_back()
            return last
        return self._call(name, run, [output], opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        name = "allgather_into_tensor_coalesced"
        self.check(name, list(outputs) + list(inputs))
        world = self.pg.size()
        lists = [[o.reshape(-1).chunk(world)[r] if o.numel() else o.reshape(-1)
                  for o in outputs] for r in range(world)]
        strided = [o for o in outputs if not o.is_contiguous()]
        if strided:  # chunks of a strided output are copies: gather into temporaries
            temps = [torch.empty_like(o, memory_format=torch.contiguous_format)
                     for o in outputs]
            lists = [[t.reshape(-1).chunk(world)[r] if t.numel() else t.reshape(-1)
                      for t in temps] for r in range(world)]
            return self._gather_bytes(name, lists, inputs, opts, outputs,
                                      after=lambda: [o.copy_(t) for o, t in zip(outputs, temps)])
        return self._gather_bytes(name, lists, inputs, opts, outputs)

    def _gather_bytes(self, name, output_lists, inputs, opts, value, extra=(), after=None):
        """One all_gather of every input's bytes; output_lists[r][i] <- rank r's input i;
        each list in `extra` (more output lists of allgather) gets a copy of the first."""
        world = self.pg.size()

        def run(stream, t_s):
            parts = [_bytes(t.contiguous()) for t in inputs]
            block = torch.cat(parts) if len(parts) > 1 else parts[0]
            gathered = torch.empty((world, block.numel()), dtype=torch.uint8,
                                   device=block.device)
            last = self.dg.all_gather(list(gathered), block, _code(inputs[0]), stream, t_s,
                                      shape_word(inputs[0]))
            for r, outs in enumerate(output_lists):
                offset = 0
                for dst, part in zip(outs, parts):
                    _write(dst, gathered[r, offset:offset + part.numel()])
                    offset += part.numel()
            k = len(inputs)
            for lst in extra:
                for i, o in enumerate(lst):
                    o.copy_(output_lists[i // k][i % k])
            if after is not None:
                after()
            return last
        return self._call(name, run, value, opts)

    def gather(self, outs, inputs, opts, value):
        name = "gather"
        self.check(name, list(inputs) + list(outs))
        root = opts.rootRank
        src = inputs[0]

        def run(stream, t_s):
            dsts = None
            if self.pg.rank() == root:
                dsts = torch.empty((self.pg.size(), src.numel() * src.element_size()),
                                   dtype=torch.uint8, device=src.device)
            last = self.dg.gather(_bytes(src.contiguous()), None if dsts is None else list(dsts),
                                  root, _code(src), stream, t_s, shape_word(src))
            if dsts is not None:
                for o, row in zip(outs, dsts):
                    _write(o, row)
            return last
        return self._call(name, run, value, opts)

    def scatter(self, outputs, ins, opts):
        name = "scatter"
        self.check(name, list(outputs) + list(ins))
        root = opts.rootRank
        obuf = _Buf(outputs[0], read=False)

        def run(stream, t_s):
            pieces = None
            if self.pg.rank() == root:
                pieces = torch.stack([_bytes(t.contiguous()) for t in ins])
            last = self.dg.scatter(_bytes(obuf.flat), pieces, root, _code(outputs[0]), stream,
                                   t_s, shape_word(outputs[0]))
            obuf.write_back()
            return last
        return self._call(name, run, outputs, opts)

    def alltoall(self, outs, ins, opts, value):
        name = "alltoall"
        self.check(name, list(outs) + list(ins))

        def run(stream, t_s):
            bufs = [_Buf(o, read=False) for o in outs]
            dst = [_bytes(b.flat) for b in bufs]
            src = _unaliased([_bytes(t.contiguous()) for t in ins], dst)
            last = self.dg.all_to_all(dst, src, _code(outs[0]), stream, t_s)
            for b in bufs:
                b.write_back()
            return last
        return self._call(name, run, value, opts)


def _reduce_op(name, op):
    try:
        return reduce_op(op)
    except ValueError as e:
        checks.fail(name, str(e))


def _write(dst, src_bytes):
    """Copy raw bytes into tensor `dst` (possibly strided) of the same byte size."""
    if dst.is_contiguous():
        _bytes(dst).copy_(src_bytes)
    else:
        dst.copy_(src_bytes.view(dst.dtype).view(dst.shape))
