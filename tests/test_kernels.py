"""shmcoll.native.reducers against numpy references: every (kind, dtype, op), K sources, bitwise."""

import mmap
import threading

import numpy as np
import pytest

from shmcoll.native.reducers import (
    OP_BAND, OP_BOR, OP_BXOR, OP_MAX, OP_MIN, OP_PRODUCT, OP_SUM,
    bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16, reduce_into, warm_up,
)
from support.reference import bf16_rne, bf16_widen

CASES = [
    ("int", np.int8), ("int", np.uint8), ("int", np.int16), ("int", np.int32),
    ("int", np.int64), ("float", np.float32), ("float", np.float64),
    ("complex", np.complex64), ("complex", np.complex128),
    ("float16", np.uint16), ("bfloat16", np.uint16), ("bool", np.uint8),
]
ALL_OPS = [OP_SUM, OP_PRODUCT, OP_MIN, OP_MAX, OP_BAND, OP_BOR, OP_BXOR]
OPS = {
    "int": ALL_OPS,
    "bool": ALL_OPS,  # SUM/MAX -> or, PRODUCT/MIN -> and, remapped inside reduce_into
    "float": [OP_SUM, OP_PRODUCT, OP_MIN, OP_MAX],
    "float16": [OP_SUM, OP_PRODUCT, OP_MIN, OP_MAX],
    "bfloat16": [OP_SUM, OP_PRODUCT, OP_MIN, OP_MAX],
    "complex": [OP_SUM, OP_PRODUCT],
}
SCALED_KINDS = [c for c in CASES if c[0] in ("float", "complex", "float16", "bfloat16")]


# ------------------------------------------------------------------------------ helpers

def addrs(arrays):
    return np.array([a.ctypes.data for a in arrays], np.int64)


def make_src(kind, dt, n, rng, op):
    """Random data with the awkward values each kind has (wrap, NaN, inf, subnormal...)."""
    with np.errstate(all="ignore"):
        return _make_src(kind, dt, n, rng, op) if n else np.empty(0, dt)


def _make_src(kind, dt, n, rng, op):
    if kind == "bool":
        return rng.integers(0, 2, n).astype(np.uint8)
    if kind == "int":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)
    k = n // 300  # a few special values per source (none in tiny arrays)
    if kind == "float":
        a = (rng.standard_normal(n) * 10).astype(dt)
        a[rng.integers(0, n, k)] = rng.choice([np.nan, np.inf, -np.inf], k)
        return a
    if kind == "complex":
        a = (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dt)
        a.real[rng.integers(0, n, k)] = rng.choice([np.nan, np.inf], k)
        return a
    if kind == "float16":
        a = (rng.standard_normal(n) * 300).astype(np.float16).view(np.uint16)
        special = [0x7E00, 0x7C00, 0xFC00, 0x0001, 0x83FF, 0x0200, 0x7AFF, 0x7BFF, 0xF800]
    else:
        f = (rng.standard_normal(n) * 2.0 ** rng.integers(-130, 128, n)).astype(np.float32)
        a = (f.view(np.uint32) >> 16).astype(np.uint16)
        special = [0x7FC0, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x7F7F, 0xFF7F]
    if op in (OP_MIN, OP_MAX):
        a &= 0x7FFF  # keep +/-0 out of min/max: which zero wins is not the point here
    a[rng.integers(0, n, k)] = rng.choice(special, k)
    return a


def _cmul(x, y):
    """Textbook complex multiply in the real dtype (what numba emits, without FMA)."""
    xr, xi = np.real(x), np.imag(x)
    yr, yi = np.real(y), np.imag(y)
    r = np.empty(np.broadcast(x, y).shape, np.result_type(x, y))
    with np.errstate(all="ignore"):
        r.real = xr * yr - xi * yi
        r.imag = xr * yi + xi * yr
    return r


