"""What the test_threaded_pg_*.py modules share: the autouse fixtures (nothing outlives a
test; one warm-up spawn per module) and the timing helper. A module takes the fixtures by
importing them (`from support.threaded import nothing_outlives_the_test, warm`)."""

import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import threaded_pg

FAST_S = 10.0  # generous on 2 loaded cores, far below the 60 s spawn/collective timeout


@pytest.fixture(autouse=True)
def nothing_outlives_the_test():
    """Guards: no rank, executor or p2p thread and no thread-local world survive a test."""
    before = set(threading.enumerate())
    original_world = c10d._world
    hook = sys.excepthook
    yield
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        extra = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not extra:
            break
        time.sleep(0.05)
    assert not extra, f"threads left behind: {[t.name for t in extra]}"
    assert c10d._world is original_world, "torch's _world was not restored"
    assert sys.excepthook is hook, "sys.excepthook was not restored"


@pytest.fixture(scope="module", autouse=True)
def warm():
    """The first spawn loads the numba kernels; keep that out of timed tests."""
    threaded_pg.spawn(lambda rank, ws: dist.all_reduce(torch.ones(2)), 2)


def timed(fn, *args, **kwargs):
    """(result, exception, seconds) of fn(*args, **kwargs)."""
    t0 = time.monotonic()
    try:
        return fn(*args, **kwargs), None, time.monotonic() - t0
    except BaseException as e:  # returned for inspection
        return None, e, time.monotonic() - t0
