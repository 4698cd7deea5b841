"""protocol/'s compiled side, imported on first use (native/compiled.py says why):
`compiled.protocol_kernels` (kernels.py: the protocol's steps and kernel sets), and the
names of native's `compiled` (atomics, kernels, single_copy), read through it."""

from ..native import compiled as native_compiled

_NAMES = ("protocol_kernels",)


def __getattr__(name):
    if name == "protocol_kernels":
        from . import kernels as module
    else:
        module = getattr(native_compiled, name)  # AttributeError for an unknown name
    globals()[name] = module  # later reads are a dict lookup
    return module


def __dir__():
    return sorted(set(globals()) | set(_NAMES) | set(dir(native_compiled)))
