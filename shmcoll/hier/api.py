"""The public collectives of HierGroup: the engine Group's signatures and argument checks
(so torch_backend's EngineProcessGroup and fast paths run unchanged on top), then one
framed call into reduce.py / move.py. Checks come first: a bad call raises on the calling
rank, consumes no sequence number and leaves the group usable."""

import numpy as np

from ..engine.group import Group
from ..engine.group_args import (Flat, all_to_all_args, all_to_all_single_counts, as_bytes,
                                 check_arrays, dtype_code, pieces, shape_word, unaliased)
from ..native.ops import ReduceOp, dtype_of, reduce_spec
from . import move, reduce

__all__ = ["Collectives"]


class Collectives:
    """Mixin of HierGroup (uses rank, world_size, run, _usable)."""

    _split_out = Group._split_out  # list checks worded as the engine's (world_size only)
    _split_in = Group._split_in
    _gather_args = Group._gather_args

    def _root(self, name, root):
        if not 0 <= root < self.world_size:
            raise ValueError(f"{name}: invalid root rank {root} (world size {self.world_size})")

    def barrier(self, timeout_s=None):
        self._usable("barrier")
        self.run("barrier", (0, 0, 0, 0, 0), move.barrier, timeout_s=timeout_s)

    def all_reduce(self, array, op=ReduceOp.SUM, dtype=None, timeout_s=None, premul=1.0):
        """Reduce `array` over all ranks, in place (order: hier/reduce.py)."""
        self._usable("all_reduce")
        check_arrays("all_reduce", [array])
        dt = dtype_of(array, dtype)
        reduce_spec(op, dt, self.world_size, "all_reduce", premul)
        f = Flat(array, dt.storage)
        self.run("all_reduce", (dt.code, f.flat.size, 0, int(op), shape_word(array)),
                 reduce.all_reduce, f.flat, dt, op, premul, timeout_s=timeout_s,
                 nbytes=f.flat.nbytes)
        f.write_back()
        return array

    def reduce(self, array, root=0, op=ReduceOp.SUM, dtype=None, timeout_s=None, premul=1.0):
        """Reduce `array` over all ranks into `root`'s array (others keep theirs)."""
        self._usable("reduce")
        self._root("reduce", root)
        check_arrays("reduce", [array])
        dt = dtype_of(array, dtype)
        reduce_spec(op, dt, self.world_size, "reduce", premul)
        f = Flat(array, dt.storage)
        self.run("reduce", (dt.code, f.flat.size, root, int(op), shape_word(array)),
                 reduce.reduce, f.flat, dt, op, premul, root, timeout_s=timeout_s,
                 nbytes=f.flat.nbytes)
        if self.rank == root:
            f.write_back()
        return array

    def reduce_scatter(self, out, ins, op=ReduceOp.SUM, dtype=None, timeout_s=None,
                       premul=1.0):
        """out = reduction over ranks of their ins[rank]; `ins`: a list of world_size
        arrays (sizes may differ per destination) or one array of world_size * out.size."""
        self._usable("reduce_scatter")
        check_arrays("reduce_scatter", [out])
        dt = dtype_of(out, dtype)
        reduce_spec(op, dt, self.world_size, "reduce_scatter", premul)
        if type(ins) is np.ndarray and ins.flags.c_contiguous and ins.dtype == out.dtype \
                and ins.size == self.world_size * out.size:
            blocks = as_bytes(ins).view(dt.storage)
            sizes, form = [out.size] * self.world_size, 0
        else:
            ins = self._split_in("reduce_scatter", ins, out)
            blocks = [np.ascontiguousarray(a).reshape(-1).view(dt.storage) for a in ins]
            sizes, form = [b.size for b in blocks], 1
        f = Flat(out, dt.storage, copy_in=False)
        self.run("reduce_scatter", (dt.code, sum(sizes), form, int(op), shape_word(None, sizes)),
                 reduce.reduce_scatter, f.flat, blocks, sizes, dt, op, premul,
                 timeout_s=timeout_s, nbytes=sum(sizes) * out.itemsize)
        f.write_back()
        return out

    def broadcast(self, array, root=0, timeout_s=None):
        """Copy `array` from `root` to every rank, in place."""
        self._usable("broadcast")
        self._root("broadcast", root)
        check_arrays("broadcast", [array])
        f = Flat(array, array.dtype, copy_in=(self.rank == root))
        self.run("broadcast", (dtype_code(array), f.flat.size, root, 0, shape_word(array)),
                 move.broadcast, as_bytes(f.flat), root, timeout_s=timeout_s,
                 nbytes=f.flat.nbytes)
        if self.rank != root:
            f.write_back()
        return array

    def all_gather(self, outs, array, timeout_s=None):
        """outs[j] (a list of world_size arrays, or one array of world_size * array.size
        elements) receives rank j's `array`."""
        self._usable("all_gather")
        check_arrays("all_gather", [array])
        src = np.ascontiguousarray(array)
        n = self.world_size
        if type(outs) is np.ndarray and outs.flags.c_contiguous and outs.flags.writeable \
                and outs.dtype == array.dtype and outs.size == n * array.size:
            self.run("all_gather", (dtype_code(array), src.size, 0, 0, shape_word(array)),
                     move.all_gather, as_bytes(src), as_bytes(outs), timeout_s=timeout_s,
                     nbytes=src.nbytes)
            return outs
        outs, whole = self._split_out("all_gather", outs, array)
        gathered = np.empty(n * src.nbytes, np.uint8)
        self.run("all_gather", (dtype_code(array), src.size, 1, 0, shape_word(array)),
                 move.all_gather, as_bytes(src), gathered, timeout_s=timeout_s,
                 nbytes=src.nbytes)
        _unpack(gathered, outs, whole)
        return outs

    def gather(self, array, outs=None, root=0, timeout_s=None):
        """Root's outs[j] receives rank j's array; non-roots pass outs=None."""
        src, outs, whole = self._gather_args(array, outs, root)
        gathered = np.empty(self.world_size * src.nbytes, np.uint8) if self.rank == root \
            else None
        self.run("gather", (dtype_code(array), src.size, root, 0, shape_word(array)), move.gather,
                 as_bytes(src), gathered, root, timeout_s=timeout_s, nbytes=src.nbytes)
        if self.rank == root:
            _unpack(gathered, outs, whole)
        return outs

    def scatter(self, out, ins=None, root=0, timeout_s=None):
        """Rank j's `out` receives root's ins[j]; non-roots pass ins=None."""
        self._usable("scatter")
        self._root("scatter", root)
        check_arrays("scatter", [out])
        src = None
        if self.rank == root:
            pieces = self._split_in("scatter", ins, out)
            src = np.concatenate([as_bytes(np.ascontiguousarray(a)) for a in pieces])
        f = Flat(out, out.dtype, copy_in=False)
        self.run("scatter", (dtype_code(out), f.flat.size, root, 0, shape_word(out)), move.scatter,
                 as_bytes(f.flat), src, root, timeout_s=timeout_s, nbytes=f.flat.nbytes)
        f.write_back()
        return out

    def all_to_all(self, outs, ins, timeout_s=None):
        """outs[j] receives rank j's ins[rank]; sizes may differ per pair (must agree)."""
        self._usable("all_to_all")
        src, flats = all_to_all_args(self.world_size, outs, ins)
        dst = [as_bytes(f.flat) for f in flats]
        src = unaliased(src, dst)  # the rounds write outputs before later ones send
        self.run("all_to_all", (dtype_code(outs[0]) if outs else 0, 0, 0, 0, 0),
                 move.all_to_all, dst, src, timeout_s=timeout_s,
                 nbytes=sum(s.size for s in src))
        for f in flats:
            f.write_back()
        return outs

    def all_to_all_single(self, out, array, out_counts=None, in_counts=None, timeout_s=None):
        """Rank j's piece `rank` of its `array` lands as piece j of my `out` (pieces of
        in_counts / out_counts elements, or equal): all_to_all of those pieces."""
        n = self.world_size
        out_counts, in_counts = all_to_all_single_counts(n, out, array, out_counts, in_counts)
        f = Flat(out, out.dtype, copy_in=False)
        self.all_to_all(pieces(f.flat, out_counts, n),
                        pieces(np.ascontiguousarray(array).reshape(-1), in_counts, n), timeout_s)
        f.write_back()
        return out

    # point-to-point goes through the torch backend's world channel (hier_pg.py)
    def isend(self, *args, **kw):
        raise NotImplementedError("send/recv of a group spanning nodes run through the torch "
                                  "backend (dist.send / dist.recv)")

    irecv = isend


def _unpack(gathered, outs, whole):
    """Write world_size equal blocks of `gathered` into the output arrays."""
    n = gathered.size // max(len(outs), 1)
    for j, o in enumerate(outs):
        f = Flat(o, o.dtype, copy_in=False)
        as_bytes(f.flat)[:] = gathered[j * n:(j + 1) * n]
        f.write_back()
    for w in whole:
        w.write_back()
