"""cuda_ipc without a GPU: its protocol, algorithms and torch adapter on the simulated device.

The simulated device (cuda_ipc/sim.py) is the device seam over shared memory, so these
tests run the code a GPU runs, minus the CUDA calls themselves:
- unit: the cyclic flag comparison, the tier choice, the reduction's definition;
- the whole torch.distributed surface on backend "shm" with SHMCOLL_CUDA_SIM=inline (every
  tensor takes the device path): the host backend's own test bodies, reused;
- the tiers: same device, different devices with peer access, without (host-staged).
Engine-level ordering, faults and leaks with asynchronous streams: test_cuda_ipc_async.py.
GPU tests (marked `cuda`): test_cuda_ipc_gpu.py.
"""

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

import harness
import test_torch_backend as tb
import test_torch_backend_pg as tbpg
from cuda_ipc import tiers
from cuda_ipc.device import DeviceError, at_or_past, word_add
from cuda_ipc.reduce import reduce_into
from shmcoll import config
from shmcoll.native import reducers
from shmcoll.native.ops import DTYPES, ReduceOp, reduce_spec
from support.torch_reference import ALL_DTYPES, assert_same

SIM = {"SHMCOLL_CUDA_SIM": "inline"}
JOB_TIMEOUT_S = tb.JOB_TIMEOUT_S


# ------------------------------------------------------------------------------ unit

def test_flag_words_compare_cyclically():
    assert at_or_past(5, 5) and at_or_past(6, 5) and not at_or_past(4, 5)
    top = 0xFFFFFFFF
    assert at_or_past(word_add(top, 3), top)  # wrapped past: still "after"
    assert not at_or_past(top, word_add(top, 3))
    assert word_add(top, 1) == 0 and word_add(0, -1) == top


def _infos(*uuids, kind="cuda"):
    return [tiers.DeviceInfo(kind, u, i, "gpu") for i, u in enumerate(uuids)]


class _Dev:
    def __init__(self, can):
        self._can = can

    def can_access_peer(self, uuid):
        return self._can


def test_tier_choice():
    same, two = _infos("a", "a", "a"), _infos("a", "b")
    assert tiers.choose(same, [True] * 3) == tiers.SAME_GPU
    assert tiers.choose(two, [True, True]) == tiers.P2P
    assert tiers.choose(two, [True, False]) == tiers.HOST  # any failed probe: host, everywhere
    assert tiers.choose(same, [True] * 3, "host") == tiers.HOST
    with pytest.raises(DeviceError, match="SHMCOLL_CUDA_TIER=ipc.*ranks \\[1\\]"):
        tiers.choose(two, [True, False], "ipc")
    with pytest.raises(ValueError, match="SHMCOLL_CUDA_TIER"):
        tiers.choose(two, [True, True], "fast")
    assert tiers.wants_ipc(same, 0, _Dev(False))  # one device needs no peer access
    assert not tiers.wants_ipc(two, 0, _Dev(False))
    assert tiers.wants_ipc(two, 0, _Dev(True))
    assert not tiers.wants_ipc(two, 0, _Dev(True), "host")
    with pytest.raises(DeviceError, match="different device kinds"):
        tiers.wants_ipc(_infos("a") + _infos("b", kind="sim"), 0, _Dev(True))
    info = tiers.DeviceInfo("cuda", "GPU-1|x", 3, "H100 | SXM")
    back = tiers.DeviceInfo.parse(info.render())
    assert (back.kind, back.uuid, back.index, back.name) == ("cuda", "GPU-1|x", 3, "H100 | SXM")


