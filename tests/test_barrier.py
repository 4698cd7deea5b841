"""barrier: no rank leaves before every rank arrived (store counters, no timing), repeated,
interleaved with data collectives, on world sizes 1-4."""

import functools

import pytest

import harness
from cases import (SMALL_SLOT_ENV, assert_rank_results, check_all_reduce, check_barrier,
                   check_broadcast, run_cases)
from shmcoll import ReduceOp

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

WORLD_SIZES = [1, 2, 3, 4]
JOB_TIMEOUT_S = 300


def _sweep(rank, world_size, store, seed):
    group = harness.new_group(store, rank, world_size)
    try:
        cases = [("barrier x20", functools.partial(check_barrier, group, store, "a", 20))]
        for i in range(5):  # barriers between collectives that use the slots
            cases.append((f"all_reduce {i}", functools.partial(
                check_all_reduce, group, 70001, "float32", ReduceOp.SUM, seed + i)))
            cases.append((f"barrier after all_reduce {i}",
                          functools.partial(check_barrier, group, store, f"b{i}", 1)))
            cases.append((f"broadcast {i}", functools.partial(
                check_broadcast, group, 3333, "int8", i % world_size, seed + i)))
            cases.append((f"barrier after broadcast {i}",
                          functools.partial(check_barrier, group, store, f"c{i}", 2)))
        return run_cases(cases)
    finally:
        group.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_barrier(kind, world_size, seed):
    results = harness.run_ranks(_sweep, world_size, kind, timeout_s=JOB_TIMEOUT_S, args=(seed,),
                                env=SMALL_SLOT_ENV)
    assert_rank_results(results)
