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

