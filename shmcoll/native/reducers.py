"""numba reduction kernels: one C-callable reducer per element type, built on first use.

reducer(storage, kind) returns the address of a compiled C function

    void reduce(int64 out, int64 srcs, int64 nsrc, int64 offset, int64 mine, int64 nbytes,
                int64 op, double pre, double post)

which computes, element-wise and in the fixed order k = 0..nsrc-1,
out[i] = post * op(...op(pre*src_0[i], pre*src_1[i])..., pre*src_{nsrc-1}[i]) over the
`nbytes` at address `out`. Source k is at srcs[k] + offset (srcs: the address of nsrc
int64 addresses), except source `mine` (-1: none), which is `out` itself: the protocol
kernels pass a slot's address table as it is, with no per-call copy to patch.
Compiled callers (protocol.py, single_copy.py) call it with call_reduce(fn, ...), Python
with reduce_into (checked) or reduce_unchecked (the engine's validated calls).

Why it looks like this:
* A reducer is reached through its address, so the protocol kernels that call it move
  bytes and are compiled once for every dtype; a dtype costs only its own reducer, compiled
  (or loaded from numba's cache) the first time it is reduced. Cold, every storage dtype
  used to compile the protocol kernels again around its reduction: ~5 s per dtype, 48 s
  for all of them (docs/COLD_START.md has the measurements).
* Each reducer is one function with its loops written out, not a tree of small @njit
  helpers: numba compiles every helper on its own and links it into each caller, which
  cost 1.2-1.7 s per dtype against 0.3-0.4 s for one function (2-core VM, numba 0.68,
  first use in a process after the first compilation). The op is a runtime int branched
  on outside the element loops; what a dtype lacks (MIN/MAX for complex, bitwise ops
  for floats, pre/post scales for ints) is pruned at compile time.
* Fixed order, no parallel=True, no fastmath: every rank must get bitwise-identical bytes,
  and reducers run concurrently in several threads (rank threads, no GIL involved).
* Work goes block by block over 0-based views: an element loop indexing `out[start + j]`
  would not vectorize (numba's negative-index fix-up makes the address non-affine). Out is
  folded into directly when that is safe (out is src 0, or aliases no source); otherwise
  through a private block accumulator on the stack, so out may alias any source.
* float16 / bfloat16 have no numba support on CPU: they stay uint16 bit patterns, widened to
  float32 with integer bit tricks, accumulated in float32 and rounded once (RNE) at the end.
"""

import time

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import jit
from .op_codes import OP_BAND, OP_BOR, OP_BXOR, OP_MAX, OP_MIN, OP_PRODUCT, OP_SUM

__all__ = [
    "reducer", "call_reduce", "view_1d", "view_2d", "reduce_into", "reduce_unchecked",
    "OP_SUM", "OP_PRODUCT", "OP_MIN", "OP_MAX", "OP_BAND", "OP_BOR", "OP_BXOR",
    "KINDS", "warm_up", "f16_to_f32", "f32_to_f16", "bf16_to_f32", "f32_to_bf16",
]

_jit = jit.kernel(nogil=True, boundscheck=False)

# Storage dtypes per kind: bool is uint8 holding 0/1, float16/bfloat16 are uint16 bits.
KINDS = {
    "int": (np.int8, np.uint8, np.int16, np.int32, np.int64),
    "float": (np.float32, np.float64),
    "complex": (np.complex64, np.complex128),
    "float16": (np.uint16,),
    "bfloat16": (np.uint16,),
    "bool": (np.uint8,),
}
KINDS_16 = ("float16", "bfloat16")  # kept as uint16 bits, reduced in float32
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

# The reducers' C signature: out, srcs, nsrc, offset, mine, nbytes, op, pre, post.
_SIG = types.void(types.int64, types.int64, types.int64, types.int64, types.int64,
                  types.int64, types.int64, types.float64, types.float64)


# ---------------------------------------------------------------------------- intrinsics