def _textbook_complex_mul():
    """Whether torch's complex64 multiply rounds as the host kernel does, (ac - bd, ad + bc)
    in float32, in every lane: torch 2.4's CPU kernel is one ulp off in the element its
    vector loop leaves over (the last of 257, with this pair there); torch 2.13's is not."""
    a = torch.full((257,), complex(-0.2117047, -0.50292957), dtype=torch.complex64)
    b = torch.full((257,), complex(-1.0363108, -1.3550628), dtype=torch.complex64)
    x, y = a.numpy(), b.numpy()
    real = x.real * y.real - x.imag * y.imag
    imag = x.real * y.imag + x.imag * y.real
    got = torch.mul(a, b).numpy()
    return bool(np.array_equal(got.real, real) and np.array_equal(got.imag, imag))


TEXTBOOK_COMPLEX_MUL = _textbook_complex_mul()


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int8", "complex64", "bool"])
@pytest.mark.parametrize("op", list(ReduceOp))
@pytest.mark.parametrize("nsrc", [1, 2, 3])
def test_reduce_matches_the_host_kernel(dtype, op, nsrc):
    """reduce_into (torch kernels) computes the same bytes as the host's numba kernel for
    every op and dtype it allows (fixed order, pre and post scaling; a complex product to
    one ulp where torch's complex multiply is not the textbook one: TEXTBOOK_COMPLEX_MUL)."""
    d = DTYPES[dtype]
    try:
        spec = reduce_spec(op, d, 3, premul=2.5)
    except TypeError:
        return  # the op is not defined for this dtype
    rng = np.random.default_rng(nsrc * 100 + int(op))
    srcs = [_random(rng, d.storage if dtype != "bool" else np.bool_, 257) for _ in range(nsrc)]
    want = srcs[0].view(d.storage).copy()
    reducers.reduce_into(want, np.array([s.ctypes.data for s in srcs], np.int64), spec.op,
                        spec.kind, spec.pre, spec.post)
    tsrcs = [torch.from_numpy(s.copy()) for s in srcs]
    out = torch.empty_like(tsrcs[0])
    reduce_into(out, tsrcs, spec)
    got = out.numpy().view(d.storage)
    if spec.kind in ("float", "complex") and (spec.pre != 1.0 or spec.post != 1.0):
        np.testing.assert_allclose(got, want, rtol=1e-6)  # a*x+b may fuse differently
    elif spec.kind == "complex" and op == ReduceOp.PRODUCT and not TEXTBOOK_COMPLEX_MUL:
        np.testing.assert_allclose(got, want, rtol=1e-6)
    else:
        assert got.tobytes() == want.tobytes(), (got[:5], want[:5])


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_half_precision_accumulates_in_float32_and_rounds_once(kind):
    """Three float16 inputs whose pairwise sums round: folding in float16 would round twice."""
    tdtype = torch.float16 if kind == "float16" else torch.bfloat16
    a = torch.tensor([2048.0, 1.0, 256.0], dtype=tdtype)
    b = torch.tensor([1.0, 2048.0, 1.0], dtype=tdtype)
    c = torch.tensor([1.0, 1.0, 1.0], dtype=tdtype)
    out = torch.empty_like(a)
    reduce_into(out, [a, b, c], reduce_spec(ReduceOp.SUM, DTYPES[kind], 3))
    want = (a.float() + b.float() + c.float()).to(tdtype)
    assert torch.equal(out, want), (out, want)
    twice = (a + b) + c
    assert not torch.equal(twice, want), "inputs chosen so that double rounding differs"


def _random(rng, storage, n):
    if storage == np.bool_:
        return rng.integers(0, 2, n).astype(np.uint8)
    if np.issubdtype(storage, np.integer):
        return rng.integers(-50, 50, n).astype(storage)
    if np.issubdtype(storage, np.complexfloating):
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(storage)
    return rng.standard_normal(n).astype(storage)


