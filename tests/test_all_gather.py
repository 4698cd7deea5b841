"""all_gather: every dtype x counts 0, 1, 3333, larger than a slot x outputs as a list, as
one flat array and as a strided 2-D array, strided (sentinels) and 0-d, on world sizes 1-4;
one multi-MiB case."""

import functools

import pytest

import harness
from cases import (assert_rank_results, case_name, check_all_gather, COUNTS, DTYPES, group_cases,
                   SMALL_SLOT_ENV)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

WORLD_SIZES = [1, 2, 3, 4]
JOB_TIMEOUT_S = 300


def _case(group, count, dtype, layout, seed):
    return (case_name("all_gather", count=count, dtype=dtype, layout=layout),
            functools.partial(check_all_gather, group, count, dtype, seed, layout))


@group_cases
def _sweep(group, rank, world_size, seed):
    cases = []
    for count in COUNTS:
        for dtype in DTYPES:
            for layout in ("list", "flat"):
                cases.append(_case(group, count, dtype, layout, seed))
    for dtype in DTYPES:
        for count, layout in ((3333, "strided"), (0, "strided"), (1, "0d"),
                              (3333, "flat_strided"), (1, "flat_strided")):
            cases.append(_case(group, count, dtype, layout, seed))
    return cases


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather(kind, world_size, seed):
    results = harness.run_ranks(_sweep, world_size, kind, timeout_s=JOB_TIMEOUT_S, args=(seed,),
                                env=SMALL_SLOT_ENV)
    assert_rank_results(results)


@group_cases
def _multi_mib(group, rank, world_size, seed):
    count = (5 << 20) + 7  # 5 MiB of uint8 per rank: two chunks of the default slot
    return [_case(group, count, "uint8", "flat", seed)]


def test_all_gather_multi_mib_default_slot(kind, seed):
    results = harness.run_ranks(_multi_mib, 3, kind, timeout_s=JOB_TIMEOUT_S, args=(seed,),
                                env={"SHMCOLL_SLOT_BYTES": None})
    assert_rank_results(results)
