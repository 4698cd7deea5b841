"""Test helpers: the `@ranks(n)` decorator (pytest or plain functions) and ThreadedTestCase.

    @threaded_pg.ranks(4)
    @pytest.mark.parametrize("count", [1, 3333])
    def test_sum(rank, world_size, count):       # body runs on 4 rank threads
        t = torch.full((count,), float(rank))
        dist.all_reduce(t)
        assert t[0] == sum(range(world_size))

    class TestMine(threaded_pg.ThreadedTestCase):
        world_size = 4
        def test_sum(self):                        # each test method runs on 4 rank threads
            t = torch.ones(2); dist.all_reduce(t)
            self.assertEqual(t[0].item(), self.world_size)
"""

import functools
import inspect
import unittest

import torch.distributed as dist

from .runner import DEFAULT_TIMEOUT_S
from .spawning import spawn

__all__ = ["ranks", "ThreadedTestCase"]

_RANK_PARAMS = ("rank", "world_size")


def ranks(world_size, timeout=DEFAULT_TIMEOUT_S):
    """Run the decorated function on `world_size` rank threads (threaded_pg.spawn).

    The body may declare `rank` and/or `world_size` parameters; they are filled per rank
    and hidden from the wrapper's signature, so pytest's parametrize and fixtures see only
    the other parameters (their values are shared by all ranks).
    """
    def decorate(body):
        signature = inspect.signature(body)
        wanted = [p for p in _RANK_PARAMS if p in signature.parameters]

        @functools.wraps(body)
        def wrapper(*args, **kwargs):
            def on_rank(rank, size):
                own = {"rank": rank, "world_size": size}
                return body(*args, **kwargs, **{p: own[p] for p in wanted})
            spawn(on_rank, world_size, timeout=timeout)

        wrapper.__signature__ = signature.replace(parameters=[
            p for name, p in signature.parameters.items() if name not in _RANK_PARAMS])
        return wrapper
    return decorate


class ThreadedTestCase(unittest.TestCase):
    """unittest base: every test method runs on `world_size` rank threads.

    setUp/tearDown run once, on the calling thread; inside a test, `self.rank` is the
    calling rank (dist.get_rank()). Assertions failing on any rank fail the test with
    "rank r: <traceback>".
    """

    world_size = 2
    timeout_s = DEFAULT_TIMEOUT_S

    def __init__(self, methodName="runTest"):
        super().__init__(methodName)
        test = getattr(self, methodName, None)
        if test is not None and methodName != "runTest":
            setattr(self, methodName, self._on_ranks(test))

    def _on_ranks(self, test):
        @functools.wraps(test)
        def wrapper():
            spawn(lambda rank, size: test(), self.world_size, timeout=self.timeout_s)
        return wrapper

    @property
    def rank(self):
        return dist.get_rank()
