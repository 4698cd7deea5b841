"""One small spec per collective: sizes, inputs, the call itself, exact verification, bus factor.

Conventions (the same as nccl-tests):

* ``count`` is the number of elements of the *largest* buffer of the op, and ``nbytes`` is
  ``count * itemsize``: the whole buffer for all_reduce / broadcast / reduce, the gathered
  output for all_gather, the input for reduce_scatter, and the send buffer for all_to_all.
  Ops that split the buffer between ranks need ``count`` to be a multiple of the world size;
  ``count_for`` rounds down (and up to at least one element per rank).
* ``algbw = nbytes / time`` and ``busbw = algbw * busbw_factor(world_size)``.

Data: every rank's input is a deterministic function of (rank, seed, element index): small
positive integers (1..vmax) looked up in a pseudo-random table of ``PERIOD`` entries (a
prime), so that

* every sum the backend may form, in any order, is an integer representable exactly in the
  dtype (``vmax`` is chosen from the dtype and world size), hence results compare *exactly*;
* a missing or doubled contribution always changes an element (values are >= 1);
* a block written at the wrong offset is caught unless the offset error is a multiple of
  ``PERIOD`` (65521), which chunk sizes of power-of-two buffers never are;
* outputs are poisoned (NaN, or 0 for integers, never a valid value) before every
  iteration, so an op that silently does nothing cannot pass on stale data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

PERIOD = 65521  # largest prime below 2**16
_CHECK_CHUNK = 1 << 24  # elements compared per step, bounds the temporary bool mask

# The non-deprecated names where this torch has them (all_gather_into_tensor and
# reduce_scatter_tensor emit a FutureWarning per call in recent torch, which would add
# Python warning machinery to every timed call); both resolve to the same public API.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Largest integer N such that every integer in [0, N] is exactly representable.
_EXACT_INT_LIMIT = {
    torch.float16: 2**11,
    torch.bfloat16: 2**8,
    torch.float32: 2**24,
    torch.float64: 2**53,
    torch.int8: 2**7 - 1,
    torch.uint8: 2**8 - 1,
    torch.int16: 2**15 - 1,
    torch.int32: 2**31 - 1,
    torch.int64: 2**63 - 1,
}

DTYPES = {
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float64": torch.float64, "double": torch.float64, "fp64": torch.float64,
    "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16,
    "int32": torch.int32, "int": torch.int32, "int64": torch.int64, "long": torch.int64,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def max_value(dtype: torch.dtype, world_size: int) -> int:
    """Largest input value such that a sum over ``world_size`` ranks stays exact in ``dtype``."""
    limit = _EXACT_INT_LIMIT[dtype]
    vmax = min(15, limit // world_size)
    if vmax < 1:
        raise ValueError(f"{dtype_name(dtype)} cannot hold a sum over {world_size} ranks exactly")
    return vmax


def poison_value(dtype: torch.dtype):
    """A value no correct output ever contains (inputs and sums are >= 1)."""
    return float("nan") if dtype.is_floating_point else 0


def table(seed: int, key: int, vmax: int) -> torch.Tensor:
    """PERIOD pseudo-random int64 values in [1, vmax], a pure function of (seed, key)."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + key * 7_919 + 12_345) % (2**62))
    return torch.randint(1, vmax + 1, (PERIOD,), generator=g, dtype=torch.int64)


