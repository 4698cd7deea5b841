"""PEP 562 attributes for a package whose names load their modules on first use.

`shmcoll`, `shmcoll.torch_backend` and `threaded_pg` import neither torch nor numba; each
maps its public names to the submodule defining them and takes its module `__getattr__`
and `__dir__` from `lazy_attributes`. Imports nothing of shmcoll.
"""

import importlib
import sys

__all__ = ["lazy_attributes"]


def lazy_attributes(package, where):
    """(__getattr__, __dir__) for the package named `package`: a name in `where` (name ->
    submodule of `package`) is imported from its submodule on first use and kept in the
    package's namespace; any other name raises AttributeError, as a module does."""

    def __getattr__(name):
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__():
        namespace = vars(sys.modules[package])
        return sorted(set(namespace) | set(namespace.get("__all__", ())))

    return __getattr__, __dir__
