"""reduce_scatter: every (dtype, valid op) x counts 0, 1, 3333, larger than a slot x inputs as
one flat array, as a list of equal blocks and of uneven ones, strided (sentinels), on world
sizes 1-4; unsupported (op, dtype) raise TypeError; one real multi-MiB case."""

import functools

import pytest

import harness
from cases import (assert_rank_results, case_name, check_reduce_scatter, check_unsupported_ops,
                   COUNTS, DTYPES, group_cases, SMALL_SLOT_ENV, valid_ops)
from shmcoll import ReduceOp

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

WORLD_SIZES = [1, 2, 3, 4]
JOB_TIMEOUT_S = 300


def _case(group, count, dtype, op, layout, seed):
    return (case_name("reduce_scatter", count=count, dtype=dtype, op=op, layout=layout),
            functools.partial(check_reduce_scatter, group, count, dtype, op, seed, layout))


@group_cases
def _sweep(group, rank, world_size, seed):
    cases = []
    for count in COUNTS:
        for dtype in DTYPES:
            for op in valid_ops(dtype):
                for layout in ("flat", "uneven", "list"):
                    cases.append(_case(group, count, dtype, op, layout, seed))
    for dtype in DTYPES:
        for layout in ("strided", "flat_strided"):
            cases.append(_case(group, 3333, dtype, valid_ops(dtype)[-1], layout, seed))
        cases.append((case_name("unsupported ops", dtype=dtype),
                      functools.partial(check_unsupported_ops, group, dtype,
                                        ("reduce_scatter",))))
    return cases


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter(kind, world_size, seed):
    results = harness.run_ranks(_sweep, world_size, kind, timeout_s=JOB_TIMEOUT_S, args=(seed,),
                                env=SMALL_SLOT_ENV)
    assert_rank_results(results)


@group_cases
def _multi_mib(group, rank, world_size, seed):
    count = (3 << 20) // 4 + 5  # 3 MiB of float32 per destination, 9 MiB per rank
    return [_case(group, count, "float32", ReduceOp.SUM, layout, seed)
            for layout in ("flat", "uneven")]


def test_reduce_scatter_multi_mib_default_slot(kind, seed):
    results = harness.run_ranks(_multi_mib, 3, kind, timeout_s=JOB_TIMEOUT_S, args=(seed,),
                                env={"SHMCOLL_SLOT_BYTES": None})
    assert_rank_results(results)
