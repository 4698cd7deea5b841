"""all_to_all: every dtype x counts 0, 1, 3333, larger than a slot, with uneven (and some
empty) pieces per pair, strided outputs (sentinels), on world sizes 1-4; mismatched sizes
raise ValueError on every rank and leave the group usable; one multi-MiB case.

Each transport of all_to_all_direct is covered: messages riding with the size table (small
counts), read from the peers' buffers (single copy: counts whose messages outgrow the
64 KiB slot), a mix of both in one call (one rank's messages ride, another's do not), and,
with single copy off, the chunked slot steps."""

import functools

import numpy as np
import pytest

import harness
from cases import (all_to_all_sizes, assert_rank_results, assert_bits_equal, case_name,
                   check_all_to_all, COUNTS,
                   DTYPES, group_cases, make_input, Placed, SMALL_SLOT_BYTES, SMALL_SLOT_ENV,
                   storage)
from shmcoll.algorithms import A2A_READ_MIN_NBYTES
from shmcoll.native.single_copy import CMA, NONE
from shmcoll.protocol import A2A_PLAN_SLOT, ONE_STEP_ALL_TO_ALL, a2a_head_nbytes

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

WORLD_SIZES = [1, 2, 3, 4]
JOB_TIMEOUT_S = 300


def _case(group, count, dtype, layout, seed):
    return (case_name("all_to_all", count=count, dtype=dtype, layout=layout),
            functools.partial(check_all_to_all, group, count, dtype, seed, layout))


def _size_mismatch(group, seed):
    """Rank 0 sends one element more to its last peer than that peer expects."""
    ws, rank = group.world_size, group.rank
    ins = [np.zeros(4 + (rank == 0 and d == ws - 1), np.int32) for d in range(ws)]
    outs = [np.zeros(4, np.int32) for _ in range(ws)]
    try:
        group.all_to_all(outs, ins)
    except ValueError as e:
        assert "all_to_all" in str(e), str(e)
    else:
        raise AssertionError("mismatched all_to_all sizes did not raise ValueError")
    return check_all_to_all(group, 3, "int32", seed)  # still usable, still in step


def _mixed(group, seed, big):
    """Rank 0 sends `big` elements to every rank (more than its slot carries), every other
    rank 5: in one call some messages ride with the table and some do not."""
    ws, rank = group.world_size, group.rank
    n = lambda s: big if s == 0 else 5  # noqa: E731
    ins = [np.arange(n(rank), dtype=np.int64) * ws + rank * 1000 + d for d in range(ws)]
    outs = [np.full(n(s), -1, np.int64) for s in range(ws)]
    group.all_to_all(outs, ins)
    for s, o in enumerate(outs):
        np.testing.assert_array_equal(o, np.arange(n(s), dtype=np.int64) * ws + s * 1000 + rank)
    return None


@group_cases
def _sweep(group, rank, world_size, seed):
    cases = []
    for count in COUNTS:
        for dtype in DTYPES:
            cases.append(_case(group, count, dtype, "list", seed))
    for dtype in DTYPES:
        cases.append(_case(group, 3333, dtype, "strided", seed))
    if world_size > 1:
        cases.append(("all_to_all(size mismatch)",
                      functools.partial(_size_mismatch, group, seed)))
        cases.append(("all_to_all(some ride, some do not)",
                      functools.partial(_mixed, group, seed, 20000)))
    return cases


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_to_all(kind, world_size, seed):
    results = harness.run_ranks(_sweep, world_size, kind, timeout_s=JOB_TIMEOUT_S, args=(seed,),
                                env=SMALL_SLOT_ENV)
    assert_rank_results(results)


def _single(group, count, dtype, seed, layout):
    """all_to_all_single of `count` elements per block: rank r's block j is piece (r, j);
    with layout "strided" the output is strided (the general path, staged)."""
    ws, rank = group.world_size, group.rank
    piece = lambda s, d: make_input(dtype, count, s, seed, tag=d)  # noqa: E731
    src = np.concatenate([piece(rank, d) for d in range(ws)])
    out = Placed(np.zeros(ws * count, storage(dtype)), layout)
    group.all_to_all_single(out.array, src)
    assert_bits_equal(out.values(), np.concatenate([piece(s, rank) for s in range(ws)]), dtype,
                      "all_to_all_single")
    out.check_sentinel("all_to_all_single")
    # (the block to myself stays out of the slot)
    rides = ws > 1 and a2a_head_nbytes(ws) + src.nbytes - src.nbytes // ws <= SMALL_SLOT_BYTES
    # 3+ ranks read blocks that do not ride from the peers' buffers in the same call, and
    # from 4 rank processes (CMA) large ones that would
    sc = group._arena.single_copy if group._arena is not None else NONE
    reads = ws > 2 and sc != NONE and (not rides or ws >= 4 and sc == CMA
                                       and src.nbytes >= A2A_READ_MIN_NBYTES)
    if layout == "contig":
        plan = group._plans.get(("all_to_all", src.dtype, src.size))
        assert (plan is not None and plan.mode == ONE_STEP_ALL_TO_ALL) == (rides or reads), \
            f"one-step plan {plan and plan.mode}, expected riding {rides}, reading {reads}"
        if plan is not None and plan.mode is not None:
            assert (plan.words[A2A_PLAN_SLOT] == 0) == reads, plan.words[:A2A_PLAN_SLOT + 1]
    else:  # the list form, which stages pieces that ride into the one-array form (counts)
        plan = group._plans.get(("all_to_all", src.dtype, None))
        assert (plan is not None) == rides, f"staged plan {plan}, expected riding {rides}"
    return None


