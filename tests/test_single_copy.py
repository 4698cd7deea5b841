"""Single-copy paths (shmcoll/native/single_copy.py): peers' buffers read where they lie, through
process_vm_readv between rank processes and in place between rank threads.

Exactness: the same case checks as the slot paths (bit-exact against the rank-order
reference, every rank the same bytes), with SHMCOLL_SINGLE_COPY=always so every size takes
them, and with the automatic choice at a size above its threshold. Agreement: a group
goes single-copy only if every rank can read every peer. Errors: a failed read names the
peer and the reason; a dead peer is a PeerLostError.
"""

import functools
import os

import numpy as np
import pytest

import harness
from cases import (assert_rank_results, case_name, check_all_gather, check_all_reduce,
                   check_broadcast, check_reduce_scatter, group_cases, run_cases)
from shmcoll import ReduceOp, protocol
from shmcoll.native import single_copy, single_copy_kernels
from shmcoll.algorithms import SINGLE_COPY_MIN
from shmcoll.errors import CollectiveMismatchError, PeerLostError, ShmcollError

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

JOB_TIMEOUT_S = 300
ALWAYS = {"SHMCOLL_SINGLE_COPY": "always"}
# CMA reductions go in pieces of PIECE_NBYTES per peer: a part of 300001 float32 per rank
# spans several pieces at 2 ranks, and the counts do not divide by the world size.
COUNTS = (0, 1, 3333, 70001, 300001)
REDUCE_CASES = (("float32", ReduceOp.SUM), ("bfloat16", ReduceOp.AVG),
                ("float16", ReduceOp.SUM), ("int8", ReduceOp.BXOR),
                ("complex128", ReduceOp.PRODUCT), ("int64", ReduceOp.MAX),
                ("float64", ReduceOp.PREMUL_SUM))


def _expected_transport(kind):
    return single_copy.IN_PROCESS if kind == "threads" else single_copy.CMA


def _cma_works():
    """Whether this host lets a process read its child's memory (ptrace policy, seccomp)."""
    src = np.arange(16, dtype=np.uint8)
    pid = os.fork()
    if pid == 0:
        import time
        time.sleep(5)
        os._exit(0)
    try:
        return single_copy.probe(pid, src.ctypes.data, src)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