@intrinsic
def _stack_bytes(typingctx, nbytes):
    """The int64 address of `nbytes` bytes on the calling kernel's stack (64-byte aligned,
    uninitialized, gone when the kernel returns): the reducers' block buffers (at most
    2 x 16 KiB). np.empty there would allocate twice per call, and its compiled helper
    would bring the environment _view avoids."""
    if not isinstance(nbytes, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        block = builder.alloca(ir.IntType(8), size=args[0])
        block.align = 64
        return builder.ptrtoint(block, ir.IntType(64))

    return types.int64(types.int64), codegen


@intrinsic
def _view(typingctx, addr, dtype, count):
    """A 1-D C-contiguous array of `count` elements of `dtype` (a numpy scalar type) at the
    int64 address `addr`, owning nothing: numba.carray, without its overload, whose
    compiled helper would carry an environment of numba.np.arrayobj into every reducer's
    cached code (loading one would import that module: ~30 ms of a warm first
    collective). The array helpers below run only while a kernel compiles."""
    if not isinstance(addr, types.Integer) or not isinstance(dtype, types.NumberClass) \
            or not isinstance(count, types.Integer):
        return None
    arrty = types.Array(dtype.instance_type, 1, "C")

    def codegen(context, builder, sig, args):
        elem = context.get_data_type(dtype.instance_type)
        itemsize = context.get_abi_sizeof(elem)
        ary = context.make_array(arrty)(context, builder)
        context.populate_array(
            ary, data=builder.inttoptr(args[0], elem.as_pointer()),
            shape=[context.cast(builder, args[2], sig.args[2], types.intp)],
            strides=[context.get_constant(types.intp, itemsize)], itemsize=itemsize,
            meminfo=None)
        return ary._getvalue()

    return arrty(addr, dtype, count), codegen


view_1d = _view  # for the other layers' kernels (protocol.kernels.one_step_entry)


@intrinsic
def view_2d(typingctx, addr, dtype, rows, cols):
    """_view's 2-D sibling: a C-contiguous rows x cols array of `dtype` at `addr`."""
    if not isinstance(addr, types.Integer) or not isinstance(dtype, types.NumberClass) \
            or not isinstance(rows, types.Integer) or not isinstance(cols, types.Integer):
        return None
    arrty = types.Array(dtype.instance_type, 2, "C")

    def codegen(context, builder, sig, args):
        elem = context.get_data_type(dtype.instance_type)
        itemsize = context.get_abi_sizeof(elem)
        nrows = context.cast(builder, args[2], sig.args[2], types.intp)
        ncols = context.cast(builder, args[3], sig.args[3], types.intp)
        ary = context.make_array(arrty)(context, builder)
        context.populate_array(
            ary, data=builder.inttoptr(args[0], elem.as_pointer()), shape=[nrows, ncols],
            strides=[builder.mul(ncols, context.get_constant(types.intp, itemsize)),
                     context.get_constant(types.intp, itemsize)],
            itemsize=itemsize, meminfo=None)
        return ary._getvalue()

    return arrty(addr, dtype, rows, cols), codegen


@intrinsic
def call_reduce(typingctx, fn, out, srcs, nsrc, offset, mine, nbytes, op, pre, post):
    """Call the reducer at address `fn` (see reducer()) from compiled code."""
    sig = types.void(types.int64, types.int64, types.int64, types.int64, types.int64,
                     types.int64, types.int64, types.int64, types.float64, types.float64)

    def codegen(context, builder, signature, args):
        i64, f64 = ir.IntType(64), ir.DoubleType()
        fnty = ir.FunctionType(ir.VoidType(), [i64] * 7 + [f64, f64])
        builder.call(builder.inttoptr(args[0], fnty.as_pointer()), args[1:])
        return context.get_dummy_value()

    return sig, codegen


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


# ------------------------------------------------------------------------------ reducers
# Built per storage dtype by closure: numba freezes the closure's constants into the code
# (and into the cache key), so each dtype gets its own compiled reducer from one source.

def _build_same(storage, sum_only):
    """The reducer body for int / float / complex storage, accumulated in its own dtype
    (pre/post scale in the tensor's own precision, as torch does); every op, or SUM only."""
    SUM_ONLY = sum_only
    NP = storage.type
    SIZE = storage.itemsize
    BLK = max(1, _BLOCK_BYTES // SIZE)
    SCALED = storage.kind in "fc"  # ints never get pre/post (ops.py refuses AVG, PREMUL)
    ORDERED = storage.kind in "iuf"  # MIN / MAX
    BITWISE = storage.kind in "iu"  # BAND / BOR / BXOR

    def reduce(out_addr, srcs_addr, nsrc, offset, mine, nbytes, op, pre, post):
        n = nbytes // SIZE
        srcs = _view(srcs_addr, np.int64, nsrc)
        scaled = SCALED and pre != 1
        # Fold straight into out unless writing it could clobber a source not yet read (out
        # is src k >= 1) or sources need a scaled copy first. out == src 0 needs no copy.
        direct = not scaled
        for k in range(1, nsrc):
            if k == mine or srcs[k] + offset == out_addr:
                direct = False
        in_place = direct and (mine == 0 or srcs[0] + offset == out_addr)
        acc = _view(_stack_bytes(BLK * SIZE), NP, BLK)
        tmp = _view(_stack_bytes(BLK * SIZE), NP, BLK)
        p, q = NP(pre), NP(post)
        for start in range(0, n, BLK):
            m = min(BLK, n - start)
            o = _view(out_addr + start * SIZE, NP, m)
            d = o if direct else acc[:m]
            for k in range(1 if in_place else 0, nsrc):
                at = out_addr if k == mine else srcs[k] + offset
                x = _view(at + start * SIZE, NP, m)
                if scaled:
                    for j in range(m):
                        tmp[j] = x[j] * p
                    x = tmp[:m]
                if k == 0:
                    for j in range(m):
                        d[j] = x[j]
                elif SUM_ONLY or op == OP_SUM:  # small ints widen, wrap on store, as torch
                    for j in range(m):
                        d[j] = d[j] + x[j]
                elif op == OP_PRODUCT:
                    for j in range(m):
                        d[j] = d[j] * x[j]
                elif ORDERED and op == OP_MIN:  # NaN propagates, as torch.minimum
                    for j in range(m):
                        a, b = d[j], x[j]
                        d[j] = a if (a < b) | (a != a) else b
                elif ORDERED and op == OP_MAX:
                    for j in range(m):
                        a, b = d[j], x[j]
                        d[j] = a if (a > b) | (a != a) else b
                elif BITWISE and op == OP_BAND:
                    for j in range(m):
                        d[j] = d[j] & x[j]
                elif BITWISE and op == OP_BOR:
                    for j in range(m):
                        d[j] = d[j] | x[j]
                elif BITWISE:
                    for j in range(m):
                        d[j] = d[j] ^ x[j]
            if SCALED and post != 1:
                for j in range(m):
                    d[j] = d[j] * q
            if not direct:
                for j in range(m):
                    o[j] = d[j]

    return reduce


def _build_16(bf16, sum_only):
    """The reducer body for float16 (bf16 False) or bfloat16 bits: widen each block to
    float32, fold, round once into out (a private accumulator: out may alias any source);
    every op, or SUM only."""
    BLK = _BLOCK_BYTES // 8
    BF16 = bf16
    SUM_ONLY = sum_only

    def reduce(out_addr, srcs_addr, nsrc, offset, mine, nbytes, op, pre, post):
        n = nbytes // 2
        srcs = _view(srcs_addr, np.int64, nsrc)
        acc = _view(_stack_bytes(BLK * 4), np.float32, BLK)
        tmp = _view(_stack_bytes(BLK * 4), np.float32, BLK)
        p, q = np.float32(pre), np.float32(post)
        for start in range(0, n, BLK):
            m = min(BLK, n - start)
            for k in range(nsrc):
                at = out_addr if k == mine else srcs[k] + offset
                x = _view(at + start * 2, np.uint16, m)
                d = acc if k == 0 else tmp
                if BF16:
                    for j in range(m):
                        d[j] = _b2f(x[j])
                else:
                    for j in range(m):
                        d[j] = _h2f(x[j])
                if pre != 1:
                    for j in range(m):
                        d[j] = d[j] * p
                if k == 0:
                    continue
                if SUM_ONLY or op == OP_SUM:
                    for j in range(m):
                        acc[j] = acc[j] + tmp[j]
                elif op == OP_PRODUCT:
                    for j in range(m):
                        acc[j] = acc[j] * tmp[j]
                elif op == OP_MIN:
                    for j in range(m):
                        a, b = acc[j], tmp[j]
                        acc[j] = a if (a < b) | (a != a) else b
                else:
                    for j in range(m):
                        a, b = acc[j], tmp[j]
                        acc[j] = a if (a > b) | (a != a) else b
            if post != 1:
                for j in range(m):
                    acc[j] = acc[j] * q
            o = _view(out_addr + start * 2, np.uint16, m)
            if BF16:
                for j in range(m):
                    o[j] = _f2b(acc[j])
            else:
                for j in range(m):
                    o[j] = _f2h(acc[j])

    return reduce


_by_key = {}  # (storage, kind, op is SUM) -> reducer address: the lookup of every call
_cfuncs = {}  # (storage dtype, kind or "same", SUM only) -> compiled cfunc


def reducer(storage, kind, op=None):
    """Address of the compiled reducer for `kind` over `storage` elements (see the module
    docstring), compiled or loaded from numba's cache on first use, under the job's
    compile lock (jit.py): one rank compiles it, the others wait and load it. op OP_SUM
    (also AVG and PREMUL_SUM's kernel op) gets a reducer that only sums: the common case
    compiles in ~0.3 s instead of ~0.5 s; any other op, or None, one that does every op."""
    key = (storage, kind, op == OP_SUM)
    fn = _by_key.get(key)
    if fn is None:
        fn = _by_key[key] = _build(np.dtype(storage), kind, op == OP_SUM).address
    return fn


def _build(storage, kind, sum_only):
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {sorted(KINDS)}")
    if storage.type not in KINDS[kind]:
        raise ValueError(f"dtype {storage} does not match kind {kind!r}")
    same = kind not in KINDS_16
    key = (storage, "same" if same else kind, sum_only)
    what = f"the {storage if same else kind} {'sum' if sum_only else 'reduction'} kernel"
    with jit.compiling(what):
        cf = _cfuncs.get(key)
        if cf is None:
            body = _build_same(storage, sum_only) if same else \
                _build_16(kind == "bfloat16", sum_only)
            cf = _cfuncs[key] = jit.cfunc(_SIG, body)
    return cf


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


# ------------------------------------------------------------------ Python-level calls

@_jit
def _reduce_call(fn, out, srcs, op, pre, post):
    """Python's way into a reducer: `out` the output's bytes (uint8), `srcs` addresses."""
    if out.nbytes > 0:
        call_reduce(fn, out.ctypes.data, srcs.ctypes.data, srcs.size, 0, -1, out.nbytes, op,
                    pre, post)


def _warm_reduce_call():
    _reduce_call(0, np.zeros(0, np.uint8), np.zeros(1, np.int64), 0, 1.0, 1.0)  # no bytes


_REDUCE_CALL = "shmcoll's Python-callable reduction"


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
    if out.size:
        fn = reducer(out.dtype, kind, op)
        jit.once(_REDUCE_CALL, _warm_reduce_call)
        _reduce_call(fn, out.view(np.uint8), np.ascontiguousarray(srcs), op, float(pre),
                     float(post))


def reduce_unchecked(out, srcs, fn, op, pre=1.0, post=1.0):
    """reduce_into without the argument checks, for the engine: `fn` is the reducer of
    out's dtype (ops.ReduceSpec.fn, which validated op and kind and remapped bool ops);
    out is 1-D and C-contiguous, srcs a contiguous int64 address array."""
    if out.size:
        jit.once(_REDUCE_CALL, _warm_reduce_call)
        _reduce_call(fn, out.view(np.uint8), srcs, op, pre, post)


def warm_up(kinds=None, python_call=True):
    """Compile or load from cache the reducers of `kinds` (default all), and the way
    Python calls them unless not `python_call`; seconds."""
    t0 = time.perf_counter()
    if python_call:
        jit.once(_REDUCE_CALL, _warm_reduce_call)
    for kind in KINDS if kinds is None else kinds:
        for dt in KINDS[kind]:
            for op in (OP_BAND,) if kind == "bool" else (OP_SUM, OP_PRODUCT):
                reducer(dt, kind, op)
        if kind == "float16":
            f32_to_f16(f16_to_f32(np.zeros(1, np.uint16)))
        elif kind == "bfloat16":
            f32_to_bf16(bf16_to_f32(np.zeros(1, np.uint16)))
    return time.perf_counter() - t0
