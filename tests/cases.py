"""Collective checks written once, run on every kind and world size (mpi4py BaseTestCCOBuf).

Each check runs on one rank of an engine Group (numpy API): it builds every rank's input from
(rank, seed), calls the collective, and compares this rank's output bit for bit with a numpy
reference. It returns a digest of what must be identical on every rank (None where ranks
legitimately differ), so the caller can also assert that all ranks got the same bytes.

References follow the engine's documented arithmetic (support/reference.py: reduce in rank
order, pre-scale by the PREMUL_SUM factor, post-scale by 1/world_size for AVG, float16/bfloat16
accumulated in float32 and rounded once). Inputs
are small dyadic rationals, so sums and products are exact and only that final rounding
(and AVG's scale) can differ from exact arithmetic.

Layouts: "contig"; "strided" (every other element of a buffer whose other bytes hold a 0xA5
sentinel, checked afterwards); "strided2d" (a 2-D non-contiguous view with sentinel
columns); "0d" (a 0-d array, count 1). all_gather/gather/scatter also take "flat" (one
array of world_size * count elements) and "flat_strided" (that array as a 2-D view that not
even reshape(-1) can flatten without a copy); reduce_scatter takes "flat", "flat_strided"
and "uneven" (a list of per-destination blocks of different sizes).

Sweeps: run_cases() runs (name, thunk) pairs inside a rank, collecting AssertionErrors (a
wrong value is local, so the collectives stay in step) and re-raising anything else with the
case name attached; assert_rank_results() checks the per-rank outcomes in the test process.
"""

import functools
import hashlib

import numpy as np

from shmcoll import ReduceOp
from support.reference import bf16_widen, PREMUL, reference_reduce

__all__ = [
    "DTYPES", "COUNTS", "LARGE_COUNT", "LAYOUT_CASES", "SMALL_SLOT_ENV", "PREMUL", "valid_ops", "invalid_ops",
    "make_input", "reference_reduce", "check_all_reduce", "check_broadcast", "check_reduce",
    "check_all_gather", "check_reduce_scatter", "check_gather", "check_scatter",
    "check_all_to_all", "check_barrier", "check_unsupported_ops", "run_cases",
    "assert_rank_results", "case_name",
]

DTYPES = ("float16", "bfloat16", "float32", "float64", "complex64", "complex128",
          "int8", "uint8", "int16", "int32", "int64", "bool")
SMALL_SLOT_BYTES = 64 << 10
SMALL_SLOT_ENV = {"SHMCOLL_SLOT_BYTES": str(SMALL_SLOT_BYTES)}
# Larger than a 64 KiB slot even for 1-byte dtypes (2 chunks), 17 chunks for complex128;
# odd, and not a multiple of any world size, so chunk and slice edges are uneven.
LARGE_COUNT = 70001
COUNTS = (0, 1, 3333, LARGE_COUNT)
# (count, layout) of the non-contiguous and 0-d cases every in-place collective runs
LAYOUT_CASES = ((3333, "strided"), (3333, "strided2d"), (1, "0d"), (0, "strided"))

_FLOATS = ("float16", "bfloat16", "float32", "float64")
_COMPLEX = ("complex64", "complex128")
_INTS = ("int8", "uint8", "int16", "int32", "int64")
_O = ReduceOp
_VALID = {
    **{d: (_O.SUM, _O.AVG, _O.PRODUCT, _O.MIN, _O.MAX, _O.PREMUL_SUM) for d in _FLOATS},
    **{d: (_O.SUM, _O.AVG, _O.PRODUCT, _O.PREMUL_SUM) for d in _COMPLEX},
    **{d: (_O.SUM, _O.PRODUCT, _O.MIN, _O.MAX, _O.BAND, _O.BOR, _O.BXOR) for d in _INTS},
    "bool": (_O.SUM, _O.PRODUCT, _O.MIN, _O.MAX, _O.BAND, _O.BOR, _O.BXOR),
}
_NUMPY = {"bfloat16": np.uint16}  # storage of the dtypes numpy lacks
SENTINEL_BYTE = 0xA5


def valid_ops(dtype):
    """The reduce ops the engine supports for `dtype` (every other op raises TypeError)."""
    return _VALID[dtype]


def invalid_ops(dtype):
    return tuple(op for op in ReduceOp if op not in _VALID[dtype])


def storage(dtype):
    return np.dtype(_NUMPY.get(dtype, dtype))


def engine_dtype(dtype):
    """The `dtype=` argument for the engine: only bfloat16 needs one (uint16 bits)."""
    return "bfloat16" if dtype == "bfloat16" else None


