"""Loader that exposes PyTorch's backend-agnostic distributed test suite for pytest.

It is imported twice per test: once by pytest in the parent process (collection) and
once in *each* spawned rank process (``torch.multiprocessing`` "spawn" pickles
``TestDistBackendWithSpawn._run`` by reference, so every rank re-imports this module
before it calls ``init_process_group``).  Everything that must hold inside the ranks
(plugin registration, the feature-table patch, the gloo stand-in patch) therefore
happens at import time, driven only by environment variables.

Environment (set by ``run_suite.py``; can be set by hand as well):

``SHMCOLL_CONF_MODE``   one of ``shm``, ``gloo_plugin``, ``shm_as_gloo``, ``gloo_as_gloo``, ``gloo``
``BACKEND``             the name the torch suite sees (derived from the mode when unset)
``WORLD_SIZE``          ranks per test (default 3)
``TEMP_DIR``            scratch dir the suite requires at import (default: a fresh tmp dir)
``SHMCOLL_CONF_NODES``  > 1: simulated nodes, rank r gets SHMCOLL_NODE_ID conf-node<r*N//W>

Modes:

``shm``          BACKEND=shm.  ``import shmcoll`` must register the "shm" plugin.
                 "shm" is added to backend_feature["plugin"|"ddp"|"subgroup"].
``gloo_plugin``  BACKEND=gloo_plugin.  Registers a plugin whose creator returns
                 ``dist.ProcessGroupGloo(store, rank, size, timeout)``; same feature
                 grant.  This is the baseline under identical gating.
``shm_as_gloo``  BACKEND=gloo, but every process group the suite asks for with backend
                 "gloo" is built by the "shm" plugin (see ``_install_standin``).
``gloo_as_gloo`` Same mechanism with the gloo plugin as stand-in: sanity check of the
                 stand-in mechanism itself.
``gloo``         Native gloo, nothing patched: reference for the stand-in modes.
"""

from __future__ import annotations

import os
import sys
import tempfile

MODES = {
    # mode: (BACKEND seen by the suite, plugin that really builds the PGs, stand-in?)
    "shm": ("shm", "shm", False),
    "gloo_plugin": ("gloo_plugin", "gloo_plugin", False),
    "shm_as_gloo": ("gloo", "shm", True),
    "gloo_as_gloo": ("gloo", "gloo_plugin", True),
    # native gloo, no plugin, no patch: the reference for the stand-in modes
    "gloo": ("gloo", None, False),
}

_SUITE_MODULE = "torch.testing._internal.distributed.distributed_test"


class ConformanceSetupError(ImportError):
    """Raised (at import/collection time) when the backend under test cannot be set up."""


MODE = os.environ.get("SHMCOLL_CONF_MODE", "gloo_plugin")
if MODE not in MODES:
    raise ConformanceSetupError(
        f"SHMCOLL_CONF_MODE={MODE!r} is not one of {sorted(MODES)}"
    )
SUITE_BACKEND, PLUGIN, STANDIN = MODES[MODE]

if os.environ.setdefault("BACKEND", SUITE_BACKEND) != SUITE_BACKEND:
    raise ConformanceSetupError(
        f"BACKEND={os.environ['BACKEND']!r} conflicts with SHMCOLL_CONF_MODE={MODE!r} "
        f"(expects BACKEND={SUITE_BACKEND!r})"
    )
os.environ.setdefault("WORLD_SIZE", "3")
if "TEMP_DIR" not in os.environ:
    os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="shmcoll_conf_")

if _SUITE_MODULE in sys.modules:
    # Its skip decorators were evaluated at import with the unpatched tables/BACKEND.
    raise ConformanceSetupError(
        f"{_SUITE_MODULE} was imported before tests/conformance/_suite.py; "
        "the feature-table patch would have no effect"
    )

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

try:
    import expecttest  # noqa: F401,E402  (torch.testing._internal.common_utils needs it)
except ImportError as e:  # pragma: no cover - environment problem
    raise ConformanceSetupError(
        "torch's internal test utilities need 'expecttest': "
        "pip install -r tests/conformance/requirements.txt"
    ) from e

from torch.distributed import Backend  # noqa: E402