@group_cases
def _sweep(group, rank, world_size, seed):
    mode = group._arena.single_copy
    cases = [("transport", lambda: mode)]
    for count in COUNTS:
        for dtype, op in REDUCE_CASES:
            cases.append((case_name("all_reduce", count=count, dtype=dtype, op=op),
                          functools.partial(check_all_reduce, group, count, dtype, op, seed)))
        cases.append((case_name("reduce_scatter", count=count // world_size),
                      functools.partial(check_reduce_scatter, group, count // world_size,
                                        "float32", ReduceOp.SUM, seed)))
        cases.append((case_name("all_gather", count=count),
                      functools.partial(check_all_gather, group, count, "bfloat16", seed,
                                        "flat")))
        for root in {0, world_size - 1}:
            cases.append((case_name("broadcast", count=count, root=root),
                          functools.partial(check_broadcast, group, count, "int32", root,
                                            seed)))
    # the forms that never go single-copy still work in between (slots, fingerprints)
    cases.append(("all_gather list", functools.partial(check_all_gather, group, 3333,
                                                         "float32", seed, "list")))
    cases.append(("reduce_scatter uneven", functools.partial(
        check_reduce_scatter, group, 333, "float32", ReduceOp.SUM, seed, "uneven")))
    cases.append(("all_reduce strided", functools.partial(
        check_all_reduce, group, 3333, "float32", ReduceOp.SUM, seed, "strided")))
    return cases


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_single_copy_collectives_are_exact(kind, world_size, seed):
    """Guards: with single-copy forced at every size, all_reduce (7 dtype/op pairs),
    reduce_scatter, all_gather and broadcast are bit-exact on every rank, for counts that
    are 0, smaller than the world size, uneven over ranks, and span several CMA pieces."""
    if kind == "processes" and not _cma_works():
        pytest.skip("process_vm_readv is not allowed on this host (ptrace policy)")
    results = harness.run_ranks(_sweep, world_size, kind, timeout_s=JOB_TIMEOUT_S,
                                args=(seed,), env=ALWAYS)
    for failures, digests in results:
        assert digests["transport"] == _expected_transport(kind), digests["transport"]
    assert_rank_results(results)


@group_cases
def _auto(group, rank, world_size, seed):
    mode = group._arena.single_copy
    least, _ = SINGLE_COPY_MIN[mode]["all_reduce"]
    count = least // 4 + 7  # float32, just above the threshold
    return [("transport", lambda: mode),
            ("all_reduce", functools.partial(check_all_reduce, group, count, "float32",
                                             ReduceOp.SUM, seed)),
            ("reduce_scatter", functools.partial(check_reduce_scatter, group,
                                                 count // world_size, "bfloat16",
                                                 ReduceOp.SUM, seed))]


def test_automatic_choice_above_the_threshold(kind, seed):
    """Guards: the default choice (SHMCOLL_SINGLE_COPY unset) takes the single-copy paths
    above SINGLE_COPY_MIN and stays exact (4 ranks: threads need 4 for all_reduce)."""
    if kind == "processes" and not _cma_works():
        pytest.skip("process_vm_readv is not allowed on this host (ptrace policy)")
    results = harness.run_ranks(_auto, 4, kind, timeout_s=JOB_TIMEOUT_S, args=(seed,),
                                env={"SHMCOLL_SINGLE_COPY": None})
    assert results[0][1]["transport"] == _expected_transport(kind)
    assert_rank_results(results)


def _one_rank_refuses(rank, world_size, store):
    """Rank 1 turns single-copy off: every rank must then agree on the slots."""
    # patched for this job only: the pooled worker processes outlive it
    with harness.patched_environ({"SHMCOLL_SINGLE_COPY": "off" if rank == 1 else "always"}):
        group = harness.new_group(store, rank, world_size)
    try:
        mode = group._arena.single_copy
        failures, _ = run_cases([("all_reduce", functools.partial(
            check_all_reduce, group, 70001, "float32", ReduceOp.SUM, 0))])
        return mode, failures
    finally:
        group.close()


def test_ranks_agree_on_the_transport():
    """Guards: single-copy is used only if every rank can read every peer (process_vm_readv
    access need not be symmetric): one rank that cannot (here: turned off) puts the whole
    group on the slots, and the collective is still exact."""
    results = harness.run_ranks(_one_rank_refuses, 3, "processes", timeout_s=JOB_TIMEOUT_S)
    assert [mode for mode, _ in results] == [single_copy.NONE] * 3, results
    assert all(not failures for _, failures in results), results


def _pages_differ(rank, world_size, store):
    """Only rank 0 says its buffers are on small pages; 17 MiB is past the small-page bound
    of the CMA all_reduce, so ranks that did not agree would run different algorithms."""
    import shmcoll
    with harness.patched_environ({"SHMCOLL_SINGLE_COPY": None}):
        group = shmcoll.new_shm_group(store, rank, world_size, timeout_s=60,
                                      small_pages=rank == 0)
    try:
        failures, _ = run_cases([("all_reduce", functools.partial(
            check_all_reduce, group, (17 << 20) // 4 + 3, "float32", ReduceOp.SUM, 0))])
        return group.small_pages, group._arena.single_copy, failures
    finally:
        group.close()


def test_ranks_agree_on_small_pages():
    """Guards: the small-pages hint steers algorithm choice, so the ranks agree on one
    value at init (any rank on small pages makes the group's), and the call is exact."""
    results = harness.run_ranks(_pages_differ, 2, "processes", timeout_s=JOB_TIMEOUT_S)
    assert [small for small, _, _ in results] == [True, True], results
    assert all(not failures for _, _, failures in results), results


def _mixed_forms(rank, world_size, store):
    group = harness.new_group(store, rank, world_size)
    try:
        inp = np.full(70001, rank, np.float32)
        try:
            if rank == 0:
                group.all_gather(np.zeros(70001 * world_size, np.float32), inp)
            else:
                group.all_gather([np.zeros(70001, np.float32) for _ in range(world_size)], inp)
        except CollectiveMismatchError as e:
            caught = str(e)
        else:
            caught = None
        group.all_reduce(inp)  # the group stays usable
        return caught, float(inp[0])
    finally:
        group.close()


def test_all_gather_forms_must_match(kind):
    """Guards: all_gather into one array and into a list take different steps (the first
    may go single-copy), so a rank calling the other form gets a CollectiveMismatchError
    on every rank instead of a wrong result or a hang."""
    results = harness.run_ranks(_mixed_forms, 2, kind, timeout_s=JOB_TIMEOUT_S, env=ALWAYS)
    for caught, total in results:
        assert caught is not None and "all_gather" in caught, caught
        assert total == 1.0


def _arena_pair(pids, alive=True):
    layout = protocol.RegionLayout(4096, 2)
    regions = [np.zeros(layout.nbytes, np.uint8) for _ in range(2)]
    arena = protocol.Arena(regions, 0, layout, lambda p: alive, pids=pids,
                           single_copy=single_copy.CMA)
    arena.begin(1, "all_reduce", (2, 3, 1, 0, 0, 1), 5.0)
    return arena


def test_failed_read_names_peer_and_reason():
    """Guards: a read the kernel refuses (a bad address from a peer) is a ShmcollError that
    names the collective, both ranks and errno; a peer that is gone (ESRCH, or reported
    dead) is a PeerLostError."""
    dst = np.zeros(64, np.uint8)
    one = np.array([1], np.int64)
    args = (one, np.array([8], np.int64), np.array([dst.ctypes.data], np.int64),
            np.array([64], np.int64))
    arena = _arena_pair([os.getpid(), os.getpid()])
    with pytest.raises(ShmcollError, match=r"all_reduce \(seq 1\): rank 0 could not read "
                                           r"rank 1's buffer .*EFAULT"):
        arena.gather_peers(*args)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)  # reaped: the pid no longer exists
    arena = _arena_pair([os.getpid(), pid])
    with pytest.raises(PeerLostError, match="rank 1"):
        arena.gather_peers(*args)
    arena = _arena_pair([os.getpid(), os.getpid()], alive=False)
    with pytest.raises(PeerLostError, match="rank 1"):
        arena.gather_peers(*args)


def test_peer_read_copies_and_reports_errno():
    """Guards: the compiled process_vm_readv returns what it copied, or -errno."""
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    assert single_copy_kernels.fetch(single_copy.CMA, os.getpid(), dst.ctypes.data,
                                     src.ctypes.data, src.size) == 0
    assert np.array_equal(dst, src)
    assert single_copy_kernels.fetch(single_copy.CMA, os.getpid(), dst.ctypes.data, 8,
                                     16) == -14
    assert "EFAULT" in single_copy.errno_text(-14)