def test_config_validates_cuda_settings():
    assert config.from_env({"SHMCOLL_CUDA_TIER": "host"}).cuda_tier == "host"
    with pytest.raises(ValueError, match="SHMCOLL_CUDA_TIER"):
        config.from_env({"SHMCOLL_CUDA_TIER": "nvlink"})
    with pytest.raises(ValueError, match="SHMCOLL_CUDA_SIM"):
        config.from_env({"SHMCOLL_CUDA_SIM": "yes"})
    with pytest.raises(ValueError, match="SHMCOLL_CUDA_NSLOTS"):
        config.from_env({"SHMCOLL_CUDA_SLOT_BYTES": "1000"})
    assert not config.from_env({"SHMCOLL_CUDA_SIM_P2P": "0"}).cuda_sim_p2p


class _Request:
    """A stand-in engine p2p request, completed by the test."""

    op, error, source = "recv", None, 0

    def __init__(self):
        import threading
        self._done, self._callbacks = threading.Event(), []

    def add_done_callback(self, fn):
        self._callbacks.append(fn)

    def is_completed(self):
        return self._done.is_set()

    def wait(self, timeout_s=None):
        self._done.wait(timeout_s)

    def finish(self):
        """As the engine: the event first, then the callbacks (here: later, elsewhere)."""
        self._done.set()


def test_staged_receive_is_copied_in_before_wait_returns():
    """A CUDA recv is staged through a host tensor; its copy into the device tensor must be
    enqueued before work.wait() returns, even when the engine's completing thread has not
    yet run its callbacks (the engine sets its event first), and exactly once."""
    from shmcoll.torch_backend.p2p import P2PWork
    calls = []
    req = _Request()
    work = P2PWork("recv", req, [torch.zeros(1)], copy_in=lambda: calls.append("copy"))
    req.finish()
    assert work.wait()
    assert calls == ["copy"]
    for fn in req._callbacks:  # the completing thread catches up
        fn(req)
    assert calls == ["copy"] and work.get_future().wait()[0].shape == (1,)


# ------------------------------------------- the torch.distributed surface, device path

def _sim_env(**extra):
    env = dict(SIM)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _on_device_path(rank, ws, fn, *args):
    """fn, after checking that this group really routes tensors through cuda_ipc."""
    t = torch.ones(3)
    dist.all_reduce(t)
    pg = harness.made(dist.group.WORLD)
    assert ws == 1 or (pg._device is not None and pg._device.dg.arena is not None), \
        "SHMCOLL_CUDA_SIM did not route the tensors through cuda_ipc"
    return fn(rank, ws, *args)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_dist_collectives_on_the_device_path(world_size):
    """Every collective and dtype through dist.* (test_torch_backend's sweep), with small
    device slots so that messages are chunked and slots reused."""
    assert all(harness.run_torch_ranks(
        _on_device_path, world_size, "shm", JOB_TIMEOUT_S,
        args=(tb._dist_sweep, ALL_DTYPES + [torch.uint16]),
        env=_sim_env(SHMCOLL_CUDA_SLOT_BYTES=4096)))


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("job,world_size", [
    (tb._all_ops, 3), (tbpg._pg_direct, 2), (tbpg._strided, 2), (tbpg._strided, 3),
    (tbpg._lists, 2), (tb._every_dtype, 2)],
    ids=["ops", "pg_object", "strided2", "strided3", "lists", "dtypes"])
def test_torch_surface_on_the_device_path(job, world_size):
    assert all(harness.run_torch_ranks(_on_device_path, world_size, "shm", JOB_TIMEOUT_S,
                                       args=(job,), env=_sim_env()))


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_async_ops_and_futures_on_the_device_path():
    assert all(harness.run_torch_ranks(_on_device_path, 2, "shm", JOB_TIMEOUT_S,
                                       args=(tbpg._async_many, 100), env=_sim_env()))


