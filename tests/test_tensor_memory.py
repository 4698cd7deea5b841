"""The adapter takes a tensor's memory without changing the tensor (issue 15).

`Tensor.numpy()` marks a tensor's storage non-resizable for good. Taking numpy views that way
made every user tensor unresizable after its first collective, and FSDP1 crashed at its
first forward (it frees all-gather buffers with `storage.resize_(0)`). gloo leaves tensors
resizable. This file checks, on "shm" processes and on "threaded" ranks, that after every
kind of call (latency path, general path, async, strided, bfloat16, lists, point-to-point)
each tensor the call touched is still resizable, and still holds the right result. It also
checks the lifetime rules in convert.py (an array keeps its tensor alive; a cached
latency-path array keeps nothing alive), and that lazily conjugated or negated views,
whose memory does not hold their values, are refused at the call.
"""

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

import harness
import threaded_pg
from shmcoll.torch_backend import convert

pytestmark = [pytest.mark.torch, pytest.mark.timeout(300)]

JOB_TIMEOUT_S = 120


def _calls(rank, world_size):
    """Every adapter path once; returns [(what, tensor)] of the tensors the calls touched,
    each checked for its value here."""
    touched = []

    def keep(what, t, want=None):
        if want is not None:
            assert torch.equal(t, want), f"{what}: got {t}, expected {want}"
        touched.append((what, t))

    n = world_size
    total = float(sum(range(1, n + 1)))
    t = torch.full((8,), rank + 1.0)
    dist.all_reduce(t)  # latency path (fast.py)
    keep("sync all_reduce", t, torch.full((8,), total))
    t = torch.full((8,), rank + 1.0)
    dist.all_reduce(t, async_op=True).wait()  # general path (process_group.py)
    keep("async all_reduce", t, torch.full((8,), total))
    base = torch.full((16,), rank + 1.0)
    dist.all_reduce(base[::2])  # strided: general path, numpy strides
    keep("strided all_reduce", base, torch.tensor([total, rank + 1.0] * 8))
    b = torch.full((4,), rank + 1.0, dtype=torch.bfloat16)
    dist.all_reduce(b)  # bfloat16 as its uint16 bits
    keep("bfloat16 all_reduce", b, torch.full((4,), total, dtype=torch.bfloat16))
    t = torch.full((4,), float(rank))
    dist.broadcast(t, src=1)
    keep("broadcast", t, torch.ones(4))
    out, inp = torch.zeros(4 * n), torch.full((4,), float(rank))
    dist.all_gather_into_tensor(out, inp)
    keep("all_gather_into_tensor out", out,
         torch.arange(n, dtype=torch.float32).repeat_interleave(4))
    keep("all_gather_into_tensor in", inp)
    out, inp = torch.zeros(2), torch.ones(2 * n)
    dist.reduce_scatter_tensor(out, inp)
    keep("reduce_scatter_tensor out", out, torch.full((2,), float(n)))
    keep("reduce_scatter_tensor in", inp)
    outs = [torch.zeros(3) for _ in range(n)]
    dist.all_gather(outs, torch.full((3,), float(rank)))
    for r, o in enumerate(outs):
        keep(f"all_gather list [{r}]", o, torch.full((3,), float(r)))
    ins = [torch.full((2,), float(rank + j)) for j in range(n)]
    out = torch.zeros(2)
    dist.reduce_scatter(out, ins)
    keep("reduce_scatter list out", out, torch.full((2,), float(sum(r + rank for r in range(n)))))
    for j, i in enumerate(ins):
        keep(f"reduce_scatter list in [{j}]", i)
    lst = [torch.full((2,), rank + 1.0), torch.full((3,), rank + 2.0)]
    dist.all_reduce_coalesced(lst)
    keep("all_reduce_coalesced [0]", lst[0], torch.full((2,), total))
    out, inp = torch.zeros(2 * n), torch.arange(2.0 * n) + 10 * rank
    dist.all_to_all_single(out, inp)
    keep("all_to_all_single", out, torch.cat(
        [torch.arange(2.0 * rank, 2.0 * rank + 2) + 10 * r for r in range(n)]))
    t = torch.full((5,), rank + 1.0)
    if rank == 0:
        dist.send(t, dst=1)
    elif rank == 1:
        dist.recv(t, src=0)
        keep("recv", t, torch.ones(5))
    keep("send/recv", t)
    p = torch.nn.Parameter(torch.full((3,), rank + 1.0))  # requires_grad: detached view
    dist.all_reduce(p.data)
    dist.all_reduce(p.detach(), async_op=True).wait()
    keep("parameter", p.data)
    return touched