def reference(kind, dt, srcs, op, pre=1.0, post=1.0):
    if kind == "float16":
        xs = [s.view(np.float16).astype(np.float32) for s in srcs]
    elif kind == "bfloat16":
        xs = [bf16_widen(s) for s in srcs]
    else:
        xs = [s.copy() for s in srcs]
    scalar = np.float32 if kind in ("float16", "bfloat16") else np.dtype(dt).type
    mul = _cmul if kind == "complex" else np.multiply
    if pre != 1.0:
        with np.errstate(all="ignore"):
            xs = [mul(x, scalar(pre)) for x in xs]
    if kind == "bool":
        op = {OP_SUM: OP_BOR, OP_MAX: OP_BOR, OP_PRODUCT: OP_BAND, OP_MIN: OP_BAND}.get(op, op)
    fold = {OP_SUM: np.add, OP_PRODUCT: mul, OP_MIN: np.minimum, OP_MAX: np.maximum,
            OP_BAND: np.bitwise_and, OP_BOR: np.bitwise_or, OP_BXOR: np.bitwise_xor}[op]
    acc = xs[0]
    with np.errstate(all="ignore"):
        for x in xs[1:]:
            acc = fold(acc, x)
        if post != 1.0:
            acc = mul(acc, scalar(post))
    if kind == "float16":
        with np.errstate(over="ignore"):
            return acc.astype(np.float16).view(np.uint16)
    if kind == "bfloat16":
        return bf16_rne(acc)
    return acc.astype(dt)


def nan_mask(kind, a):
    if kind == "float16":
        return (a & 0x7FFF) > 0x7C00
    if kind == "bfloat16":
        return (a & 0x7FFF) > 0x7F80
    if kind == "float":
        return np.isnan(a)
    if kind == "complex":
        return np.isnan(a.view(a.real.dtype))
    return np.zeros(a.shape, bool)


