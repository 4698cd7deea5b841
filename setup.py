"""Builds shmcoll's numba kernels into the wheel (shmcoll/native/prebuilt.py, docs/COLD_START.md).

Everything else is in pyproject.toml. After build_py has copied the sources into the
build directory, `shmcoll.tools.build_kernels.build` compiles the kernels there for the portable
target (shmcoll/_kernels/), so that a regular install loads them instead of compiling
them; ~20-40 s on 2 cores. Skipped for an editable install (its sources change: the
kernels would never match).

The C extension shmcoll.torch_backend._lane (the compiled latency path, lane.py) is built
by build_ext, in place for an editable install; it is optional (OptionalBuildExt).

SHMCOLL_BUILD_KERNELS: "auto" (default) builds them and, should that fail (a numba whose
internals differ, a machine that runs none of the target CPUs), says so and builds the
wheel without them: it then compiles its kernels on first use, as before. "require"
makes any of that fail the build (CI: scripts/wheel_check.sh). "0" skips them.
"""

import os
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

_MODES = ("auto", "require", "0")


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        mode = os.environ.get("SHMCOLL_BUILD_KERNELS", "auto")
        if mode not in _MODES:
            raise SystemExit(f"SHMCOLL_BUILD_KERNELS={mode!r}: expected one of {_MODES}")
        if getattr(self, "editable_mode", False) or mode == "0":
            return
        package = os.path.abspath(os.path.join(self.build_lib, "shmcoll"))
        print(f"shmcoll: compiling the kernels into {package}/_kernels", flush=True)
        run = subprocess.run(
            [sys.executable, "-c", "import json, sys; from shmcoll.tools import build_kernels; "
             "r = build_kernels.build(sys.argv[1]); print(json.dumps(r)); "
             "sys.exit(3 if 'skipped' in r else 0)", package],
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(  # keep pip's build env's
                [os.path.dirname(package)] + os.environ.get("PYTHONPATH", "").split(
                    os.pathsep))),
            cwd=os.path.dirname(package), capture_output=True, text=True)
        print(run.stdout[-3000:], run.stderr[-6000:], sep="\n", flush=True)
        if run.returncode == 0:
            return
        why = "skipped" if run.returncode == 3 else f"failed (exit {run.returncode})"
        if mode == "require":
            raise SystemExit(f"shmcoll: building the kernels {why}; SHMCOLL_BUILD_KERNELS="
                             f"require")
        print(f"shmcoll: WARNING: building the kernels {why}: the wheel ships none, and "
              f"compiles them on first use", file=sys.stderr, flush=True)


class OptionalBuildExt(build_ext):
    """The compiled latency path (shmcoll/torch_backend/_lane.c) is optional: without a C
    compiler or Python's headers the package installs without it and every call takes the
    Python latency path (lane.py), with a warning here."""

    def run(self):
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - distutils raises several kinds
            self._skipped(e)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001
            # an earlier build's, here or in the source tree (editable): stale
            for stale in (self.get_ext_fullpath(ext.name),
                          os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                       self.get_ext_filename(ext.name))):
                if os.path.exists(stale):
                    os.remove(stale)
            self._skipped(e)

    @staticmethod
    def _skipped(e):
        print(f"shmcoll: WARNING: the compiled latency path was not built ({e}); "
              f"collectives take the Python one", file=sys.stderr, flush=True)


LANE = Extension("shmcoll.torch_backend._lane", ["shmcoll/torch_backend/_lane.c"],
                 extra_compile_args=["-O2", "-std=c11"])

setup(cmdclass={"build_py": BuildPyWithKernels, "build_ext": OptionalBuildExt},
      ext_modules=[LANE])
