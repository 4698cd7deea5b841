"""Rank threads share torch's RNG; threaded_pg.rng_lock(seed) gives each rank the draws of
a single process (issue 15).

The model below draws in several steps and sleeps between them, as any model whose
construction releases the GIL may; all ranks start building it at once (a barrier). Without
the lock the ranks' draws interleave and their models differ from the single-process one
(the hazard, checked so the test cannot pass vacuously); inside rng_lock(seed) every rank
gets the single-process model, spawn after spawn.
"""

import threading
import time

import pytest
import torch
import torch.distributed as dist

import threaded_pg

pytestmark = [pytest.mark.torch, pytest.mark.timeout(120)]

WORLD_SIZE = 4


class _SlowInit(torch.nn.Module):
    """Parameters drawn in steps, with the GIL released in between (a sleep)."""

    def __init__(self, steps=5):
        super().__init__()
        self.weights = torch.nn.ParameterList()
        for _ in range(steps):
            self.weights.append(torch.nn.Parameter(torch.randn(8)))
            time.sleep(0.002)


def _reference():
    torch.manual_seed(0)
    return [p.detach().clone() for p in _SlowInit().parameters()]


def _build(locked, barrier):
    barrier.wait()
    if locked:
        with threaded_pg.rng_lock(seed=0):
            model = _SlowInit()
    else:
        torch.manual_seed(0)
        model = _SlowInit()
    return [p.detach().clone() for p in model.parameters()]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_without_the_lock_rank_threads_interleave_their_draws():
    """The hazard rng_lock exists for (documented in README and THREADED_PG.md)."""
    reference = _reference()
    barrier = threading.Barrier(WORLD_SIZE)
    models = threaded_pg.spawn(lambda r, n: _build(False, barrier), WORLD_SIZE)
    assert not all(_same(m, reference) for m in models)


def test_rng_lock_gives_every_rank_the_single_process_draws():
    reference = _reference()
    for _ in range(3):
        barrier = threading.Barrier(WORLD_SIZE)
        models = threaded_pg.spawn(lambda r, n: _build(True, barrier), WORLD_SIZE)
        for rank, model in enumerate(models):
            assert _same(model, reference), f"rank {rank} drew other numbers"


def test_rng_lock_outside_a_spawn_only_seeds():
    """The same code runs in a process rank ("shm", gloo) or with no ranks at all."""
    with threaded_pg.rng_lock(seed=0):
        with threaded_pg.rng_lock():  # nests
            drawn = [p.detach().clone() for p in _SlowInit().parameters()]
    assert _same(drawn, _reference())


def test_collective_inside_the_section_fails_at_once():
    """The peers wait for their turn and could never join: an immediate error, not a
    hang until the spawn's timeout."""
    def body(rank, world_size):
        with threaded_pg.rng_lock(seed=0):
            dist.all_reduce(torch.ones(1))

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="collective inside threaded_pg.rng_lock"):
        threaded_pg.spawn(body, 2, timeout=30)
    assert time.monotonic() - t0 < 10


def test_waiting_for_the_turn_ends_with_the_spawn():
    """A rank holding the turn for long (rank 0, blocked in its own code) does not leave a
    waiting rank (1) blocked after another rank (2) failed: the spawn's abort ends the wait."""
    release = threading.Event()

    def body(rank, world_size):
        if rank == 0:
            with threaded_pg.rng_lock():
                release.wait(1.5)
        elif rank == 1:
            time.sleep(0.2)
            with threaded_pg.rng_lock():
                pass
        else:
            time.sleep(0.5)
            raise ValueError("rank 2 fails")

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="rank 2 fails") as info:
        threaded_pg.spawn(body, 3, timeout=30)
    release.set()
    assert "rank 1: shmcoll.errors.GroupAbortedError: rank 1: threaded_pg.rng_lock: the " \
           "spawn was aborted" in str(info.value), str(info.value)
    assert time.monotonic() - t0 < 10