def _under_a_default_device(rank, ws):
    """A caller's torch.set_default_device stays active inside the backend for direct
    ProcessGroup calls, C++ callers (DDP) and, on torch < 2.13, dist.broadcast & co (no
    __torch_function__ hook pops it): every tensor the backend makes must name its device.
    With "meta" as the default, one that does not is a meta tensor and the results break."""
    torch.set_default_device("meta")
    try:
        pg = dist.group.WORLD
        x = torch.full((5,), float(rank + 1), device="cpu")
        pg.allreduce([x], dist.AllreduceOptions()).wait()  # the group's first collective
        assert x.device.type == "cpu" and x.tolist() == [ws * (ws + 1) / 2] * 5, x
        b = torch.arange(6, dtype=torch.float32, device="cpu") * (1 if rank == 0 else -1)
        dist.broadcast(b, 0)
        assert b.tolist() == list(range(6)), b
        wide = torch.arange(12, dtype=torch.float32, device="cpu").view(3, 4)
        strided = wide.t()  # non-contiguous: the backend stages it in a temporary
        dist.all_reduce(strided)
        assert torch.equal(wide, torch.arange(12, dtype=torch.float32, device="cpu").view(3, 4)
                           * ws), wide
        out = [torch.empty(2, device="cpu") for _ in range(ws)]
        dist.all_gather(out, torch.full((2,), float(rank), device="cpu"))
        assert [o.tolist() for o in out] == [[float(r)] * 2 for r in range(ws)], out
        cols = torch.empty(2, ws, device="cpu")
        pg._allgather_base(cols.t(), torch.full((2,), float(rank), device="cpu")).wait()
        assert cols.t().tolist() == [[float(r)] * 2 for r in range(ws)], cols
        if ws >= 2:
            m = torch.full((3,), 7.0, device="cpu") if rank == 0 else torch.empty(3, device="cpu")
            if rank == 0:
                dist.send(m, 1)
            elif rank == 1:
                dist.recv(m, 0)
            assert m.tolist() == [7.0] * 3, m
        return True
    finally:
        torch.set_default_device(None)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("device_path", [True, False], ids=["device-path", "host"])
def test_a_callers_default_device_does_not_leak_into_the_backend(device_path):
    assert all(harness.run_torch_ranks(_under_a_default_device, 2, "shm", JOB_TIMEOUT_S,
                                       env=_sim_env() if device_path else None))


def test_factories_in_the_backend_name_their_device():
    """Static companion of the test above, for code only a GPU runs (cuda_ipc/cuda.py's
    pinned read, p2p's pinned staging buffer): torch factory calls in the adapter and in
    cuda_ipc pass device=, so a caller's default device never chooses for them."""
    import ast
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1]
    factories = {"empty", "zeros", "ones", "full", "arange", "tensor", "rand", "randn",
                 "empty_strided", "linspace"}
    missing = []
    for d in ("cuda_ipc", "shmcoll/torch_backend", "threaded_pg"):
        for path in sorted((root / d).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in factories
                        and isinstance(node.func.value, ast.Name)
                        and node.func.value.id == "torch"
                        and not any(k.arg == "device" for k in node.keywords)):
                    missing.append(f"{path.relative_to(root)}:{node.lineno} torch."
                                   f"{node.func.attr}")
    assert not missing, "factory calls without device=: " + ", ".join(missing)


