"""threaded_pg, failures: exceptions re-raised with rank and traceback, no hangs, abort,
timeout diagnostics, mismatch reporting.

Fixtures (nothing outlives a test, one warm-up spawn per module): support/threaded.py. Each
test says what it guards.
"""

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

import threaded_pg
from shmcoll import CollectiveMismatchError, CollectiveTimeoutError
from threaded_pg.spawning import group_timeout_s
from support.threaded import (FAST_S, nothing_outlives_the_test,  # noqa: F401 (fixtures)
                              timed, warm)

pytestmark = [pytest.mark.torch, pytest.mark.timeout(120)]


# ===================================================================== failures


def test_exception_reraised_with_rank_and_traceback():
    """Guards: the first failing rank is re-raised as "rank r: <original traceback>", still
    catchable as the original type, naming the line that raised."""
    def body(rank, ws):
        dist.barrier()
        if rank == 2:
            raise KeyError("lost key")  # noqa: the line the traceback must show
        return rank

    with pytest.raises(KeyError) as info:
        threaded_pg.spawn(body, 3)
    err = info.value
    assert isinstance(err, threaded_pg.RankFailedError)
    assert err.rank == 2 and isinstance(err.exception, KeyError)
    text = str(err)
    assert text.startswith("rank 2: Traceback (most recent call last):")
    assert 'raise KeyError("lost key")' in text and "in body" in text
    assert "KeyError: 'lost key'" in text


def test_one_failing_rank_wakes_the_others_promptly():
    """Guards: ranks blocked in a collective the failed rank never joins return at once
    (group aborted), long before the 60 s timeout; their errors are listed."""
    def body(rank, ws):
        dist.all_reduce(torch.ones(2))
        if rank == 1:
            raise RuntimeError("rank 1 gives up")
        dist.all_reduce(torch.ones(2))  # blocks: rank 1 never comes
        dist.barrier()

    _, err, elapsed = timed(threaded_pg.spawn, body, 4, timeout=60)
    print(f"\n[figures] failure propagated to 3 blocked ranks in {elapsed:.2f} s")
    assert isinstance(err, RuntimeError) and err.rank == 1, err
    assert "rank 1 gives up" in str(err)
    assert elapsed < FAST_S
    others = str(err).split("other ranks:", 1)[1]
    for rank in (0, 2, 3):
        assert f"rank {rank}: " in others


def test_rank_busy_in_python_is_interrupted_after_abort():
    """Guards: a rank that never enters a collective after a failure (a Python loop) is
    interrupted after the grace period instead of hanging the caller."""
    def body(rank, ws):
        if rank == 0:
            raise ValueError("boom")
        while True:
            time.sleep(0.01)

    _, err, elapsed = timed(threaded_pg.spawn, body, 2)
    assert isinstance(err, ValueError) and err.rank == 0
    assert elapsed < threaded_pg.runner.ABORT_GRACE_S + FAST_S


def test_spawn_timeout_reports_what_each_rank_is_blocked_in():
    """Guards: past the spawn timeout, the error says per rank which collective (op, seq,
    group) it is blocked in and for whom it waits, or its source line outside collectives."""
    def body(rank, ws):
        dist.all_reduce(torch.ones(1))
        if rank == 1:
            while True:  # stuck in user code: never reaches the all_reduce
                time.sleep(0.01)
        dist.all_reduce(torch.ones(4))

    _, err, elapsed = timed(threaded_pg.spawn, body, 3, timeout=2)
    assert isinstance(err, threaded_pg.SpawnTimeoutError), err
    assert isinstance(err, TimeoutError) and err.ranks == [0, 1, 2]
    text = str(err)
    for rank in (0, 2):
        assert (f"rank {rank}: in all_reduce (seq 2, 16 bytes) on group '0' (ranks [0, 1, 2])"
                in text), text
        assert "waiting for rank 1 at seq 1" in text
    assert "rank 1: not in a collective, at " in text and "time.sleep(0.01)" in text
    assert "last collective: all_reduce seq 1 (completed) on group '0'" in text
    assert elapsed < 2 + threaded_pg.runner.ABORT_GRACE_S + FAST_S