def case_name(collective, **params):
    parts = [f"{k}={v.name if isinstance(v, ReduceOp) else v}" for k, v in params.items()]
    return f"{collective}({', '.join(parts)})"


# -------------------------------------------------------------------------------- inputs

def make_input(dtype, count, rank, seed, op=ReduceOp.SUM, tag=0):
    """Rank `rank`'s input (1-D, storage dtype): the same on every rank that computes it.

    A window of a per-(dtype, value family, seed) pool of random values, at an offset
    derived from (rank, tag, count, op): generating the pool once per process keeps the
    sweeps cheap (every rank also builds its peers' inputs for the reference)."""
    family = _family(dtype, op)
    pool = _pool(dtype, family, seed)
    key = rank * 7919 + tag * 104729 + count * 31 + int(op) * 1299709
    if count > pool.size:  # multi-MiB cases: the pool repeated, rotated
        return np.roll(np.resize(pool, count), key % count)
    offset = key % (pool.size - count + 1)
    return pool[offset:offset + count].copy()


POOL_COUNT = 1 << 18  # > 3 x LARGE_COUNT, so ranks' windows start at different places


def _family(dtype, op):
    """Which value distribution an op needs (1: "all"-style bool ops, exact products)."""
    if dtype == "bool":
        return int(op in (_O.PRODUCT, _O.MIN, _O.BAND))  # AND of ranks needs mostly Trues
    return int(op == _O.PRODUCT and dtype not in _INTS)


@functools.lru_cache(maxsize=None)
def _pool(dtype, family, seed):
    rng = np.random.default_rng([seed & 0xFFFFFFFF, DTYPES.index(dtype), family])
    n = POOL_COUNT
    if dtype == "bool":
        pool = rng.random(n) < (0.85 if family else 0.3)
    elif dtype in _INTS:
        info = np.iinfo(dtype)  # full range: sums and products wrap, as in torch
        pool = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    elif dtype in _COMPLEX:
        pool = (_dyadic(rng, n, family) + 1j * _dyadic(rng, n, family)).astype(dtype)
    elif dtype == "bfloat16":  # exactly representable: the top half of the float32 bits
        pool = (_dyadic(rng, n, family).astype(np.float32).view(np.uint32) >> 16)
        pool = pool.astype(np.uint16)
    else:
        pool = _dyadic(rng, n, family).astype(dtype)
    pool.flags.writeable = False
    return pool


def _dyadic(rng, count, product):
    """Values every dtype holds exactly: quarters in [-16, 16]; +-{0.5, 1, 2} for PRODUCT."""
    if product:
        return rng.choice(np.array([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0]), count)
    return rng.integers(-64, 65, count) / 4.0


# ------------------------------------------------------------------------------- layouts

class Placed:
    """An array of some layout holding given values, and the sentinel bytes around it."""

    def __init__(self, values, layout, rows=1):
        values = np.asarray(values)
        n = values.size
        self.base = None
        gaps = np.s_[:, 1::2]
        if layout == "contig":
            self.array = values.copy()
        elif layout == "0d":
            assert n == 1, "0-d layout needs count 1"
            self.array = values.reshape(()).copy()
        elif layout == "strided":
            self.base = np.empty(2 * n + 2, values.dtype)
            self._fill_sentinel()
            self.array = self.base[1:2 * n + 1:2]
            self.array[...] = values
        elif layout == "strided2d":
            assert n % 3 == 0, "strided2d layout needs a count divisible by 3"
            rows, cols = 3, n // 3
            self.base = np.empty((rows, 2 * cols + 1), values.dtype)
            self._fill_sentinel()
            self.array = self.base[:, 1::2]
            self.array[...] = values.reshape(rows, cols)
        elif layout == "rows":  # (rows, n / rows) with a sentinel column before each row:
            cols = n // rows    # not even reshape(-1) can view it without a copy
            self.base = np.empty((rows, cols + 1), values.dtype)
            self._fill_sentinel()
            self.array = self.base[:, 1:]
            self.array[...] = values.reshape(rows, cols)
            gaps = np.s_[:, 1:]
        else:
            raise ValueError(f"unknown layout {layout!r}")
        if self.base is not None:
            self._mask = np.ones(self.base.shape, bool)
            self._mask[np.s_[1:2 * n + 1:2] if layout == "strided" else gaps] = False

    def _fill_sentinel(self):
        self.base.reshape(-1).view(np.uint8)[:] = SENTINEL_BYTE

    def values(self):
        """The array's elements, as a contiguous 1-D copy."""
        return np.ascontiguousarray(self.array).reshape(-1)

    def check_sentinel(self, what):
        if self.base is None:
            return
        outside = np.ascontiguousarray(self.base[self._mask]).view(np.uint8)
        bad = np.flatnonzero(outside != SENTINEL_BYTE)
        assert bad.size == 0, (f"{what}: wrote {bad.size} bytes outside the strided view "
                               f"(first at byte {bad[0]} of the gaps)")


