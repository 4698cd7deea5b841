"""Per-thread torch.distributed state, so each rank thread has its own default process group.

Private torch symbols touched here (checked against torch 2.13.0; `check_torch()` fails
loudly when one is missing):
- `torch.distributed.distributed_c10d._world`: the module global holding c10d's group
  state. While any spawn runs it is replaced by a proxy that forwards every attribute to the
  calling thread's world; threads that are not rank threads (the main thread, pytest, ...)
  are forwarded to the original object, so their state is untouched.
- `torch.distributed.distributed_c10d._World`: subclassed so each rank thread's maps live in
  the instance (torch's keeps pg_map, pg_names, ... in module globals).
- `torch._C._distributed_c10d._set_thread_isolation_mode(bool)`: makes the C++ group-name
  registry (`_register_process_group` / `_resolve_process_group`) per thread. There is no
  getter: it is switched on with the first install and off with the last uninstall.
- `torch.autograd.set_multithreading_enabled` (public): off while installed, so autograd
  never runs a rank's backward on an engine thread that has no rank world.
- `sys.excepthook` (not torch, but mutated by every `init_process_group`): restored by the
  last uninstall so spawns do not pile up hooks.

Installation is reference counted (one count per live rank thread plus one per running
spawn) and thread-safe, so sequential, concurrent and leaked spawns all leave the process
as they found it once their threads are gone.
"""

import sys
import threading

import torch
import torch.distributed.distributed_c10d as c10d

__all__ = ["install", "uninstall", "bind", "unbind", "current", "follow", "check_torch",
           "TORCH_CHECKED"]

TORCH_CHECKED = "2.13"


def check_torch():
    """Raise a clear error when this torch lacks a private symbol we rely on."""
    missing = [name for name, ok in (
        ("torch.distributed.distributed_c10d._world", hasattr(c10d, "_world")),
        ("torch.distributed.distributed_c10d._World", hasattr(c10d, "_World")),
        ("torch._C._distributed_c10d._set_thread_isolation_mode",
         hasattr(torch._C._distributed_c10d, "_set_thread_isolation_mode")),
    ) if not ok]
    if missing:
        raise RuntimeError(f"threaded_pg: torch {torch.__version__} lacks {', '.join(missing)} "
                           f"(checked against torch {TORCH_CHECKED})")


class _RankWorld(c10d._World):
    """One rank thread's c10d state: torch's _World, with its maps held per instance."""

    def __init__(self):
        super().__init__()
        self._pg_map = {}
        self._pg_names = {}
        self._pg_group_ranks = {}
        self._pg_backend_config = {}
        self._group_count = 0
        self._tags_to_pg = {}
        self._pg_to_tag = {}

    pg_map = property(lambda self: self._pg_map)
    pg_names = property(lambda self: self._pg_names)
    pg_group_ranks = property(lambda self: self._pg_group_ranks)
    pg_backend_config = property(lambda self: self._pg_backend_config)
    tags_to_pg = property(lambda self: self._tags_to_pg)
    pg_to_tag = property(lambda self: self._pg_to_tag)

    @property
    def group_count(self):
        return self._group_count

    @group_count.setter
    def group_count(self, value):
        self._group_count = value


class _ThreadLocalWorld(threading.local, _RankWorld):
    """Stands in for c10d._world: every attribute goes to the calling thread's world.

    A threading.local: a bound rank thread's world state lives in that thread's own
    instance dict, so `_world.default_pg` costs what it costs on torch's own _World (a
    C-level lookup and a property) instead of a Python __getattr__ hop per access (~1 us;
    dist.all_reduce makes three). Other threads (the main thread, pytest) have an empty
    dict: their reads fall through to __getattr__ and their writes to __setattr__, both
    forwarded to the original world, so its state is theirs and stays untouched.
    """

    _fallback = None  # the original c10d._world (install)

    def __init__(self):
        pass  # runs in each thread on its first access: the dict stays empty until bind()

    def bind(self):
        super().__setattr__("_bound", True)
        _RankWorld.__init__(self)

    def unbind(self):
        self.__dict__.clear()

    def __getattr__(self, name):
        own = self.__dict__
        if "_bound" in own:
            raise AttributeError(name)
        followed = own.get("_follow")
        if followed is not None:  # a rank's helper thread (follow): the rank's world
            try:
                return followed[name]
            except KeyError:
                raise AttributeError(name) from None
        return getattr(type(self)._fallback, name)

    def __setattr__(self, name, value):
        own = self.__dict__
        if "_bound" in own:
            super().__setattr__(name, value)
        elif "_follow" in own:
            prop = getattr(type(self), name, None)
            if isinstance(prop, property):
                prop.__set__(self, value)  # its setter stores the private name: below
            else:
                own["_follow"][name] = value
        else:
            setattr(type(self)._fallback, name, value)


_lock = threading.Lock()
_count = 0
_proxy = None
_saved = None  # (original _world, sys.excepthook, autograd multithreading context)


def install():
    """Take one reference on the thread-local world (installing it if first)."""
    global _count, _proxy, _saved
    with _lock:
        if _count == 0:
            check_torch()
            original = c10d._world
            _ThreadLocalWorld._fallback = original
            _proxy = _ThreadLocalWorld()
            c10d._world = _proxy
            torch._C._distributed_c10d._set_thread_isolation_mode(True)
            _saved = (original, sys.excepthook, torch.autograd.set_multithreading_enabled(False))
        _count += 1


def uninstall():
    """Drop one reference; the last one restores torch's own world and settings."""
    global _count, _proxy, _saved
    with _lock:
        _count -= 1
        if _count > 0:
            return
        original, excepthook, autograd_ctx = _saved
        if c10d._world is _proxy:
            c10d._world = original
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        sys.excepthook = excepthook
        autograd_ctx.__exit__(None, None, None)
        _ThreadLocalWorld._fallback = None
        _proxy = _saved = None


def bind():
    """Give the calling thread a fresh, empty world (call between install and uninstall)."""
    _proxy.bind()


def unbind():
    _proxy.unbind()


def current():
    """The calling rank thread's world (an opaque handle for follow), or None when the
    calling thread is not a bound rank thread."""
    proxy = _proxy
    if proxy is None:
        return None
    own = proxy.__dict__
    return own if "_bound" in own else None


def follow(handle):
    """Make the calling thread (one that is not a rank thread: a process group's worker,
    which runs future callbacks) read and write the world of the rank whose current() gave
    `handle`, for as long as the thread lives."""
    proxy = _proxy
    if proxy is not None and handle is not None:
        proxy.__dict__["_follow"] = handle
