"""The engine Group's argument helpers: 1-D views of arrays (a temporary copy for strided
ones), argument checks, and the fingerprint words of an array's dtype and shape. Shared by
group.py and hier/api.py.
"""

import numpy as np

from ..native.ops import dtype_of


class Flat:
    """A 1-D contiguous view of an array; a temporary copy for strided ones, written back."""

    __slots__ = ("array", "flat", "_copied")

    def __init__(self, array, storage, copy_in=True):
        self.array = array
        if array.flags.c_contiguous:
            self.flat = array.reshape(-1).view(storage)
            self._copied = False
        else:
            tmp = np.ascontiguousarray(array) if copy_in else np.empty(array.shape, array.dtype)
            self.flat = tmp.reshape(-1).view(storage)
            self._copied = True

    def write_back(self):
        if self._copied:
            self.array[...] = self.flat.view(self.array.dtype).reshape(self.array.shape)


BYTES = np.dtype(np.uint8)  # what the one-step kernel takes (as_bytes' view, a plan's)


def as_bytes(array):
    """Flat uint8 view of a C-contiguous array (callers make it contiguous first). On the
    latency path of every collective: a 1-D array is viewed without a reshape (~0.2 us)."""
    return (array if array.ndim == 1 else array.reshape(-1)).view(BYTES)


def check_arrays(name, arrays, same_dtype=False):
    """Arguments are numpy arrays (TypeError otherwise), of one dtype where bytes move
    between them (a float64 input into float32 outputs would be silently reinterpreted)."""
    for i, a in enumerate(arrays):
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{name}: expected a numpy array at index {i}, got {type(a).__name__}")
        if same_dtype and a.dtype != arrays[0].dtype:
            raise TypeError(f"{name}: mixed dtypes: {arrays[0].dtype} and {a.dtype} at index {i}")


def shape_word(array, extra=()):
    """Fingerprint word for the array's shape (None: only `extra`, e.g. reduce_scatter's
    split sizes, whose outputs legitimately differ in shape per rank). Equal shapes give
    equal words on every rank (hashes of int tuples do not depend on PYTHONHASHSEED)."""
    shape = () if array is None else tuple(array.shape)
    return hash((shape, tuple(extra))) & 0x7FFFFFFFFFFFFFFF


def dtype_code(array):
    try:
        return dtype_of(array).code
    except TypeError:
        return 0


def all_to_all_single_counts(world_size, out, array, out_counts=None, in_counts=None):
    """all_to_all_single's argument check (the engine's and the hierarchical group's): one
    dtype; `in_counts` / `out_counts`: the elements of each of the world_size pieces of
    the (flat) input and output, in rank order, or both None for equal pieces. -> the two
    lists of counts, or (None, None) for equal pieces."""
    if type(array) is not np.ndarray or type(out) is not np.ndarray:
        check_arrays("all_to_all", [out, array])
    if out.dtype != array.dtype:
        raise TypeError(f"all_to_all: mixed dtypes: {out.dtype} and {array.dtype}")
    if in_counts is None and out_counts is None:
        if array.size % world_size or out.size != array.size:
            raise ValueError(f"all_to_all: input and output must hold {world_size} equal "
                             f"blocks (input {array.size} elements, output {out.size})")
        return None, None
    if in_counts is None or out_counts is None:
        raise ValueError("all_to_all: pass both the input and the output counts, or neither")
    in_counts, out_counts = [int(c) for c in in_counts], [int(c) for c in out_counts]
    for what, counts, a in (("input", in_counts, array), ("output", out_counts, out)):
        if len(counts) != world_size or min(counts) < 0 or sum(counts) != a.size:
            raise ValueError(f"all_to_all: {what} counts {counts} do not split its {a.size} "
                             f"elements into {world_size} pieces")
    return out_counts, in_counts


def pieces(flat, counts, n):
    """The n pieces of 1-D `flat`: of counts[j] elements each, or equal (counts None)."""
    if counts is None:
        return np.split(flat, n)
    return np.split(flat, np.cumsum(counts[:-1])) if n > 1 else [flat]


def unaliased(srcs, outs):
    """`srcs` (all_to_all's inputs), each one that shares memory with one of `outs` replaced
    by a private copy. An in-place call (`dist.all_to_all_single(t, t)`, outs[j] is
    ins[j], pieces of one buffer) would otherwise overwrite inputs that are still to be
    read: by peers reading my buffer where it lies (single copy) while I write my outputs,
    or by a later step of my own (the streamed steps, the hierarchical group's rounds).
    np.may_share_memory compares bounds only (~0.3 us a pair), so a strided view that
    interleaves with an output without touching it is copied too."""
    return [a.copy() if any(np.may_share_memory(a, o) for o in outs) else a for a in srcs]


def all_to_all_args(world_size, outs, ins):
    """all_to_all's checked arguments (the engine's and the hierarchical group's): the
    inputs as contiguous bytes, and a Flat of every output (write_back() after the call).
    The inputs may still be the outputs' memory: see unaliased()."""
    if len(ins) != world_size or len(outs) != world_size:
        raise ValueError(f"all_to_all: expected {world_size} inputs and outputs, got "
                         f"{len(ins)} and {len(outs)}")
    check_arrays("all_to_all", list(outs) + list(ins), same_dtype=True)
    return ([as_bytes(np.ascontiguousarray(a)) for a in ins],
            [Flat(o, o.dtype, copy_in=False) for o in outs])