# ----------------------------------------------------------------------------- comparing

def digest(*arrays):
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes())
    return h.hexdigest()


def _show(x, dtype):
    if dtype == "bfloat16":
        return f"bf16 0x{int(x):04x} ({float(bf16_widen(np.array([x]))[0])!r})"
    return repr(x)


def assert_bits_equal(got, expected, dtype, what):
    got = np.ascontiguousarray(got).reshape(-1)
    expected = np.ascontiguousarray(expected, dtype=got.dtype).reshape(-1)
    assert got.size == expected.size, f"{what}: {got.size} elements, expected {expected.size}"
    if got.size == 0:
        return
    a = got.view(np.uint8).reshape(got.size, -1)
    b = expected.view(np.uint8).reshape(expected.size, -1)
    bad = np.flatnonzero((a != b).any(axis=1))
    if bad.size:
        i = bad[0]
        raise AssertionError(f"{what}: {bad.size} of {got.size} elements differ; first at "
                             f"[{i}]: got {_show(got[i], dtype)}, expected "
                             f"{_show(expected[i], dtype)}")


# -------------------------------------------------------------------------------- checks

def check_all_reduce(group, count, dtype, op, seed=0, layout="contig"):
    ws, rank = group.world_size, group.rank
    inputs = [make_input(dtype, count, r, seed, op) for r in range(ws)]
    placed = Placed(inputs[rank], layout)
    premul = PREMUL if op == _O.PREMUL_SUM else 1.0
    group.all_reduce(placed.array, op, dtype=engine_dtype(dtype), premul=premul)
    got = placed.values()
    assert_bits_equal(got, reference_reduce(inputs, dtype, op, ws), dtype, "all_reduce")
    placed.check_sentinel("all_reduce")
    return digest(got)


def check_broadcast(group, count, dtype, root, seed=0, layout="contig"):
    """Every rank starts with its own data; all end with the root's."""
    ws, rank = group.world_size, group.rank
    placed = Placed(make_input(dtype, count, rank, seed), layout)
    group.broadcast(placed.array, root)
    got = placed.values()
    assert_bits_equal(got, make_input(dtype, count, root, seed), dtype, "broadcast")
    placed.check_sentinel("broadcast")
    return digest(got)


def check_reduce(group, count, dtype, op, root, seed=0, layout="contig"):
    """The root gets the reduction; every other rank keeps its input untouched."""
    ws, rank = group.world_size, group.rank
    inputs = [make_input(dtype, count, r, seed, op) for r in range(ws)]
    placed = Placed(inputs[rank], layout)
    premul = PREMUL if op == _O.PREMUL_SUM else 1.0
    group.reduce(placed.array, root, op, dtype=engine_dtype(dtype), premul=premul)
    got = placed.values()
    if rank == root:
        assert_bits_equal(got, reference_reduce(inputs, dtype, op, ws), dtype, "reduce (root)")
    else:
        assert_bits_equal(got, inputs[rank], dtype, "reduce (non-root input changed)")
    placed.check_sentinel("reduce")
    return digest(got) if rank == root else None


def _gather_outputs(ws, count, dtype, layout):
    """Outputs for all_gather/gather: (argument to pass, list of Placed to read back)."""
    dt = storage(dtype)
    if layout in ("flat", "flat_strided"):
        placed = Placed(np.zeros(ws * count, dt), "rows" if layout == "flat_strided" else "contig",
                        rows=ws)
        return placed.array, [placed]
    if layout == "0d":
        placed = [Placed(np.zeros(1, dt), "0d") for _ in range(ws)]
    else:
        placed = [Placed(np.zeros(count, dt), "strided" if layout == "strided" else "contig")
                  for _ in range(ws)]
    return [p.array for p in placed], placed


