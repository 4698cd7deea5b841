"""The engine Group's reductions: all_reduce, reduce, reduce_scatter (ReduceMixin).

Part of group.Group: each method validates its arguments, derives (or takes from the
Group's plan cache) the fingerprint, reduction and algorithm, and runs the collective
through the Group's plumbing (_run, _run_one_step, _plan, _select in group.py; _split_in in
group_movement.py).
"""

import numpy as np

from .group_args import _bytes, _check_arrays, _Flat, _shape
from .ops import ReduceOp, dtype_of, reduce_spec


class ReduceMixin:
    """all_reduce, reduce and reduce_scatter of group.Group (see the module docstring)."""

    def all_reduce(self, array, op=ReduceOp.SUM, dtype=None, timeout_s=None, premul=1.0):
        """Reduce `array` over all ranks, in place."""
        if self._poison is not None or self._closed or self._kernels is not None:
            self._usable("all_reduce")
        if type(array) is not np.ndarray:
            _check_arrays("all_reduce", [array])
        flags = array.flags
        if flags.c_contiguous and flags.writeable:  # the common case: no _Flat, plan cached
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
        f = _Flat(array, dt.storage)
        flat = f.flat
        algo = _local_reduce if self._arena is None else \
            self._select("all_reduce", flat.nbytes)
        self._run("all_reduce", (dt.code, flat.size, 0, int(op), _shape(array)), algo,
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
        return self._plan(key, "all_reduce", (dt.code, array.size, 0, int(op), _shape(array)),
                          algo, array.nbytes, dt.storage, spec,
                          None if array.dtype == dt.storage else dt.storage)

    def _plan_reduce_scatter(self, key, out, ins):
        """_plan_all_reduce for reduce_scatter of one contiguous input of equal blocks."""
        _, _, _, _, op, dtype, premul = key
        dt = dtype_of(out, dtype)
        spec = reduce_spec(op, dt, self.world_size, "reduce_scatter", premul)
        sizes = (out.size,) * self.world_size
        return self._plan(key, "reduce_scatter", (dt.code, sum(sizes), 0, int(op),
                                                  _shape(None, sizes)),
                          self._select("reduce_scatter", ins.nbytes), ins.nbytes, dt.storage,
                          spec, None if ins.dtype == dt.storage else dt.storage)

    def reduce(self, array, root=0, op=ReduceOp.SUM, dtype=None, timeout_s=None, premul=1.0):
        """Reduce `array` over all ranks into `root`'s array (others keep theirs)."""
        self._usable("reduce")
        self._root("reduce", root)
        _check_arrays("reduce", [array])
        dt = dtype_of(array, dtype)
        spec = reduce_spec(op, dt, self.world_size, "reduce", premul)
        f = _Flat(array, dt.storage)
        algo = _local_reduce_rooted if self._arena is None else \
            self._select("reduce", f.flat.nbytes)
        self._run("reduce", (dt.code, f.flat.size, root, int(op), _shape(array)), algo,
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
                self._run_one_step("reduce_scatter", plan, src, _bytes(out), -1, timeout_s)
                return out
        _check_arrays("reduce_scatter", [out])
        dt = dtype_of(out, dtype)
        spec = reduce_spec(op, dt, self.world_size, "reduce_scatter", premul)
        if type(ins) is np.ndarray and ins.flags.c_contiguous and ins.dtype == out.dtype \
                and ins.size == self.world_size * out.size:
            # One contiguous input of equal blocks (reduce_scatter_tensor): no split.
            blocks = _bytes(ins).view(dt.storage)
            sizes = (out.size,) * self.world_size
            nbytes = blocks.nbytes
            form = 0
        else:
            ins = self._split_in("reduce_scatter", ins, out)
            blocks = [np.ascontiguousarray(a).reshape(-1).view(dt.storage) for a in ins]
            sizes = tuple(b.size for b in blocks)
            nbytes = sum(b.nbytes for b in blocks)
            form = 1  # the root word: the list form takes other steps (see all_gather)
        f = _Flat(out, dt.storage, copy_in=False)
        algo = _local_reduce_scatter if self._arena is None else \
            self._select("reduce_scatter", nbytes if form == 0 else 0)
        self._run("reduce_scatter", (dt.code, sum(sizes), form, int(op), _shape(None, sizes)),
                  algo, blocks, f.flat, spec, timeout_s=timeout_s, nbytes=nbytes)
        f.write_back()
        return out


# world_size == 1: the same semantics without any shared memory.
def _local_reduce(arena, flat, spec):
    if flat.size and (spec.pre != 1.0 or spec.post != 1.0):
        from .kernels import reduce_into
        reduce_into(flat, np.array([flat.ctypes.data], np.int64), spec.op, spec.kind,
                    spec.pre, spec.post)


def _local_reduce_rooted(arena, flat, root, spec):
    _local_reduce(arena, flat, spec)


def _local_reduce_scatter(arena, blocks, out, spec):
    out[:] = blocks if type(blocks) is np.ndarray else blocks[0]
    _local_reduce(arena, out, spec)
