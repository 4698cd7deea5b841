"""shmcoll.torch_backend.compat on the installed torch (CI runs this on the newest and on
the oldest supported torch): every version-dependent read works here, or fails loudly."""

import gc
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
import torch.distributed as dist

import harness
from shmcoll.native.ops import ReduceOp
from shmcoll.torch_backend import compat
from shmcoll.torch_backend.convert import reduce_op


@pytest.mark.parametrize("factor", [2.5, -0.125, torch.tensor([3.0]), torch.tensor(0.5)],
                         ids=["float", "negative", "tensor1", "scalar-tensor"])
def test_premul_factor_is_read_on_this_torch(factor):
    op = dist._make_nccl_premul_sum(factor)
    want = float(factor.item() if isinstance(factor, torch.Tensor) else factor)
    assert compat.premul_factor(op) == want
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    assert compat.premul_factor(opts.reduceOp) == want  # what a ProcessGroup receives
    assert reduce_op(op) == (ReduceOp.PREMUL_SUM, want)


def test_an_unreadable_factor_raises_instead_of_summing():
    class Opaque:  # neither .factor nor an (op, factor) state, as a future torch might be
        op = dist.ReduceOp.PREMUL_SUM

        def __getstate__(self):
            return None

    with pytest.raises(ValueError, match="cannot read PREMUL_SUM's factor"):
        compat.premul_factor(Opaque())


def test_a_factor_of_several_elements_is_refused():
    class Wide:
        factor = torch.tensor([1.0, 2.0])

    with pytest.raises(ValueError, match="one element"):
        compat.premul_factor(Wide())


def test_other_ops_have_no_factor():
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX):
        assert reduce_op(op)[1] == 1.0


def test_version_tuple():
    assert compat._version_tuple("2.11.0+cu130") == (2, 11, 0)
    assert compat._version_tuple("2.14.0a0+git1234") == (2, 14, 0)
    assert compat._version_tuple("2.4.1") == (2, 4, 1)
    assert compat.TORCH_VERSION[:2] == tuple(int(x) for x in torch.__version__.split(".")[:2])


def test_rng_seed_hooks_catch_every_public_seeding_call():
    """Every way a user reseeds the default generator passes through a hook (wrapped here
    for the duration of the test, as threaded_pg's seed watch does during a spawn)."""
    from torch.random import manual_seed as bound_before  # a name taken before the wrap

    hooks = compat.rng_seed_hooks()
    calls = []
    saved = [(m, a, getattr(m, a)) for m, a, _ in hooks]
    wrappers = {}
    for (module, attribute, original), (_, _, public) in zip(saved, hooks):
        if id(original) not in wrappers:
            def wrapper(*args, _original=original, _public=public, **kwargs):
                calls.append(_public)
                return _original(*args, **kwargs)
            wrappers[id(original)] = wrapper
        setattr(module, attribute, wrappers[id(original)])
    try:
        torch.manual_seed(0)
        torch.random.manual_seed(0)
        torch.seed()
        torch.random.seed()
        expected = ["torch.manual_seed"] * 2 + ["torch.seed"] * 2
        if hooks[0][1] == "_manual_seed_impl":  # torch 2.13: the inner function
            bound_before(0)
            expected.append("torch.manual_seed")
    finally:
        for module, attribute, original in saved:
            setattr(module, attribute, original)
    assert calls == expected


def test_a_torch_older_than_supported_is_refused_at_the_first_group(monkeypatch):
    """torch is not a pip requirement (optional): the creator checks the version itself."""
    compat.require_supported_torch()  # the installed torch is supported
    monkeypatch.setattr(compat, "TORCH_VERSION", (2, 3, 1))
    with pytest.raises(ImportError, match=r"needs torch >= 2\.4"):
        compat.require_supported_torch()
    from shmcoll.torch_backend import plugin
    with pytest.raises(ImportError, match=r"needs torch >= 2\.4"):
        plugin.create_shm_process_group(None)


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("0", False), ("yes", False)])
def test_autoload_follows_torchs_switch(monkeypatch, value, on):
    """As torch/__init__.py reads TORCH_DEVICE_BACKEND_AUTOLOAD (enabled only by "1")."""
    if value is None:
        monkeypatch.delenv("TORCH_DEVICE_BACKEND_AUTOLOAD", raising=False)
    else:
        monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", value)
    want = on and compat.TORCH_VERSION[:2] >= compat.AUTOLOAD_FROM
    assert compat.autoloads_backends() is want
    monkeypatch.setattr(compat, "TORCH_VERSION", (2, 4, 1))
    assert compat.autoloads_backends() is False


# ------------------------------------------ a Python Work handed to C++ (CPP_KEEPS_PYTHON_WORK)

