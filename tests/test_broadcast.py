"""broadcast: every dtype x counts 0, 1, 3333, larger than a slot x every root x layouts, on
world sizes 1-4; one real multi-MiB case with the default slot."""

import functools

import pytest

import harness
from cases import (assert_rank_results, case_name, check_broadcast, COUNTS, DTYPES, group_cases,
                   LAYOUT_CASES, SMALL_SLOT_ENV)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

WORLD_SIZES = [1, 2, 3, 4]
JOB_TIMEOUT_S = 300


@group_cases
def _sweep(group, rank, world_size, seed):
    cases = []
    for count in COUNTS:
        for dtype in DTYPES:
            for root in range(world_size):
                cases.append((case_name("broadcast", count=count, dtype=dtype, root=root),
                              functools.partial(check_broadcast, group, count, dtype, root,
                                                seed)))
    for dtype in DTYPES:
        root = world_size - 1
        for count, layout in LAYOUT_CASES:
            cases.append((case_name("broadcast", count=count, dtype=dtype, root=root,
                                    layout=layout),
                          functools.partial(check_broadcast, group, count, dtype, root,
                                            seed, layout)))
    return cases


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_broadcast(kind, world_size, seed):
    results = harness.run_ranks(_sweep, world_size, kind, timeout_s=JOB_TIMEOUT_S, args=(seed,),
                                env=SMALL_SLOT_ENV)
    assert_rank_results(results)


@group_cases
def _multi_mib(group, rank, world_size, seed):
    count = (9 << 20) // 8 + 3  # 9 MiB of float64: three chunks of the default 4 MiB slot
    return [(case_name("broadcast", count=count, dtype="float64", root=root),
             functools.partial(check_broadcast, group, count, "float64", root, seed))
            for root in (0, world_size - 1)]


def test_broadcast_multi_mib_default_slot(kind, seed):
    results = harness.run_ranks(_multi_mib, 3, kind, timeout_s=JOB_TIMEOUT_S, args=(seed,),
                                env={"SHMCOLL_SLOT_BYTES": None})
    assert_rank_results(results)
