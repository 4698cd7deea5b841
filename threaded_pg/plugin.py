"""Backend "threaded" as a torch.distributed plugin: its creator and its registration.

Importing this module imports neither torch nor the engine: it is on the path of every
`import torch` where shmcoll is installed (the `torch.backends` entry point calls
autoload()), and `import threaded_pg` registers through register_when_torch_loads(), as
shmcoll.torch_backend.plugin does for "shm". The creator imports threaded_pg.backend (the
process group, over the engine) when torch creates the first group.

Name clash: torch's own `torch.testing._internal.distributed.multi_threaded_pg` registers
"threaded" when it is imported (torch 2.13's register_backend silently replaces an existing
entry). So we register "threaded" only if the name is free, and always register the alias
"shmcoll_threaded"; `backend_name()` answers, at each spawn, the name that currently maps to
our creator. Importing torch's module after ours therefore leaves both usable: torch's tests
get theirs under "threaded", spawn() uses ours under the alias. Where register_backend
refuses a name that is taken (torch 2.4 asserts), holding "threaded" would make torch's
module fail to import after ours; there we register the alias only
(compat.registration_replaces).

Private torch symbols touched (checked against torch 2.13.0): `dist.Backend._plugins` (is
the name free, and whose creator holds it) and `dist.Backend.register_backend(...,
extended_api=True)`.
"""

from shmcoll.torch_backend.import_hook import after_import
from shmcoll.torch_backend.plugin import register_guarded

__all__ = ["register", "register_when_torch_loads", "autoload", "backend_name",
           "create_threaded_process_group", "BACKEND", "ALIAS"]

BACKEND = "threaded"
ALIAS = "shmcoll_threaded"


def create_threaded_process_group(backend_opts, pg_options=None):
    """Creator for dist.Backend.register_backend: one engine Group per torch group (on a
    rank thread of threaded_pg.spawn); loads threaded_pg.backend on first use."""
    from .backend import new_process_group
    return new_process_group(backend_opts, pg_options)


def _owner(name):
    import torch.distributed as dist
    plugin = dist.Backend._plugins.get(name.upper())
    return None if plugin is None else plugin.creator_fn


_DEVICES = ["cpu", "cuda"]
_claim_backend = None  # whether to hold BACKEND while it is free: others can take it over


def register():
    """Register ALIAS always, and BACKEND while free where torch lets a later registration
    take it over (idempotent); nothing where torch was built without torch.distributed."""
    global _claim_backend
    import torch.distributed as dist
    if not dist.is_available():
        return
    if _owner(ALIAS) is not create_threaded_process_group:
        dist.Backend.register_backend(ALIAS, create_threaded_process_group, extended_api=True,
                                      devices=_DEVICES)
    if _claim_backend is None:
        from shmcoll.torch_backend.compat import registration_replaces
        _claim_backend = registration_replaces(ALIAS, create_threaded_process_group, _DEVICES)
    if _claim_backend and _owner(BACKEND) is None:
        dist.Backend.register_backend(BACKEND, create_threaded_process_group, extended_api=True,
                                      devices=_DEVICES)


def backend_name():
    """"threaded" when that name is ours, else the alias (always on a torch whose
    register_backend refuses a taken name)."""
    register()
    return BACKEND if _owner(BACKEND) is create_threaded_process_group else ALIAS


def register_when_torch_loads():
    """register() now if torch is imported, else right after torch.distributed is (what
    `import threaded_pg` does). Never raises: warns."""
    after_import("torch.distributed", autoload)


def autoload():
    """The `torch.backends` entry point (end of `import torch`, torch >= 2.5). Never
    raises: a failure to register warns."""
    register_guarded(BACKEND, register)
