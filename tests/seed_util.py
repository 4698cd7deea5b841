"""Helpers for tests/test_gloo_seeds_*.py: gloo-seed style assertions inside rank processes.

The seeds (../shared/seeds/000, test_c10d_gloo.py::ProcessGroupGlooTest) run one process
per rank with MultiProcessTestCase; here a job function runs on every rank of the shared
harness pool (harness.run_ranks) and uses these helpers:

* `Ranks(rank, world_size, store)`: FileStore rendezvous files under the job's store dir,
  `pg()` = gloo's `_create_process_group_gloo` for "shm" (direct construction, then
  `dist.barrier(group=pg)`), `init()` = `dist.init_process_group("shm", ...)`; every group
  made is shut down (and the default group destroyed) by `close()`, so a pooled worker
  starts the next job clean.
* `run_job(fn)`: `fn` on WS ranks of the harness pool, SEED_JOB_TIMEOUT (240 s) by default.
  A test runs one job that batches many seed checks, so the spawn/rendezvous cost is paid once
  per batch; WS = 4 like MultiProcessTestCase's default (DEFAULT_WORLD_SIZE) unless noted.
* `assert_equal`, `raises(exc, regex)`: assertEqual / assertRaisesRegex equivalents.
* Test-case generators copied from the seed (simple_reduce_tests & co) and from
  torch.testing._internal.common_distributed (simple_sparse_reduce_tests).
"""

import contextlib
import datetime
import math
import operator
import os
import re
from functools import partial, reduce

import torch
import torch.distributed as dist

import harness

__all__ = ["WS", "JOB_TIMEOUT_S", "run_job", "Ranks", "ranks", "assert_equal", "raises",
           "simple_reduce_tests", "simple_coalesced_reduce_tests",
           "simple_multi_input_reduce_tests",
           "simple_sparse_reduce_tests"]


WS = 4
JOB_TIMEOUT_S = int(os.environ.get("SEED_JOB_TIMEOUT", 240))


def run_job(fn, world_size=WS, timeout_s=JOB_TIMEOUT_S, args=(), env=None):
    """`fn(rank, world_size, store, *args)` on every rank of the harness pool."""
    return harness.run_ranks(fn, world_size, timeout_s=timeout_s, args=args, env=env)


