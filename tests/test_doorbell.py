"""The Executor's doorbell (shmcoll/torch_backend/doorbell.py, _lane.c's bell_*): the worker
sleeps with the GIL released, runs a job only when its submitter has not taken it within a
look, parks when no submissions come, and wakes at once for anything urgent; and the jobs'
futures, made only when asked for (work.Job).

The executor-level guarantees (an async op nobody waits for still runs; callbacks, chains
and C++ waits through the worker) are test_futures.py's, on real groups."""

import threading
import time

import pytest
import torch

from shmcoll.torch_backend import doorbell
from shmcoll.torch_backend.executor import Executor
from shmcoll.torch_backend.work import Job

pytestmark = [pytest.mark.timeout(120)]

needs_bell = pytest.mark.skipif(doorbell._lane is None,
                                reason="the C extension (_lane) was not built here")

LONG_S = 30.0  # a deadline no passing run comes near


def _waiter(bell, seen, timeout_s):
    """wait() on a thread: (thread, result dict with 'got' and 'elapsed' once it returned)."""
    out = {}

    def run():
        t0 = time.monotonic()
        out["got"] = bell.wait(seen, timeout_s)
        out["elapsed"] = time.monotonic() - t0
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _returns_at_once(bell, seen):
    """A wait from `seen` returns True well before its deadline."""
    thread, out = _waiter(bell, seen, LONG_S)
    thread.join(LONG_S)
    assert out["got"] is True and out["elapsed"] < 5.0


def _until(predicate, limit_s=LONG_S):
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(1e-3)


@needs_bell
def test_a_job_nobody_takes_wakes_the_waiter_after_a_look():
    bell = doorbell.Doorbell(poll_ns=20_000_000, idle_ns=10**12)
    thread, out = _waiter(bell, bell.snapshot(), LONG_S)
    time.sleep(0.05)
    t0 = time.monotonic()
    bell.job()
    thread.join(LONG_S)
    assert out["got"] is True and bell.pending == 1
    # queued at one look and still at the next: at least one poll after the ring
    assert time.monotonic() - t0 >= 0.02 * 0.9


@needs_bell
def test_a_job_taken_before_the_next_look_leaves_the_waiter_asleep():
    bell = doorbell.Doorbell(poll_ns=200_000_000, idle_ns=10**12)
    thread, out = _waiter(bell, bell.snapshot(), 0.6)
    time.sleep(0.01)
    bell.job()
    bell.taken()  # its submitter ran it (Executor.wait) long before the next look
    thread.join(LONG_S)
    assert out["got"] is False and out["elapsed"] >= 0.6 * 0.9  # slept to its timeout
    assert bell.pending == 0


@needs_bell
def test_jobs_queued_before_the_wait_are_taken_at_once():
    bell = doorbell.Doorbell(poll_ns=10**10, idle_ns=10**12)
    bell.job()
    _returns_at_once(bell, bell.snapshot())  # not one 10 s look later


@needs_bell
def test_an_urgent_ring_wakes_one_waiter_and_a_ring_for_everyone_wakes_them_all():
    bell = doorbell.Doorbell(poll_ns=10**10, idle_ns=10**12)
    bell.urgent(everyone=True)
    seen = bell.snapshot()  # taken after that ring: it is not news
    waiters = [_waiter(bell, seen, LONG_S) for _ in range(2)]
    time.sleep(0.05)
    assert all(t.is_alive() for t, _ in waiters)
    bell.urgent()  # one token: one waiter returns, as with a condition's notify()
    _until(lambda: sum(not t.is_alive() for t, _ in waiters) == 1)
    time.sleep(0.05)
    assert sum(t.is_alive() for t, _ in waiters) == 1
    bell.urgent(everyone=True)
    for t, out in waiters:
        t.join(LONG_S)
        assert out["got"] is True and out["elapsed"] < 5.0


@needs_bell
def test_an_urgent_ring_with_nobody_waiting_is_taken_by_the_next_wait():
    bell = doorbell.Doorbell(poll_ns=10**10, idle_ns=10**12)
    bell.urgent()
    _returns_at_once(bell, bell.snapshot())
    thread, out = _waiter(bell, bell.snapshot(), 0.2)  # the token is spent
    thread.join(LONG_S)
    assert out["got"] is False


@needs_bell
def test_the_waiter_parks_without_submissions_and_a_job_wakes_it():
    bell = doorbell.Doorbell(poll_ns=20_000_000, idle_ns=1_000_000)
    thread, out = _waiter(bell, bell.snapshot(), LONG_S)
    _until(lambda: bell.parked == 1)
    bell.job()
    thread.join(LONG_S)
    assert out["got"] is True and out["elapsed"] < LONG_S / 2
    assert bell.parked == 0


@needs_bell
def test_a_parked_waiter_still_ends_at_its_timeout():
    bell = doorbell.Doorbell(poll_ns=1_000_000, idle_ns=1_000_000)
    thread, out = _waiter(bell, bell.snapshot(), 0.3)
    thread.join(LONG_S)
    assert out["got"] is False and 0.3 * 0.9 <= out["elapsed"] < LONG_S / 2


def test_bad_addresses_are_refused():
    if doorbell._lane is None:
        pytest.skip("the C extension (_lane) was not built here")
    with pytest.raises(ValueError, match="doorbell"):
        doorbell._lane.bell_ring(0, 1)
    with pytest.raises(ValueError, match="unknown kind"):
        doorbell._lane.bell_ring(doorbell.Doorbell()._address, 7)
    with pytest.raises(ValueError, match="doorbell"):
        doorbell._lane.bell_wait(3, 0, 1, 1, 0)


# -- the Executor on its doorbell ----------------------------------------------------------

