"""Real PyTorch distributed programs (tests/programs/) on "shm" and "threaded" against gloo.

Two ranks. One pair of rank processes runs every program on gloo, then on "shm" (one process
start for all of them); the rank threads run them on "threaded" in this process. Each
program's results (parameters after training, outputs, losses, loaded checkpoints) are held
against gloo's, bitwise unless the program says why not (tests/programs/__init__.py). A
program torch itself cannot run on CPU must fail on gloo, and the same way on ours. The
elastic program runs under torchrun with worker restarts. The inductor variant of the
compiled program runs with -m slow (it needs a C++ compiler); its aot_eager variant runs here.
"""

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

import harness
import threaded_pg
from programs import BITWISE, programs
from programs.run import run_in_processes, run_on_threads
from shmcoll.torch_backend.compat import TORCH_VERSION

pytestmark = [pytest.mark.torch, pytest.mark.timeout(900)]

JOB_TIMEOUT_S = 600
PROGRAMS = programs()
FAST = [name for name, p in PROGRAMS.items() if not p.slow]
SLOW = [name for name, p in PROGRAMS.items() if p.slow and not p.unsupported(TORCH_VERSION)]
RUN = [name for name in FAST if not PROGRAMS[name].unsupported(TORCH_VERSION)]
ELASTIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs", "elastic.py")


@pytest.fixture(scope="module")
def process_runs():
    """Per rank: {backend: {program: outcome}}, gloo then shm in the same processes."""
    return harness.run_ranks(run_in_processes, 2, "processes", JOB_TIMEOUT_S,
                             args=(RUN, ("gloo", "shm")))


@pytest.fixture(scope="module")
def threaded_runs(tmp_path_factory):
    """Per rank: {program: outcome} on rank threads (one intra-op thread, as the rank
    processes have: torch.set_num_threads is process-wide, so it is set around the spawn)."""
    return _on_threads(RUN, str(tmp_path_factory.mktemp("threaded_programs")))


def _on_threads(names, workdir):
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return threaded_pg.spawn(run_on_threads, 2, args=(names, workdir, dist.HashStore()),
                                 timeout=JOB_TIMEOUT_S)
    finally:
        torch.set_num_threads(saved)


def _reference(gloo_runs, name):
    """gloo's outcome of `name`; where gloo failed on it and the program names another that
    computes the same (`same_as`), gloo's outcome of that one."""
    want = gloo_runs[name]
    spec = PROGRAMS[name]
    if want[0] == "ok" or spec.torch_fails or not spec.same_as:
        return want
    other, why = spec.same_as
    warnings.warn(f"gloo failed on {name} ({want[1]}); held against gloo's {other} instead: "
                  f"{why}")
    return gloo_runs[other]


def _check(got, want, name, where):
    """Outcome `got` against gloo's outcome `want` of program `name`."""
    spec = PROGRAMS[name]
    if spec.torch_fails:
        assert want[0] == "error", (
            f"{name}: gloo ran it, so torch can now (update the program: {spec.torch_fails})")
        assert got[0] == "error" and got[1] == want[1], (
            f"{where}: {name} should fail as on gloo ({want[1]}); got {got[:2]}")
        return
    assert want[0] == "ok", f"gloo failed on {name}: {want[1]}\n{want[2]}"
    assert got[0] == "ok", f"{where}: {name} failed: {got[1]}\n{got[2]}"
    assert got[1].keys() == want[1].keys(), (sorted(got[1]), sorted(want[1]))
    for key, expected in want[1].items():
        actual = got[1][key]
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, key
        if spec.compare == BITWISE:
            assert torch.equal(actual, expected), (
                f"{where}: {name}/{key} differs from gloo's by "
                f"{(actual.double() - expected.double()).abs().max().item()}")
        else:
            rtol, atol, _reason = spec.compare
            torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", FAST)
def test_program_on_shm_matches_gloo(process_runs, name):
    _skip_if_unsupported(name)
    for rank, runs in enumerate(process_runs):
        _check(runs["shm"][name], _reference(runs["gloo"], name), name, f"shm rank {rank}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", FAST)
def test_program_on_threaded_matches_gloo(process_runs, threaded_runs, name):
    _skip_if_unsupported(name)
    for rank, runs in enumerate(process_runs):
        _check_threaded(threaded_runs, rank, _reference(runs["gloo"], name), name)


def _skip_if_unsupported(name):
    why = PROGRAMS[name].unsupported(TORCH_VERSION)
    if why:
        pytest.skip(f"{name} {why}")


def _check_threaded(threaded_runs, rank, want, name):
    got = threaded_runs[rank][name]
    if not PROGRAMS[name].threads_rng or want[0] != "ok" or got[0] != "ok":
        _check(got, want, name, f"threaded rank {rank}")
        return
    _reason, keys = PROGRAMS[name].threads_rng  # see the program's reason
    _check(got[:1] + ({k: got[1][k] for k in keys},), want[:1] + (
        {k: want[1][k] for k in keys},), name, f"threaded rank {rank}")
    first = threaded_runs[0][name][1]
    for key, value in got[1].items():  # parameters: every rank's are the same
        if "loss" not in key:
            assert torch.equal(value, first[key]), f"threaded: {name}/{key} differs across ranks"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_slow_programs_match_gloo(tmp_path):
    runs = harness.run_ranks(run_in_processes, 2, "processes", JOB_TIMEOUT_S,
                             args=(SLOW, ("gloo", "shm")))
    threaded = _on_threads(SLOW, str(tmp_path))
    for name in SLOW:
        for rank, run in enumerate(runs):
            _check(run["shm"][name], _reference(run["gloo"], name), name, f"shm rank {rank}")
            _check_threaded(threaded, rank, _reference(run["gloo"], name), name)


def _torchrun(out):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "--max-restarts", "2", "--monitor-interval", "0.1", ELASTIC, "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)


@pytest.mark.multiprocess
def test_elastic_torchrun_restarts(tmp_path):
    """A worker crashes in each backend's training; torchrun restarts the job, training
    resumes from the checkpoint, and both backends end with the same parameters."""
    proc = _torchrun(tmp_path)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    for backend in ("gloo", "shm"):
        assert f"{backend}: rank 1 crashes after step 3" in proc.stdout, proc.stdout
    assert "rank 0 done in attempt 2" in proc.stdout, proc.stdout
    gloo = torch.load(tmp_path / "gloo" / "final.pt")
    shm = torch.load(tmp_path / "shm" / "final.pt")
    assert gloo["resumed_from"] == shm["resumed_from"] == 3
    for key, value in gloo["params"].items():
        assert torch.equal(shm["params"][key], value), key
