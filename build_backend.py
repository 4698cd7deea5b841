"""The build backend: setuptools', asking for numba, numpy and posix-ipc only when it builds
a wheel (setup.py compiles the kernels into it: shmcoll/tools/build_kernels.py). An editable install
builds no kernels and so does not install them into pip's build environment (~20 s)."""

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (every other hook: setuptools')

_KERNEL_BUILD = ["numba>=0.68", "numpy>=1.26"]


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _KERNEL_BUILD
