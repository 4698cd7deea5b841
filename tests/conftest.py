"""Shared pytest setup: markers, the /dev/shm leak check, the test seed, the worker pool.

Leak check: every test snapshots /dev/shm before and after. A new `shmcoll-*` segment that
belongs to this test run (its owner pid, the last field of the name, is this process, a
worker the harness started, or a live descendant of this process) fails the test and is
unlinked, so one leak does not cascade. Other new entries are reported, not failed on:
other engineers' jobs share this machine and /dev/shm.
"""

import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
from support import devshm  # noqa: E402

DEFAULT_SEED = 20240611


def pytest_configure(config):
    for line in (
        "multiprocess: spawns rank processes (harness pool, torchrun, mp.spawn)",
        "torch: goes through torch.distributed",
    ):
        config.addinivalue_line("markers", line)


def pytest_sessionfinish(session, exitstatus):
    harness.shutdown_pool()


# ------------------------------------------------------------------------ /dev/shm leaks

@pytest.fixture(autouse=True)
def no_shm_leaks(request):
    """Fail a test that leaves a shmcoll-* segment of ours in /dev/shm."""
    before = devshm.listing()
    yield
    new = devshm.listing() - before
    if not new:
        return
    ours = {os.getpid(), *harness.our_pids()} | devshm.descendants(os.getpid())
    leaked = sorted(n for n in new
                    if n.startswith(devshm.SEGMENT_PREFIX) and devshm.owner_pid(n) in ours)
    others = sorted(new - set(leaked))
    if others:
        warnings.warn(f"new /dev/shm entries during {request.node.nodeid} (not attributed to "
                      f"this test; other jobs share the machine): {others}")
    for name in leaked:
        devshm.unlink(name)
    assert not leaked, f"test leaked shared-memory segments (now unlinked): {leaked}"


# ------------------------------------------------------------------------------- seeds

@pytest.fixture
def seed(request):
    """The seed of a randomized test: SHMCOLL_TEST_SEED or a fixed default; printed."""
    value = int(os.environ.get("SHMCOLL_TEST_SEED", DEFAULT_SEED))
    print(f"{request.node.nodeid}: seed {value} (set SHMCOLL_TEST_SEED to change)")
    return value


@pytest.fixture(params=harness.available_kinds())
def kind(request):
    """Every available way of running ranks (processes; threads once registered)."""
    return request.param
