"""algorithms.select(): a pure function of (collective, nbytes, world_size, direct_max_nbytes).

It reads no environment (the group passes SHMCOLL_DIRECT_MAX_BYTES in), keeps no state, and
cuts all_reduce over from one-shot to two-shot just above the per-world-size threshold."""

import itertools

import pytest

from shmcoll import algorithms
from shmcoll.algorithms import (ONE_SHOT_MAX_NBYTES, all_gather_direct, all_reduce_one_shot,
                                all_reduce_two_shot, all_to_all_direct, barrier_flags,
                                broadcast_direct, broadcast_streamed, gather_direct,
                                reduce_direct,
                                reduce_scatter_direct, scatter_direct, select)

FIXED = {
    "broadcast": broadcast_direct, "reduce": reduce_direct, "all_gather": all_gather_direct,
    "reduce_scatter": reduce_scatter_direct, "barrier": barrier_flags,
    "gather": gather_direct, "scatter": scatter_direct, "all_to_all": all_to_all_direct,
}
DEFAULT_LIMIT = algorithms.ONE_SHOT_MAX_NBYTES_DEFAULT


def _limit(world_size):
    return ONE_SHOT_MAX_NBYTES.get(world_size, DEFAULT_LIMIT)


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 8, 16])
def test_all_reduce_threshold(world_size):
    limit = _limit(world_size)
    for nbytes in (0, 1, 4096, limit - 1, limit):
        if nbytes >= 0:
            assert select("all_reduce", nbytes, world_size) is all_reduce_one_shot, nbytes
    if limit < (1 << 62):
        for nbytes in (limit + 1, limit * 4, 1 << 40):
            assert select("all_reduce", nbytes, world_size) is all_reduce_two_shot, nbytes


def test_thresholds_table():
    # two ranks: one-shot reads as many bytes as two-shot with one wait fewer: always
    assert select("all_reduce", 1 << 40, 2) is all_reduce_one_shot
    assert ONE_SHOT_MAX_NBYTES[3] == 1 << 20 and ONE_SHOT_MAX_NBYTES[4] == 512 << 10
    assert DEFAULT_LIMIT == 512 << 10
    # thresholds never grow with the world size (one-shot reads N * S per rank)
    sizes = [2, 3, 4, 5, 6, 8, 16, 64]
    limits = [_limit(n) for n in sizes]
    assert limits == sorted(limits, reverse=True)


@pytest.mark.parametrize("override", [0, 1, 4096, 1 << 30])
def test_direct_max_override(override):
    for world_size, nbytes in itertools.product([2, 3, 4, 8], [0, 1, 4096, 4097, 1 << 31]):
        expected = all_reduce_one_shot if nbytes <= override else all_reduce_two_shot
        assert select("all_reduce", nbytes, world_size, override) is expected
    # negative = "use the table"
    assert select("all_reduce", 1 << 20, 4, -1) is select("all_reduce", 1 << 20, 4)


@pytest.mark.parametrize("collective", sorted(FIXED))
def test_fixed_choices(collective):
    for nbytes, world_size, override in itertools.product([0, 1, 1 << 20, 1 << 34], [2, 3, 4, 8],
                                                          [-1, 0, 1 << 20]):
        expected = FIXED[collective]
        if collective == "broadcast" and nbytes >= algorithms.BROADCAST_STREAMED_MIN_NBYTES:
            expected = broadcast_streamed
        assert select(collective, nbytes, world_size, override) is expected
        assert select(collective, nbytes, world_size, override, threads=True) is \
            FIXED[collective]


def test_broadcast_streams_large_messages():
    """broadcast: one compiled step below the threshold, streamed (root's copy-in and the
    others' copy-out overlapping) from it on, for processes only."""
    limit = algorithms.BROADCAST_STREAMED_MIN_NBYTES
    assert limit == 8 << 20
    for world_size in (2, 3, 4, 8):
        assert select("broadcast", limit - 1, world_size) is broadcast_direct
        assert select("broadcast", limit, world_size) is broadcast_streamed
        assert select("broadcast", limit, world_size, threads=True) is broadcast_direct


def test_unknown_collective():
    with pytest.raises(NotImplementedError, match="all_reduce_coalesced"):
        select("all_reduce_coalesced", 0, 2)