def _single_uneven(group, count, dtype, seed, list_ranks=()):
    """all_to_all_single with uneven counts (all_to_all_sizes: some empty), every rank but
    those in `list_ranks`, which pass the same pieces as lists."""
    ws, rank = group.world_size, group.rank
    n = all_to_all_sizes(count, ws)
    piece = lambda s, d: make_input(dtype, n[s][d], s, seed, tag=d)  # noqa: E731
    if rank in list_ranks:
        outs = [np.zeros(n[s][rank], storage(dtype)) for s in range(ws)]
        group.all_to_all(outs, [piece(rank, d) for d in range(ws)])
        got = np.concatenate(outs)
    else:
        got = np.zeros(sum(n[s][rank] for s in range(ws)), storage(dtype))
        group.all_to_all_single(got, np.concatenate([piece(rank, d) for d in range(ws)]),
                                [n[s][rank] for s in range(ws)], n[rank])
    assert_bits_equal(got, np.concatenate([piece(s, rank) for s in range(ws)]), dtype,
                      "all_to_all_single (uneven)")
    return None


def _single_beside_lists(group, seed):
    """all_to_all_single on rank 0, the list form on the others, with uneven messages
    among ranks 1.. (rank 0's are equal blocks of 4): the one-step kernel sees tables
    unlike its own and leaves the rest to the general path, whose result must match."""
    ws, rank = group.world_size, group.rank
    n = [[4 if 0 in (s, d) else 3 + s + 2 * d for d in range(ws)] for s in range(ws)]
    value = lambda s, d: np.arange(n[s][d], dtype=np.int64) + 1000 * s + 100 * d  # noqa: E731
    for _ in range(2):  # the second call finds rank 0's plan cached
        if rank == 0:
            out = np.full(4 * ws, -1, np.int64)
            group.all_to_all_single(out, np.concatenate([value(0, d) for d in range(ws)]))
            outs = np.split(out, ws)
        else:
            outs = [np.full(n[s][rank], -1, np.int64) for s in range(ws)]
            group.all_to_all(outs, [value(rank, d) for d in range(ws)])
        for s in range(ws):
            np.testing.assert_array_equal(outs[s], value(s, rank))
    return None


def _single_bad_size(group, seed):
    """A size that does not divide by the world size raises ValueError on every rank (all
    pass it) before anything moves; the group stays usable."""
    ws = group.world_size
    a = np.zeros(ws + 1, np.float32)
    with pytest.raises(ValueError, match="equal blocks"):
        group.all_to_all_single(a.copy(), a)
    return _single(group, 5, "float32", seed, "contig")


@group_cases
def _single_sweep(group, rank, world_size, seed):
    cases = []
    for count in (0, 1, 3333, 70001):
        for dtype in ("float32", "complex128", "bfloat16"):
            cases.append((case_name("all_to_all_single", count=count, dtype=dtype),
                          functools.partial(_single, group, count, dtype, seed, "contig")))
    for count in (0, 1, 3333, 70001):
        cases.append((case_name("all_to_all_single(uneven)", count=count, dtype="float64"),
                      functools.partial(_single_uneven, group, count, "float64", seed)))
        cases.append((case_name("all_to_all_single(uneven) beside a list", count=count,
                                dtype="int16"),
                      functools.partial(_single_uneven, group, count, "int16", seed, (1,))))
    cases.append(("all_to_all_single(strided output)",
                  functools.partial(_single, group, 333, "int32", seed, "strided")))
    if world_size > 1:
        cases.append(("all_to_all_single beside uneven lists",
                      functools.partial(_single_beside_lists, group, seed)))
        cases.append(("all_to_all_single(bad size)",
                      functools.partial(_single_bad_size, group, seed)))
    return cases


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_all_to_all_single(kind, world_size, seed):
    """The one-array form: the one-step call where the blocks ride with the size table
    (asserted through the group's plan), the general path where they do not or the
    output is strided, and a rank calling it beside peers that pass uneven lists."""
    results = harness.run_ranks(_single_sweep, world_size, kind, timeout_s=JOB_TIMEOUT_S,
                                args=(seed,), env=SMALL_SLOT_ENV)
    assert_rank_results(results)


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_to_all_without_single_copy(kind, world_size, seed):
    """SHMCOLL_SINGLE_COPY=off: what does not ride with the table goes in chunks of a slot."""
    results = harness.run_ranks(_sweep, world_size, kind, timeout_s=JOB_TIMEOUT_S, args=(seed,),
                                env=dict(SMALL_SLOT_ENV, SHMCOLL_SINGLE_COPY="off"))
    assert_rank_results(results)