def assert_same(kind, got, ref):
    """Bitwise equality, except that any NaN matches any NaN (payload/sign not specified)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if kind == "complex":
        got, ref = got.view(got.real.dtype), ref.view(ref.real.dtype)
    gm, rm = nan_mask(kind, got), nan_mask(kind, ref)
    np.testing.assert_array_equal(gm, rm)
    bits = np.dtype(f"u{got.itemsize}")
    np.testing.assert_array_equal(got[~gm].view(bits), ref[~rm].view(bits))


# -------------------------------------------------------------------------- main matrix

@pytest.mark.parametrize("count", [0, 1, 3333])
@pytest.mark.parametrize("nsrc", [1, 2, 3, 4])
@pytest.mark.parametrize("kind,dt,op", [(k, d, o) for k, d in CASES for o in OPS[k]],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_matches_reference(kind, dt, op, nsrc, count):
    rng = np.random.default_rng([op, nsrc, count, CASES.index((kind, dt))])
    srcs = [make_src(kind, dt, count, rng, op) for _ in range(nsrc)]
    out = np.full(count * np.dtype(dt).itemsize, 0x55, np.uint8).view(dt)  # garbage to overwrite
    reduce_into(out, addrs(srcs), op, kind)
    assert_same(kind, out, reference(kind, dt, srcs, op))


@pytest.mark.parametrize("kind,dt", CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_many_blocks(kind, dt):
    # 70001 elements crosses several kernel blocks for every dtype, with a ragged tail.
    rng = np.random.default_rng(7)
    op = OP_BXOR if kind == "bool" else OP_SUM
    srcs = [make_src(kind, dt, 70001, rng, op) for _ in range(3)]
    out = np.empty(70001, dt)
    reduce_into(out, addrs(srcs), op, kind)
    assert_same(kind, out, reference(kind, dt, srcs, op))


# ------------------------------------------------------------------------------ aliasing

@pytest.mark.parametrize("alias", [0, 1, 3])
@pytest.mark.parametrize("kind,dt,scaled", [(k, d, False) for k, d in CASES]
                         + [(k, d, True) for k, d in SCALED_KINDS],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_out_aliases_a_source(kind, dt, scaled, alias):
    rng = np.random.default_rng(alias)
    op = OP_BXOR if kind == "bool" else OP_SUM
    n = 5000  # > one block for the wide dtypes
    srcs = [make_src(kind, dt, n, rng, op) for _ in range(4)]
    kw = dict(pre=0.5, post=0.25) if scaled else {}
    ref = reference(kind, dt, [s.copy() for s in srcs], op, **kw)
    reduce_into(srcs[alias], addrs(srcs), op, kind, **kw)
    assert_same(kind, srcs[alias], ref)


def test_sources_in_other_mappings():
    # Sources living in separate anonymous mappings, as slots of other ranks do.
    n = 1000
    maps = [mmap.mmap(-1, n * 4) for _ in range(3)]
    views = [np.frombuffer(m, np.float32) for m in maps]
    for i, v in enumerate(views):
        v[:] = np.arange(n, dtype=np.float32) * (i + 1)
    out = np.empty(n, np.float32)
    reduce_into(out, addrs(views), OP_SUM, "float")
    np.testing.assert_array_equal(out, np.arange(n, dtype=np.float32) * 6)


# ------------------------------------------------------------------- pre / post scaling

@pytest.mark.parametrize("nsrc", [1, 2, 4])
@pytest.mark.parametrize("pre,post", [(1.0, 1 / 3), (0.37, 1.0), (1.5, 0.25)])
@pytest.mark.parametrize("kind,dt", SCALED_KINDS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_scaling(kind, dt, pre, post, nsrc):
    rng = np.random.default_rng(nsrc)
    srcs = [make_src(kind, dt, 3333, rng, OP_SUM) for _ in range(nsrc)]
    out = np.empty(3333, dt)
    reduce_into(out, addrs(srcs), OP_SUM, kind, pre=pre, post=post)
    assert_same(kind, out, reference(kind, dt, srcs, OP_SUM, pre, post))


def test_avg_is_sum_times_inverse_world_size():
    a = np.array([1.0, 2.0, 3.0], np.float32)
    b = np.array([3.0, 4.0, 6.0], np.float32)
    out = np.empty(3, np.float32)
    reduce_into(out, addrs([a, b]), OP_SUM, "float", post=0.5)
    np.testing.assert_array_equal(out, [2.0, 3.0, 4.5])


# ---------------------------------------------------------------------- 16-bit rounding

def test_f16_to_f32_exhaustive():
    u = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = f16_to_f32(u).view(np.uint32)
    ref = u.view(np.float16).astype(np.float32).view(np.uint32)
    nan = (u & 0x7FFF) > 0x7C00
    np.testing.assert_array_equal(got[~nan], ref[~nan])
    np.testing.assert_array_equal(got[nan], ref[nan] | 0x00400000)  # quieted, payload kept


def test_f32_to_f16_matches_numpy_rne():
    rng = np.random.default_rng(0)
    bits = np.concatenate([
        rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32),
        # dense around the f16 range: subnormals, normals, the overflow edge
        rng.integers(0x32000000, 0x47900000, 200_000, dtype=np.uint64).astype(np.uint32),
        np.array([0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x33000000, 0x33000001,
                  0x387FC000, 0x387FE000, 0x7F800000, 0x7FC00000, 0x7F800001, 0x80000000],
                 np.uint32),
    ])
    bits = np.concatenate([bits, bits | 0x80000000])
    f = bits.view(np.float32)
    got = f32_to_f16(f)
    with np.errstate(over="ignore"):
        ref = f.astype(np.float16).view(np.uint16)
    nan = np.isnan(f)
    np.testing.assert_array_equal(got[~nan], ref[~nan])
    assert np.all((got[nan] & 0x7E00) == 0x7E00)  # quiet NaN
    np.testing.assert_array_equal(got[nan] >> 15, bits[nan] >> 31)  # sign kept
    assert got[f == np.float32(65520.0)][0] == 0x7C00  # halfway above max -> inf (RNE)


def test_bf16_round_trip_exhaustive():
    u = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    f = bf16_to_f32(u)
    np.testing.assert_array_equal(f.view(np.uint32), u.astype(np.uint32) << 16)
    back = f32_to_bf16(f)
    nan = (u & 0x7FFF) > 0x7F80
    np.testing.assert_array_equal(back[~nan], u[~nan])
    np.testing.assert_array_equal(back[nan], u[nan] | 0x40)


def test_f32_to_bf16_is_nearest_even():
    # Independent oracle: pick the nearer of the two bracketing bf16 values in float64.
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 0x7F800000, 300_000, dtype=np.uint64).astype(np.uint32)
    bits = np.concatenate([bits, (bits & 0xFFFF0000) | 0x8000, [0x7F7FFFFF, 0x7F7F8000]])
    bits = bits.astype(np.uint32)
    f = bits.view(np.float32)
    got = f32_to_bf16(f)
    lo = (bits >> 16).astype(np.uint16)
    hi = lo + np.uint16(1)
    dlo = f.astype(np.float64) - bf16_widen(lo).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        top = np.where(hi == 0x7F80, 2.0 ** 128, bf16_widen(hi).astype(np.float64))
    dhi = top - f.astype(np.float64)
    want = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo & 1, hi, lo)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(f32_to_bf16(np.array([np.inf, -np.inf], np.float32)),
                                  [0x7F80, 0xFF80])


def test_16bit_overflow_nan_subnormal_through_reduce():
    def run(kind, a, b):
        a, b = np.array(a, np.uint16), np.array(b, np.uint16)
        out = np.empty(a.size, np.uint16)
        reduce_into(out, addrs([a, b]), OP_SUM, kind)
        return out.tolist()
    # f16: 60000+60000 -> inf; inf + -inf -> NaN; NaN stays; subnormal + subnormal exact;
    # 65504 + 16 is exactly halfway to 65536 and RNE goes up to inf.
    f16 = lambda v: int(np.float16(v).view(np.uint16))
    got = run("float16", [f16(6e4), 0x7C00, 0x7E00, 0x0001, f16(65504)],
              [f16(6e4), 0xFC00, f16(1), 0x0001, f16(16)])
    assert got[0] == 0x7C00 and got[3] == 0x0002 and got[4] == 0x7C00
    assert (got[1] & 0x7FFF) > 0x7C00 and (got[2] & 0x7FFF) > 0x7C00
    # bf16: max + max -> inf, NaN stays NaN, subnormals add exactly.
    got = run("bfloat16", [0x7F7F, 0x7FC0, 0x0001], [0x7F7F, 0x3F80, 0x0001])
    assert got[0] == 0x7F80 and (got[1] & 0x7FFF) > 0x7F80 and got[2] == 0x0002


# --------------------------------------------------------------- semantics and errors

def test_float_min_max_propagate_nan():
    a = np.array([np.nan, 1.0, 2.0], np.float32)
    b = np.array([0.0, np.nan, 1.0], np.float32)
    out = np.empty(3, np.float32)
    for op, last in ((OP_MIN, 1.0), (OP_MAX, 2.0)):
        reduce_into(out, addrs([a, b]), op, "float")
        assert np.isnan(out[0]) and np.isnan(out[1]) and out[2] == last


def test_int_sum_wraps():
    a = np.array([127, -128], np.int8)
    out = np.empty(2, np.int8)
    reduce_into(out, addrs([a, a]), OP_SUM, "int")
    np.testing.assert_array_equal(out, [-2, 0])


def test_bool_accepts_real_bool_arrays():
    a = np.array([True, False, True])
    b = np.array([True, False, False])
    out = np.empty(3, bool)
    reduce_into(out, addrs([a, b]), OP_SUM, "bool")
    np.testing.assert_array_equal(out, [True, False, True])


@pytest.mark.parametrize("kind,dt,op", [
    ("complex", np.complex64, OP_MIN), ("complex", np.complex128, OP_MAX),
    ("complex", np.complex64, OP_BAND), ("float", np.float32, OP_BAND),
    ("float", np.float64, OP_BOR), ("float", np.float32, OP_BXOR),
    ("float16", np.uint16, OP_BXOR), ("bfloat16", np.uint16, OP_BAND),
    ("int", np.int32, 7), ("int", np.int32, -1),
])
def test_unsupported_op_raises(kind, dt, op):
    a = np.zeros(4, dt)
    with pytest.raises(ValueError):
        reduce_into(np.empty(4, dt), addrs([a]), op, kind)


@pytest.mark.parametrize("kind,dt", [("int", np.int32), ("bool", np.uint8)])
@pytest.mark.parametrize("kw", [dict(pre=2.0), dict(post=0.5)])
def test_scaling_integer_kinds_raises(kind, dt, kw):
    a = np.zeros(4, dt)
    with pytest.raises(ValueError):
        reduce_into(np.empty(4, dt), addrs([a]), OP_SUM if kind == "int" else OP_BOR, kind, **kw)


@pytest.mark.parametrize("make", [
    lambda a: (np.empty(4, np.float32), addrs([a]), "int"),          # dtype vs kind
    lambda a: (np.empty(4, np.float32), addrs([a]), "float16"),
    lambda a: (np.empty(4, np.float32), addrs([a]), "nope"),          # unknown kind
    lambda a: (np.empty(8, np.float32)[::2], addrs([a]), "float"),    # not contiguous
    lambda a: (np.empty((2, 2), np.float32), addrs([a]), "float"),    # not 1-D
    lambda a: (np.empty(4, np.float32), addrs([a]).astype(np.int32), "float"),
    lambda a: (np.empty(4, np.float32), np.empty(0, np.int64), "float"),  # no sources
    lambda a: (np.empty(4, np.float32), [a.ctypes.data], "float"),   # srcs not an array
])
def test_bad_arguments_raise(make):
    a = np.zeros(4, np.float32)
    out, srcs, kind = make(a)
    with pytest.raises(ValueError):
        reduce_into(out, srcs, OP_SUM, kind)


def test_read_only_out_raises():
    a = np.zeros(4, np.float32)
    out = np.empty(4, np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError):
        reduce_into(out, addrs([a]), OP_SUM, "float")


# --------------------------------------------------------------------- reproducibility

@pytest.mark.parametrize("kind,dt", SCALED_KINDS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_bitwise_reproducible(kind, dt):
    rng = np.random.default_rng(3)
    srcs = [make_src(kind, dt, 20000, rng, OP_SUM) for _ in range(4)]
    a, b = np.empty(20000, dt), np.empty(20000, dt)
    reduce_into(a, addrs(srcs), OP_SUM, kind, post=0.25)
    reduce_into(b, addrs(srcs), OP_SUM, kind, post=0.25)
    assert a.tobytes() == b.tobytes()


def test_concurrent_calls_from_threads():
    # The engine calls kernels from several threads at once (nogil, no shared scratch).
    rng = np.random.default_rng(5)
    jobs = [(kind, dt, [make_src(kind, dt, 30000, rng, OP_SUM) for _ in range(3)])
            for kind, dt in SCALED_KINDS] * 2
    outs = [np.empty(30000, dt) for _, dt, _ in jobs]
    errors = []

    def work(i):
        kind, dt, srcs = jobs[i]
        try:
            for _ in range(20):
                reduce_into(outs[i], addrs(srcs), OP_SUM, kind, post=0.5)
        except Exception as e:  # pragma: no cover - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for (kind, dt, srcs), out in zip(jobs, outs):
        assert_same(kind, out, reference(kind, dt, srcs, OP_SUM, post=0.5))


def test_warm_up_returns_seconds():
    assert warm_up(["float"]) >= 0.0
    assert warm_up() >= 0.0