def _large(rank, ws):
    """Messages of many chunks (4 KiB slots): all_reduce in bf16 and f32, reduce_scatter,
    all_gather, all_to_all with uneven splits (also in place), results exact."""
    n = 3 * 4096 + 7
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        x = torch.arange(n, dtype=torch.int64) % 13
        t = (x + rank).to(dtype)
        dist.all_reduce(t)
        assert_same(t, (x * ws + sum(range(ws))).to(dtype), f"all_reduce {dtype}")
    blocks = torch.arange(ws * n, dtype=torch.float32) % 7 + rank
    out = torch.empty(n)
    dist.reduce_scatter_tensor(out, blocks)
    want = (torch.arange(ws * n, dtype=torch.float32) % 7)[rank * n:(rank + 1) * n] * ws \
        + sum(range(ws))
    assert_same(out, want, "reduce_scatter_tensor")
    gathered = torch.empty(ws * n, dtype=torch.int16)
    dist.all_gather_into_tensor(gathered, torch.full((n,), rank, dtype=torch.int16))
    assert_same(gathered, torch.arange(ws, dtype=torch.int16).repeat_interleave(n), "all_gather")
    sends = [1000 * (rank + 1) + 37 * j for j in range(ws)]
    recvs = [1000 * (j + 1) + 37 * rank for j in range(ws)]
    inp = torch.cat([torch.full((s,), float(rank * 10 + j)) for j, s in enumerate(sends)])
    out = torch.empty(sum(recvs))
    dist.all_to_all_single(out, inp, recvs, sends)
    want = torch.cat([torch.full((r,), float(j * 10 + rank)) for j, r in enumerate(recvs)])
    assert_same(out, want, "all_to_all_single uneven")
    # in place, uneven: rank s sends 1000 + 600 ((d - s) mod ws) to rank d, so input and
    # output have one length but each piece lands at another offset than it left from,
    # and the chunks would overwrite bytes not yet sent
    sends = [1000 + 600 * ((j - rank) % ws) for j in range(ws)]
    recvs = [1000 + 600 * ((rank - j) % ws) for j in range(ws)]
    t = torch.cat([torch.full((s,), float(rank * 10 + j)) for j, s in enumerate(sends)])
    dist.all_to_all_single(t, t, recvs, sends)
    want = torch.cat([torch.full((r,), float(j * 10 + rank)) for j, r in enumerate(recvs)])
    assert_same(t, want, "all_to_all_single uneven, in place")
    return True


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tier", ["same_gpu", "p2p", "host"])
def test_chunked_collectives_in_every_tier(tier):
    """The same results whichever tier the ranks agree on; the tier is the expected one."""
    env = _sim_env(SHMCOLL_CUDA_SLOT_BYTES=4096, SHMCOLL_CUDA_HOST_SLOT_BYTES=8192)
    if tier == "host":
        env["SHMCOLL_CUDA_SIM_P2P"] = "0"
    assert harness.run_ranks(_tiered, 3, "processes", JOB_TIMEOUT_S, args=(tier,),
                             env=env) == [tier] * 3


def _tiered(rank, ws, store, tier):
    import shmcoll  # noqa: F401  (registers "shm")
    if tier != "same_gpu":  # one simulated device per rank (read when the group is built)
        os.environ["SHMCOLL_CUDA_SIM_DEVICE"] = str(rank)
    try:
        dist.init_process_group("shm", init_method=f"file://{store.path}/rdv", rank=rank,
                                world_size=ws)
        try:
            _large(rank, ws)
            return harness.made(dist.group.WORLD)._device.dg.tier
        finally:
            dist.destroy_process_group()
    finally:
        os.environ.pop("SHMCOLL_CUDA_SIM_DEVICE", None)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_mismatched_device_and_host_calls_raise_on_every_rank():
    """Rank 0 all_reduces a device tensor where rank 1 all_reduces a host one: a
    CollectiveMismatchError on both naming both calls, and the group stays usable."""
    out = harness.run_ranks(_mismatch, 2, "processes", JOB_TIMEOUT_S)
    dev, host = "device all_reduce(float32, count=4, op=SUM)", "all_reduce(float32, count=4, op=SUM)"
    assert out[0].endswith(f"rank 0 called {dev} but rank 1 called {host}"), out[0]
    assert out[1].endswith(f"rank 1 called {host} but rank 0 called {dev}"), out[1]


