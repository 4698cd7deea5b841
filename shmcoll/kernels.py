"""numba reduction kernels over raw slot addresses; nothing else lives here.

reduce_into(out, srcs, op, kind, pre, post) computes, element-wise and in the fixed order
k = 0..K-1, out[i] = post * op(...op(pre*src_0[i], pre*src_1[i])..., pre*src_{K-1}[i]).
Sources are raw int64 addresses (arr.ctypes.data), so a slot in any shared-memory mapping
is read without building a Python object per peer.

Why it looks like this:
* Fixed order, no parallel=True, no fastmath: every rank must get bitwise-identical bytes,
  and the kernels are called concurrently from several threads (nogil).
* Work goes block by block over 0-based views. Each element loop touches only two views,
  which LLVM can check for overlap once and then vectorize. Out is folded into directly
  when that is safe (out is src 0, or aliases no source); otherwise through a private
  block accumulator, so out may alias any source.
* float16 / bfloat16 have no numba support on CPU: they stay uint16 bit patterns, widened to
  float32 with integer bit tricks, accumulated in float32 and rounded once (RNE) at the end.
* Few specializations: one driver for int/float/complex (numba specializes per dtype), one
  for the 16-bit kinds; the op is a runtime int branched on outside the element loops.
"""

import time

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

__all__ = [
    "reduce_unchecked", "reduce_any", "view_like",
    "OP_SUM", "OP_PRODUCT", "OP_MIN", "OP_MAX", "OP_BAND", "OP_BOR", "OP_BXOR",
    "KINDS", "reduce_into", "warm_up",
    "f16_to_f32", "f32_to_f16", "bf16_to_f32", "f32_to_bf16",
]

OP_SUM, OP_PRODUCT, OP_MIN, OP_MAX, OP_BAND, OP_BOR, OP_BXOR = range(7)

_jit = numba.njit(nogil=True, cache=True, boundscheck=False)

# Storage dtypes per kind: bool is uint8 holding 0/1, float16/bfloat16 are uint16 bits.
KINDS = {
    "int": (np.int8, np.uint8, np.int16, np.int32, np.int64),
    "float": (np.float32, np.float64),
    "complex": (np.complex64, np.complex128),
    "float16": (np.uint16,),
    "bfloat16": (np.uint16,),
    "bool": (np.uint8,),
}
_FLOAT_OPS = {OP_SUM, OP_PRODUCT, OP_MIN, OP_MAX}
_KIND_OPS = {
    "int": set(range(7)),
    "bool": {OP_BAND, OP_BOR, OP_BXOR},  # after _BOOL_REMAP
    "float": _FLOAT_OPS, "float16": _FLOAT_OPS, "bfloat16": _FLOAT_OPS,
    "complex": {OP_SUM, OP_PRODUCT},
}
# torch semantics for bool tensors: sum/max are "any", product/min are "all".
_BOOL_REMAP = {OP_SUM: OP_BOR, OP_MAX: OP_BOR, OP_PRODUCT: OP_BAND, OP_MIN: OP_BAND}

_BLOCK_BYTES = 16384  # a block of the accumulator stays in L1 while K sources stream by


# ---------------------------------------------------------------------------- intrinsics

@intrinsic
def _ptr_like(typingctx, addr, like):
    """int64 address -> pointer to like's dtype (so carray needs no dtype argument)."""
    if not isinstance(addr, types.Integer) or not isinstance(like, types.Array):
        return None

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

    return types.CPointer(like.dtype)(types.int64, like), codegen


@intrinsic
def _bits(typingctx, x):
    """float32 -> its bit pattern (uint32)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _f32(typingctx, u):
    """Integer whose low 32 bits are a float32 bit pattern -> that float32."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)), ir.FloatType())

    return types.float32(types.int64), codegen


@_jit
def _view(addr, start, m, like):
    """Elements [start, start+m) of the buffer at addr, typed like `like`."""
    return numba.carray(_ptr_like(addr + start * like.itemsize, like), (m,))


