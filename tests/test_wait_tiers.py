"""The compiled wait tiers (atomics.wait_all_ge / wait_any_ge: spin and yield tiers bounded
by time, no spin for a peer last seen on my CPU) and the rank threads' Python turn
(protocol_kernels._gil_enter / _gil_leave, threaded_pg RankStates).

These are the pieces whose failure would not show as a wrong result, only as a hang or a
slow group: a yield tier that never ends, a turn that is never given back.
"""

import contextlib
import ctypes
import os
import threading
import time

import numba
import numpy as np
import pytest

from shmcoll.native.atomics import (OWNER_CPU_OFFSET, cpu_pause, load_acquire, monotonic_ns,
                                    wait_all_ge, wait_any_ge, write_release)
from shmcoll.protocol.kernels import GIL_LEAVE_NS, _gil_enter, _gil_leave, post_wake
from shmcoll.protocol.layout import CTRL_LINES, LINE_WORDS
from threaded_pg.arena import RankStates

pytestmark = pytest.mark.timeout(60)


def _words(n):
    w = np.zeros(n + 1, np.int64)  # the last word is the abort word
    addrs = np.array([w.ctypes.data + 8 * k for k in range(n)], np.int64)
    return w, addrs, w.ctypes.data + 8 * n


@numba.njit
def _clock():
    return monotonic_ns()


def test_monotonic_ns_is_the_monotonic_clock():
    _clock()
    before = time.monotonic_ns()
    now = _clock()
    after = time.monotonic_ns()
    assert before <= now <= after


def test_wait_all_ge_zero_budget_is_one_pass():
    w, addrs, abort = _words(2)
    wait_all_ge(addrs, 1, 0, 0, abort)  # compiled before timing
    took = []
    for _ in range(5):  # the fastest of 5: a lost time slice on a loaded host is not the call
        t0 = time.perf_counter()
        assert wait_all_ge(addrs, 1, 0, 0, abort) == 0  # word 0 still below: index 0
        took.append(time.perf_counter() - t0)
    assert min(took) < 0.05, took  # one pass, not a yield tier (YIELD_NS) or a spin budget
    w[0] = 1
    assert wait_all_ge(addrs, 1, 0, 0, abort) == 1
    w[1] = 5
    assert wait_all_ge(addrs, 1, 0, 0, abort) == -1


def test_wait_all_ge_yield_tier_lasts_its_time_budget():
    _, addrs, abort = _words(1)
    wait_all_ge(addrs, 1, 0, 0, abort)  # compiled before timing
    t0 = time.perf_counter()
    assert wait_all_ge(addrs, 1, 10, 20_000_000, abort) == 0
    elapsed = time.perf_counter() - t0
    assert 0.02 <= elapsed < 2.0


@contextlib.contextmanager
def _later(w, index, value, delay_s=0.01):
    """w[index] = value from another thread, `delay_s` into the block."""
    timer = threading.Timer(delay_s, lambda: w.__setitem__(index, value))
    timer.start()
    try:
        yield
    finally:
        timer.join()


def test_wait_all_ge_sees_a_late_post_and_the_abort_word():
    w, addrs, abort = _words(1)
    with _later(w, 0, 3):
        assert wait_all_ge(addrs, 3, 100, 5_000_000_000, abort) == -1
    with _later(w, 1, 1):
        assert wait_all_ge(addrs, 4, 100, 5_000_000_000, abort) == -2


def test_wait_any_ge_budget():
    w, addrs, abort = _words(2)
    targets = np.array([1, 1], np.int64)
    t0 = time.perf_counter()
    assert wait_any_ge(addrs, targets, 0, 0, abort) == -1
    assert time.perf_counter() - t0 < 1.0  # one pass (plus a first compile/load)
    t0 = time.perf_counter()
    assert wait_any_ge(addrs, targets, 0, 20_000_000, abort) == -1
    assert 0.02 <= time.perf_counter() - t0 < 2.0
    w[1] = 1
    assert wait_any_ge(addrs, targets, 0, 0, abort) == 1


@contextlib.contextmanager
def _on_one_cpu():
    """Run this thread on one CPU (yielded) for the block: the CPU the waits see."""
    before = os.sched_getaffinity(0)
    cpu = min(before)
    os.sched_setaffinity(0, {cpu})
    try:
        yield cpu
    finally:
        os.sched_setaffinity(0, before)


