"""p2p/'s compiled side, imported on first use (native/compiled.py says why):
`compiled.p2p_cells` (cells.py: the mailbox cells' kernels), and the names of protocol's
`compiled` (protocol_kernels, atomics, kernels, single_copy), read through it."""

from ..protocol import compiled as protocol_compiled

_NAMES = ("p2p_cells",)


def __getattr__(name):
    if name == "p2p_cells":
        from . import cells as module
    else:
        module = getattr(protocol_compiled, name)  # AttributeError for an unknown name
    globals()[name] = module  # later reads are a dict lookup
    return module


def __dir__():
    return sorted(set(globals()) | set(_NAMES) | set(dir(protocol_compiled)))
