"""Kernels shipped in the wheel (shmcoll/native/prebuilt.py, shmcoll/tools/build_kernels.py):
a build of a group's first kernels into a copy of the package is loaded -- nothing compiled, right
results, in rank processes and rank threads --; an edited source, another numba, a CPU
without the target's features, a broken file: never loaded, the kernels compile as
without them.

The full set and the installed wheel are checked by scripts/wheel_check.sh."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from shmcoll.tools import build_kernels
from shmcoll.native import prebuilt

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.timeout(600)


def _copy_package(into):
    """A copy of this tree's packages (sources only) under `into`: shmcoll's path, and its
    neighbours', which would otherwise come from wherever the interpreter finds them."""
    for name in ("shmcoll", "threaded_pg", "cuda_ipc"):
        shutil.copytree(os.path.join(REPO, name), into / name,
                        ignore=shutil.ignore_patterns("__pycache__", prebuilt.DIR_NAME))
    return into / "shmcoll"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A copy of the package with the kernels of a group's warm-up shipped in it."""
    pkg = _copy_package(tmp_path_factory.mktemp("built"))
    result = build_kernels.build(pkg, parts=("first",))
    if "skipped" in result:
        pytest.skip(result["skipped"])
    return pkg, result


def _variant(built, tmp_path):
    """A fresh copy of the built packages (shmcoll with its _kernels) to edit."""
    for path in built[0].parent.iterdir():
        shutil.copytree(path, tmp_path / "pkg" / path.name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "pkg" / "shmcoll"


def _env(pkg, cache):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NUMBA_", "SHMCOLL_")) and k != "PYTHONPATH"}
    return dict(env, PYTHONPATH=str(pkg.parent), NUMBA_CACHE_DIR=str(cache))


def _run(pkg, cache, code, *args):
    """`code` in a fresh process importing `pkg` (cwd beside it: nothing else on the
    path first); its last stdout line as JSON."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                       env=_env(pkg, cache), cwd=pkg.parent, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


# Reduces two float32 arrays of 1.0 and 2.0 through the float32 sum reducer (a cfunc
# reached by its address), counting numba's compiles.
_REDUCE = """
    import json
    from shmcoll.native import prebuilt
    recorder = prebuilt.CompileRecorder()
    import numpy as np
    from shmcoll.native import reducers as kernels
    a, b = np.full(1000, 1.0, np.float32), np.full(1000, 2.0, np.float32)
    kernels.reduce_into(a, np.array([a.ctypes.data, b.ctypes.data], np.int64),
                        kernels.OP_SUM, "float")
    print(json.dumps({"got": float(a[0]), "all_same": bool((a == a[0]).all()),
                      "compiled": recorder.compiled, "counts": prebuilt.counts(),
                      "path": str(prebuilt.status().path), "reason": prebuilt.status().reason}))
"""

# One rank process of a 2-rank engine group: creation (the warm-up loads the one-step
# kernel and the float32 sum reducer) and a float32 all_reduce, compiles counted before
# the close (which may need kernels the "first" build does not hold).
_RANK = """
    import json, sys
    from shmcoll.native import prebuilt
    recorder = prebuilt.CompileRecorder()
    import numpy as np
    import shmcoll
    rank, path = int(sys.argv[1]), sys.argv[2]
    g = shmcoll.new_shm_group(shmcoll.FileStore(path), rank, 2, timeout_s=120)
    a = np.full(1000, rank + 1.0, np.float32)
    g.all_reduce(a)
    out = {"ok": bool((a == 3.0).all()), "compiled": list(recorder.compiled),
           "counts": prebuilt.counts()}
    g.close()
    print(json.dumps(out))
"""

# A 2-rank threaded_pg test: float32 all_reduce through dist.*.
_THREADS = """
    import json
    from shmcoll.native import prebuilt
    recorder = prebuilt.CompileRecorder()
    import torch, torch.distributed as dist
    import threaded_pg

    def fn(rank, world_size):
        t = torch.full((1000,), rank + 1.0)
        dist.all_reduce(t)
        return bool((t == 3.0).all())

    ok = threaded_pg.spawn(fn, 2) == [True, True]
    print(json.dumps({"ok": ok, "compiled": recorder.compiled, "counts": prebuilt.counts()}))
"""


def test_build_writes_a_manifest_and_checks_itself(built):
    pkg, result = built
    (cpu, manifest), = result["manifests"].items()
    assert cpu == prebuilt.targets()[0][0]
    on_disk = json.loads((pkg / prebuilt.DIR_NAME / cpu / prebuilt.MANIFEST).read_text())
    assert on_disk["key"] == manifest["key"] == prebuilt.key(prebuilt.fields(cpu, pkg))
    assert manifest["files"] > 0 and manifest["compiled"] > 0
    assert result["check"]["compiled"] == [] and result["check"]["counts"]["shipped"] > 0


def test_rank_processes_load_them_and_compile_nothing(built, tmp_path):
    pkg = built[0]
    store = tmp_path / "store"
    code = textwrap.dedent(_RANK)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(store)],
                              env=_env(pkg, tmp_path / "cache"), cwd=pkg.parent,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-4000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    for out in outs:
        assert out["ok"]
        assert out["compiled"] == [], out
        assert out["counts"]["shipped"] > 0 and out["counts"]["compiled"] == 0


def test_rank_threads_load_them_and_compile_nothing(built, tmp_path):
    out, _ = _run(built[0], tmp_path / "cache", _THREADS)
    assert out["ok"]
    assert out["compiled"] == [], out
    assert out["counts"]["shipped"] > 0


def test_reducer_by_address_is_loaded(built, tmp_path):
    out, _ = _run(built[0], tmp_path / "cache", _REDUCE)
    assert (out["got"], out["all_same"]) == (3.0, True)
    assert out["compiled"] == [] and out["counts"]["shipped"] > 0, out


def test_an_edited_kernel_is_compiled_not_loaded(built, tmp_path):
    """The float32 sum made to add 1 more: the result shows the edited code ran."""
    pkg = _variant(built, tmp_path)
    src = pkg / "native" / "reducers.py"
    text = src.read_text()
    assert text.count("d[j] = d[j] + x[j]\n") == 1
    src.write_text(text.replace("d[j] = d[j] + x[j]\n", "d[j] = d[j] + x[j] + 1\n"))
    out, _ = _run(pkg, tmp_path / "cache", _REDUCE)
    assert out["got"] == 4.0 and out["all_same"]
    assert "shmcoll.native.reducers._build_same.<locals>.reduce" in out["compiled"]
    assert out["counts"]["shipped"] == 0
    assert out["path"] == "None" and "sources differ" in out["reason"]


def test_an_edit_elsewhere_in_the_package_turns_them_off(built, tmp_path):
    """A kernel's code also comes from other files (constants, intrinsics): any edit in the
    package, here a comment in a file with no kernel, and none is loaded."""
    pkg = _variant(built, tmp_path)
    with open(pkg / "protocol" / "layout.py", "a") as f:
        f.write("# edited\n")
    out, _ = _run(pkg, tmp_path / "cache", _REDUCE)
    assert out["got"] == 3.0
    assert out["compiled"] and out["counts"]["shipped"] == 0
    assert "sources differ" in out["reason"]


def test_a_broken_file_turns_them_off_and_compiles(built, tmp_path):
    pkg = _variant(built, tmp_path)
    data = sorted((pkg / prebuilt.DIR_NAME).rglob("reducers._build_same.locals.reduce-*.nbc"))
    assert data
    for path in data:
        path.write_bytes(path.read_bytes()[:100])
    out, err = _run(pkg, tmp_path / "cache", _REDUCE)
    assert out["got"] == 3.0 and out["all_same"]
    assert "shmcoll.native.reducers._build_same.<locals>.reduce" in out["compiled"]
    assert "shipped kernels turned off" in err


def test_what_does_not_match_is_named(built, tmp_path):
    pkg = _variant(built, tmp_path)
    cpu, needs = prebuilt.targets()[0]
    assert prebuilt._check_target(pkg, cpu, needs).path == pkg / prebuilt.DIR_NAME / cpu
    st = prebuilt._check_target(pkg, cpu, needs + ("no-such-feature",))
    assert st.path is None and "which this CPU is not (no no-such-feature)" in st.reason
    manifest = pkg / prebuilt.DIR_NAME / cpu / prebuilt.MANIFEST
    m = json.loads(manifest.read_text())
    manifest.write_text(json.dumps(dict(m, numba="0.0.1")))
    st = prebuilt._check_target(pkg, cpu, needs)
    assert st.path is None and "built for numba '0.0.1'" in st.reason
    shutil.rmtree(pkg / prebuilt.DIR_NAME)
    assert "none shipped" in prebuilt._check_target(pkg, cpu, needs).reason


def test_doctor_says_whether_they_match(built, tmp_path):
    pkg = _variant(built, tmp_path)
    code = """
        import json
        from shmcoll.tools import doctor
        print(json.dumps([f.level + " " + f.text for f in doctor.check_cache(None)]))
    """
    out, _ = _run(pkg, tmp_path / "cache", code)
    assert any(line.startswith("OK the kernels shipped in the wheel match this install")
               for line in out), out
    with open(pkg / "engine" / "group.py", "a") as f:
        f.write("# edited\n")
    out, _ = _run(pkg, tmp_path / "cache2", code)
    assert any("shipped kernels not used: the package's sources differ" in line
               for line in out), out