def test_spawn_report_wins_over_collective_timeouts_when_the_caller_wakes_late(monkeypatch):
    """Guards: the ranks' collective timeout outlasts the spawn's, so a caller thread that
    wakes late (a loaded machine) still finds the ranks blocked in their collectives; with
    equal timeouts they had failed by then and the report said "not in a collective"."""
    late_s = 0.3
    assert late_s < group_timeout_s(1) - 1
    wait = threaded_pg.runner._Run._wait_for_failure_or_end

    def late_wait(self, deadline):
        done = wait(self, deadline)
        time.sleep(late_s)  # the caller thread descheduled right at the deadline
        return done

    monkeypatch.setattr(threaded_pg.runner._Run, "_wait_for_failure_or_end", late_wait)

    def body(rank, ws):
        if rank == 0:
            dist.all_reduce(torch.ones(1))  # rank 1 never joins
        else:
            while True:
                time.sleep(0.01)

    _, err, _ = timed(threaded_pg.spawn, body, 2, timeout=1)
    assert isinstance(err, threaded_pg.SpawnTimeoutError), err
    assert "rank 0: in all_reduce (seq 1, 4 bytes)" in str(err), err


def test_collective_timeout_names_seq_group_and_missing_peer():
    """Guards: a group's own timeout raises CollectiveTimeoutError in the waiting rank, and
    the report shows the state of every rank when it happened."""
    parked = threading.Event()

    def body(rank, ws):
        sub = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=1))
        if rank == 0:
            parked.wait(30)  # rank 1 is in its loop before rank 0's 1 s timeout starts
            dist.all_reduce(torch.ones(1), group=sub)  # rank 1 never joins
        else:
            rendezvous = threaded_pg.binding.current_rank()[0]
            parked.set()
            while not rendezvous.aborted:  # until rank 0's failure aborts the spawn
                time.sleep(0.01)

    with pytest.raises(CollectiveTimeoutError) as info:
        threaded_pg.spawn(body, 2)
    text = str(info.value)
    assert text.startswith("rank 0: Traceback")
    assert "all_reduce (seq 1): Timed out waiting 1000ms for ranks [1]" in text
    assert "ranks when it failed:" in text
    report = text.split("ranks when it failed:", 1)[1]
    assert ("rank 0: raised CollectiveTimeoutError; last collective: all_reduce seq 1 (failed) "
            "on group '1'") in report
    rank1 = report.split("rank 1: ", 1)[1].splitlines()[0]
    assert rank1.startswith("not in a collective, at ") and " in body `" in rank1, report


def test_mismatch_is_reported_on_every_rank_naming_both_sides():
    """Guards: different collectives at the same seq raise CollectiveMismatchError on every
    rank, naming both calls, and leave the group usable."""
    def body(rank, ws):
        t = torch.ones(3)
        try:
            if rank == 0:
                dist.all_reduce(t)
            else:
                dist.broadcast(t, src=0)
        except CollectiveMismatchError as e:
            message = str(e)
        else:
            message = None
        dist.all_reduce(t)  # still usable
        return message, t.tolist()

    results = threaded_pg.spawn(body, 3)
    for rank, (message, values) in enumerate(results):
        assert message is not None, f"rank {rank} did not see the mismatch"
        assert "all_reduce(float32, count=3" in message and "broadcast(float32, count=3" in message
        assert message.startswith(f"seq 1: rank {rank} called ")
        assert values == [3.0] * 3


def test_uncaught_mismatch_surfaces_as_collective_mismatch_error():
    """Guards: spawn() re-raises a mismatch as CollectiveMismatchError (pytest.raises works)
    with both sides in the message."""
    def body(rank, ws):
        if rank == 0:
            dist.all_reduce(torch.ones(2))
        else:
            dist.all_gather_into_tensor(torch.empty(2 * ws), torch.ones(2))

    with pytest.raises(CollectiveMismatchError, match=r"all_reduce\(.*\).*all_gather\(|"
                                                      r"all_gather\(.*\).*all_reduce\("):
        threaded_pg.spawn(body, 2)