class Ranks:
    """Per-rank context of one job: rendezvous paths and every process group it made."""

    def __init__(self, rank, world_size, store):
        from shmcoll.torch_backend import ProcessGroupShm  # (importing shmcoll registers "shm")

        self.rank = rank
        self.world_size = world_size
        self.dir = store.path
        self._cls = ProcessGroupShm
        self._pgs = []
        self._count = 0

    def file(self, name):
        return os.path.join(self.dir, name)

    def filestore(self, name=None, world_size=None):
        self._count += 1
        return dist.FileStore(self.file(name or f"filestore{self._count}"),
                              world_size or self.world_size)

    def opts(self, timeout_s=50.0, threads=2, group_name="0"):
        """The seed's opts(): `_timeout` assigned in seconds (float), threads, group name."""
        opts = self._cls.Options()
        opts._timeout = timeout_s
        opts._threads = threads
        opts.group_name = group_name
        return opts

    def pg(self, store=None, opts=None, barrier=True, **kw):
        """gloo's _create_process_group_gloo: construct, then dist.barrier(group=pg)."""
        store = store if store is not None else self.filestore()
        pg = self._cls(store, self.rank, self.world_size, opts or self.opts(**kw))
        self._pgs.append(pg)
        if barrier:
            dist.barrier(group=pg)
        return pg

    def track(self, pg):
        self._pgs.append(pg)
        return pg

    def init(self, store=None, init_method=None, timeout_s=60.0, **kw):
        """dist.init_process_group("shm") on a FileStore (or an init_method URL)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if init_method is not None:
            dist.init_process_group("shm", init_method=init_method, rank=self.rank,
                                    world_size=self.world_size, timeout=timeout, **kw)
        else:
            dist.init_process_group("shm", store=store or self.filestore(), rank=self.rank,
                                    world_size=self.world_size, timeout=timeout, **kw)
        return dist.group.WORLD

    def close(self):
        if dist.is_initialized():
            dist.destroy_process_group()
        for pg in self._pgs:
            with contextlib.suppress(Exception):
                pg.shutdown()
        self._pgs = []


@contextlib.contextmanager
def ranks(rank, world_size, store):
    ctx = Ranks(rank, world_size, store)
    try:
        yield ctx
    finally:
        ctx.close()


def assert_equal(actual, expected, msg=None, rtol=None, atol=None, exact_dtype=True):
    """assertEqual for tensors (dense or sparse), numbers and nested lists of them."""
    if isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)), f"{msg or ''}: expected a list, got {actual!r}"
        assert len(actual) == len(expected), \
            f"{msg or ''}: length {len(actual)} != {len(expected)}: {actual!r} vs {expected!r}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_equal(a, e, f"{msg or ''}[{i}]", rtol, atol, exact_dtype)
        return
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{msg or ''}: expected a tensor, got {actual!r}"
        if expected.layout == torch.sparse_coo or actual.layout == torch.sparse_coo:
            actual = actual.to_dense() if actual.layout == torch.sparse_coo else actual
            expected = expected.to_dense() if expected.layout == torch.sparse_coo else expected
        kw = {}
        if rtol is not None or atol is not None:
            kw = dict(rtol=rtol or 0.0, atol=atol or 0.0)
        torch.testing.assert_close(actual, expected, check_dtype=exact_dtype,
                                   msg=(lambda m: f"{msg}: {m}") if msg else None, **kw)
        return
    assert actual == expected, f"{msg or ''}: {actual!r} != {expected!r}"


@contextlib.contextmanager
def raises(exc_type, regex):
    """assertRaisesRegex: the block must raise `exc_type` whose text matches `regex`."""
    try:
        yield
    except exc_type as e:
        if not re.search(regex, str(e)):
            raise AssertionError(f"{regex!r} does not match {str(e)!r}") from e
        return
    raise AssertionError(f"{exc_type.__name__} matching {regex!r} not raised")


# ----------------------------------------------------------- generators from the seeds

def simple_reduce_tests(rank, world_size):
    tests = [
        (dist.ReduceOp.SUM, torch.tensor([rank + 1.0]),
         torch.tensor([float(world_size * (world_size + 1) / 2)])),
        (dist.ReduceOp.PRODUCT, torch.tensor([rank + 1.0]),
         torch.tensor([float(math.factorial(world_size))])),
        (dist.ReduceOp.MIN, torch.tensor([rank + 1.0]), torch.tensor([1.0])),
        (dist.ReduceOp.MAX, torch.tensor([rank + 1.0]), torch.tensor([float(world_size)])),
        (dist.ReduceOp.AVG, torch.tensor([rank + 1.0]),
         torch.tensor([float((world_size + 1) / 2)])),
    ]
    for i in range(4):
        vin = rank | (1 << i)
        vout = 1 << i
        tests.append((dist.ReduceOp.BAND, torch.tensor([vin], dtype=torch.int32),
                      torch.tensor([vout], dtype=torch.int32)))
    for i in range(1, 5):
        vin = reduce(operator.or_, [rank * i + j for j in range(i)])
        vout = reduce(operator.or_, range(world_size * i))
        tests.append((dist.ReduceOp.BOR, torch.tensor([vin], dtype=torch.int32),
                      torch.tensor([vout], dtype=torch.int32)))
    for i in range(1, 5):
        vin = reduce(operator.xor, [rank * i + j for j in range(i)])
        vout = reduce(operator.xor, range(world_size * i))
        tests.append((dist.ReduceOp.BXOR, torch.tensor([vin], dtype=torch.int32),
                      torch.tensor([vout], dtype=torch.int32)))
    s = world_size * (world_size + 1) / 2
    a = float((world_size + 1) / 2)
    tests.extend((
        (dist.ReduceOp.SUM, torch.tensor([complex(rank + 1.0, rank + 1.0)], dtype=torch.cfloat),
         torch.tensor([complex(s, s)], dtype=torch.cfloat)),
        (dist.ReduceOp.AVG, torch.tensor([complex(rank + 1.0, rank + 1.0)], dtype=torch.cfloat),
         torch.tensor([complex(a, a)], dtype=torch.cfloat)),
    ))
    return tests


def simple_coalesced_reduce_tests(rank, world_size):
    ws = world_size
    return [
        (dist.ReduceOp.SUM, [torch.tensor([rank + 1.0]), torch.tensor([(rank + 1.0) ** 2])],
         [torch.tensor([float(ws * (ws + 1) / 2)]),
          torch.tensor([float(ws * (ws + 1) * (2 * ws + 1) / 6)])]),
        (dist.ReduceOp.PRODUCT, [torch.tensor([rank + 1.0]), torch.tensor([rank + 2.0])],
         [torch.tensor([float(math.factorial(ws))]),
          torch.tensor([float(math.factorial(ws + 1))])]),
        (dist.ReduceOp.MIN, [torch.tensor([rank + x]) for x in [0.0, 1.0]],
         [torch.tensor([0.0]), torch.tensor([1.0])]),
        (dist.ReduceOp.MAX, [torch.tensor([rank + x]) for x in [1.0, 2.0]],
         [torch.tensor([float(ws)]), torch.tensor([ws + 1.0])]),
    ]


def simple_multi_input_reduce_tests(rank, world_size):
    ws = world_size
    return [
        (dist.ReduceOp.SUM, [torch.tensor([2 * rank + 0.0]), torch.tensor([2 * rank + 1.0])],
         torch.tensor([float(ws * (2 * ws - 1))])),
        (dist.ReduceOp.PRODUCT, [torch.tensor([2 * rank + 1.0]), torch.tensor([2 * rank + 2.0])],
         torch.tensor([float(math.factorial(2 * ws))])),
        (dist.ReduceOp.MIN, [torch.tensor([2 * rank + 1.0]), torch.tensor([2 * rank + 2.0])],
         torch.tensor([1.0])),
        (dist.ReduceOp.MAX, [torch.tensor([2 * rank + 1.0]), torch.tensor([2 * rank + 2.0])],
         torch.tensor([2.0 * ws])),
    ]


def simple_sparse_reduce_tests(rank, world_size, num_inputs=1):
    """torch.testing._internal.common_distributed.simple_sparse_reduce_tests (torch 2.13)."""

    def generate(rank, world_size, sparse_dims=1, dense_dims=0):
        indices = torch.reshape(torch.arange(rank + 1), (1, rank + 1))
        shape = [world_size] + [2 for _ in range(dense_dims)]
        for _ in range(sparse_dims - 1):
            indices = torch.cat((indices, torch.zeros(1, rank + 1)))
            shape.append(world_size)
        values = torch.ones([rank + 1] + [2 for _ in range(dense_dims)])
        return torch.sparse_coo_tensor(indices, values, shape)

    def compute_sum(fn, world_size):
        return reduce(operator.add, [fn(r, world_size) for r in range(world_size)])

    return [
        ([fn(num_inputs * rank + i, num_inputs * world_size) for i in range(num_inputs)],
         [compute_sum(fn, num_inputs * world_size) for i in range(num_inputs)])
        for fn in [
            partial(generate, sparse_dims=1), partial(generate, sparse_dims=2),
            partial(generate, sparse_dims=3), partial(generate, dense_dims=1),
            partial(generate, dense_dims=2), partial(generate, dense_dims=3),
        ]
    ]