def check_all_gather(group, count, dtype, seed=0, layout="list"):
    """layout: "list" (list of arrays), "flat" (one array), "flat_strided" (one strided
    2-D array of world_size rows, sentinels between rows), "strided" (strided input and
    outputs, with sentinels), "0d" (0-d input and outputs)."""
    ws, rank = group.world_size, group.rank
    inputs = [make_input(dtype, count, r, seed) for r in range(ws)]
    src = Placed(inputs[rank], {"strided": "strided", "0d": "0d"}.get(layout, "contig"))
    outs, placed = _gather_outputs(ws, count, dtype, layout)
    group.all_gather(outs, src.array)
    got = np.concatenate([p.values() for p in placed])
    assert_bits_equal(got, np.concatenate(inputs), dtype, "all_gather")
    assert_bits_equal(src.values(), inputs[rank], dtype, "all_gather (input changed)")
    for p in placed + [src]:
        p.check_sentinel("all_gather")
    return digest(got)


def check_gather(group, count, dtype, root, seed=0, layout="list"):
    ws, rank = group.world_size, group.rank
    inputs = [make_input(dtype, count, r, seed) for r in range(ws)]
    src = Placed(inputs[rank], {"strided": "strided", "0d": "0d"}.get(layout, "contig"))
    outs, placed = _gather_outputs(ws, count, dtype, layout) if rank == root else (None, [])
    group.gather(src.array, outs, root)
    assert_bits_equal(src.values(), inputs[rank], dtype, "gather (input changed)")
    if rank != root:
        return None
    got = np.concatenate([p.values() for p in placed])
    assert_bits_equal(got, np.concatenate(inputs), dtype, "gather (root)")
    for p in placed + [src]:
        p.check_sentinel("gather")
    return digest(got)


def uneven_sizes(count, ws):
    """Per-destination block sizes of the "uneven" layout: differ per rank, some may be 0."""
    return [max(0, count + j - 1) for j in range(ws)]


def check_reduce_scatter(group, count, dtype, op, seed=0, layout="flat"):
    """layout: "flat" (one input array of ws * count), "flat_strided" (the same as a
    strided 2-D array), "list" (a list of ws blocks of count), "uneven" (a list of blocks of
    uneven_sizes()), "strided" (strided output with sentinel, list of strided inputs)."""
    ws, rank = group.world_size, group.rank
    sizes = uneven_sizes(count, ws) if layout == "uneven" else [count] * ws
    block = lambda r, j: make_input(dtype, sizes[j], r, seed, op, tag=j)  # noqa: E731  r -> j
    mine = [block(rank, j) for j in range(ws)]
    if layout in ("flat", "flat_strided"):
        ins = np.concatenate(mine) if ws * count else np.zeros(0, storage(dtype))
        if layout == "flat_strided":
            ins = Placed(ins, "rows", rows=ws).array
    elif layout == "strided":
        ins = [Placed(b, "strided").array for b in mine]
    else:
        ins = mine
    out = Placed(np.zeros(sizes[rank], storage(dtype)),
                 "strided" if layout == "strided" else "contig")
    premul = PREMUL if op == _O.PREMUL_SUM else 1.0
    group.reduce_scatter(out.array, ins, op, dtype=engine_dtype(dtype), premul=premul)
    expected = reference_reduce([block(r, rank) for r in range(ws)], dtype, op, ws)
    assert_bits_equal(out.values(), expected, dtype, "reduce_scatter")
    out.check_sentinel("reduce_scatter")
    return None  # every rank holds a different block


def check_scatter(group, count, dtype, root, seed=0, layout="list"):
    """layout: "list", "flat" (root passes one array of ws * count), "flat_strided" (the
    same as a strided 2-D array), "strided" (strided output with sentinel and strided
    inputs), "0d" (0-d output)."""
    ws, rank = group.world_size, group.rank
    piece = lambda j: make_input(dtype, count, root, seed, tag=j)  # noqa: E731  root -> j
    ins = None
    if rank == root:
        pieces = [piece(j) for j in range(ws)]
        if layout in ("flat", "flat_strided"):
            ins = np.concatenate(pieces) if ws * count else np.zeros(0, storage(dtype))
            if layout == "flat_strided":
                ins = Placed(ins, "rows", rows=ws).array
        elif layout == "strided":
            ins = [Placed(p, "strided").array for p in pieces]
        else:
            ins = [p.copy() for p in pieces]
    out_layout = {"strided": "strided", "0d": "0d"}.get(layout, "contig")
    out = Placed(make_input(dtype, count, rank, seed + 1), out_layout)  # to be overwritten
    group.scatter(out.array, ins, root)
    assert_bits_equal(out.values(), piece(rank), dtype, "scatter")
    out.check_sentinel("scatter")
    return None


