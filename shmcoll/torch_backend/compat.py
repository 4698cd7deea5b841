"""What differs between the torch versions shmcoll accepts, in one place.

Every read of a torch internal whose spelling or behaviour changed between releases goes
through a name here, each written so that it works on every supported version or fails
with a clear error -- never by quietly falling back to a default that gives a wrong result.
Where it can, a difference is detected (an attribute, a probe), not read off the version.
tests/test_torch_compat.py runs each on the installed torch (CI: the newest and the
oldest supported torch).

| what | where it differs |
|---|---|
| PREMUL_SUM's factor | `ReduceOp.factor` exists from torch 2.13; every version pickles the op as `(RedOpType.PREMUL_SUM, factor)` through `__getstate__` |
| `opts.asyncOp` | the collective options say whether the front end waits at once only on newer torch (absent in 2.4); without it the adapter's latency path (fast.py), which runs a call on the caller's thread, is off |
| where the default generator is reseeded | torch 2.13's `torch.random.manual_seed` calls the module function `_manual_seed_impl` (also what `torch.distributed._local_tensor` calls), so replacing that one name catches `torch.manual_seed` under every alias, the wrapper `torch._dynamo` puts on it at import included; a torch whose `manual_seed` does not call it is caught at its two public names. `torch.seed` is `torch.random.seed` on every version |
| backend autoload | from 2.5 `import torch` runs the `torch.backends` entry points (plugin.py) |
| oldest torch | 2.4: torch is optional, not a pip requirement; the creator checks it |
| a Python Work handed to C++ | 2.13 keeps its Python object alive (`PyWorkHolder`); 2.4 does not, and C++ waiters (DDP) then reach the base `Work`, whose `wait()` never returns: `CPP_KEEPS_PYTHON_WORK` (probed), `Work` holds a collective's Work until waited |
| destroy_process_group | 2.13 shuts every group down (`ProcessGroup.shutdown()`); 2.4 only NCCL's, so a destroyed "shm" group, like a gloo one, keeps working until its last reference goes: `DESTROY_SHUTS_DOWN` |
| registering a taken backend name | 2.13's `register_backend` replaces the entry; 2.4's asserts, so a name we hold could never be taken over (threaded_pg claims "threaded" only where it can be): `registration_replaces` |
"""

import os

import torch
# (as a name: threaded_pg's registration imports this module from the import hook, which can
# fire while torch itself is still being imported, before `torch.distributed` is set on it)
import torch.distributed as dist

__all__ = ["TORCH_VERSION", "OLDEST_TORCH", "AUTOLOAD_FROM", "OPTIONS_HAVE_ASYNC_OP",
           "CPP_KEEPS_PYTHON_WORK", "DESTROY_SHUTS_DOWN", "Work", "premul_factor",
           "rng_seed_hooks", "registration_replaces", "require_supported_torch",
           "autoloads_backends"]


def _version_tuple(text):
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts)


TORCH_VERSION = _version_tuple(torch.__version__)  # (major, minor, patch)
OLDEST_TORCH = (2, 4)  # the oldest torch shmcoll's adapter is tested on (CI)
AUTOLOAD_FROM = (2, 5)  # the first torch that runs the `torch.backends` entry points


def require_supported_torch():
    """Raise (ImportError, naming both versions) on a torch older than OLDEST_TORCH: pip
    does not enforce it, since torch is an optional dependency."""
    if TORCH_VERSION[:2] < OLDEST_TORCH:
        raise ImportError(
            f"shmcoll's backend needs torch >= {'.'.join(map(str, OLDEST_TORCH))}; this is "
            f"torch {torch.__version__}")


def autoloads_backends():
    """Whether this torch registers "shm" and "threaded" at `import torch` (by calling the
    installed `torch.backends` entry points): torch >= 2.5 with TORCH_DEVICE_BACKEND_AUTOLOAD
    unset or "1" (torch's own test of the variable)."""
    return TORCH_VERSION[:2] >= AUTOLOAD_FROM and \
        os.getenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") == "1"

# The front end sets opts.asyncOp = not async_op before calling the ProcessGroup; older
# torch has no such field, so a call cannot know that its caller waits at once.
OPTIONS_HAVE_ASYNC_OP = hasattr(dist.AllreduceOptions(), "asyncOp")


def premul_factor(op):
    """The factor of a PREMUL_SUM ReduceOp (`dist._make_nccl_premul_sum(f)`, also as
    `opts.reduceOp`), as a float; a tensor factor holds one element.

    torch < 2.13 has no `ReduceOp.factor`; its `__getstate__` (what pickling uses, on every
    version) returns `(RedOpType.PREMUL_SUM, factor)`. An op that offers neither raises:
    a factor silently read as 1.0 would turn PREMUL_SUM into a plain SUM."""
    factor = getattr(op, "factor", None)
    if factor is None:
        state = None
        getstate = getattr(op, "__getstate__", None)
        if getstate is not None:
            try:
                state = getstate()
            except Exception:  # noqa: BLE001 - reported below as the missing factor
                state = None
        if isinstance(state, tuple) and len(state) == 2:
            factor = state[1]
    if factor is None:
        raise ValueError(
            f"shm: cannot read PREMUL_SUM's factor from {op!r} on torch {torch.__version__} "
            f"(no ReduceOp.factor and no (op, factor) state); refusing to reduce it as a "
            f"plain SUM")
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1:
            raise ValueError(f"shm: PREMUL_SUM's factor must hold one element, got a tensor "
                             f"of shape {tuple(factor.shape)}")
        return float(factor.item())
    return float(factor)


