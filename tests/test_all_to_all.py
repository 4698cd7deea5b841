"""all_to_all: every dtype x counts 0, 1, 3333, larger than a slot, with uneven (and some
empty) pieces per pair, strided outputs (sentinels), on world sizes 1-4; mismatched sizes
raise ValueError on every rank and leave the group usable; one multi-MiB case."""

import functools

import numpy as np
import pytest

import harness
from cases import (assert_rank_results, case_name, check_all_to_all, COUNTS, DTYPES, group_cases,
                   SMALL_SLOT_ENV)

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
    return cases


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_to_all(kind, world_size, seed):
    results = harness.run_ranks(_sweep, world_size, kind, timeout_s=JOB_TIMEOUT_S, args=(seed,),
                                env=SMALL_SLOT_ENV)
    assert_rank_results(results)


@group_cases
def _multi_mib(group, rank, world_size, seed):
    count = (3 << 20) // 4  # ~3 MiB of float32 per pair (uneven): several chunks
    return [_case(group, count, "float32", "list", seed)]


def test_all_to_all_multi_mib_default_slot(kind, seed):
    results = harness.run_ranks(_multi_mib, 3, kind, timeout_s=JOB_TIMEOUT_S, args=(seed,),
                                env={"SHMCOLL_SLOT_BYTES": None})
    assert_rank_results(results)