def _owned_word():
    """[a word awaited, its owner's CPU + 1 (OWNER_CPU_OFFSET past it), the abort word]."""
    assert OWNER_CPU_OFFSET == 8
    w = np.zeros(3, np.int64)
    return w, np.array([w.ctypes.data], np.int64), w.ctypes.data + 16


def test_a_post_says_which_cpu_it_came_from():
    words = np.zeros(CTRL_LINES * LINE_WORDS, np.int64)  # a control block (SLEEPERS read)
    with _on_one_cpu() as cpu:
        post_wake(words.ctypes.data, 7)
    assert words[0] == 7 and words[OWNER_CPU_OFFSET // 8] == cpu + 1


def test_spin_tier_lasts_its_budget_unless_the_peer_last_posted_from_my_cpu():
    w, addrs, abort = _owned_word()
    with _on_one_cpu() as cpu:
        wait_all_ge(addrs, 1, 0, 0, abort)  # compiled before timing
        w[1] = cpu + 2  # the peer is elsewhere: spin the whole budget, then give up
        t0 = time.perf_counter()
        assert wait_all_ge(addrs, 1, 50_000_000, 0, abort) == 0
        assert 0.05 <= time.perf_counter() - t0 < 2.0
        w[1] = cpu + 1  # it last posted from my CPU: it cannot run while I spin
        took = []
        for _ in range(3):
            t0 = time.perf_counter()
            assert wait_all_ge(addrs, 1, 5_000_000_000, 0, abort) == 0
            took.append(time.perf_counter() - t0)
        assert min(took) < 1.0, took  # not the 5 s budget
        w[1] = cpu + 2  # it moves onto my CPU while I spin: the spin ends there
        t0 = time.perf_counter()
        with _later(w, 1, cpu + 1, 0.02):
            assert wait_all_ge(addrs, 1, 5_000_000_000, 0, abort) == 0
        assert time.perf_counter() - t0 < 2.5
        w[1] = cpu + 2  # ... and a post during the spin is seen
        with _later(w, 0, 1, 0.02):
            assert wait_all_ge(addrs, 1, 5_000_000_000, 0, abort) == -1


def test_wait_any_ge_spin_budget():
    w, addrs, abort = _words(1)
    targets = np.array([1], np.int64)
    wait_any_ge(addrs, targets, 0, 0, abort)  # compiled before timing
    t0 = time.perf_counter()
    assert wait_any_ge(addrs, targets, 20_000_000, 0, abort) == -1
    assert 0.02 <= time.perf_counter() - t0 < 2.0


def _turn():
    word = np.zeros(16, np.int64)
    return word, word.ctypes.data


def test_turn_is_taken_on_leave_and_given_up_on_enter():
    word, addr = _turn()
    _gil_leave(addr, 3, -1, 1)
    assert word[0] == 3
    _gil_enter(addr, 7)  # not the holder: no effect
    assert word[0] == 3
    _gil_enter(addr, 3)
    assert word[0] == 0


def test_incomplete_wait_does_not_take_the_turn():
    word, addr = _turn()
    _gil_leave(addr, 3, 0, 1)  # r = 0: a peer is still missing, Python's slow path follows
    assert word[0] == 0


@pytest.mark.parametrize("spins", [1, 0])
def test_a_held_turn_delays_leave_by_at_most_its_budget(spins):
    word, addr = _turn()
    word[0] = 9  # held by a thread that never gives it back
    _gil_leave(addr, 3, -1, spins)  # compiled before timing
    t0 = time.perf_counter()
    _gil_leave(addr, 3, -1, spins)
    elapsed = time.perf_counter() - t0
    assert word[0] == 9
    assert GIL_LEAVE_NS / 1e9 <= elapsed < GIL_LEAVE_NS / 1e9 + 0.5


@numba.njit(nogil=True)
def _give_up_later(go_addr, turn_addr, holder, delay_ns):
    """The holder's side, compiled so that it is already running (spinning on `go`) when
    the leave starts: wait for go, let delay_ns pass, then enter compiled code."""
    while load_acquire(go_addr) == 0:
        cpu_pause()
    until = monotonic_ns() + delay_ns
    while monotonic_ns() < until:
        cpu_pause()
    _gil_enter(turn_addr, holder)


def test_leave_takes_the_turn_once_the_holder_gives_it_up():
    _gil_leave(*_turn()[1:], 3, -1, 1)  # compiled before timing
    _give_up_later(np.ones(1, np.int64).ctypes.data, _turn()[1], 9, 0)
    # A holder descheduled for longer than GIL_LEAVE_NS makes the leave time out, which is
    # correct too (checked below); attempts keep that scheduling accident out of the
    # result, and a host so loaded that it happens every time skips rather than fails.
    for _ in range(20):
        word, addr = _turn()
        word[0] = 9
        go = np.zeros(16, np.int64)
        holder = threading.Thread(target=_give_up_later,
                                  args=(go.ctypes.data, addr, 9, GIL_LEAVE_NS // 4))
        holder.start()
        time.sleep(0.01)  # the holder spins on `go` by now, unless the host is loaded
        write_release(go.ctypes.data, 1)
        t0 = time.perf_counter()
        _gil_leave(addr, 3, -1, 1)
        elapsed = time.perf_counter() - t0
        holder.join()
        if word[0] == 3:
            return
        # timed out before the holder gave the turn up: went on without it, after the budget
        assert word[0] == 0 and elapsed >= GIL_LEAVE_NS / 1e9
    pytest.skip("the holder thread never ran within GIL_LEAVE_NS of the leave (loaded host)")


@pytest.mark.parametrize("end", ["mark_finished", "mark_failed"])
def test_a_rank_thread_that_ends_gives_up_its_turn(end):
    states = RankStates(3)
    addr, me = states.gil_turn(1)
    assert me == 2 and states.gil_turn(0) == (addr, 1)
    word = np.ctypeslib.as_array((ctypes.c_int64 * 1).from_address(addr))
    _gil_leave(addr, states.gil_turn(0)[1], -1, 1)  # rank 0 holds the turn
    getattr(states, end)(1)
    assert word[0] == 1  # rank 1 ending leaves rank 0's turn alone
    getattr(states, end)(0)
    assert word[0] == 0


def _stream_job(rank, world_size, rendezvous, count):
    import threaded_pg

    group = threaded_pg.new_threaded_group(rendezvous, rank, world_size)
    try:
        out = []
        for rep in range(3):
            a = np.arange(count, dtype=np.float32) * (rank + 1) + rep
            gathered = np.empty(world_size * count, np.float32)
            group.all_gather(gathered, a)
            group.all_reduce(a)
            out.append((a, gathered))
        return out
    finally:
        group.close()


@pytest.mark.parametrize("world_size,direct_max", [(2, -1), (3, 0)],
                         ids=["one_shot", "two_shot"])
def test_streamed_collectives_resume_through_the_python_wait(monkeypatch, world_size,
                                                             direct_max):
    """No spin and no yield tier: nearly every sub-chunk wait of the streamed one-shot
    all_reduce and all_gather (Arena._stream), and every step wait of the two-shot
    all_reduce (Arena.exchange_reduce_two_shot, forced at 3 ranks), ends in Python's slow
    path, which does that step's work from its ring sub-slot and resumes the kernel; the
    results must not notice. 64 KiB slots: 32 KiB sub-slots, so 1 MiB takes 32 sub-chunks
    through the 2-slot ring."""
    import threaded_pg
    from shmcoll import config, protocol

    monkeypatch.setattr(protocol, "SPIN_NS", 0)
    monkeypatch.setattr(protocol, "YIELD_NS", 0)
    cfg = config.from_env(slot_nbytes=64 << 10, direct_max_nbytes=direct_max)
    count = (1 << 20) // 4 + 3
    results = threaded_pg.run_threads(_stream_job, world_size, args=(count,), timeout=60,
                                      cfg=cfg)
    base = np.arange(count, dtype=np.float32)
    factor = world_size * (world_size + 1) // 2
    for rep in range(3):
        want = base * factor + world_size * rep
        gathered = np.concatenate([base * (r + 1) + rep for r in range(world_size)])
        for out in results:
            np.testing.assert_array_equal(out[rep][0], want)
            np.testing.assert_array_equal(out[rep][1], gathered)


# -- rule 5's sleeper handshake (protocol_kernels.post_wake / sleep_on, atomics.futex_*) ----

def _control_block():
    """One rank's control block (zeros): POSTED at its address, SLEEPERS further on."""
    from shmcoll.protocol import CTRL_LINES, LINE_WORDS, W_SLEEPERS
    words = np.zeros(CTRL_LINES * LINE_WORDS, np.int64)
    return words, words.ctypes.data, W_SLEEPERS * LINE_WORDS


def _sleep_while_a_peer_posts(post, delay_s=0.1, timeout_s=5.0):
    """Seconds a sleep_on(target 1, `timeout_s`) took while another thread posts 1 after
    `delay_s` with `post`; and the SLEEPERS word seen by the poster."""
    from shmcoll.protocol.kernels import post_wake, sleep_on
    words, posted, sleepers = _control_block()
    sleep_on(posted, 0, 0)  # compiled before timing
    post_wake(posted + 8 * 16, 0)  # (another line of the same block)
    seen = []

    def peer():
        time.sleep(delay_s)
        seen.append(int(words[sleepers]))
        post(posted, 1)

    t = threading.Thread(target=peer)
    t.start()
    t0 = time.monotonic()
    sleep_on(posted, 1, int(timeout_s * 1e9))
    took = time.monotonic() - t0
    t.join()
    assert words[sleepers] == 0  # the sleeper took itself off again
    return took, seen[0]


@pytest.mark.skipif(not __import__("shmcoll.native.atomics").native.atomics.HAVE_FUTEX,
                    reason="no futex on this platform (sleeps are plain sleeps there)")
def test_a_post_wakes_a_sleeper_at_once():
    from shmcoll.protocol.kernels import post_wake
    took, sleepers = _sleep_while_a_peer_posts(post_wake)
    assert sleepers == 1  # the sleeper announced itself before sleeping
    assert took < 2.5, took  # woken by the post, not by its 5 s bound


@pytest.mark.skipif(not __import__("shmcoll.native.atomics").native.atomics.HAVE_FUTEX,
                    reason="no futex on this platform (sleeps are plain sleeps there)")
def test_a_post_without_the_wake_leaves_the_sleeper_to_its_bound():
    """The control for the test above: the plain release store of before (no wake) is
    not seen until the sleep's bound, so it is the wake that ends the sleep."""
    took, _ = _sleep_while_a_peer_posts(lambda addr, v: write_release(addr, v), timeout_s=1.0)
    assert took >= 0.9, took


def test_sleep_on_a_word_already_there_returns_at_once():
    from shmcoll.protocol.kernels import sleep_on
    words, posted, sleepers = _control_block()
    words[0] = 7
    sleep_on(posted, 7, 0)
    t0 = time.monotonic()
    sleep_on(posted, 5, 5_000_000_000)  # 5 s bound, but POSTED is past the target
    assert time.monotonic() - t0 < 1.0
    assert words[sleepers] == 0


@pytest.mark.skipif(not __import__("shmcoll.native.atomics").native.atomics.HAVE_FUTEX,
                    reason="no futex on this platform (sleeps are plain sleeps there)")
@pytest.mark.parametrize("who", ["own_abort", "peer_abort", "peer_close"])
def test_a_state_change_wakes_a_sleeping_wait_at_once(monkeypatch, who):
    """Rule 5: an abort or close wakes the sleepers, so with sleeps bounded at 30 s a rank
    asleep in its slow wait for a peer's post still fails at once when another thread
    aborts its own group, or when the peer aborts or closes."""
    from shmcoll import protocol
    from shmcoll.protocol import waits as protocol_waits
    from shmcoll.errors import GroupAbortedError, PeerLostError
    monkeypatch.setattr(protocol_waits, "FUTEX_SLEEP_MIN_S", 30.0)
    monkeypatch.setattr(protocol_waits, "FUTEX_SLEEP_MAX_S", 30.0)
    layout = protocol.RegionLayout(4096, 2)
    regions = [np.zeros(layout.nbytes, np.uint8) for _ in range(2)]
    a0, a1 = [protocol.Arena(regions, r, layout, lambda p: True) for r in range(2)]
    fp = (1,)
    for a in (a0, a1):
        a.begin(1, "barrier", fp, 60.0)
    a0._write_fp()
    a0.post()
    change = {"own_abort": lambda: a0.abort_at(1), "peer_abort": lambda: a1.abort_at(1),
              "peer_close": lambda: a1.set_state(protocol.STATE_CLOSED)}[who]

    def later():
        time.sleep(0.5)  # rank 0 is asleep by then (its yield tier lasts YIELD_NS)
        change()

    t = threading.Thread(target=later)
    t.start()
    t0 = time.monotonic()
    with pytest.raises((GroupAbortedError, PeerLostError)):
        a0.wait_all()
    took = time.monotonic() - t0
    t.join()
    assert took < 10.0, took  # woken by the change, not by the 30 s bound
