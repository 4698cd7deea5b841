"""The engine Group's data movement: broadcast, all_gather, gather, scatter, all_to_all
(MovementMixin), and the list helpers that split one array into world_size (also used by
reduce_scatter).

Part of group.Group: each method validates its arguments and runs the collective through
the Group's plumbing (_run, _run_one_step, _plan, _select, _root in group.py).
"""

import numpy as np

from .group_args import _all_to_all_args, _bytes, _check_arrays, _code_of, _Flat, _shape


class MovementMixin:
    """broadcast, all_gather, gather, scatter and all_to_all of group.Group (see the module
    docstring)."""

    def broadcast(self, array, root=0, timeout_s=None):
        """Copy `array` from `root` to every rank, in place."""
        if self._poison is not None or self._closed or self._kernels is not None:
            self._usable("broadcast")
        if type(array) is np.ndarray and self._arena is not None and \
                array.flags.c_contiguous and array.flags.writeable:
            key = ("broadcast", array.dtype, array.shape, root)
            plan = self._plans.get(key)
            if plan is None:
                self._root("broadcast", root)
                plan = self._plan(key, "broadcast", (_code_of(array), array.size, root, 0,
                                                     _shape(array)),
                                  self._select("broadcast", array.nbytes), array.nbytes,
                                  np.dtype(np.uint8))
            if plan.mode is not None:
                self._run_one_step("broadcast", plan, _bytes(array), None, root,
                                   timeout_s)
                return array
        self._root("broadcast", root)
        _check_arrays("broadcast", [array])
        f = _Flat(array, array.dtype, copy_in=(self.rank == root))
        self._run("broadcast", (_code_of(array), f.flat.size, root, 0, _shape(array)),
                  _local_nothing if self._arena is None else
                  self._select("broadcast", f.flat.nbytes), _bytes(f.flat), root,
                  timeout_s=timeout_s, nbytes=f.flat.nbytes)
        if self.rank != root:
            f.write_back()
        return array

    def all_gather(self, outs, array, timeout_s=None):
        """outs[j] (list of world_size arrays, or one array of world_size * array.size
        elements) receives rank j's `array`."""
        if self._poison is not None or self._closed or self._kernels is not None:
            self._usable("all_gather")
        _check_arrays("all_gather", [array])
        if type(outs) is np.ndarray and outs.flags.c_contiguous and outs.flags.writeable \
                and outs.dtype == array.dtype and outs.size == self.world_size * array.size:
            # One contiguous output (all_gather_into_tensor): gathered straight into it.
            src = array if array.flags.c_contiguous else np.ascontiguousarray(array)
            if self._arena is not None:
                key = ("all_gather", array.dtype, array.shape)
                plan = self._plans.get(key)
                if plan is None:
                    plan = self._plan(key, "all_gather", (_code_of(array), src.size, 0, 0,
                                                          _shape(array)),
                                      self._select("all_gather", src.nbytes), src.nbytes,
                                      np.dtype(np.uint8))
                if plan.mode is not None:
                    self._run_one_step("all_gather", plan, _bytes(src), _bytes(outs), -1,
                                       timeout_s)
                    return outs
            self._run("all_gather", (_code_of(array), src.size, 0, 0, _shape(array)),
                      _local_all_gather if self._arena is None else
                      self._select("all_gather", src.nbytes),
                      _bytes(src), _bytes(outs), timeout_s=timeout_s, nbytes=src.nbytes)
            return outs
        outs, whole = self._split_out("all_gather", outs, array)
        src = np.ascontiguousarray(array)
        flats = [_Flat(o, o.dtype, copy_in=False) for o in outs]
        # root word 1: the list form moves its bytes in other steps than the one-array
        # form (and never single-copy), so a rank calling the other form must mismatch
        self._run("all_gather", (_code_of(array), src.size, 1, 0, _shape(array)),
                  _local_all_gather if self._arena is None else self._select("all_gather", 0),
                  _bytes(src), [_bytes(f.flat) for f in flats], timeout_s=timeout_s,
                  nbytes=src.nbytes)
        for f in flats + whole:
            f.write_back()
        return outs

    def gather(self, array, outs=None, root=0, timeout_s=None):
        """Root's outs[j] receives rank j's array; non-roots pass outs=None."""
        src, outs, whole = self._gather_args(array, outs, root)
        flats = [_Flat(o, o.dtype, copy_in=False) for o in outs] if self.rank == root else []
        self._run("gather", (_code_of(array), src.size, root, 0, _shape(array)),
                  _local_all_gather_rooted if self._arena is None else self._select("gather", 0),
                  _bytes(src), [_bytes(f.flat) for f in flats], root, timeout_s=timeout_s,
                  nbytes=src.nbytes)
        for f in flats + whole:
            f.write_back()
        return outs

    def scatter(self, out, ins=None, root=0, timeout_s=None):
        """Rank j's `out` receives root's ins[j]; non-roots pass ins=None."""
        self._usable("scatter")
        self._root("scatter", root)
        _check_arrays("scatter", [out])
        pieces = []
        if self.rank == root:
            pieces = [_bytes(np.ascontiguousarray(a)) for a in self._split_in("scatter", ins, out)]
        f = _Flat(out, out.dtype, copy_in=False)
        self._run("scatter", (_code_of(out), f.flat.size, root, 0, _shape(out)),
                  _local_scatter if self._arena is None else self._select("scatter", 0),
                  pieces, _bytes(f.flat), root, timeout_s=timeout_s, nbytes=f.flat.nbytes)
        f.write_back()
        return out

    def all_to_all(self, outs, ins, timeout_s=None):
        """outs[j] receives rank j's ins[rank]; sizes may differ per pair (must agree)."""
        self._usable("all_to_all")
        src, flats = _all_to_all_args(self.world_size, outs, ins)
        self._run("all_to_all", (_code_of(outs[0]) if outs else 0, 0, 0, 0),
                  _local_all_to_all if self._arena is None else self._select("all_to_all", 0),
                  src, [_bytes(f.flat) for f in flats], timeout_s=timeout_s,
                  nbytes=sum(s.size for s in src))
        for f in flats:
            f.write_back()
        return outs

    # -- list helpers --------------------------------------------------------------------

    def _gather_args(self, array, outs, root):
        """gather's checks, shared with HierGroup: -> (array as a contiguous source, the
        root's output arrays (non-roots: `outs` as given), the root's arrays to write back
        (_split_out's `whole`; [] elsewhere))."""
        self._usable("gather")
        self._root("gather", root)
        _check_arrays("gather", [array])
        whole = []
        if self.rank == root:
            outs, whole = self._split_out("gather", outs, array)
        return np.ascontiguousarray(array), outs, whole

    def _split_out(self, name, outs, array):
        """-> (world_size output arrays, [_Flat to write back after the collective]).

        One output array is split through a _Flat: `reshape(-1)` of a strided array may be
        a copy, and results written into a copy would be lost."""
        whole = []
        if isinstance(outs, np.ndarray):
            if outs.size != self.world_size * array.size:
                raise ValueError(f"{name}: output has {outs.size} elements, expected "
                                 f"{self.world_size} x {array.size}")
            whole = [_Flat(outs, outs.dtype, copy_in=False)]
            flat = whole[0].flat
            outs = np.split(flat, self.world_size) if flat.size else [flat] * self.world_size
        if len(outs) != self.world_size:
            raise ValueError(f"{name}: expected {self.world_size} outputs, got {len(outs)}")
        _check_arrays(name, [array] + list(outs), same_dtype=True)
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
        _check_arrays(name, [out] + list(ins), same_dtype=True)
        if ins[self.rank].size != out.size:
            raise ValueError(f"{name}: input for rank {self.rank} has {ins[self.rank].size} "
                             f"elements, output {out.size}")
        return ins


# world_size == 1: the same semantics without any shared memory.
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
