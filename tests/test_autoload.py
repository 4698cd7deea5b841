"""Backends "shm" and "threaded" without `import shmcoll` (issue 23).

torch >= 2.5 calls the `torch.backends` entry points at the end of `import torch`
(pyproject.toml -> shmcoll/torch_backend/plugin.py, threaded_pg/plugin.py): that registers
both names, imports neither numba nor the engine, and never fails `import torch`. Where
autoload is off (TORCH_DEVICE_BACKEND_AUTOLOAD=0, or torch 2.4) `import shmcoll` registers,
before or after torch. Every check runs in fresh subprocesses: registration is per process.

The entry points exist only for an installed distribution (CI: `pip install -e .` in
scripts/install.sh); where this environment's shmcoll metadata lacks them, the autoload
checks skip and say so, and test_entry_points_declared still checks pyproject.toml.
"""

import importlib.metadata
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from shmcoll.torch_backend import compat

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.torch]

TIMEOUT_S = 240  # one subprocess, ranks included: a deadline, not a speed goal


def _declared_entry_points():
    """{name: "module:function"} of pyproject.toml's `torch.backends` table."""
    text = (ROOT / "pyproject.toml").read_text()
    table = re.search(r'^\[project\.entry-points\."torch\.backends"\]\n(.*?)(?:^\[|\Z)', text,
                      re.S | re.M)
    assert table, 'pyproject.toml has no [project.entry-points."torch.backends"] table'
    return dict(re.findall(r'^(\w+)\s*=\s*"([^"]+)"', table.group(1), re.M))


def _installed_entry_points():
    eps = importlib.metadata.entry_points()
    eps = eps.select(group="torch.backends") if hasattr(eps, "select") else \
        eps.get("torch.backends", [])
    return {ep.name: ep.value for ep in eps}


def _autoload_missing():
    """Why `import torch` cannot register here (None: it can)."""
    if compat.TORCH_VERSION[:2] < compat.AUTOLOAD_FROM:
        return f"torch {torch.__version__} runs no torch.backends entry points (from 2.5)"
    installed = _installed_entry_points()
    stale = {k: v for k, v in _declared_entry_points().items() if installed.get(k) != v}
    if stale:
        return (f"this environment's installed shmcoll metadata lacks the torch.backends "
                f"entry points {stale} (found {installed}): `pip install -e .` from this "
                f"checkout (scripts/install.sh) installs them")
    return None


needs_autoload = pytest.mark.skipif(_autoload_missing() is not None,
                                    reason=str(_autoload_missing()))


def _env(autoload=True):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["OMP_NUM_THREADS"] = "1"
    if not autoload:
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    return env


def _run(args, cwd, autoload=True, timeout=TIMEOUT_S):
    """Run `python args...` in its own session; kill the whole session (ranks included) at
    the deadline. -> (returncode, stdout, stderr)."""
    proc = subprocess.Popen([sys.executable, *args], cwd=cwd, env=_env(autoload),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"python {' '.join(map(str, args))} did not end in {timeout} s\n"
                    f"stdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}")
    return proc.returncode, out, err


# What `import torch` may load of ours: the torch-free plugin modules (test_layering's
# IMPORT_TIME_MODULES), not the engine, the adapter or numba.
HEAVY = """
import sys
def heavy():
    return sorted(m for m in sys.modules if m.split(".")[0] == "numba" or m in (
        "shmcoll.engine.group", "shmcoll.protocol", "shmcoll.native.reducers",
        "shmcoll.torch_backend.process_group", "threaded_pg.backend", "threaded_pg.group"))
def threaded_names():
    # what threaded_pg registers: its alias, and "threaded" where torch lets a later
    # registration take the name over (not torch 2.4: compat.registration_replaces)
    from shmcoll.torch_backend.compat import registration_replaces
    from threaded_pg.plugin import ALIAS, create_threaded_process_group
    claims = registration_replaces(ALIAS, create_threaded_process_group, ["cpu", "cuda"])
    return {"SHMCOLL_THREADED", "THREADED"} if claims else {"SHMCOLL_THREADED"}
"""


def _python(code, tmp_path, autoload=True, extra=()):
    rc, out, err = _run([*extra, "-c", HEAVY + textwrap.dedent(code)], tmp_path, autoload)
    assert rc == 0 and out.strip().endswith("ok"), f"rc={rc}\nstdout:\n{out}\nstderr:\n{err}"
    return out, err


def test_entry_points_declared():
    """pyproject.toml names the two entry points, and each names a function of a module
    that imports without torch (test_layering checks those modules)."""
    import shmcoll.torch_backend.plugin
    import threaded_pg.plugin
    declared = _declared_entry_points()
    assert declared == {"shmcoll": "shmcoll.torch_backend.plugin:autoload",
                        "shmcoll_threaded": "threaded_pg.plugin:autoload"}, declared
    assert callable(shmcoll.torch_backend.plugin.autoload)
    assert callable(threaded_pg.plugin.autoload)


@needs_autoload
def test_import_torch_registers_both_without_the_engine(tmp_path):
    _python("""
        import sys
        import torch
        import torch.distributed as dist
        names = set(dist.Backend._plugins)
        assert {"SHM"} | threaded_names() <= names, names
        assert not heavy(), heavy()
        from shmcoll.torch_backend import plugin
        assert dist.Backend._plugins["SHM"].creator_fn is plugin.create_shm_process_group
        assert dist.Backend("shm") == "shm"
        print("ok")
    """, tmp_path)


