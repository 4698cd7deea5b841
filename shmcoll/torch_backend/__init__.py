"""The torch.distributed adapter (leaf): backend "shm" over the engine.

Importing this package imports neither torch nor the engine: `import torch` loads it through
the `torch.backends` entry point (plugin.autoload), and `import shmcoll` through
plugin.register_when_torch_loads. The names below load their modules on first use (PEP 562);
the backend's creator (plugin.create_shm_process_group) loads the adapter and the engine
when torch creates the first "shm" group.

Private torch symbols touched (checked against torch 2.13.0): subclassing
`torch.distributed.ProcessGroup` and `torch.distributed.Work` from Python (the pybind
trampolines), `dist.Backend.register_backend(..., extended_api=True)` with
`_DistributedBackendOptions` fields (store, group_rank, group_size, timeout, group_id).
"""

import importlib

__all__ = ["register", "EngineProcessGroup", "ProcessGroupShm", "HierProcessGroup",
           "ShmOptions", "create_shm_process_group", "new_process_group"]

_WHERE = {  # name -> the module of this package that defines it
    "register": "plugin",
    "create_shm_process_group": "plugin",
    "EngineProcessGroup": "process_group",
    "ProcessGroupShm": "process_group",
    "ShmOptions": "pg_args",
    "HierProcessGroup": "hier_pg",
    "new_process_group": "hier_pg",
}


def __getattr__(name):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
