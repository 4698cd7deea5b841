"""native/'s compiled side, imported on first use: the one way the numba-free modules reach
this layer's kernels (each layer above that has kernels keeps its own `compiled`, which
answers for the layers below it too: protocol/compiled.py, p2p/compiled.py).

    compiled.atomics       atomics.py: intrinsics, waits, read_acquire / write_release
    compiled.kernels       reducers.py: the reducers, reduce_into / reduce_unchecked
    compiled.single_copy   single_copy_kernels.py: process_vm_readv and its phases

Each name imports its module (and so numba, ~0.3 s, and numba's runtime on the first kernel
load: prebuilt.ready_runtime) the first time it is read, then is a plain attribute of this
module.
So creating a group imports no numba: the group's warm-up thread (engine/warmup.py) is the
first reader, and the group's first call, which waits for that warm-up (Group's kernel
gate), finds them loaded. tests/test_warm_init.py checks that the creation path stays clear
of numba; tests/test_layering.py that the modules which import numba at module level are
only reached through a `compiled` module (or from each other, or from the numba-only tools:
tools/doctor, tools/build_kernels).
"""

_NAMES = ("atomics", "kernels", "single_copy")


def __getattr__(name):
    if name == "atomics":
        from . import atomics as module
    elif name == "kernels":
        from . import reducers as module
    elif name == "single_copy":
        from . import single_copy_kernels as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = module  # later reads are a dict lookup
    return module


def __dir__():
    return sorted(set(globals()) | set(_NAMES))
