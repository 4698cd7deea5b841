"""all_reduce: every (dtype, valid op) x counts 0, 1, 3333, larger than a slot x layouts, on
world sizes 1-4; both algorithms (one-shot / two-shot) forced; one real multi-MiB case."""

import functools

import pytest

import harness
from cases import (assert_rank_results, case_name, check_all_reduce, check_unsupported_ops,
                   COUNTS, DTYPES, group_cases, LAYOUT_CASES, run_cases, SMALL_SLOT_ENV,
                   valid_ops)
from shmcoll import ReduceOp

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

WORLD_SIZES = [1, 2, 3, 4]
JOB_TIMEOUT_S = 300


@group_cases
def _sweep(group, rank, world_size, seed):
    cases = []
    for count in COUNTS:
        for dtype in DTYPES:
            for op in valid_ops(dtype):
                cases.append((case_name("all_reduce", count=count, dtype=dtype, op=op),
                              functools.partial(check_all_reduce, group, count, dtype, op,
                                                seed)))
    for dtype in DTYPES:
        op = valid_ops(dtype)[-1]  # PREMUL_SUM / BXOR: the least common paths
        for count, layout in LAYOUT_CASES:
            cases.append((case_name("all_reduce", count=count, dtype=dtype, op=op,
                                    layout=layout),
                          functools.partial(check_all_reduce, group, count, dtype, op,
                                            seed, layout)))
        cases.append((case_name("unsupported ops", dtype=dtype),
                      functools.partial(check_unsupported_ops, group, dtype)))
    return cases


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce(kind, world_size, seed):
    results = harness.run_ranks(_sweep, world_size, kind, timeout_s=JOB_TIMEOUT_S, args=(seed,),
                                env=SMALL_SLOT_ENV)
    assert_rank_results(results)


def _forced(rank, world_size, store, seed):
    """A few cases per algorithm, with the one-shot threshold forced through the env."""
    group = harness.new_group(store, rank, world_size)
    try:
        cases = [(case_name("all_reduce", count=count, dtype=dtype, op=op),
                  functools.partial(check_all_reduce, group, count, dtype, op, seed))
                 for count in (0, 1, 3333, 70001)
                 for dtype, op in (("float32", ReduceOp.SUM), ("bfloat16", ReduceOp.AVG),
                                   ("int8", ReduceOp.BXOR), ("complex128", ReduceOp.PRODUCT))]
        return run_cases(cases)
    finally:
        group.close()


@pytest.mark.parametrize("direct_max", ["0", str(1 << 40)], ids=["two_shot", "one_shot"])
@pytest.mark.parametrize("world_size", [3, 4])
def test_all_reduce_forced_algorithm(kind, world_size, direct_max, seed):
    env = dict(SMALL_SLOT_ENV, SHMCOLL_DIRECT_MAX_BYTES=direct_max)
    results = harness.run_ranks(_forced, world_size, kind, timeout_s=JOB_TIMEOUT_S,
                                args=(seed,), env=env)
    assert_rank_results(results)


@group_cases
def _multi_mib(group, rank, world_size, seed):
    count = (6 << 20) // 4 + 1  # 6 MiB of float32: two chunks of the default 4 MiB slot
    cases = [(case_name("all_reduce", count=count, dtype=dtype, op=op),
              functools.partial(check_all_reduce, group, count, dtype, op, seed))
             for dtype, op in (("float32", ReduceOp.SUM), ("bfloat16", ReduceOp.SUM))]
    return cases


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_multi_mib_default_slot(kind, world_size, seed):
    results = harness.run_ranks(_multi_mib, world_size, kind, timeout_s=JOB_TIMEOUT_S,
                                args=(seed,), env={"SHMCOLL_SLOT_BYTES": None})
    assert_rank_results(results)


def _fused_meets_general(rank, world_size, store):
    """Small all_reduces whose ranks take different engine paths at the same seq: a
    contiguous array takes the fused one-call path (Arena.all_reduce_fused), a strided view
    of the same values the general begin/claim/exchange path; one rank arrives late (so
    the others' fused kernel gives up its fast tiers and Python finishes the wait); a late
    rank calls a different op (a mismatch seen on the slow path). Returns, per call, what
    this rank got, and which calls took the fused path."""
    import time

    import numpy as np

    from shmcoll import CollectiveMismatchError

    group = harness.new_group(store, rank, world_size)
    try:
        got, fused = [], []
        for i in range(12):
            count = (2, 3333)[i % 2]
            values = np.arange(count, dtype=np.float32) + rank * 1000 + i
            if (rank + i) % 2:  # strided: every other element of a larger buffer
                buf = np.zeros(2 * count, np.float32)
                buf[::2] = values
                array = buf[::2]
            else:
                array = values
            if i % 3 == 2 and rank == (i + 1) % world_size:
                time.sleep(0.05)  # late: the others' fused kernels run out of fast tiers
            group.all_reduce(array)
            got.append(array.tolist())
            plan = group._plans.get((np.dtype(np.float32), (count,), ReduceOp.SUM, None, 1.0))
            fused.append(bool(array.flags.c_contiguous and plan is not None and plan.fused))
        x = np.ones(8, np.float32)
        if rank == 1:
            time.sleep(0.05)
        try:
            group.all_reduce(x, op=ReduceOp.MAX if rank == 1 else ReduceOp.SUM)
            mismatch = None
        except CollectiveMismatchError as e:
            mismatch = str(e)
        group.all_reduce(x)  # usable after the mismatch
        return got, fused, mismatch, x.tolist()
    finally:
        group.close()


@pytest.mark.parametrize("world_size", [2, 3])
def test_fused_and_general_paths_interoperate(kind, world_size):
    """Guards the fused latency path: it must be bit-compatible with the general path
    (same slot, steps and fingerprint) -- otherwise a rank whose array happens to be strided
    deadlocks or reads the wrong slot --, finish correctly when a peer is late, and report a
    mismatch (naming both sides) with the group still usable afterwards."""
    import numpy as np

    results = harness.run_ranks(_fused_meets_general, world_size, kind,
                                timeout_s=JOB_TIMEOUT_S)
    for rank, (got, fused, mismatch, after) in enumerate(results):
        for i, values in enumerate(got):
            count = (2, 3333)[i % 2]
            want = sum(np.arange(count, dtype=np.float32) + r * 1000 + i
                       for r in range(world_size))
            assert values == want.tolist(), (rank, i)
        # both paths ran at every seq, and every rank took the fused one sometimes
        assert fused == [(rank + i) % 2 == 0 for i in range(12)], (rank, fused)
        assert mismatch is not None and "op=SUM" in mismatch and "op=MAX" in mismatch, \
            (rank, mismatch)
        assert after == [float(world_size)] * 8, (rank, after)