def _check_resizable(rank, world_size):
    for what, t in _calls(rank, world_size):
        storage = t.untyped_storage()
        assert storage.resizable(), f"{what}: the collective pinned the tensor's storage"
    t = torch.zeros(8)
    dist.all_reduce(t)
    t.untyped_storage().resize_(0)  # the reproducer, what FSDP1 does
    t = torch.zeros(8)
    dist.all_reduce(t, async_op=True).wait()
    t.resize_(64)
    return True


def test_tensors_stay_resizable_on_shm_processes():
    assert harness.run_torch_ranks(_check_resizable, 2, "shm", JOB_TIMEOUT_S) == [True, True]


def test_tensors_stay_resizable_on_threaded_ranks():
    assert threaded_pg.spawn(_check_resizable, 2) == [True, True]


def test_general_path_array_keeps_its_tensor_alive():
    """A job may hold only arrays of temporary views (reduce_scatter's input chunks): an
    array must keep its tensor's memory alive, and leave the tensor resizable."""
    t = torch.arange(6.0).reshape(2, 3)[:, ::2]  # strided view of a temporary
    ref = weakref.ref(t)
    array, name = convert.as_array(t)
    del t
    gc.collect()
    assert ref() is not None, "the array does not keep its tensor alive"
    assert name == "float32" and array.tolist() == [[0.0, 2.0], [3.0, 5.0]]
    array[1, 1] = 50.0
    assert ref()[1, 1].item() == 50.0, "the array does not share the tensor's memory"
    assert ref().untyped_storage().resizable()
    del array
    gc.collect()
    assert ref() is None, "the tensor outlived its array"


def test_latency_path_array_is_cached_and_references_no_tensor():
    """plain_array: cached per (address, dtype, shape), it reads whatever live tensor
    occupies that memory, and keeps no tensor alive (convert.py says why that is safe)."""
    t = torch.arange(4.0)
    first = convert.plain_array(t)
    assert convert.plain_array(t) is first
    assert first.tolist() == [0.0, 1.0, 2.0, 3.0]
    t.add_(1)
    assert first.tolist() == [1.0, 2.0, 3.0, 4.0], "not a view of the tensor's memory"
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is None, "the cached array keeps its tensor alive"
    other = torch.arange(4, dtype=torch.int32)
    assert convert.plain_array(other).tolist() == [0, 1, 2, 3]  # dtype is part of the key
    for dtype in (torch.float16, torch.float64, torch.int8, torch.uint8, torch.int16,
                  torch.int64, torch.bool, torch.complex64, torch.complex128):
        x = torch.ones(3, dtype=dtype)
        assert convert.plain_array(x).tolist() == x.tolist(), dtype


def test_byte_views_of_other_dtypes():
    """Byte-moving collectives view any other dtype as same-width integers."""
    x = torch.tensor([1.5, -2.0], dtype=torch.float32).to(torch.float8_e4m3fn)
    array, name = convert.as_array(x, for_reduce=False)
    assert name is None and array.dtype.itemsize == 1
    assert array.tobytes() == x.view(torch.uint8).numpy().tobytes()
    with pytest.raises(TypeError, match="not supported for reductions"):
        convert.as_array(x)


def _lazy_views(rank, world_size):
    z = torch.tensor([1 + 2j, 3 + 4j]) * (rank + 1)
    errors = []
    for what, call in (
            ("negated", lambda: dist.all_reduce(z.conj().imag, op=dist.ReduceOp.MAX)),
            ("negated", lambda: dist.all_reduce(torch._neg_view(torch.ones(1)))),
            ("conjugated", lambda: dist.group.WORLD.broadcast([z.conj()], 0).wait())):
        try:
            call()
        except RuntimeError as e:
            assert f"lazily {what} view" in str(e), str(e)
            errors.append(what)
    t = torch.ones(2)
    dist.all_reduce(t)  # the group stays usable
    return errors, t.tolist()


def test_lazy_conjugate_and_negative_views_are_refused_at_the_call():
    """Their memory holds the un-negated values: reducing it would be silently wrong
    (MAX of negated values); gloo gives the wrong answer here, we a clear error."""
    for result in harness.run_torch_ranks(_lazy_views, 2, "shm", JOB_TIMEOUT_S):
        assert result == (["negated", "negated", "conjugated"], [2.0, 2.0])
