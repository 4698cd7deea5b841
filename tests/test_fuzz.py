"""Fuzz: random programs of collectives on 2-4 real rank processes, checked against numpy.

Hypothesis draws a program (collective, dtype, element count -- often beyond one slot, the
slots are 4 KiB here --, reduce op, root, subgroup, strided views, uneven splits, per-op
data seed); every rank receives the same program, builds every rank's inputs from the seeds,
runs its part on the world group or a lazily created subgroup, and compares its results
with the numpy reference model in _scenarios_fuzz.py (exact, except AVG). The slow variant
also runs long programs that every rank draws itself from a shared seed.

Guards: any wrong byte, lost chunk, slot-reuse race, mismatch false positive, subgroup
cross-talk or hang (per-op deadline) in the engine's algorithms and protocol.
"""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _ranks import Job
from _scenarios_fuzz import BITWISE, FUZZ_DTYPES, FUZZ_KINDS, REDUCING, ops_for

pytestmark = [pytest.mark.multiprocess]

# small slots: every collective chunks; a low one-shot threshold: all_reduce runs both
# algorithms at every world size
ENV = {"SHMCOLL_SLOT_BYTES": 4096, "SHMCOLL_DIRECT_MAX_BYTES": 1024}


class Pool:
    """world_size fuzz workers kept across examples (restarted after a failure)."""

    def __init__(self, world_size, tmp):
        self.world_size, self.tmp = world_size, tmp
        self.job, self.count, self.executed = None, 0, 0

    def _start(self):
        self.job = Job("fuzz_worker", self.world_size, self.tmp, env=ENV, timeout_s=60)
        self.job.all_ranks("ready", timeout_s=180)
        self.count = 0

    def run(self, program):
        """Run `program` ({"ops": [...]} or {"seed": s, "length": n}) on every rank."""
        if self.job is None:
            self._start()
        self.count += 1
        program = dict(program, id=self.count)
        line = json.dumps(program)
        for r in range(self.world_size):
            self.job.send(r, line)
        try:
            done = {r: self.job.event(r, "done", timeout_s=300, count=self.count)
                    for r in range(self.world_size)}
        except AssertionError:
            self.close()
            raise
        self.executed += sum(e.get("executed", 0) for e in done.values())
        bad = {r: e for r, e in done.items() if not e["ok"]}
        if bad:
            self.close()
            shown = {k: v for k, v in program.items() if k != "ops"}
            raise AssertionError(f"program {shown} failed: {bad}\nops: {program.get('ops')}")

    def close(self):
        if self.job is not None:
            for r in range(self.world_size):
                self.job.send(r, "quit")
            try:
                self.job.join(30)
            finally:
                self.job.__exit__(None, None, None)
            self.job = None


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    made = {}

    def get(world_size):
        if world_size not in made:
            made[world_size] = Pool(world_size, tmp_path_factory.mktemp(f"fuzz{world_size}"))
        return made[world_size]

    yield get
    for p in made.values():
        p.close()


@st.composite
def fuzz_op(draw, world_size):
    kind = draw(st.sampled_from(FUZZ_KINDS))
    dtype = draw(st.sampled_from(FUZZ_DTYPES))
    members = None
    if world_size > 2 and draw(st.booleans()):
        members = sorted(draw(st.sets(st.integers(0, world_size - 1), min_size=2)))
    n = len(members) if members else world_size
    op = {"kind": kind, "dtype": dtype, "members": members,
          "count": draw(st.one_of(st.integers(0, 16), st.integers(17, 3000))),
          "root": draw(st.integers(0, n - 1)), "seed": draw(st.integers(0, 2**31 - 1)),
          "strided": draw(st.booleans())}
    if kind in REDUCING:
        op["op"] = draw(st.sampled_from(ops_for(dtype)))
    if kind == "reduce_scatter":
        op["sizes"] = draw(st.one_of(st.none(), st.lists(st.integers(0, 40), min_size=n,
                                                         max_size=n)))
    if kind == "all_to_all":
        op["matrix"] = draw(st.lists(st.lists(st.integers(0, 600), min_size=n, max_size=n),
                                     min_size=n, max_size=n))
    return op


def programs(world_size, max_ops):
    return st.lists(fuzz_op(world_size), min_size=1, max_size=max_ops)


_SETTINGS = dict(deadline=None, derandomize=True, print_blob=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.function_scoped_fixture])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 3])
def test_fuzz_short(pools, world_size):
    """Default run: a few random programs per world size."""
    pool = pools(world_size)

    @settings(max_examples=8, **_SETTINGS)
    @given(programs(world_size, 10))
    def check(ops):
        pool.run({"ops": ops})

    before = pool.executed
    check()
    print(f"\n[figures] fuzz ws{world_size}: {pool.executed - before} rank-ops checked")
    assert pool.executed > before


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_fuzz_long(pools, world_size):
    """Many longer random programs (hypothesis, shrinking on failure)."""
    pool = pools(world_size)

    @settings(max_examples=300, **_SETTINGS)
    @given(programs(world_size, 30))
    def check(ops):
        pool.run({"ops": ops})

    before = pool.executed
    check()
    print(f"\n[figures] fuzz ws{world_size}: {pool.executed - before} rank-ops checked")
    assert pool.executed > before


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_fuzz_seeded_long_programs(pools, world_size):
    """Long programs that every rank draws itself from a shared seed (no per-op round trip
    to the test process): 500 ops per seed."""
    pool = pools(world_size)

    @settings(max_examples=25, **_SETTINGS)
    @given(st.integers(0, 2**32 - 1))
    def check(seed):
        pool.run({"seed": seed, "length": 500})

    before = pool.executed
    check()
    print(f"\n[figures] seeded fuzz ws{world_size}: {pool.executed - before} rank-ops checked")
    assert pool.executed > before


def test_reference_model_sanity():
    """The reference the fuzz trusts: bf16 rounding and bitwise ops on known values."""
    import numpy as np

    from _scenarios_fuzz import make_input, reference_reduce
    from support.reference import bf16_rne, bf16_widen
    x = np.array([1.0, 3.0, -2.5, 256.0, 257.0], np.float32)
    assert np.array_equal(bf16_widen(bf16_rne(x)), [1.0, 3.0, -2.5, 256.0, 256.0])
    a, b = make_input(1, 0, "int32", 64, True), make_input(1, 1, "int32", 64, True)
    assert np.array_equal(reference_reduce([a, b], "int32", "BXOR"), a ^ b)
    assert BITWISE == ("BAND", "BOR", "BXOR")
    f = [np.array([1.0, 2.0], np.float32), np.array([3.0, -1.0], np.float32)]
    assert np.array_equal(reference_reduce(f, "float32", "PREMUL_SUM"), [8.0, 2.0])


class _DoNothingGroup:
    """A 'group' of 2 whose collectives leave every buffer as it is (rank 0)."""

    rank, world_size = 0, 2

    def __getattr__(self, name):
        return lambda *a, **k: None


@pytest.mark.parametrize("kind", [k for k in FUZZ_KINDS if k != "barrier"])
def test_fuzz_checker_catches_wrong_results(kind):
    """The fuzz is only as good as its checker: a group that moves nothing must be caught
    for every collective kind."""
    from _scenarios_fuzz import run_fuzz_op
    op = {"kind": kind, "dtype": "float32", "count": 5, "root": 1 if kind == "broadcast" else 0,
          "seed": 3, "op": "SUM", "sizes": None, "matrix": [[3, 4], [5, 6]]}
    assert run_fuzz_op(_DoNothingGroup(), op, (0, 1)), kind