@group_cases
def _multi_mib(group, rank, world_size, seed):
    count = (3 << 20) // 4  # ~3 MiB of float32 per pair (uneven): several chunks
    return [_case(group, count, "float32", "list", seed)]


def test_all_to_all_multi_mib_default_slot(kind, seed):
    results = harness.run_ranks(_multi_mib, 3, kind, timeout_s=JOB_TIMEOUT_S, args=(seed,),
                                env={"SHMCOLL_SLOT_BYTES": None})
    assert_rank_results(results)


@group_cases
def _streamed_in_python(group, rank, world_size, seed):
    """The streamed steps (pieces that do not ride) with the compiled wait tiers off: every
    step whose peer has not posted yet goes back to Python (Arena._settle), which finishes
    the wait, consumes the step and resumes the kernel after it."""
    arena = group._arena
    arena._spins, arena._yield_ns = 0, 0

    def case(count, dtype, uneven):
        if uneven:
            return functools.partial(_single_uneven, group, count, dtype, seed)
        return functools.partial(_single, group, count, dtype, seed, "contig")
    return [(case_name("all_to_all_single, Python waits", count=count, dtype=dtype,
                       uneven=uneven), case(count, dtype, uneven))
            for count, dtype, uneven in ((70001, "float32", False), (40000, "int64", True),
                                         (3, "int16", False))]


@pytest.mark.parametrize("single_copy", ["auto", "off"])
def test_all_to_all_streamed_steps_finished_in_python(kind, seed, single_copy):
    results = harness.run_ranks(_streamed_in_python, 2, kind, timeout_s=JOB_TIMEOUT_S,
                                args=(seed,), env=dict(SMALL_SLOT_ENV,
                                                       SHMCOLL_SINGLE_COPY=single_copy))
    assert_rank_results(results)


# -- large blocks read where they lie (all_to_all_read: 4+ rank processes, CMA) ----------

READ_BLOCK = A2A_READ_MIN_NBYTES // 4 // 4  # float32 elements per block of a 4-rank read


def _read_values(rank, ws, count, seed):
    """(my input, the output I must get): block d of rank s is make_input(s, tag=d)."""
    piece = lambda s, d: make_input("float32", count, s, seed, tag=d)  # noqa: E731
    return (np.concatenate([piece(rank, d) for d in range(ws)]),
            np.concatenate([piece(s, rank) for s in range(ws)]))


def _read_forms(group, seed, form):
    """One all_to_all of READ_BLOCK-element blocks in which rank 0 uses `form` and every
    other rank the one-array form (read in the one-step kernel): "single" (the same),
    "strided" (a strided output: the general path's all_to_all_read), "splits" (equal
    counts given: they ride with the table), "inplace" (the output is the input: the
    input is copied first), "late" (rank 0 calls 0.3 s late: the others' kernel waits run
    out, Python finishes the wait and the read). Returns the plan's reads flag on the
    ranks that took the one-array form."""
    import time as _time
    ws, rank = group.world_size, group.rank
    src, want = _read_values(rank, ws, READ_BLOCK, seed)
    mine = form if rank == 0 else "single"
    if mine == "late":
        _time.sleep(0.3)
    if mine == "strided":
        out = Placed(np.zeros(ws * READ_BLOCK, np.float32), "strided")
        group.all_to_all_single(out.array, src)
        got = out.values()
    elif mine == "splits":
        got = np.zeros(ws * READ_BLOCK, np.float32)
        group.all_to_all_single(got, src, [READ_BLOCK] * ws, [READ_BLOCK] * ws)
    elif mine == "inplace":
        got = src
        group.all_to_all_single(src, src)
    else:
        got = np.full(ws * READ_BLOCK, -1.0, np.float32)
        group.all_to_all_single(got, src)
    assert_bits_equal(got, want, "float32", f"all_to_all_single ({form} on rank 0)")
    plan = group._plans.get(("all_to_all", np.dtype(np.float32), ws * READ_BLOCK))
    return plan is not None and bool(plan.reads) and plan.words[A2A_PLAN_SLOT] == 0


@group_cases
def _read_sweep(group, rank, world_size, seed):
    def case(form):
        def run():
            reads = _read_forms(group, seed, form)
            if form in ("single", "late") or rank != 0:
                assert reads == (group._arena.single_copy == CMA), (form, reads)
            return check_all_to_all(group, 5, "int32", seed)  # in step afterwards
        return (f"all_to_all_single(read, {form} on rank 0)", run)
    return [case(f) for f in ("single", "strided", "splits", "inplace", "late", "single")]


def test_all_to_all_reads_large_blocks_where_they_lie(seed):
    """4 rank processes, 4 MiB inputs (the default slot): the one-step kernel reads the
    peers' blocks from their buffers (CMA) and closes with one more step; beside a rank on
    the general path, a rank whose blocks ride, an in-place rank and a late rank, the
    tables say what each must do and every rank gets the exact blocks."""
    results = harness.run_ranks(_read_sweep, 4, "processes", timeout_s=JOB_TIMEOUT_S,
                                args=(seed,), env={"SHMCOLL_SLOT_BYTES": None})
    assert_rank_results(results)