def test_pure_function(monkeypatch):
    """Same answer whatever the environment and however often it is asked; no state."""
    grid = list(itertools.product(["all_reduce", *FIXED], [0, 1, 64 << 10, 200 << 10,
                                                           300 << 10, 1 << 30],
                                  [2, 3, 4, 5, 8], [-1, 0, 100 << 10]))
    table = dict(ONE_SHOT_MAX_NBYTES)
    before = [select(*args) for args in grid]
    monkeypatch.setenv("SHMCOLL_DIRECT_MAX_BYTES", "0")
    monkeypatch.setenv("SHMCOLL_SLOT_BYTES", "65536")
    assert [select(*args) for args in grid] == before
    assert [select(*args) for args in reversed(grid)] == before[::-1]
    assert ONE_SHOT_MAX_NBYTES == table  # not mutated by the calls


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_rank_threads_have_their_own_one_shot_limit(world_size):
    """Rank threads pay a GIL hand-over per wait: their one-shot limit is measured through
    dist.* (threaded_bench), 64 KiB from 4 ranks on, and processes do not take it."""
    limit = algorithms.ONE_SHOT_MAX_NBYTES_THREADS.get(
        world_size, algorithms.ONE_SHOT_MAX_NBYTES_THREADS_DEFAULT)
    if world_size >= 4:
        assert limit == 64 << 10
    assert select("all_reduce", limit, world_size, threads=True) is all_reduce_one_shot
    if limit < (1 << 62):
        assert select("all_reduce", limit + 1, world_size, threads=True) is all_reduce_two_shot
    if world_size >= 4:  # processes keep one-shot further (their table)
        assert select("all_reduce", limit + 1, world_size) is all_reduce_one_shot


def test_small_pages_keep_all_reduce_off_cma():
    """Guards the 4 KiB-page rule: where the ranks' buffers are likely on small pages,
    all_reduce never reads peers' buffers (CMA), whatever the size and world size; on huge
    pages it does from SINGLE_COPY_MIN; reduce_scatter and rank threads (no pages pinned)
    are unaffected."""
    from shmcoll.algorithms import SINGLE_COPY_MIN, SINGLE_COPY_NOT_ON_SMALL_PAGES, \
        all_reduce_single_copy, all_reduce_two_shot, reduce_scatter_single_copy
    from shmcoll.native.single_copy import CMA, IN_PROCESS
    least, least_ws = SINGLE_COPY_MIN[CMA]["all_reduce"]
    assert "all_reduce" in SINGLE_COPY_NOT_ON_SMALL_PAGES[CMA]

    def ar(nbytes, ws, small, transport=CMA):
        return algorithms.select("all_reduce", nbytes, ws, single_copy=transport,
                                 small_pages=small, threads=transport == IN_PROCESS)

    for nbytes in (least, 8 << 20, 256 << 20):
        assert ar(nbytes, 2, True) is all_reduce_one_shot
        assert ar(nbytes, 4, True) is all_reduce_two_shot
        assert ar(nbytes, max(2, least_ws), False) is all_reduce_single_copy
        assert ar(nbytes, 4, False) is all_reduce_single_copy
    assert ar(least - 1, 2, False) is all_reduce_one_shot
    assert ar(256 << 20, 4, True, IN_PROCESS) is all_reduce_single_copy
    assert algorithms.select("reduce_scatter", 256 << 20, 4, single_copy=CMA,
                             small_pages=True) is reduce_scatter_single_copy


@pytest.mark.parametrize("mode,env,small", [
    ("always", {}, False), ("madvise", {}, True), ("madvise", {"THP_MEM_ALLOC_ENABLE": "1"}, False),
    ("madvise", {"THP_MEM_ALLOC_ENABLE": "0"}, True), ("never", {"THP_MEM_ALLOC_ENABLE": "1"}, True)])
def test_torch_buffers_small_pages(mode, env, small):
    from shmcoll.native.pages import numpy_buffers_small_pages, torch_buffers_small_pages
    assert torch_buffers_small_pages(mode, env) is small
    assert numpy_buffers_small_pages(mode) is (mode == "never")


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    from shmcoll.native.pages import thp_mode
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert thp_mode(str(f)) == "madvise"
    f.write_text("[always] madvise never\n")
    assert thp_mode(str(f)) == "always"
    assert thp_mode(str(tmp_path / "missing")) == "never"