# --------------------------------------------------------------------------- plugins
def _create_gloo_plugin(store, rank, size, timeout):
    """Creator for the "gloo_plugin" backend: plain gloo, reached through the plugin path."""
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _register_plugin(name: str) -> None:
    if name == "gloo_plugin":
        if "GLOO_PLUGIN" not in Backend._plugins:
            Backend.register_backend("gloo_plugin", _create_gloo_plugin, devices=["cpu"])
        return
    if name == "shm":
        try:
            import shmcoll  # noqa: F401  (registers "shm" as a side effect)
        except Exception as e:
            raise ConformanceSetupError(
                f"backend 'shm' unavailable: 'import shmcoll' failed: "
                f"{type(e).__name__}: {e}"
            ) from e
        if "SHM" not in Backend._plugins:
            raise ConformanceSetupError(
                "backend 'shm' unavailable: 'import shmcoll' succeeded but did not call "
                "dist.Backend.register_backend('shm', creator, devices=['cpu'])"
            )
        if os.environ.get("SHMCOLL_CONF_START_METHOD") == "forkserver":
            # The ranks fork from a server that imported this module: load the adapter and
            # the engine and ready the kernels a group loads at creation here, once, as
            # torch and the suite are (`import shmcoll` loads neither: PEP 562). Else every
            # rank of every test imports numba and readies it (~1-2 s of CPU each: the
            # 3-rank subset took 320 s instead of ~110). The main suite covers a rank's
            # own first load.
            import shmcoll.torch_backend.process_group  # noqa: F401
            from shmcoll.engine import warmup
            warmup.warm_up(warmup.FIRST_REDUCERS)
        return
    raise ConformanceSetupError(f"unknown plugin {name!r}")


if PLUGIN is not None:
    _register_plugin(PLUGIN)


# --------------------------------------------------------------- gloo stand-in patch
def _install_standin(target: str, impersonated: str = "gloo") -> None:
    """Make every process group requested with backend ``impersonated`` be built by
    plugin ``target`` while still *reporting* ``impersonated``.

    ``init_process_group`` and ``new_group`` both funnel through the module-level
    ``distributed_c10d._new_process_group_helper``.  That helper hard-codes
    ``ProcessGroupGloo`` for the literal name "gloo" (the plugin table is consulted only
    for unknown names, so re-registering "gloo" via ``register_backend`` has no effect).
    We wrap the helper: rewrite the backend string ("gloo", "cpu:gloo",
    "cpu:gloo,cuda:nccl", ...) to the plugin name, build the group, then put the
    impersonated name back into ``_world.pg_map`` so ``dist.get_backend()`` still says
    "gloo".  ``_world.pg_backend_config`` is left telling the truth ("cpu:shm").
    """
    import torch.distributed.distributed_c10d as c10d

    if getattr(c10d._new_process_group_helper, "_conformance_standin", None):
        return
    orig = c10d._new_process_group_helper

    def _translate(backend):
        s = str(backend)
        if ":" not in s and "," not in s:
            return target if s.lower() == impersonated else backend
        parts = []
        for pair in s.split(","):
            dev, _, b = pair.partition(":")
            parts.append(f"{dev}:{target if b.lower() == impersonated else b}")
        return ",".join(parts)

    def _helper(group_size, group_rank, global_ranks_in_group, backend, store,
                group_name, *args, **kwargs):
        new_backend = _translate(backend)
        pg, pg_store = orig(group_size, group_rank, global_ranks_in_group,
                            new_backend, store, group_name, *args, **kwargs)
        if new_backend != backend and pg is not None and pg in c10d._world.pg_map:
            _, st = c10d._world.pg_map[pg]
            c10d._world.pg_map[pg] = (backend, st)
        return pg, pg_store

    _helper._conformance_standin = (impersonated, target)
    c10d._new_process_group_helper = _helper


if STANDIN:
    _install_standin(PLUGIN)


# ------------------------------------------------------------ feature table patch
from torch.testing._internal import common_distributed  # noqa: E402
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

# Features granted to the plugin name.  Default: plugin (makes
# require_backend_is_available accept the name), ddp, subgroup.  "gpu" is worth adding:
# despite its name, DistTestCases.backend_feature["gpu"] is used by the suite as the
# "real backend" allow-list of ~33 CPU tests (object collectives, monitored_barrier,
# many DDP tests); tests that really need GPUs still skip in the ranks on a CPU box.
DEFAULT_FEATURES = "plugin,ddp,subgroup"
GRANTED_FEATURES = tuple(
    f.strip() for f in os.environ.get("SHMCOLL_CONF_FEATURES", DEFAULT_FEATURES).split(",")
    if f.strip()
)
_unknown = [f for f in GRANTED_FEATURES if f not in DistTestCases.backend_feature]
if _unknown:
    raise ConformanceSetupError(
        f"SHMCOLL_CONF_FEATURES: unknown feature(s) {_unknown}; known: "
        f"{sorted(DistTestCases.backend_feature)}"
    )
PATCH_FEATURES = PLUGIN is not None and not STANDIN
if PATCH_FEATURES:
    for _feature in GRANTED_FEATURES:
        DistTestCases.backend_feature[_feature].add(SUITE_BACKEND)