def test_autoload_off_registers_nothing_until_import_shmcoll(tmp_path):
    _python("""
        import sys
        import torch
        import torch.distributed as dist
        assert "shmcoll" not in sys.modules and "SHM" not in dist.Backend._plugins
        import shmcoll
        assert "SHM" in dist.Backend._plugins and "THREADED" not in dist.Backend._plugins
        import threaded_pg
        assert threaded_names() <= set(dist.Backend._plugins)
        assert not heavy(), heavy()
        print("ok")
    """, tmp_path, autoload=False)


@pytest.mark.parametrize("autoload", [False, True], ids=["autoload_off", "autoload_on"])
def test_import_shmcoll_before_torch_registers(tmp_path, autoload):
    """`import shmcoll` does not import torch; torch imported later still gets "shm" (and
    "threaded" from `import threaded_pg`), through the import hook where autoload is off.
    The hook leaves sys.meta_path once it fired."""
    if autoload and _autoload_missing():
        pytest.skip(_autoload_missing())
    _python("""
        import sys
        import shmcoll, threaded_pg
        assert "torch" not in sys.modules and not heavy(), heavy()
        import torch
        import torch.distributed as dist
        names = set(dist.Backend._plugins)
        assert {"SHM"} | threaded_names() <= names, names
        assert not heavy(), heavy()
        from shmcoll.torch_backend import import_hook
        assert not [f for f in sys.meta_path if isinstance(f, import_hook._Watcher)]
        print("ok")
    """, tmp_path, autoload=autoload)


FAILING_REGISTRATION = """
import sys, warnings
def broken():
    raise RuntimeError("simulated broken install")
import shmcoll.torch_backend.plugin as p, threaded_pg.plugin as t
p.register = t.register = broken
if ORDER == "entry_points_only":  # take out the hook `import shmcoll` installed: only
    from shmcoll.torch_backend import import_hook  # torch's entry points call the plugins
    for f in [f for f in sys.meta_path if isinstance(f, import_hook._Watcher)]:
        sys.meta_path.remove(f)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter(WARNINGS)
    import torch
    import torch.distributed as dist
assert "SHM" not in dist.Backend._plugins and "THREADED" not in dist.Backend._plugins
messages = [str(w.message) for w in caught]
for name in ("shm", "threaded") if WARNINGS == "always" else ():
    assert any(f"backend {name!r} not registered" in m and "simulated broken install" in m
               for m in messages), messages
print("ok")
"""


@pytest.mark.parametrize("warnings_filter", ["always", "error"])
@pytest.mark.parametrize("order", ["entry_points_only", "shmcoll_first"])
def test_failing_registration_does_not_break_import_torch(tmp_path, order, warnings_filter):
    """A registration that raises (simulated: plugin.register replaced by one that raises,
    as a broken install or an incompatible torch would) costs a warning, not `import torch`;
    with warnings turned into errors it is silent. shmcoll_first: through the import hook
    (and the entry points, where they run)."""
    if order == "entry_points_only" and _autoload_missing():
        pytest.skip(_autoload_missing())
    code = f"ORDER, WARNINGS = {order!r}, {warnings_filter!r}\n" + FAILING_REGISTRATION
    _python(code, tmp_path, extra=["-W", warnings_filter])


RANKS_SCRIPT = HEAVY + '''
import os, sys, tempfile
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank(r, init):
    assert not heavy(), heavy()  # the engine loads at the first "shm" group, not before
    dist.init_process_group("shm", init_method=f"file://{init}", rank=r, world_size=2)
    t = torch.arange(4, dtype=torch.float32) * (r + 1)
    dist.all_reduce(t)
    assert t.tolist() == [0.0, 3.0, 6.0, 9.0], t
    assert dist.get_backend() == "shm" and "shmcoll.torch_backend.process_group" in sys.modules
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank, args=(sys.argv[1],), nprocs=2)  # (the test's deadline ends a hang)
    print("ok")
'''

TORCHRUN_SCRIPT = HEAVY + '''
import sys
import torch
import torch.distributed as dist

assert not heavy(), heavy()
dist.init_process_group("shm")  # env:// from torchrun
t = torch.full((3,), float(dist.get_rank() + 1))
dist.all_reduce(t)
assert t.tolist() == [3.0] * 3, t
dist.destroy_process_group()
print("ok")
'''


@needs_autoload
@pytest.mark.multiprocess
def test_init_process_group_shm_without_import_mp_spawn(tmp_path):
    """2 ranks started by torch.multiprocessing (spawn) in a script that never imports
    shmcoll: init_process_group("shm"), all_reduce checked on both ranks."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    rc, out, err = _run([str(script), str(tmp_path / "init")], tmp_path)
    assert rc == 0 and out.strip() == "ok", f"rc={rc}\nstdout:\n{out}\nstderr:\n{err[-5000:]}"


@needs_autoload
@pytest.mark.multiprocess
def test_init_process_group_shm_without_import_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    rc, out, err = _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         str(script)], tmp_path)
    assert rc == 0 and out.count("ok") == 2, f"rc={rc}\nstdout:\n{out}\nstderr:\n{err[-5000:]}"


# Lightning under "ddp" and "ddp_spawn" with no `import shmcoll`: tests/test_recipes.py runs
# examples/lightning_ddp.py, which never imports it, on both strategies against gloo.
