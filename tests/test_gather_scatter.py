"""gather and scatter: every dtype x counts 0, 1, 3333, larger than a slot x every root x
list / flat / strided (sentinels) / 0-d, on world sizes 1-4; one multi-MiB case each."""

import functools

import pytest

import harness
from cases import (assert_rank_results, case_name, check_gather, check_scatter, COUNTS, DTYPES,
                   group_cases, SMALL_SLOT_ENV)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

WORLD_SIZES = [1, 2, 3, 4]
JOB_TIMEOUT_S = 300
CHECKS = {"gather": check_gather, "scatter": check_scatter}


def _case(group, name, count, dtype, root, layout, seed):
    return (case_name(name, count=count, dtype=dtype, root=root, layout=layout),
            functools.partial(CHECKS[name], group, count, dtype, root, seed, layout))


@group_cases
def _sweep(group, rank, world_size, name, seed):
    cases = []
    for count in COUNTS:
        for dtype in DTYPES:
            for root in range(world_size):
                layout = ("list", "flat")[(root + count) % 2]
                cases.append(_case(group, name, count, dtype, root, layout, seed))
    for dtype in DTYPES:
        for count, layout in ((3333, "strided"), (0, "strided"), (1, "0d"),
                              (3333, "flat_strided")):
            cases.append(_case(group, name, count, dtype, world_size - 1, layout, seed))
    return cases


@pytest.mark.parametrize("name", ["gather", "scatter"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gather_scatter(kind, world_size, name, seed):
    results = harness.run_ranks(_sweep, world_size, kind, timeout_s=JOB_TIMEOUT_S,
                                args=(name, seed), env=SMALL_SLOT_ENV)
    assert_rank_results(results)


@group_cases
def _multi_mib(group, rank, world_size, seed):
    count = (5 << 20) // 2 + 1  # 5 MiB of int16 per rank
    return [_case(group, name, count, "int16", 1, "list", seed)
            for name in ("gather", "scatter")]


def test_gather_scatter_multi_mib_default_slot(kind, seed):
    results = harness.run_ranks(_multi_mib, 3, kind, timeout_s=JOB_TIMEOUT_S, args=(seed,),
                                env={"SHMCOLL_SLOT_BYTES": None})
    assert_rank_results(results)