def rng_seed_hooks():
    """Where a call that reseeds torch's default (CPU) generator can be intercepted: a list
    of `(module, attribute, public name)`, the attributes a caller may replace with a
    wrapper of the same signature for a while (threaded_pg's seed watch).

    `torch.manual_seed`: where `torch.random.manual_seed` calls the module-level
    `torch.random._manual_seed_impl` (torch 2.13), that name -- one replacement catches
    every alias: `torch.manual_seed`, `torch.random.manual_seed`, a `from torch import
    manual_seed` taken earlier, and the `_disable_dynamo` wrapper that importing
    torch._dynamo installs as `torch.manual_seed`. Otherwise the two public attributes
    (they may be one object: a wrapper for it serves both). `torch.seed` is
    `torch.random.seed`: both attributes.

    Not covered, as on every version: `torch.default_generator.manual_seed()` (a method
    of a C object) and `torch.set_rng_state` (a restore: torch.utils.checkpoint and
    `torch.random.fork_rng` call it themselves)."""
    import torch.random as random

    manual = getattr(random, "manual_seed", None)
    if manual is None or getattr(random, "seed", None) is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.random.manual_seed / "
                           f"torch.random.seed")
    code = getattr(manual, "__code__", None)
    if callable(getattr(random, "_manual_seed_impl", None)) and code is not None \
            and "_manual_seed_impl" in code.co_names:
        hooks = [(random, "_manual_seed_impl", "torch.manual_seed")]
    else:
        hooks = [(random, "manual_seed", "torch.manual_seed"),
                 (torch, "manual_seed", "torch.manual_seed")]
    return hooks + [(random, "seed", "torch.seed"), (torch, "seed", "torch.seed")]


def _cpp_keeps_python_work():
    """Whether a Work that a Python ProcessGroup returns to C++ keeps its Python overrides
    after Python dropped it: a ProcessGroup subclass hands a Work subclass to C++ (the
    unbound base method calls the override, as C++ callers do) and keeps no reference; its
    get_future() override must still answer. On a torch without that keep-alive the base
    Work answers instead, and raises. Anything unexpected counts as False: holding Works
    (Work below) only keeps them longer, while a lost override hangs C++ waiters."""
    import torch.futures

    class _ProbeWork(dist.Work):
        def get_future(self):
            future = torch.futures.Future()
            future.set_result(True)
            return future

    class _ProbeGroup(dist.ProcessGroup):
        def allgather(self, output_tensors, input_tensors, opts=None):
            return _ProbeWork()

    t = torch.zeros(1, device="cpu")
    try:
        work = dist.ProcessGroup.allgather(
            _ProbeGroup(0, 1), [[t]], [t], torch._C._distributed_c10d.AllgatherOptions())
        return work.get_future().wait() is True
    except Exception:  # noqa: BLE001 - the base Work's "getFuture not implemented", or a
        return False   # torch whose bindings differ: hold Works (the safe side)


_PROBED = {}


def _cpp_keeps():
    """CPP_KEEPS_PYTHON_WORK, probed on first use, not at import (which can happen inside
    `import torch`: see the imports)."""
    if "work" not in _PROBED:
        _PROBED["work"] = _cpp_keeps_python_work()
    return _PROBED["work"]


def __getattr__(name):
    if name == "CPP_KEEPS_PYTHON_WORK":
        return _cpp_keeps()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# destroy_process_group calls ProcessGroup.shutdown() (and so our backend's shutdown) where
# ProcessGroup has it; torch 2.4's has no such method and shuts down NCCL backends only.
DESTROY_SHUTS_DOWN = hasattr(dist.ProcessGroup, "shutdown")


class Work(dist.Work):
    """Base of the Work classes of shmcoll's collectives (what a ProcessGroup method
    returns; subclasses implement _wait(timeout) and _get_future()).

    Where torch does not keep a Python Work alive for the C++ code it is handed to
    (CPP_KEEPS_PYTHON_WORK False), an instance made with a `holder` (a set owned by its
    group object, so what is left in it goes with the group) keeps itself there until its
    wait() has run or its future was taken: torch's C++ callers (DDP's Reducer takes the
    future; `_verify_params_across_processes`, `_broadcast_coalesced` and functional
    collectives wait) need nothing of it after that, and before it a dropped Work would
    leave them with the base Work, whose wait() never returns. So a collective nobody
    waits for stays held while its group lives. Point-to-point Works are not held: torch
    2.4 calls send/recv from Python only, and its Schedule1F1B drops send Works unwaited,
    which holding would keep (with their tensors) for the group's lifetime."""

    def __init__(self, holder=None):
        super().__init__()
        self._holder = None
        if holder is not None and not _cpp_keeps():
            holder.add(self)
            self._holder = holder

    def wait(self, timeout=None):
        try:
            return self._wait(timeout)
        finally:
            self._let_go()

    def get_future(self):
        future = self._get_future()
        self._let_go()
        return future

    def _wait(self, timeout):
        raise NotImplementedError

    def _get_future(self):
        raise NotImplementedError

    def _let_go(self):
        holder, self._holder = self._holder, None
        if holder is not None:
            holder.discard(self)


def registration_replaces(name, creator, devices):
    """Whether torch's `Backend.register_backend` replaces a name that is already taken.
    `name` must already be registered with `creator` (and `devices`, extended_api): it is
    registered again, the same way. torch 2.13 replaces the entry (with itself: nothing
    changes); torch 2.4 asserts that the name is free before it changes anything."""
    try:
        dist.Backend.register_backend(name, creator, extended_api=True, devices=devices)
    except (AssertionError, ValueError):
        return False
    return True
