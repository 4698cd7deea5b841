"""The engine's compiled side, imported on first use: the one way the numba-free engine
(protocol.py, protocol/waits.py, p2p.py, p2p/progress.py, ops.py, group.py, algorithms/,
hier/, the torch adapter) reaches a kernel.

    compiled.atomics            atomics.py: intrinsics, waits, read_acquire / write_release
    compiled.kernels            kernels.py: the reducers, reduce_into / reduce_unchecked
    compiled.protocol_kernels   protocol/kernels.py: the protocol's steps and kernel sets
    compiled.p2p_cells          p2p/cells.py: the mailbox cells' kernels
    compiled.single_copy        single_copy_kernels.py: process_vm_readv and its phases

Each name imports its module (and so numba, ~0.3 s, and numba's CPU target on the first
kernel load, ~0.6-1 s) the first time it is read, then is a plain attribute of this module.
So creating a group imports no numba: the group's warm-up thread (warmup.py) is the first
reader, and the group's first call, which waits for that warm-up (Group's kernel gate),
finds them loaded. tests/test_warm_init.py checks that the creation path stays clear of
numba; tests/test_layering.py that the modules which import numba at module level are
only reached from here (or from each other, or from the numba-only tools: doctor,
build_kernels).
"""

_NAMES = ("atomics", "kernels", "protocol_kernels", "p2p_cells", "single_copy")


def __getattr__(name):
    if name == "atomics":
        from . import atomics as module
    elif name == "kernels":
        from . import reducers as module
    elif name == "protocol_kernels":
        from ..protocol import kernels as module
    elif name == "p2p_cells":
        from ..p2p import cells as module
    elif name == "single_copy":
        from . import single_copy_kernels as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = module  # later reads are a dict lookup
    return module


def __dir__():
    return sorted(set(globals()) | set(_NAMES))
