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

from ..lazy_names import lazy_attributes

__all__ = ["register", "EngineProcessGroup", "ProcessGroupShm", "HierProcessGroup",
           "ShmOptions", "create_shm_process_group", "new_process_group"]

_WHERE = {  # name -> the module of this package that defines it
    "register": "plugin",
    "create_shm_process_group": "plugin",
    "EngineProcessGroup": "process_group",
    "ProcessGroupShm": "hier_pg",
    "ShmOptions": "pg_args",
    "HierProcessGroup": "hier_pg",
    "new_process_group": "hier_pg",
}


__getattr__, __dir__ = lazy_attributes(__name__, _WHERE)