view_like = _view  # compiled callers elsewhere (protocol.py) view raw bytes with it


# ------------------------------------------------------ 16-bit <-> float32 (scalar, bits)
# Integer math is int64 on purpose: numba promotes small ints anyway, and all values fit.

_F32_HALF = np.float32(0.5)


@_jit
def _h2f(h):
    """IEEE half bits -> float32, exact (subnormals, inf; NaN quieted, payload kept)."""
    u = np.int64(h)
    sign = (u & 0x8000) << 16
    o = (u & 0x7FFF) << 13
    e = o & 0x0F800000
    if e == 0x0F800000:  # inf / NaN: exponent 31 -> 255
        return _f32((o + 0x70000000) | sign | (0x00400000 if u & 0x3FF else 0))
    if e == 0:  # zero / subnormal: renormalise by an exact float subtract of 2**-14
        f = _f32(o + 0x38800000) - _f32(0x38800000)
        return _f32(np.int64(_bits(f)) | sign)
    return _f32((o + 0x38000000) | sign)


@_jit
def _f2h(f):
    """float32 -> IEEE half bits: RNE, overflow -> inf, subnormals, NaN quieted."""
    x = np.int64(_bits(f))
    sign = (x >> 16) & 0x8000
    x &= 0x7FFFFFFF
    if x >= 0x47800000:  # |f| >= 65536, inf or NaN
        r = 0x7E00 | ((x >> 13) & 0x3FF) if x > 0x7F800000 else 0x7C00
    elif x < 0x38800000:  # half result is subnormal/zero: the FPU's RNE add aligns it
        r = np.int64(_bits(_f32(x) + _F32_HALF)) - 0x3F000000
    else:  # normal: rebias exponent, add RNE bias; a mantissa carry bumps the exponent
        r = (x - 0x38000000 + 0xFFF + ((x >> 13) & 1)) >> 13
    return r | sign


@_jit
def _b2f(h):
    """bfloat16 bits -> float32 (exact: bfloat16 is the top half of a float32)."""
    return _f32(np.int64(h) << 16)


@_jit
def _f2b(f):
    """float32 -> bfloat16 bits: RNE; NaN quieted, since rounding could make it inf."""
    x = np.int64(_bits(f))
    if (x & 0x7FFFFFFF) > 0x7F800000:
        return (x >> 16) | 0x40
    return (x + 0x7FFF + ((x >> 16) & 1)) >> 16


# ----------------------------------------------------------- element loops (one per op)
# Loops index 0-based views: `out[start + j]` would not vectorize (numba's negative-index
# fix-up makes the address non-affine).

@_jit
def _copy(dst, src, m):
    for j in range(m):
        dst[j] = src[j]


@_jit
def _scale(dst, src, m, s):
    for j in range(m):
        dst[j] = src[j] * s


@_jit
def _fold_arith(acc, x, m, op):
    """SUM / PRODUCT: all complex has. Small ints widen, then wrap on store, like torch."""
    if op == OP_SUM:
        for j in range(m):
            acc[j] = acc[j] + x[j]
    else:
        for j in range(m):
            acc[j] = acc[j] * x[j]


@_jit
def _fold_float(acc, x, m, op):
    # MIN/MAX propagate NaN like torch.minimum/maximum (selects, so they vectorize).
    if op <= OP_PRODUCT:
        _fold_arith(acc, x, m, op)
    elif op == OP_MIN:
        for j in range(m):
            a, b = acc[j], x[j]
            acc[j] = a if (a < b) | (a != a) else b
    else:
        for j in range(m):
            a, b = acc[j], x[j]
            acc[j] = a if (a > b) | (a != a) else b


@_jit
def _fold_int(acc, x, m, op):
    if op <= OP_MAX:
        _fold_float(acc, x, m, op)  # `a != a` is constant-false for ints
    elif op == OP_BAND:
        for j in range(m):
            acc[j] = acc[j] & x[j]
    elif op == OP_BOR:
        for j in range(m):
            acc[j] = acc[j] | x[j]
    else:
        for j in range(m):
            acc[j] = acc[j] ^ x[j]


