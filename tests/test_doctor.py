"""python -m shmcoll.doctor: its report, its exit status and its fixes, failing cases
simulated through its parameters (never by changing the machine)."""

import argparse
import errno
import io
import json
import os
import subprocess
import sys
import textwrap

import pytest

from shmcoll import config
from shmcoll.tools import doctor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORES = len(os.sched_getaffinity(0))
TITLES = ("dependencies", "/dev/shm", "single copy (CMA)", "page sizes", "cores and threads",
          "numba kernel cache", "GPUs (cuda_ipc)")


def _doctor(*args, env=None, pythonpath=(), cwd=REPO):
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, REPO])
    return subprocess.run([sys.executable, "-m", "shmcoll.doctor", *args], env=env,
                          capture_output=True, text=True, timeout=120, cwd=cwd)


def _opts(**kw):
    base = dict(world_size=2, threads=1, shm_bytes=None, json=False)
    base.update(kw)
    return argparse.Namespace(**base)


def _need(world_size):
    return world_size * doctor.region_nbytes(config.from_env(), world_size)


@pytest.mark.timeout(120)
def test_report_on_this_machine():
    r = _doctor("--world-size", "2", "--threads", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    for title in TITLES:
        assert f"\n{title}\n" in r.stdout
    assert "shmcoll doctor: 2 ranks, 1 intra-op threads each" in r.stdout
    assert "\n  OK    numba " in r.stdout
    assert "FAIL" not in r.stdout
    assert r.stdout.rstrip().endswith("no problem that would make a job fail")


@pytest.mark.timeout(120)
def test_too_small_dev_shm_fails_with_the_fix():
    need = _need(8)
    r = _doctor("--world-size", "8", "--threads", "1", "--shm-bytes", str(need - 1))
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"8 ranks need {need / 2**20:.1f} MiB" in r.stdout
    assert "FAIL  /dev/shm has" in r.stdout and "(--shm-bytes): init_process_group will fail" \
        in r.stdout
    assert "fix: run the container with --shm-size=" in r.stdout
    assert "lower SHMCOLL_SLOT_BYTES" in r.stdout
    assert "FAIL: a job will fail here" in r.stdout


def test_dev_shm_for_one_group_only_warns():
    out = io.StringIO()
    rc = doctor.run(_opts(world_size=4, shm_bytes=_need(4) * 3 // 2), out=out)
    assert rc == 0
    assert "WARN  /dev/shm has" in out.getvalue()
    assert "not for a second group of all ranks" in out.getvalue()


def test_dev_shm_size_suffixes():
    assert doctor._bytes("64M") == 64 << 20
    assert doctor._bytes("1g") == 1 << 30
    assert doctor._bytes("512KB") == 512 << 10
    assert doctor._bytes("1000") == 1000


def test_json_report():
    out = io.StringIO()
    rc = doctor.run(_opts(world_size=2, shm_bytes=1 << 20, json=True), out=out)
    report = json.loads(out.getvalue())
    assert rc == 1 and report["failed"] is True
    assert set(TITLES) <= set(report["sections"])
    shm = report["sections"]["/dev/shm"]
    assert [f["level"] for f in shm] == ["INFO", "FAIL"]
    assert "--shm-size=" in shm[1]["fix"]


def test_threads_against_cores():
    found = doctor.check_cores(_opts(world_size=2, threads=CORES), config.from_env())
    warn = [f for f in found if f.level == "WARN"]
    assert warn and "intra-op threads exceed" in warn[0].text
    assert f"OMP_NUM_THREADS={max(1, CORES // 2)}" in warn[0].fix
    found = doctor.check_cores(_opts(world_size=1, threads=1), config.from_env())
    assert all(f.level == "OK" for f in found)
    found = doctor.check_cores(_opts(world_size=CORES + 1, threads=1), config.from_env())
    assert "oversubscribed" in found[0].text


def test_single_copy_unavailable_says_why_and_how():
    cfg = config.from_env()
    found = doctor.check_single_copy(_opts(), cfg, probe=lambda: (False, errno.EPERM))
    assert found[0].level == "INFO"
    assert "single copy is not available (Operation not permitted" in found[0].text
    assert "every collective goes through the slots" in found[0].text
    assert "ptrace_scope=0" in found[0].fix and "--cap-add=SYS_PTRACE" in found[0].fix
    found = doctor.check_single_copy(_opts(), cfg, probe=lambda: (True, 0))
    assert found[0].level == "OK" and "reduce_scatter from 2 MiB" in found[0].text
    off = config.from_env({"SHMCOLL_SINGLE_COPY": "off"})
    assert "SHMCOLL_SINGLE_COPY=off" in doctor.check_single_copy(_opts(), off)[0].text


@pytest.mark.timeout(60)
def test_cma_probe_runs_between_siblings():
    works, err = doctor.probe_cma()
    assert isinstance(works, bool) and isinstance(err, int)
    assert works or err != 0  # a refusal comes with its errno


def test_page_size_rule():
    found = doctor.check_pages(_opts())
    assert found[0].text.startswith("transparent huge pages: ")
    assert any("4 KiB pages" in f.text or "get huge pages" in f.text for f in found[1:])


@pytest.mark.timeout(180)
def test_cache_cold_then_partly_warm(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    r = _doctor("--world-size", "2", "--threads", "1", env=env)
    assert r.returncode == 0, r.stderr
    assert f"numba caches shmcoll's kernels in {tmp_path}" in r.stdout
    assert "WARN  cold: 0 of " in r.stdout and "python -m shmcoll.engine.warmup" in r.stdout
    warm_first = ("from shmcoll.engine import warmup\n"
                  "warmup.warm_up(warmup.FIRST_REDUCERS)\n")
    subprocess.run([sys.executable, "-c", warm_first], env=dict(env, PYTHONPATH=REPO),
                   check=True, timeout=120)
    r = _doctor("--world-size", "2", "--threads", "1", env=env)
    assert "INFO  partly warm: " in r.stdout and " and 1 of " in r.stdout


_FAKE_CUDA_IPC = textwrap.dedent("""
    from shmcoll.tools import doctor

    def _gpus(opts):
        return [doctor.Finding("FAIL", "GPU 0 -> GPU 1: IPC not permitted", "use --ipc=host")]

    doctor.register_section("GPUs (cuda_ipc)", _gpus)
""")


@pytest.mark.timeout(120)
def test_gpu_section_extension_point(tmp_path):
    """A stand-in cuda_ipc package (run from its directory, so it shadows the real one)."""
    pkg = tmp_path / "cuda_ipc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "doctor.py").write_text(_FAKE_CUDA_IPC)
    r = _doctor("--world-size", "2", "--threads", "1", pythonpath=[str(tmp_path)],
                cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "\nGPUs (cuda_ipc)\n  FAIL  GPU 0 -> GPU 1: IPC not permitted" in r.stdout
    assert "fix: use --ipc=host" in r.stdout
    (pkg / "doctor.py").write_text("import a_module_that_is_not_there\n")
    r = _doctor("--world-size", "2", "--threads", "1", pythonpath=[str(tmp_path)],
                cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARN  cuda_ipc.doctor could not be imported" in r.stdout


def test_gpu_section_without_cuda_ipc(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda_ipc", None)  # as if it were not installed
    monkeypatch.setattr(doctor, "_SECTIONS", [])  # nor registered by an earlier import
    found = doctor.check_gpus(_opts())
    assert found[0].level == "INFO" and "cuda_ipc is not installed" in found[0].text


@pytest.mark.timeout(120)
def test_cuda_ipc_reports_its_section():
    """The real cuda_ipc section: without a GPU it says device tensors are unavailable
    and fails nothing."""
    r = _doctor("--world-size", "2", "--threads", "1")
    assert "\nGPUs (cuda_ipc)\n" in r.stdout, r.stdout + r.stderr
    if not __import__("torch").cuda.is_available():
        assert "no CUDA device visible" in r.stdout, r.stdout
