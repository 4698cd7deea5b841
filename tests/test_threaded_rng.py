"""Rank threads share torch's RNG; threaded_pg.rng_lock(seed) gives each rank the draws of
a single process (issue 15).

The model below draws in several steps and sleeps between them, as any model whose
construction releases the GIL may; all ranks start building it at once (a barrier). Without
the lock the ranks' draws interleave and their models differ from the single-process one
(the hazard, checked so the test cannot pass vacuously); inside rng_lock(seed) every rank
gets the single-process model, spawn after spawn.

The seed watch (issue 23): while a spawn runs, a rank thread reseeding torch's default
generator outside rng_lock gets one SharedRNGWarning per spawn, naming rng_lock; the main
thread, sections and code outside spawns do not; the originals are back after the spawn.
"""

import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import threaded_pg
from shmcoll.torch_backend import compat

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
    with pytest.warns(threaded_pg.SharedRNGWarning, match="outside threaded_pg.rng_lock"):
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


def test_rng_lock_in_a_process_imports_neither_the_groups_nor_numba():
    """Guards: a program whose ranks are processes and which builds its model inside
    rng_lock (the recipe, tests/programs/common.py) imports no threaded group module and no
    numba for it (threaded_pg/binding.py holds the rank binding rng_lock reads): numba's
    import (~0.3 s) and its kernel definitions would otherwise run in the program's main
    thread beside the group's warm-up. Fails if rng.py reaches group.py again."""
    script = ("import sys, torch, threaded_pg\n"
              "with threaded_pg.rng_lock(seed=1):\n"
              "    x = torch.rand(2)\n"
              "torch.manual_seed(1)\n"
              "assert torch.equal(x, torch.rand(2))\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] == 'numba'\n"
              "             or m == 'threaded_pg.group'))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout


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


# -- the seed watch: torch.manual_seed in a rank thread, outside rng_lock, warns ------------


def _seed_warnings(record):
    return [w for w in record if issubclass(w.category, threaded_pg.SharedRNGWarning)]


def _spawn_recording(body, world_size=2):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        threaded_pg.spawn(body, world_size, timeout=30)
    return _seed_warnings(record)


@pytest.mark.parametrize("seeder", ["torch.manual_seed", "torch.random.manual_seed",
                                    "torch.seed", "torch.random.seed", "imported_earlier"])
def test_seeding_in_rank_threads_warns_once_per_spawn_naming_rng_lock(seeder):
    from torch import manual_seed  # bound before the spawn: still caught on torch 2.13

    call = {"torch.manual_seed": lambda: torch.manual_seed(0),
            "torch.random.manual_seed": lambda: torch.random.manual_seed(0),
            "torch.seed": lambda: torch.seed(), "torch.random.seed": lambda: torch.random.seed(),
            "imported_earlier": lambda: manual_seed(0)}[seeder]
    if seeder == "imported_earlier" and compat.rng_seed_hooks()[0][1] != "_manual_seed_impl":
        pytest.skip(f"torch {torch.__version__}: torch.manual_seed has no inner function to "
                    f"wrap, so a name bound before the spawn is not caught")

    def body(rank, world_size):
        for _ in range(3):
            call()

    for _ in range(2):  # each spawn warns again (a pytest session's later tests are told)
        found = _spawn_recording(body, 3)
        assert len(found) == 1, [str(w.message) for w in found]
        text = str(found[0].message)
        assert "threaded_pg.rng_lock" in text and "outside" in text, text
        public = "torch.seed" if seeder.endswith("seed") and "manual" not in seeder \
            else "torch.manual_seed"
        assert f"called {public}()" in text, text
        assert found[0].filename == __file__, found[0].filename  # points at the caller


def test_no_warning_inside_rng_lock():
    def body(rank, world_size):
        with threaded_pg.rng_lock(seed=0):
            torch.manual_seed(1)  # an explicit reseed inside the section is fine
            torch.seed()
            torch.randn(2)

    assert _spawn_recording(body) == []


def test_no_warning_in_the_main_thread_during_a_spawn():
    before = _originals()
    entered, release = threading.Barrier(3), threading.Event()

    def body(rank, world_size):
        entered.wait()
        release.wait(10)

    def seed_while_running():
        entered.wait()
        try:
            torch.manual_seed(0)  # the main thread, while the spawn's watch is installed
            torch.seed()
            assert _wrapped(before), "the watch was not installed during the spawn"
        finally:
            release.set()

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        runner = threading.Thread(target=lambda: threaded_pg.spawn(body, 2, timeout=30))
        runner.start()
        seed_while_running()
        runner.join(30)
    assert not runner.is_alive()
    assert _seed_warnings(record) == []


def test_no_warning_outside_a_spawn():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        torch.seed()
    assert _seed_warnings(record) == []


def _wrapped(before):
    """Some seeding function differs from what _originals() gave (a spawn wraps them)."""
    return any(getattr(module, attribute) is not original
               for module, attribute, original in before)


def _originals():
    return [(module, attribute, getattr(module, attribute))
            for module, attribute, _public in compat.rng_seed_hooks()]


def test_the_seeding_functions_are_restored_after_the_spawn():
    before = _originals()
    public = (torch.manual_seed, torch.random.manual_seed, torch.seed, torch.random.seed)
    seen = []

    def body(rank, world_size):
        seen.append(_wrapped(before))

    threaded_pg.spawn(body, 2, timeout=30)
    assert seen == [True, True], "nothing was wrapped during the spawn"
    for module, attribute, original in before:
        assert getattr(module, attribute) is original, f"{module.__name__}.{attribute}"
    assert (torch.manual_seed, torch.random.manual_seed, torch.seed, torch.random.seed) == public

    def failing(rank, world_size):
        raise ValueError("boom")

    with pytest.raises(ValueError):
        threaded_pg.spawn(failing, 2, timeout=30)  # a failed spawn restores them too
    for module, attribute, original in before:
        assert getattr(module, attribute) is original, f"{module.__name__}.{attribute}"