def _mismatch(rank, ws, store):
    from shmcoll.errors import CollectiveMismatchError
    import cuda_ipc
    from cuda_ipc.group import DeviceGroup
    from cuda_ipc.rendezvous import ProcessRendezvous
    group = harness.new_group(store, rank, ws)
    cfg = config.from_env({"SHMCOLL_CUDA_SIM": "inline"})
    dev = cuda_ipc.get_device(torch.device("cpu"), cfg)
    dg = DeviceGroup(group, dev, lambda: ProcessRendezvous(
        store, rank, ws, group._arena._pids, 30.0), cfg)
    try:
        t = torch.ones(4)
        dg.all_reduce(t, "float32", ReduceOp.SUM)  # the arena is built by both ranks
        try:
            if rank == 0:
                dg.all_reduce(t, "float32", ReduceOp.SUM)
            else:
                group.all_reduce(np.ones(4, np.float32))
        except CollectiveMismatchError as e:
            msg = str(e)
        else:
            raise AssertionError("no mismatch raised")
        t = torch.full((4,), float(rank))
        dg.all_reduce(t, "float32", ReduceOp.SUM)  # still usable
        assert torch.equal(t, torch.full((4,), 1.0)), t
        return msg
    finally:
        group.close()


def _threaded_job(rank, ws):
    pg = dist.group.WORLD
    _large(rank, ws)
    tb._dist_sweep(rank, ws, [torch.float32, torch.bfloat16, torch.int64])
    assert pg._device is not None and pg._device.dg.tier == "same_gpu"
    return True


@pytest.mark.timeout(300)
def test_threaded_pg_ranks_share_device_memory_by_pointer(monkeypatch):
    """threaded_pg rank threads take the device path too (one process: the peers'
    allocations are used directly, no IPC handle is opened -- the simulated device refuses
    to open a handle in the exporting process, as CUDA does)."""
    import threaded_pg
    monkeypatch.setenv("SHMCOLL_CUDA_SIM", "inline")
    monkeypatch.setenv("SHMCOLL_CUDA_SLOT_BYTES", "4096")
    assert threaded_pg.spawn(_threaded_job, 3, timeout=240) == [True] * 3


def _ddp(rank, ws, steps):
    """DDP (async gradient buckets, futures, broadcast at construction) on the device path:
    every rank ends with the same parameters as one process training on the whole batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    reference = [p.detach().clone() for p in model.parameters()]
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0005)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = torch.randn(steps, ws, 5, 8, generator=torch.Generator().manual_seed(1))
    for s in range(steps):
        opt.zero_grad()
        ddp(data[s, rank]).square().mean().backward()
        opt.step()
    params = [p.detach().clone() for p in ddp.parameters()]
    single = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        for p, r in zip(single.parameters(), reference):
            p.copy_(r)
    sopt = torch.optim.SGD(single.parameters(), lr=0.1)
    for s in range(steps):
        sopt.zero_grad()
        single(data[s].reshape(-1, 8)).square().mean().backward()
        sopt.step()
    for p, q in zip(params, single.parameters()):
        assert torch.allclose(p, q, atol=1e-6), (p - q).abs().max()
    gathered = [None] * ws
    dist.all_gather_object(gathered, [p.tolist() for p in params])
    assert all(g == gathered[0] for g in gathered), "ranks differ"
    return True


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_ddp_on_the_device_path():
    assert all(harness.run_torch_ranks(_on_device_path, 2, "shm", JOB_TIMEOUT_S,
                                       args=(_ddp, 5), env=_sim_env()))


def _device_across_nodes(rank, ws):
    try:
        dist.all_reduce(torch.ones(4))
    except RuntimeError as e:
        return str(e)
    return "no error"


def _node_job(rank, ws, store, timeout_s):
    with harness.patched_environ({"SHMCOLL_NODE_ID": "ab"[rank], **SIM}):
        return harness._torch_job(rank, ws, store, _device_across_nodes, "shm", "file", 0,
                                  timeout_s, ())


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_device_tensors_in_a_group_across_nodes_are_refused_clearly():
    """A group spanning (simulated) nodes: device tensors get a clear error at the call on
    every rank (cuda_ipc serves one node), not a hang or a wrong path."""
    out = harness.run_ranks(_node_job, 2, "processes", JOB_TIMEOUT_S, args=(60,))
    assert all("spans 2 nodes" in m and "within one node" in m for m in out), out
