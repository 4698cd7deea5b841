"""reduce: every (dtype, valid op) x counts 0, 1, 3333, larger than a slot, roots rotating
(and every root for some cases) x layouts, on world sizes 1-4; non-roots keep their input;
one real multi-MiB case with the default slot."""

import functools

import pytest

import harness
from cases import (assert_rank_results, case_name, check_reduce, check_unsupported_ops, COUNTS,
                   DTYPES, group_cases, SMALL_SLOT_ENV, valid_ops)
from shmcoll import ReduceOp

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

WORLD_SIZES = [1, 2, 3, 4]
JOB_TIMEOUT_S = 300


def _case(group, count, dtype, op, root, seed, layout="contig"):
    params = dict(count=count, dtype=dtype, op=op, root=root)
    if layout != "contig":
        params["layout"] = layout
    return (case_name("reduce", **params),
            functools.partial(check_reduce, group, count, dtype, op, root, seed, layout))


@group_cases
def _sweep(group, rank, world_size, seed):
    cases = []
    i = 0
    for count in COUNTS:
        for dtype in DTYPES:
            for op in valid_ops(dtype):
                cases.append(_case(group, count, dtype, op, i % world_size, seed))
                i += 1
    for root in range(world_size):
        for count in (1, 3333, 70001):
            cases.append(_case(group, count, "float32", ReduceOp.SUM, root, seed))
    for dtype in DTYPES:
        op = valid_ops(dtype)[-1]
        for count, layout in ((3333, "strided"), (3333, "strided2d"), (1, "0d")):
            cases.append(_case(group, count, dtype, op, world_size - 1, seed, layout))
        cases.append((case_name("unsupported ops", dtype=dtype),
                      functools.partial(check_unsupported_ops, group, dtype, ("reduce",))))
    return cases


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce(kind, world_size, seed):
    results = harness.run_ranks(_sweep, world_size, kind, timeout_s=JOB_TIMEOUT_S, args=(seed,),
                                env=SMALL_SLOT_ENV)
    assert_rank_results(results)


@group_cases
def _multi_mib(group, rank, world_size, seed):
    count = (6 << 20) // 4 + 1  # 6 MiB of float32: two chunks of the default 4 MiB slot
    return [_case(group, count, "float32", ReduceOp.MAX, 1, seed)]


def test_reduce_multi_mib_default_slot(kind, seed):
    results = harness.run_ranks(_multi_mib, 3, kind, timeout_s=JOB_TIMEOUT_S, args=(seed,),
                                env={"SHMCOLL_SLOT_BYTES": None})
    assert_rank_results(results)
