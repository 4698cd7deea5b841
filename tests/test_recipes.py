"""The recipes of docs/RECIPES.md: every program in examples/ at 2 ranks on "shm" and on
gloo, with the same results.

Bitwise throughout: at 2 ranks each reduced element is one addition a + b, the same on
both backends in either order, and the other collectives (broadcasts, all-gathers, object
collectives, the checkpoint) move bytes. Where a run differs from its baseline in how it
gets there, the test says why the results must still agree (Lightning's ddp_spawn against
ddp; torchrun restarts against an uninterrupted run).

Each example runs as its users run it (its own script, torchrun, pytest) in a process
session of its own, under a deadline; whatever it leaves is killed with the session. A test
whose tool is not installed is skipped, saying which.
"""

import ast
import importlib.util
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

import harness
from support import devshm
from shmcoll.torch_backend import compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")

pytestmark = [pytest.mark.torch, pytest.mark.multiprocess]

RUN_TIMEOUT_S = 240  # one example run (a few process starts on a loaded 2-core machine)
SESSION_GRACE_S = 20  # what a finished run may leave running before it is killed


def _missing(module):
    return importlib.util.find_spec(module) is None


needs_lightning = pytest.mark.skipif(
    _missing("lightning"), reason="lightning is not installed (pip install lightning): "
    "the Lightning recipe's test runs it")
needs_accelerate = pytest.mark.skipif(
    _missing("accelerate"), reason="accelerate is not installed (pip install accelerate): "
    "the Accelerate recipe's test runs it")


# How torch's own teardown sometimes ends a gloo rank: a C++ std::thread destroyed while
# joinable, as the process exits (CI, 2026-11-29: the Accelerate recipe's gloo run, rank 1
# SIGABRT after its training; 0 of 40 reruns here, loaded or not).
TORCH_TEARDOWN_ABORT = "terminate called without an active exception"


def _run(args, torchrun=False, restarts=0, timeout_s=RUN_TIMEOUT_S, reference=False):
    """Run `python [torchrun options] args` (an example under examples/ first, or "-m")
    to completion; its output. A `reference` run (the gloo baseline a test holds "shm"
    to) that torch's teardown aborts (TORCH_TEARDOWN_ABORT) runs once more, with a
    warning: the baseline's crash in torch says nothing of "shm". Any other failure, and
    any failure of a run on "shm", fails the test."""
    returncode, out = _run_once(args, torchrun, restarts, timeout_s)
    if returncode != 0 and reference and TORCH_TEARDOWN_ABORT in out:
        warnings.warn(f"{' '.join(map(str, args))}: torch's teardown aborted the reference "
                      f"run ({TORCH_TEARDOWN_ABORT!r}); running it again")
        returncode, out = _run_once(args, torchrun, restarts, timeout_s)
    assert returncode == 0, (
        f"{' '.join(map(str, args))} failed ({returncode}):\n{out[-8000:]}")
    return out


def _run_once(args, torchrun, restarts, timeout_s):
    """One run of _run's command: (its exit status, its output). It must leave nothing in
    /dev/shm, whatever its status."""
    cmd = [sys.executable]
    if torchrun:
        cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--max-restarts", str(restarts), "--monitor-interval", "0.1"]
    first = args[0] if args[0] == "-m" else os.path.join(EXAMPLES, args[0])
    cmd += [first] + [str(a) for a in args[1:]]
    before = devshm.listing()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(), cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_session(proc.pid)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(map(str, args))}: still running after {timeout_s} s:\n"
                    f"{out[-5000:]}")
    finally:
        _end_session(proc.pid)
    left = devshm.left_behind(before)
    assert not left, f"{' '.join(map(str, args))} left in /dev/shm: {left}"
    return proc.returncode, out


@pytest.mark.parametrize("reference, first, runs, passes", [
    (True, (-6, TORCH_TEARDOWN_ABORT), 2, True),  # the baseline's teardown abort: once more
    (False, (-6, TORCH_TEARDOWN_ABORT), 1, False),  # a run on "shm": never
    (True, (1, "Traceback: ValueError"), 1, False),  # the baseline's own failure: never
    (True, (0, "done"), 1, True),
])
def test_run_retries_only_a_reference_run_that_torch_teardown_aborted(
        monkeypatch, reference, first, runs, passes):
    results = [first, (0, "done")]
    calls = []
    monkeypatch.setattr(sys.modules[__name__], "_run_once",
                        lambda *a: calls.append(a) or results[len(calls) - 1])
    if passes:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert _run(["x.py"], reference=reference) == "done"
        assert len(caught) == runs - 1
    else:
        with pytest.raises(AssertionError, match="x.py failed"):
            _run(["x.py"], reference=reference)
    assert len(calls) == runs