def _fold(acc, x, m, op):
    """acc[:m] = op(acc[:m], x[:m]), with the loop set picked from the dtype at compile time."""


@overload(_fold)
def _fold_by_dtype(acc, x, m, op):
    # One driver can serve int, float and complex: each dtype types only the ops it has.
    if isinstance(acc.dtype, types.Integer):
        return _fold_int.py_func
    if isinstance(acc.dtype, types.Float):
        return _fold_float.py_func
    return _fold_arith.py_func


# ------------------------------------------------------------------------------ drivers

@_jit
def _reduce_same(out, srcs, op, pre, post):
    """int / float / complex, accumulated in out's own dtype (pre/post are that dtype)."""
    n, nsrc, oa = out.size, srcs.size, out.ctypes.data
    # Fold straight into out unless writing it could clobber a source not yet read (out is
    # src k >= 1) or sources need a scaled copy first. out == src 0 (in place) needs no copy.
    direct = pre == 1
    for k in range(1, nsrc):
        if srcs[k] == oa:
            direct = False
    in_place = direct and srcs[0] == oa
    blk = max(1, _BLOCK_BYTES // out.itemsize)
    acc = np.empty(0 if direct else blk, out.dtype)
    tmp = np.empty(0 if pre == 1 else blk, out.dtype)
    for start in range(0, n, blk):
        m = min(blk, n - start)
        o = _view(oa, start, m, out)
        d = o if direct else acc[:m]
        for k in range(1 if in_place else 0, nsrc):
            x = _view(srcs[k], start, m, out)
            if pre != 1:
                _scale(tmp, x, m, pre)
                x = tmp[:m]
            if k == 0:
                _copy(d, x, m)
            else:
                _fold(d, x, m, op)
        if post != 1:
            _scale(d, d, m, post)
        if not direct:
            _copy(o, d, m)


@_jit
def _reduce_16(out, srcs, op, pre, post, bf16):
    """float16 or bfloat16 bits: widen each block to float32, fold, round once into out."""
    n, oa = out.size, out.ctypes.data
    blk = _BLOCK_BYTES // 8
    acc = np.empty(blk, np.float32)  # private, so out may alias any source
    tmp = np.empty(blk, np.float32)
    for start in range(0, n, blk):
        m = min(blk, n - start)
        for k in range(srcs.size):
            x = _view(srcs[k], start, m, out)
            d = acc if k == 0 else tmp
            if bf16:
                for j in range(m):
                    d[j] = _b2f(x[j])
            else:
                for j in range(m):
                    d[j] = _h2f(x[j])
            if pre != 1:
                _scale(d, d, m, pre)
            if k > 0:
                _fold_float(acc, tmp, m, op)
        if post != 1:
            _scale(acc, acc, m, post)
        o = _view(oa, start, m, out)
        if bf16:
            for j in range(m):
                o[j] = _f2b(acc[j])
        else:
            for j in range(m):
                o[j] = _f2h(acc[j])


def _reduce_typed(out, srcs, op, pre, post, bf16):
    """out = reduction of srcs: the driver for out's dtype, pre/post cast to its precision."""


@overload(_reduce_typed)
def _reduce_typed_by_dtype(out, srcs, op, pre, post, bf16):
    # Chosen at compile time: uint16 storage is float16/bfloat16 bits (`bf16` says which),
    # every other dtype accumulates in itself, scaled in the tensor's own precision as
    # torch does (the cast rounds like numpy's: the same bytes as the Python-level path).
    if out.dtype == types.uint16:
        def impl16(out, srcs, op, pre, post, bf16):
            _reduce_16(out, srcs, op, np.float32(pre), np.float32(post), bf16)
        return impl16
    cast = out.dtype

    def impl(out, srcs, op, pre, post, bf16):
        _reduce_same(out, srcs, op, cast(pre), cast(post))
    return impl


@_jit
def reduce_any(out, srcs, op, pre, post, bf16):
    """The engine's one-call reduction (validated arguments, see reduce_unchecked): pre and
    post are float64, `bf16` tells bfloat16 from float16 bits in uint16 storage."""
    if out.size:
        _reduce_typed(out, srcs, op, pre, post, bf16)


# ------------------------------------------------------ array converters (tests, engine)

@_jit
def f16_to_f32(u):
    """uint16 array of IEEE half bits -> float32 array (exact)."""
    r = np.empty(u.size, np.float32)
    for j in range(u.size):
        r[j] = _h2f(u[j])
    return r


@_jit
def f32_to_f16(f):
    """float32 array -> uint16 array of IEEE half bits (RNE)."""
    r = np.empty(f.size, np.uint16)
    for j in range(f.size):
        r[j] = _f2h(f[j])
    return r


@_jit
def bf16_to_f32(u):
    """uint16 array of bfloat16 bits -> float32 array (exact)."""
    r = np.empty(u.size, np.float32)
    for j in range(u.size):
        r[j] = _b2f(u[j])
    return r


@_jit
def f32_to_bf16(f):
    """float32 array -> uint16 array of bfloat16 bits (RNE)."""
    r = np.empty(f.size, np.uint16)
    for j in range(f.size):
        r[j] = _f2b(f[j])
    return r


# ------------------------------------------------------------------ Python-level dispatch

def reduce_into(out, srcs, op, kind, pre=1.0, post=1.0):
    """Reduce K sources (int64 addresses, each out.size elements of out's dtype) into out."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {sorted(KINDS)}")
    if not isinstance(out, np.ndarray) or out.ndim != 1 or not out.flags.c_contiguous:
        raise ValueError("out must be a 1-D C-contiguous numpy array")
    if not out.flags.writeable:
        raise ValueError("out must be writeable")
    if kind == "bool" and out.dtype == np.bool_:
        out = out.view(np.uint8)  # same bytes; lets callers pass real bool arrays
    if out.dtype.type not in KINDS[kind]:
        raise ValueError(f"dtype {out.dtype} does not match kind {kind!r}")
    if not isinstance(srcs, np.ndarray) or srcs.dtype != np.int64 or srcs.ndim != 1:
        raise ValueError("srcs must be a 1-D np.int64 array of addresses")
    if srcs.size < 1:
        raise ValueError("srcs must hold at least one address")
    op = int(op)
    if kind == "bool":
        op = _BOOL_REMAP.get(op, op)
    if op not in _KIND_OPS[kind]:
        raise ValueError(f"op {op} is not supported for kind {kind!r}")
    if kind in ("int", "bool") and (pre != 1.0 or post != 1.0):
        raise ValueError(f"pre/post scaling is not supported for kind {kind!r}")
    reduce_any(out, np.ascontiguousarray(srcs), op, float(pre), float(post),
               kind == "bfloat16")


def reduce_unchecked(out, srcs, op, kind, pre=1.0, post=1.0):
    """reduce_into without the argument checks, for the engine's hot path: ops.reduce_spec
    has validated (op, kind) and remapped bool ops; the algorithms pass 1-D C-contiguous
    storage-dtype views and int64 address arrays."""
    reduce_any(out, srcs, op, pre, post, kind == "bfloat16")


def warm_up(kinds=None):
    """Compile or load from cache every specialization for `kinds` (default all); seconds."""
    t0 = time.perf_counter()
    for kind in KINDS if kinds is None else kinds:
        for dt in KINDS[kind]:
            a = np.ones(2, dt)
            reduce_into(np.empty(2, dt), np.array([a.ctypes.data] * 2, np.int64),
                        OP_BAND if kind == "bool" else OP_SUM, kind)
        if kind == "float16":
            f32_to_f16(f16_to_f32(np.zeros(1, np.uint16)))
        elif kind == "bfloat16":
            f32_to_bf16(bf16_to_f32(np.zeros(1, np.uint16)))
    return time.perf_counter() - t0