def _executor(monkeypatch, poll_ns, idle_ns=doorbell.IDLE_NS):
    """An Executor whose doorbell looks every poll_ns from its worker's first wait, once
    its worker sleeps on it (else the worker's first round finds the queue itself)."""
    if doorbell._lane is not None:
        monkeypatch.setattr(doorbell.Doorbell, "create",
                            classmethod(lambda cls: cls(poll_ns=poll_ns, idle_ns=idle_ns)))
    ex = Executor("test-bell")
    if ex._bell is not None:
        _until(lambda: ex._bell.waiting == 1)
    return ex


@needs_bell
def test_a_submitter_that_waits_runs_its_job_itself(monkeypatch):
    ex = _executor(monkeypatch, poll_ns=10**9)  # the worker would take it only a second later
    try:
        ran_on = []
        for i in range(20):
            job = ex.submit(Job(f"j{i}", lambda: ran_on.append(threading.current_thread()),
                                []))
            assert ex.wait(job)
        assert ran_on == [threading.current_thread()] * 20
        assert ex._bell.pending == 0
    finally:
        assert ex.stop()


@needs_bell
def test_a_wait_with_a_deadline_has_the_worker_run_the_job_at_once(monkeypatch):
    ex = _executor(monkeypatch, poll_ns=10**10)  # a look would come 10 s later
    try:
        ran_on = []
        job = ex.submit(Job("deadline", lambda: ran_on.append(threading.current_thread()),
                            []))
        t0 = time.monotonic()
        assert ex.wait(job, timeout_s=LONG_S)
        assert time.monotonic() - t0 < 5.0 and ran_on[0] is not threading.current_thread()
    finally:
        assert ex.stop()


@pytest.mark.parametrize("poll_ns", [1_000_000, 50_000_000])
def test_a_job_nobody_waits_for_runs_on_the_worker(monkeypatch, poll_ns):
    ex = _executor(monkeypatch, poll_ns)
    try:
        ran = threading.Event()
        ran_on = []
        job = ex.submit(Job("unwaited", lambda: (ran_on.append(threading.current_thread()),
                                                  ran.set()), []))
        assert ran.wait(LONG_S), "the worker never ran the job"
        assert ran_on[0] is not threading.current_thread()
        _until(lambda: job.event.is_set())  # and completed it
        assert job.error is None
    finally:
        assert ex.stop()


def test_stop_wakes_a_parked_worker_and_fails_what_is_queued(monkeypatch):
    ex = _executor(monkeypatch, doorbell.POLL_NS, idle_ns=1_000_000)
    if ex._bell is not None:
        _until(lambda: ex._bell.parked == 1)
    t0 = time.monotonic()
    assert ex.stop()
    assert time.monotonic() - t0 < LONG_S / 2
    with pytest.raises(RuntimeError, match="shut down"):
        ex.submit(Job("late", lambda: None, []))


# -- futures made when asked for ---------------------------------------------------------

def test_a_future_asked_for_after_completion_is_complete_with_the_outputs():
    out = [torch.ones(2)]
    job = Job("done-first", lambda: None, out)
    job.execute()
    job.complete()
    assert job.event.is_set()
    fut = job.future
    assert fut.done() and fut.wait() is out and job.future is fut


def test_a_future_asked_for_before_completion_completes_with_it_after_its_callbacks():
    order = []
    job = Job("asked-first", lambda: None, [])
    fut = job.future
    fut.then(lambda f: order.append("callback"))
    assert not fut.done()
    job.execute()
    job.complete()
    order.append("complete returned")
    assert fut.done() and order == ["callback", "complete returned"]


def test_a_failed_job_puts_its_future_in_the_error_state_whenever_it_is_asked_for():
    def boom():
        raise RuntimeError("boom")
    for ask_first in (True, False):
        job = Job("failing", boom, [])
        fut = job.future if ask_first else None
        job.execute()
        job.complete()
        fut = fut if ask_first else job.future
        with pytest.raises(RuntimeError, match="boom"):
            fut.wait()
        assert not job.in_callbacks


@pytest.mark.parametrize("poll_ns,idle_ns", [(1_000_000, 50_000_000), (200_000, 300_000)])
def test_mixed_waits_from_several_threads_all_finish_in_issue_order(monkeypatch, poll_ns,
                                                                    idle_ns):
    """Jobs from three threads, each waited by Work-style wait(), by a future's C++ wait
    (torch.futures.wait_all, after get_future's expedite), or not at all, with pauses long
    enough for the worker to park (second case): every job runs once, in issue order, and
    every future completes."""
    import random
    ex = _executor(monkeypatch, poll_ns, idle_ns)
    ran, lock = [], threading.Lock()
    jobs, errors = [], []

    def issue(tid):
        rng = random.Random(tid)
        try:
            for i in range(60):
                with lock:  # issue order = the order jobs enter the queue
                    job = ex.submit(Job(f"t{tid}-{i}", lambda n=len(jobs): ran.append(n), []))
                    jobs.append(job)
                how = rng.random()
                if how < 0.4:
                    assert ex.wait(job)
                elif how < 0.7:
                    fut = job.future
                    ex.expedite()
                    torch.futures.wait_all([fut])
                if rng.random() < 0.05:
                    time.sleep(idle_ns / 1e9 * 2)  # long enough to park
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=issue, args=(t,), daemon=True) for t in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(LONG_S)
        assert not errors and not any(t.is_alive() for t in threads)
        _until(lambda: all(j.event.is_set() for j in jobs))
        assert ran == list(range(len(jobs)))
        assert all(j.future.done() and j.error is None for j in jobs)
        if ex._bell is not None:
            assert ex._bell.pending == 0
    finally:
        assert ex.stop()
