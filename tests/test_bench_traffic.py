"""benchmarks/traffic.py: every algorithm select() can pick for the benchmarked collectives
has a traffic model, and the ceiling table reads the rows it is given."""

import itertools

from benchmarks.traffic import (MODEL, bytes_per_rank, ceiling_table, copiers_for,
                                copy_bandwidth, per_rank_bytes, usable_cores)
from shmcoll.algorithms import select
from shmcoll.native.single_copy import CMA, IN_PROCESS, NONE


def test_every_selectable_algorithm_has_a_model():
    ops = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")
    for op, nbytes, world, mode, always, threads, small in itertools.product(
            ops, [8, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 1 << 30], [2, 3, 4, 8],
            [NONE, IN_PROCESS, CMA], [False, True], [False, True], [False, True]):
        name = select(op, nbytes, world, -1, mode, always, threads, small).__name__
        assert name in MODEL, (op, nbytes, world, name)
        assert bytes_per_rank(name, op, nbytes, world) > 0


def test_model_numbers():
    s = 1 << 20
    assert bytes_per_rank("broadcast_direct", "broadcast", s, 2) == 4 * s
    assert bytes_per_rank("all_reduce_one_shot", "all_reduce", s, 2) == 5 * s
    # all_gather's nbytes is the gathered output: S is the input
    assert per_rank_bytes("all_gather", 2 * s, 2) == s
    assert bytes_per_rank("all_gather_direct", "all_gather", 2 * s, 2) == 6 * s
    assert bytes_per_rank("no_such_algorithm", "broadcast", s, 2) is None


def test_ceiling_table():
    rows = [{"record": "row", "backend": "shm", "op": "broadcast", "world_size": 2,
             "nbytes": 1 << 20, "time_us": 200.0, "wrong": 0, "algorithm": "broadcast_direct"},
            {"record": "row", "backend": "mpi4py", "op": "broadcast", "world_size": 2,
             "nbytes": 1 << 20, "time_us": 100.0, "wrong": 0}]
    text = ceiling_table(rows, {2: {1 << 20: 80e9}})
    lines = text.strip().splitlines()
    assert len(lines) == 3  # title, head, the shm row only
    # two ranks' 4 MiB each at 80 GB/s all together: 104.86 us of a 200 us row
    assert "broadcast_direct" in lines[2] and "104.86" in lines[2] and "0.524" in lines[2]
    assert ceiling_table(rows[1:], {2: {1 << 20: 80e9}}) == ""
    assert ceiling_table(rows, {4: {1 << 20: 80e9}}) == ""  # no bandwidth for 2 ranks


def test_ceiling_counts_every_rank_at_the_aggregate_bandwidth():
    """4 ranks' bytes at the bandwidth their copiers reach together; the nearest measured
    size, marked '~', where the row's S was not measured."""
    row = {"record": "row", "backend": "shm", "op": "broadcast", "world_size": 4,
           "nbytes": 1 << 20, "time_us": 500.0, "wrong": 0, "algorithm": "broadcast_direct"}
    [line] = ceiling_table([row], {4: {2 << 20: 80e9}}).strip().splitlines()[2:]
    # 4 ranks x 4 MiB at 80 GB/s = 209.72 us
    assert "~80.00" in line and "209.72" in line and "0.419" in line
    assert line.split()[6] == str(copiers_for(4))


def test_copy_bandwidth_of_one_two_and_four_ranks():
    """One copier in this process; two ranks, and four sharing this machine's cores
    (spawned copiers with two buffer pairs each on a 2-core machine)."""
    got = [copy_bandwidth([64 << 10], 1, seconds=0.02, windows=2),
           copy_bandwidth([64 << 10, 1 << 20], 2, seconds=0.02, windows=2),
           copy_bandwidth([64 << 10], 4, seconds=0.02, windows=2)]
    assert [set(bw) for bw in got] == [{64 << 10}, {64 << 10, 1 << 20}, {64 << 10}]
    # read + write bytes per second: positive, and below an absurd 10 TB/s
    assert all(0 < bw < 10e12 for d in got for bw in d.values())
    assert 1 <= copiers_for(2) <= 2 and copiers_for(1) == 1 and copiers_for(64) == usable_cores()