# Per-test timeout used by MultiProcessTestCase._join_processes (it terminates the
# ranks and fails the test when exceeded).  Upstream per-test overrides that are
# *longer* (known-slow DDP tests) are kept.
_T = os.environ.get("SHMCOLL_CONF_TEST_TIMEOUT")
if _T:
    common_distributed.TIMEOUT_DEFAULT = int(_T)
    for _k, _v in list(common_distributed.TIMEOUT_OVERRIDE.items()):
        common_distributed.TIMEOUT_OVERRIDE[_k] = max(int(_v), int(_T))


def effective_timeout(test_name: str) -> int:
    return common_distributed.get_timeout(test_name)


# ----------------------------------------------------------------- the suite itself
import torch.testing._internal.distributed.distributed_test as _dt  # noqa: E402

# In stand-in mode dist.get_backend() says "gloo", so call_dist_op() would insist on
# profiler events named "gloo:<op>" -- a gloo implementation detail that no stand-in
# records (the suite skips these checks for any name not in the lists below, i.e. for
# every plugin).  Drop "gloo" from the lists so stand-in runs are gated like plugin
# runs; SHMCOLL_CONF_STANDIN_PROFILING=1 keeps the checks.
if STANDIN and os.environ.get("SHMCOLL_CONF_STANDIN_PROFILING") != "1":
    for _lst in (_dt.PROFILING_SUPPORTED_BACKENDS, _dt.CUDA_PROFILING_SUPPORTED_BACKENDS,
                 _dt.SEND_RECV_PROFILING_SUPPORTED_BACKENDS):
        _lst[:] = [b for b in _lst if b != "gloo"]

if _dt.BACKEND != SUITE_BACKEND:
    raise ConformanceSetupError(
        f"suite saw BACKEND={_dt.BACKEND!r}, expected {SUITE_BACKEND!r}"
    )


# "spawn" (default) is what upstream uses: every rank is a fresh interpreter that
# re-imports torch and this module (~3-4 s of CPU per rank per test).  "forkserver"
# forks the ranks from a server that has already imported this module; it is much
# cheaper but is *not* upstream's configuration.  forkserver children do not see the
# parent's current os.environ (the suite sets TEMP_DIR per test), so the parent's
# environment is shipped to each rank explicitly and restored before the test runs.
START_METHOD = os.environ.get("SHMCOLL_CONF_START_METHOD", "spawn")
if START_METHOD not in ("spawn", "forkserver"):
    raise ConformanceSetupError(f"SHMCOLL_CONF_START_METHOD={START_METHOD!r}")


class TestDistBackendWithSpawn(_dt.TestDistBackend, _dt.DistributedTest._DistTestBase):
    """Same shape as test/distributed/test_distributed_spawn.py upstream."""

    def setUp(self):
        super().setUp()
        if START_METHOD == "spawn":
            self._spawn_processes()
        else:
            ctx = torch.multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload([__name__])
            self._start_processes(ctx.Process)
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    def _start_processes(self, proc) -> None:
        if START_METHOD == "spawn":
            return super()._start_processes(proc)
        # upstream MultiProcessTestCase._start_processes + the environment snapshot
        self.processes = []
        for rank in range(int(self.world_size)):
            parent_conn, child_conn = torch.multiprocessing.Pipe()
            process = proc(
                target=self.__class__._run,
                name="process " + str(rank),
                args=(rank, self._current_test_name(), self.file_name, child_conn),
                kwargs={"fake_pg": getattr(self, "fake_pg", False),
                        "conf_env": dict(os.environ)},
            )
            process.start()
            self.pid_to_pipe[process.pid] = parent_conn
            self.processes.append(process)

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        env = kwargs.pop("conf_env", None)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        nodes = int(os.environ.get("SHMCOLL_CONF_NODES") or 0)
        if nodes > 1:  # simulated nodes: ranks split into `nodes` consecutive blocks
            os.environ["SHMCOLL_NODE_ID"] = \
                f"conf-node{rank * nodes // int(os.environ['WORLD_SIZE'])}"
        super()._run(rank, test_name, file_name, pipe, **kwargs)


def describe() -> dict:
    return {
        "mode": MODE,
        "suite_backend": SUITE_BACKEND,
        "plugin": PLUGIN,
        "standin_for_gloo": STANDIN,
        "granted_features": list(GRANTED_FEATURES) if PATCH_FEATURES else [],
        "world_size": int(os.environ["WORLD_SIZE"]),
        "simulated_nodes": int(os.environ.get("SHMCOLL_CONF_NODES") or 0),
        "start_method": START_METHOD,
        "backend_feature": {
            k: sorted(v) for k, v in DistTestCases.backend_feature.items()
        },
        "torch": torch.__version__,
    }


__all__ = ["TestDistBackendWithSpawn", "describe", "MODES"]