def copy_plan(args, plan_iterations):
    """The memcpy peer's sweep, the same on the host (peers.py) and on a device
    (device.py): (dtype, the source table, [(count, nbytes, warmup, iters) per size])."""
    dtype = DTYPES[args.dtype]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    tab = table(args.seed, -7, max_value(dtype, 1))
    plan = []
    for req in args.sizes:
        count = max(1, req // itemsize)
        nbytes = count * itemsize
        plan.append((count, nbytes) + tuple(plan_iterations(
            nbytes, args.iters, args.warmup, args.iter_bytes, args.min_iters)))
    return dtype, tab, plan


def tiled(tab: torch.Tensor, start: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """A new contiguous tensor ``t[j] = tab[(start + j) % PERIOD]`` for j in [0, length)."""
    out = torch.empty(length, dtype=dtype)
    if length == 0:
        return out
    s = start % PERIOD
    first = torch.cat([tab[s:], tab[:s]]).to(dtype)
    m = min(PERIOD, length)
    out[:m].copy_(first[:m])
    while m < length:  # m stays a multiple of PERIOD, so doubling keeps the pattern
        k = min(m, length - m)
        out[m:m + k].copy_(out[:k])
        m += k
    return out


def count_wrong(out: torch.Tensor, expected: torch.Tensor) -> int:
    """Number of elements of ``out`` that differ from ``expected`` (NaN counts as wrong)."""
    a, b = out.reshape(-1), expected.reshape(-1)
    if a.numel() != b.numel():
        return max(a.numel(), b.numel())
    wrong = 0
    for i in range(0, a.numel(), _CHECK_CHUNK):
        wrong += int(torch.ne(a[i:i + _CHECK_CHUNK], b[i:i + _CHECK_CHUNK]).sum())
    return wrong


@dataclass
class Buffers:
    """The tensors of one rank for one (op, count).

    ``inp``/``out`` are what the collective is called with (the same tensor for in-place
    ops). ``pristine`` is a copy of the input that ``reset`` restores into ``inp`` before
    every iteration (in-place ops destroy their input; with --fresh-inputs every op's input
    is rewritten so); ``reset`` poisons ``out`` unless it is the restored input.
    ``expected`` is what ``out`` must equal afterwards, or None if this rank has nothing to
    check (non-root ranks of reduce).
    """

    inp: torch.Tensor
    out: torch.Tensor
    expected: Optional[torch.Tensor]
    pristine: Optional[torch.Tensor] = None
    root: int = 0

    def reset(self) -> None:
        if self.pristine is not None:
            self.inp.copy_(self.pristine)
        if self.pristine is None or self.out is not self.inp:
            self.out.fill_(poison_value(self.out.dtype))

    def corrupt(self) -> None:
        """Self-test hook (--inject-error): damage one checked output element."""
        if self.expected is not None and self.out.numel():
            flat = self.out.view(-1)
            flat[flat.numel() // 2] += 1


class Collective:
    """Base spec; subclasses fill in ``build`` and ``run``."""

    name = "?"
    splits = False  # True when the buffer is divided into world_size chunks

    def busbw_factor(self, world_size: int) -> float:
        raise NotImplementedError

    def count_for(self, nbytes: int, itemsize: int, world_size: int) -> int:
        count = max(1, nbytes // itemsize)
        if self.splits:
            count = max(world_size, count - count % world_size)
        return count

    def nbytes_for(self, count: int, itemsize: int) -> int:
        return count * itemsize

    def build(self, count: int, rank: int, world_size: int, dtype: torch.dtype,
              seed: int, root: int = 0) -> Buffers:
        raise NotImplementedError

    def run(self, buf: Buffers, group=None, async_op: bool = False):
        raise NotImplementedError

    def check(self, buf: Buffers) -> int:
        if buf.expected is None:
            return 0
        return count_wrong(buf.out, buf.expected)

    # helpers -------------------------------------------------------------------------
    @staticmethod
    def _rank_tables(seed, world_size, vmax):
        return [table(seed, r, vmax) for r in range(world_size)]

    @staticmethod
    def _sum_table(seed, world_size, vmax):
        total = torch.zeros(PERIOD, dtype=torch.int64)
        for r in range(world_size):
            total += table(seed, r, vmax)
        return total


class AllReduce(Collective):
    name = "all_reduce"

    def busbw_factor(self, world_size):
        return 2.0 * (world_size - 1) / world_size

    def build(self, count, rank, world_size, dtype, seed, root=0):
        vmax = max_value(dtype, world_size)
        pristine = tiled(table(seed, rank, vmax), 0, count, dtype)
        buf = torch.empty_like(pristine)
        expected = tiled(self._sum_table(seed, world_size, vmax), 0, count, dtype)
        return Buffers(inp=buf, out=buf, expected=expected, pristine=pristine)

    def run(self, buf, group=None, async_op=False):
        return dist.all_reduce(buf.out, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


class Reduce(Collective):
    name = "reduce"

    def busbw_factor(self, world_size):
        return 1.0

    def build(self, count, rank, world_size, dtype, seed, root=0):
        vmax = max_value(dtype, world_size)
        pristine = tiled(table(seed, rank, vmax), 0, count, dtype)
        buf = torch.empty_like(pristine)
        expected = None
        if rank == root:
            expected = tiled(self._sum_table(seed, world_size, vmax), 0, count, dtype)
        return Buffers(inp=buf, out=buf, expected=expected, pristine=pristine, root=root)

    def run(self, buf, group=None, async_op=False):
        return dist.reduce(buf.out, dst=buf.root, op=dist.ReduceOp.SUM, group=group,
                           async_op=async_op)


class Broadcast(Collective):
    name = "broadcast"

    def busbw_factor(self, world_size):
        return 1.0

    def build(self, count, rank, world_size, dtype, seed, root=0):
        data = tiled(table(seed, root, max_value(dtype, 1)), 0, count, dtype)
        buf = torch.empty_like(data)
        # root: restore its data each iteration; others: poison their buffer each iteration.
        return Buffers(inp=buf, out=buf, expected=data,
                       pristine=data if rank == root else None, root=root)

    def run(self, buf, group=None, async_op=False):
        return dist.broadcast(buf.out, src=buf.root, group=group, async_op=async_op)


class AllGather(Collective):
    name = "all_gather"
    splits = True

    def busbw_factor(self, world_size):
        return (world_size - 1) / world_size

    def build(self, count, rank, world_size, dtype, seed, root=0):
        chunk = count // world_size
        tab = table(seed, -1, max_value(dtype, 1))  # one global pattern, indexed globally
        inp = tiled(tab, rank * chunk, chunk, dtype)
        out = torch.empty(count, dtype=dtype)
        return Buffers(inp=inp, out=out, expected=tiled(tab, 0, count, dtype))

    def run(self, buf, group=None, async_op=False):
        return _all_gather_tensor(buf.out, buf.inp, group=group, async_op=async_op)


class ReduceScatter(Collective):
    name = "reduce_scatter"
    splits = True

    def busbw_factor(self, world_size):
        return (world_size - 1) / world_size

    def build(self, count, rank, world_size, dtype, seed, root=0):
        chunk = count // world_size
        vmax = max_value(dtype, world_size)
        inp = tiled(table(seed, rank, vmax), 0, count, dtype)
        out = torch.empty(chunk, dtype=dtype)
        expected = tiled(self._sum_table(seed, world_size, vmax), rank * chunk, chunk, dtype)
        return Buffers(inp=inp, out=out, expected=expected)

    def run(self, buf, group=None, async_op=False):
        return _reduce_scatter_tensor(buf.out, buf.inp, op=dist.ReduceOp.SUM, group=group,
                                      async_op=async_op)


class AllToAll(Collective):
    name = "all_to_all"
    splits = True

    def busbw_factor(self, world_size):
        return (world_size - 1) / world_size

    def build(self, count, rank, world_size, dtype, seed, root=0):
        chunk = count // world_size
        vmax = max_value(dtype, 1)
        tabs = self._rank_tables(seed, world_size, vmax)
        inp = tiled(tabs[rank], 0, count, dtype)  # chunk q goes to rank q
        out = torch.empty(count, dtype=dtype)
        expected = torch.empty(count, dtype=dtype)
        for q in range(world_size):  # chunk q comes from rank q's chunk `rank`
            expected[q * chunk:(q + 1) * chunk] = tiled(tabs[q], rank * chunk, chunk, dtype)
        return Buffers(inp=inp, out=out, expected=expected)

    def run(self, buf, group=None, async_op=False):
        return dist.all_to_all_single(buf.out, buf.inp, group=group, async_op=async_op)


COLLECTIVES = {c.name: c for c in (AllReduce(), Broadcast(), AllGather(), ReduceScatter(),
                                    Reduce(), AllToAll())}


def get(name: str) -> Collective:
    key = name.strip().lower().replace("-", "_")
    key = {"allreduce": "all_reduce", "allgather": "all_gather", "alltoall": "all_to_all",
           "reducescatter": "reduce_scatter", "bcast": "broadcast"}.get(key, key)
    try:
        return COLLECTIVES[key]
    except KeyError:
        raise ValueError(f"unknown op {name!r}; choose from {', '.join(COLLECTIVES)}") from None