def _env(**extra):
    """The examples' environment. OMPI_MCA_btl=self: with mpi4py installed, Lightning's
    environment detection imports it, which initialises MPI as a singleton, and Open MPI
    5's shared-memory transport then leaves a 16 MiB segment in /dev/shm at every run; no
    example uses MPI, so its in-process transport is all it needs."""
    return dict(os.environ, OMP_NUM_THREADS="1", OMPI_MCA_btl="self",
                PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
                **extra)


def _session(sid):
    """Pids of the live processes of session `sid` (from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if len(fields) > 4 and fields[0] != "Z" and int(fields[3]) == sid:
                pids.append(int(entry))
    return pids


def _kill_session(sid):
    try:
        os.killpg(sid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _end_session(sid, grace_s=SESSION_GRACE_S):
    """Let what the run started finish on its own (multiprocessing's resource tracker
    unlinks the run's semaphores as it exits), then kill whatever is left."""
    deadline = time.monotonic() + grace_s
    while _session(sid) and time.monotonic() < deadline:
        time.sleep(0.1)
    _kill_session(sid)


def _imports_shmcoll(path):
    """Whether the script at `path` imports shmcoll, threaded_pg or cuda_ipc anywhere."""
    ours = ("shmcoll", "threaded_pg", "cuda_ipc")
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n.split(".")[0] in ours for n in names):
            return True
    return False


def _same(got, want, what):
    """Bitwise equal nested dicts of tensors."""
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
        for key in want:
            _same(got[key], want[key], f"{what}/{key}")
        return
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got, want), (
        f"{what}: shm differs from gloo by {(got.double() - want.double()).abs().max().item()}")


def _load(path):
    return torch.load(path, weights_only=True)


# -- PyTorch Lightning ---------------------------------------------------------------------


@needs_lightning
@pytest.mark.timeout(3 * RUN_TIMEOUT_S + 60)
def test_lightning_ddp_and_ddp_spawn_on_shm_match_gloo(tmp_path):
    """DDPStrategy(process_group_backend=...), strategies "ddp" and "ddp_spawn" on "shm"
    against "ddp" on gloo. The strategies differ only in how the rank processes start
    (this script run again / torch.multiprocessing spawn): the same seeds, data, sampler
    and DDP, so the same numbers (the spawn run on gloo is left out: ~20 s of imports)."""
    # The script never imports shmcoll: "shm" comes from the torch.backends entry point
    # (issue 23: Lightning's spawned ranks failed with "Unknown backend type shm" before).
    if not compat.autoloads_backends():
        pytest.skip("this torch does not load torch.backends entry points (torch < 2.5): the "
                    "recipe then needs `import shmcoll` at the top")
    assert not _imports_shmcoll(os.path.join(EXAMPLES, "lightning_ddp.py"))
    runs = {}
    for backend, strategy in (("gloo", "ddp"), ("shm", "ddp"), ("shm", "ddp_spawn")):
        out = tmp_path / f"{backend}-{strategy}.pt"
        _run(["lightning_ddp.py", "--backend", backend, "--strategy", strategy, "--out", out],
             reference=backend == "gloo")
        runs[backend, strategy] = _load(out)
    want = runs["gloo", "ddp"]
    _same(runs["shm", "ddp"], want, "ddp")
    _same(runs["shm", "ddp_spawn"], want, "ddp_spawn")


@pytest.mark.skipif(_missing("mpi4py"), reason="mpi4py is not installed: nothing initialises MPI")
@pytest.mark.timeout(120)
def test_an_example_that_initialises_mpi_leaves_no_segment():
    """What Lightning's environment detection does when mpi4py is installed (`from mpi4py
    import MPI`: MPI initialised without mpirun), in the examples' environment: Open MPI's
    shared-memory segment must not be left in /dev/shm (it was, 16 MiB per run)."""
    before = devshm.listing()
    proc = subprocess.run([sys.executable, "-c", "from mpi4py import MPI; "
                           "print(MPI.COMM_WORLD.Get_size())"],
                          capture_output=True, text=True, env=_env(), timeout=100)
    assert proc.returncode == 0 and proc.stdout.strip() == "1", proc.stdout + proc.stderr
    assert devshm.left_behind(before) == []


# -- Hugging Face Accelerate ---------------------------------------------------------------


@needs_accelerate
@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def test_accelerate_on_a_process_group_made_first_matches_gloo(tmp_path):
    runs = {}
    for backend in ("gloo", "shm"):
        out = tmp_path / f"{backend}.pt"
        _run(["accelerate_cpu.py", "--backend", backend, "--out", out], torchrun=True,
             reference=backend == "gloo")
        runs[backend] = _load(out)
    assert runs["gloo"]["losses"].shape == (4, 2)  # 4 steps x the 2 ranks' gathered losses
    _same(runs["shm"], runs["gloo"], "accelerate")