def all_to_all_sizes(count, ws):
    """n[src][dst] elements from src to dst: uneven, some pairs empty; all 0 for count 0."""
    if count == 0:
        return [[0] * ws for _ in range(ws)]
    return [[0 if (s + d) % 3 == 1 else count + s + 2 * d for d in range(ws)]
            for s in range(ws)]


def check_all_to_all(group, count, dtype, seed=0, layout="list"):
    """Rank r sends a piece of n[r][j] elements to every rank j (layout "strided": strided
    outputs with sentinels)."""
    ws, rank = group.world_size, group.rank
    n = all_to_all_sizes(count, ws)
    piece = lambda s, d: make_input(dtype, n[s][d], s, seed, tag=d)  # noqa: E731
    ins = [piece(rank, d) for d in range(ws)]
    outs = [Placed(np.zeros(n[s][rank], storage(dtype)),
                   "strided" if layout == "strided" else "contig") for s in range(ws)]
    group.all_to_all([o.array for o in outs], ins)
    for s, o in enumerate(outs):
        assert_bits_equal(o.values(), piece(s, rank), dtype, f"all_to_all (from rank {s})")
        o.check_sentinel("all_to_all")
    return None


def check_barrier(group, store, key, rounds=3):
    """No rank leaves a barrier before every rank entered it: each rank counts itself in a
    store counter before the barrier; after it, the counter must already be world_size."""
    for i in range(rounds):
        k = f"{key}/barrier/{i}"
        store.add(k, 1)
        group.barrier()
        seen = int(store.add(k, 0))
        assert seen == group.world_size, (f"barrier round {i}: rank {group.rank} left with "
                                          f"{seen} of {group.world_size} ranks arrived")
    return group.seq


def check_unsupported_ops(group, dtype, collectives=("all_reduce", "reduce", "reduce_scatter")):
    """Every op the dtype does not support raises TypeError at the call, consuming nothing."""
    ws = group.world_size
    a = make_input(dtype, 5, group.rank, 0)
    for op in invalid_ops(dtype):
        for name in collectives:
            seq = group.seq
            call = {
                "all_reduce": lambda: group.all_reduce(a.copy(), op, dtype=engine_dtype(dtype)),
                "reduce": lambda: group.reduce(a.copy(), 0, op, dtype=engine_dtype(dtype)),
                "reduce_scatter": lambda: group.reduce_scatter(
                    a.copy(), np.concatenate([a] * ws), op, dtype=engine_dtype(dtype)),
            }[name]
            try:
                call()
            except TypeError:
                pass
            else:
                raise AssertionError(f"{name}(op={op.name}, dtype={dtype}) did not raise "
                                     f"TypeError")
            assert group.seq == seq, f"{name}: a rejected call consumed a sequence number"
    return None


# -------------------------------------------------------------------------------- sweeps

def run_cases(cases):
    """Run (name, thunk) pairs on this rank -> (failures, {name: digest})."""
    failures, digests = [], {}
    for name, thunk in cases:
        try:
            digests[name] = thunk()
        except AssertionError as e:
            failures.append(f"{name}: {e}")
        except Exception as e:
            e.add_note(f"while running case {name}")
            raise
    return failures, digests


def assert_rank_results(results, max_lines=20):
    """No rank failed a case, and every shared digest is identical on all ranks."""
    def fail_on(lines):
        if lines:
            more = f"\n... and {len(lines) - max_lines} more" if len(lines) > max_lines else ""
            raise AssertionError(f"{len(lines)} failures:\n" + "\n".join(lines[:max_lines])
                                 + more)

    # first the failures: a case that failed on some ranks only has no digest there
    fail_on([f"rank {rank}: {f}" for rank, (failures, _) in enumerate(results)
             for f in failures])
    names = results[0][1].keys()
    lines = []
    for name in names:
        values = {rank: d[name] for rank, (_, d) in enumerate(results) if d.get(name) is not None}
        if len(set(values.values())) > 1:
            lines.append(f"{name}: ranks got different bytes: {values}")
    for rank, (_, d) in enumerate(results):
        assert d.keys() == names, f"rank {rank} ran different cases"
    fail_on(lines)
    return sum(len(d) for _, d in results[:1])


def group_cases(build):
    """Turn build(group, rank, world_size, *args) -> [(name, thunk)] into a rank job
    (rank, world_size, store, *args) for harness.run_ranks: it opens the group, runs the
    cases (run_cases) and always closes the group."""
    @functools.wraps(build)
    def job(rank, world_size, store, *args):
        import harness  # the job runs inside a rank process or thread

        group = harness.new_group(store, rank, world_size)
        try:
            return run_cases(build(group, rank, world_size, *args))
        finally:
            group.close()
    return job