def test_the_work_probe_answers_for_this_torch():
    """A Work subclass handed to C++ (another method than the probe's) and dropped by Python
    still answers through its override exactly where CPP_KEEPS_PYTHON_WORK says so."""
    class Mine(dist.Work):
        def get_future(self):
            future = torch.futures.Future()
            future.set_result("mine")
            return future

    class Group(dist.ProcessGroup):
        def broadcast(self, tensors, opts=None):
            return Mine()

    work = dist.ProcessGroup.broadcast(Group(0, 1), [torch.zeros(1)], dist.BroadcastOptions())
    if compat.CPP_KEEPS_PYTHON_WORK:
        assert work.get_future().wait() == "mine"
    else:
        with pytest.raises(RuntimeError, match="getFuture"):
            work.get_future()


def _backend(pg):
    from shmcoll.torch_backend import EngineProcessGroup
    if not isinstance(pg, EngineProcessGroup):
        pg = pg._get_backend(torch.device("cpu"))
    return pg.made() if hasattr(pg, "made") else pg


def _cpp_waits(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    pg = dist.group.WORLD
    t = torch.full((3,), float(rank + 1))
    dist._verify_params_across_processes(pg, [t], None)  # C++ waits on an allgather
    dist._broadcast_coalesced(pg, [t], 1 << 20, 0)  # C++ waits on a broadcast
    assert torch.equal(t, torch.ones(3)), t
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(3, 2))  # both of the above, again
    model(torch.full((2, 3), float(rank))).sum().backward()  # the Reducer takes futures
    grads = model.module.weight.grad.clone(), model.module.bias.grad.clone()
    return grads, len(_backend(pg)._works_held)


def test_torchs_cpp_waits_on_shm_works():
    """torch's C++ (DDP's construction and Reducer, _verify_params_across_processes,
    _broadcast_coalesced) waits on the Works "shm" returns: on a torch that drops their
    Python side (torch 2.4) this hung for ever, in DDP's constructor. Once C++ waited or
    took the future, no Work is held any more."""
    results = harness.run_torch_ranks(_cpp_waits, 2, "shm", 120)
    for (weight, bias), held in results:
        # two rows of `rank` per rank: the mean over the ranks of 2 * rank, and of 2
        assert torch.equal(weight, torch.full((2, 3), 1.0)), weight
        assert torch.equal(bias, torch.full((2,), 2.0)), bias
        assert held == 0


# ------------------------------------------------------ destroy_process_group (DESTROY_SHUTS_DOWN)

def _destroyed(rank, world_size, store):
    import shmcoll  # noqa: F401  (registers "shm")

    dist.init_process_group("shm", init_method=f"file://{store.path}/rendezvous", rank=rank,
                            world_size=world_size)
    backend = _backend(dist.group.WORLD)
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()
    closed = backend._closed
    if not closed:  # not shut down: it still works (as a destroyed gloo group does)
        t = torch.ones(2)
        backend.allreduce([t]).wait()
        assert torch.equal(t, torch.full((2,), float(world_size))), t
        backend.barrier().wait()  # (no rank drops it while a peer still uses it)
    ref = weakref.ref(backend)
    gc.disable()
    try:
        del backend
        released = ref() is None  # at once: no reference cycle waits for the collector
    finally:
        gc.enable()
    return closed, released


def test_destroy_process_group_shuts_down_where_torch_says_so():
    """destroy_process_group shuts the "shm" group down exactly where DESTROY_SHUTS_DOWN
    says torch does; where it does not, the group keeps working, and either way it is
    released as soon as its last reference goes."""
    for closed, released in harness.run_ranks(_destroyed, 2, "processes", 120):
        assert closed == compat.DESTROY_SHUTS_DOWN
        assert released


# ------------------------------------------------ registering a taken backend name

def test_registration_replaces_says_what_register_backend_does():
    """registration_replaces is True exactly where another creator registered later under
    the same name takes it over (in a subprocess: it registers backends)."""
    script = textwrap.dedent("""
        import torch.distributed as dist
        from shmcoll.torch_backend.compat import registration_replaces
        def first(*args):
            pass
        def second(*args):
            pass
        name, key = "shmcoll_compat_probe", "SHMCOLL_COMPAT_PROBE"
        dist.Backend.register_backend(name, first, extended_api=True, devices=["cpu"])
        replaces = registration_replaces(name, first, ["cpu"])
        assert dist.Backend._plugins[key].creator_fn is first
        try:
            dist.Backend.register_backend(name, second, extended_api=True, devices=["cpu"])
            took = True
        except AssertionError:
            took = False
        assert took == replaces, (took, replaces)
        assert dist.Backend._plugins[key].creator_fn is (second if took else first)
        print("replaces" if replaces else "refuses")
    """)
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True,
                          text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() in ("replaces", "refuses")