@needs_accelerate
@pytest.mark.timeout(120)
def test_accelerate_still_refuses_the_backend_name():
    """Why the recipe creates the group first. Should this fail, Accelerate takes "shm"
    now: docs/RECIPES.md can pass it through InitProcessGroupKwargs instead."""
    check = ("from accelerate.state import PartialState\n"
             "try:\n"
             "    PartialState(cpu=True, backend='shm')\n"
             "except ValueError as e:\n"
             "    print('refused:', e)\n")
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                          env=_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2"), timeout=100)
    assert "refused: Your assigned backend shm is not available, please use gloo" in \
        proc.stdout, proc.stdout + proc.stderr[-3000:]


# -- torchrun with restarts ----------------------------------------------------------------


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def test_torchrun_restarts_on_shm_end_where_an_uninterrupted_gloo_run_does(tmp_path):
    """On "shm", rank 1 dies at start-up while rank 0 is creating the group (attempt 0; on
    one store shared by the attempts this leaves "shm"'s rendezvous counters apart and
    every later attempt fails), then after step 3 (attempt 1); attempt 2 resumes from the
    checkpoint. The resumed training loads every parameter and momentum buffer exactly and
    takes the same steps on the same data, so it ends bit for bit where gloo's
    uninterrupted run ends."""
    shm, gloo = tmp_path / "shm", tmp_path / "gloo"
    shm.mkdir()
    gloo.mkdir()
    log = _run(["torchrun_elastic.py", "--backend", "shm", "--out", shm, "--crash",
                "init,step"], torchrun=True, restarts=2)
    for line in ("rank 1 dies before init in attempt 0", "rank 1 dies after step 3 in attempt 1",
                 "rank 0: resumed from step 3", "rank 0: done in attempt 2"):
        assert line in log, f"{line!r} missing:\n{log[-5000:]}"
    _run(["torchrun_elastic.py", "--backend", "gloo", "--out", gloo], torchrun=True,
         reference=True)
    _same(_load(shm / "final.pt"), _load(gloo / "final.pt"), "elastic")


# -- torch.distributed.checkpoint ----------------------------------------------------------


@pytest.mark.skipif(not hasattr(importlib.import_module("torch.distributed.fsdp"), "fully_shard"),
                    reason="the DCP recipe shards with FSDP2's public fully_shard (torch >= 2.6)")
@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def test_dcp_save_and_resume_of_a_sharded_model_on_shm_matches_gloo(tmp_path):
    """The example itself checks that the run resumed from the checkpoint ends where the
    saving run does (it fails otherwise); here shm's numbers are held against gloo's."""
    runs = {}
    for backend in ("gloo", "shm"):
        out, ckpt = tmp_path / f"{backend}.pt", tmp_path / f"{backend}-checkpoint"
        _run(["dcp_checkpoint.py", "--backend", backend, "--checkpoint", ckpt, "--out", out],
             torchrun=True, reference=backend == "gloo")
        runs[backend] = _load(out)
        assert (ckpt / ".metadata").exists() and len(list(ckpt.glob("*.distcp"))) == 2
    _same(runs["shm"], runs["gloo"], "dcp")


# -- threaded_pg in pytest -----------------------------------------------------------------


@pytest.mark.timeout(3 * RUN_TIMEOUT_S + 60)
def test_threaded_pg_example_passes_in_pytest_and_matches_processes():
    """Its pytest tests pass; its training on rank threads ("threaded") gives what two
    processes give on "shm" and on gloo, because the model is built inside rng_lock."""
    out = _run(["-m", "pytest", os.path.join(EXAMPLES, "threaded_pg_pytest.py"), "-q",
                "-p", "no:cacheprovider"])
    assert "2 passed" in out, out[-3000:]
    shm, gloo = (harness.run_ranks(_example_training, 2, "processes", RUN_TIMEOUT_S,
                                   args=(backend,))[0] for backend in ("shm", "gloo"))
    _same(shm, gloo, "shm")
    _same(_threaded_here(), gloo, "threaded")


def _example(name):
    """The module examples/<name>, loaded from its file."""
    spec = importlib.util.spec_from_file_location(name[:-3], os.path.join(EXAMPLES, name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _example_training(rank, world_size, store, backend):
    """What the threaded_pg example's `--backend shm|gloo` runs in each of its processes
    (its train()), here on the harness's pooled rank processes: no process starts."""
    import torch.distributed as dist

    example = _example("threaded_pg_pytest.py")
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{store.path}/rdv_{backend}",
                            rank=rank, world_size=world_size)
    try:
        return example.train(rank, world_size)
    finally:
        dist.destroy_process_group()


def _threaded_here():
    """The example's `--backend threaded`, in this process: rank 0's parameters; one
    intra-op thread, as the example sets."""
    import threaded_pg

    train = _example("threaded_pg_pytest.py").train
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return threaded_pg.spawn(train, 2, timeout=120)[0]
    finally:
        torch.set_num_threads(saved)
