"""Collectives whose output shares memory with their input, the idioms users write:
all_to_all in place (`dist.all_to_all_single(t, t)`, the list form with outs[j] is ins[j]),
all_gather with the input a view of its own block of the output (FSDP2's and ZeRO's
all_gather), reduce_scatter into its own block of the input, gather and scatter whose root
passes its own block as both. Every transport: messages riding in the slot, read from the
peers' buffers (single copy at 3 ranks, where a peer reads my input while I write my
output), and streamed through the slot after the table (2 ranks, or single copy off; a
later step reads what an earlier one may have written). Each result must equal the
out-of-place one.
"""

import functools

import numpy as np
import pytest

import harness
from cases import assert_rank_results, group_cases, SMALL_SLOT_BYTES, SMALL_SLOT_ENV

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

JOB_TIMEOUT_S = 300
# elements of int64 per block: one that rides in the 64 KiB test slot, two that do not
COUNTS = (5, 3 * SMALL_SLOT_BYTES // 8 // 2, 5 * SMALL_SLOT_BYTES // 8)


def _value(src, dst, n):
    """The block rank `src` sends rank `dst` (distinct everywhere)."""
    return np.arange(n, dtype=np.int64) * 7 + 1_000_003 * src + 1009 * dst + 1


def _sizes(count, ws):
    """Uneven block sizes n[s][d] that keep every rank's input and output one length, as
    an in-place call of the one-array form needs, but move each block to another offset
    (n[s][d] depends on (d - s) mod ws: n[s][d] != n[d][s])."""
    return [[count + (d - s) % ws * (count // 3 + 1) for d in range(ws)] for s in range(ws)]


def _symmetric_sizes(count, ws):
    """Uneven block sizes with n[s][d] == n[d][s], as outs[j] is ins[j] needs."""
    return [[count + (s + d) % 3 * (count // 3 + 1) for d in range(ws)] for s in range(ws)]


def _a2a_single(group, count, uneven):
    ws, rank = group.world_size, group.rank
    n = _sizes(count, ws) if uneven else [[count] * ws for _ in range(ws)]
    buf = np.concatenate([_value(rank, d, n[rank][d]) for d in range(ws)])
    counts = [n[s][rank] for s in range(ws)] if uneven else None
    group.all_to_all_single(buf, buf, counts, n[rank] if uneven else None)
    np.testing.assert_array_equal(
        buf, np.concatenate([_value(s, rank, n[s][rank]) for s in range(ws)]),
        err_msg="all_to_all_single(t, t)")


def _a2a_lists(group, count):
    ws, rank = group.world_size, group.rank
    n = _symmetric_sizes(count, ws)
    blocks = [_value(rank, d, n[rank][d]) for d in range(ws)]
    group.all_to_all(blocks, blocks)  # outs[j] is ins[j]
    for s in range(ws):
        np.testing.assert_array_equal(blocks[s], _value(s, rank, n[s][rank]),
                                      err_msg=f"all_to_all(outs is ins), from rank {s}")


def _a2a_one_buffer_lists(group, count):
    """The list form over pieces of one buffer, outputs and inputs the same pieces."""
    ws, rank = group.world_size, group.rank
    buf = np.concatenate([_value(rank, d, count) for d in range(ws)])
    pieces = np.split(buf, ws)
    group.all_to_all(pieces, pieces)
    np.testing.assert_array_equal(
        buf, np.concatenate([_value(s, rank, count) for s in range(ws)]),
        err_msg="all_to_all over pieces of one buffer")


def _all_gather_own_block(group, count):
    ws, rank = group.world_size, group.rank
    out = np.zeros(ws * count, np.int64)
    mine = out[rank * count:(rank + 1) * count]
    mine[:] = _value(rank, 0, count)
    group.all_gather(out, mine)
    np.testing.assert_array_equal(out, np.concatenate([_value(s, 0, count) for s in range(ws)]),
                                  err_msg="all_gather(out, out[rank block])")
    outs = [np.zeros(count, np.int64) for _ in range(ws)]
    outs[rank][:] = _value(rank, 1, count)
    group.all_gather(outs, outs[rank])
    for s in range(ws):
        np.testing.assert_array_equal(outs[s], _value(s, 1, count),
                                      err_msg=f"all_gather(outs, outs[rank]), from rank {s}")


def _reduce_scatter_own_block(group, count):
    ws, rank = group.world_size, group.rank
    buf = np.concatenate([_value(rank, d, count) for d in range(ws)])
    out = buf[rank * count:(rank + 1) * count]
    group.reduce_scatter(out, buf)
    np.testing.assert_array_equal(out, sum(_value(s, rank, count) for s in range(ws)),
                                  err_msg="reduce_scatter(in[rank block], in)")
    blocks = [_value(rank, d, count) for d in range(ws)]
    group.reduce_scatter(blocks[rank], blocks)  # the list form, into its own input
    np.testing.assert_array_equal(blocks[rank], sum(_value(s, rank, count) for s in range(ws)),
                                  err_msg="reduce_scatter(ins[rank], ins)")


def _gather_scatter_own_block(group, count):
    ws, rank = group.world_size, group.rank
    root = ws - 1
    blocks = [np.zeros(count, np.int64) for _ in range(ws)]
    mine = blocks[rank] if rank == root else np.zeros(count, np.int64)
    mine[:] = _value(rank, root, count)
    group.gather(mine, blocks if rank == root else None, root)
    if rank == root:
        for s in range(ws):
            np.testing.assert_array_equal(blocks[s], _value(s, root, count),
                                          err_msg=f"gather(outs[root] is in), from rank {s}")
        for d in range(ws):
            blocks[d][:] = _value(root, d, count)
    out = blocks[rank] if rank == root else np.zeros(count, np.int64)
    group.scatter(out, blocks if rank == root else None, root)
    np.testing.assert_array_equal(out, _value(root, rank, count),
                                  err_msg="scatter(out is ins[root])")


@group_cases
def _sweep(group, rank, world_size):
    cases = []
    for count in COUNTS:
        for name, fn in (("all_to_all_single in place", functools.partial(_a2a_single,
                                                                           uneven=False)),
                         ("all_to_all_single in place, uneven",
                          functools.partial(_a2a_single, uneven=True)),
                         ("all_to_all outs is ins", _a2a_lists),
                         ("all_to_all over one buffer's pieces", _a2a_one_buffer_lists),
                         ("all_gather from its own block", _all_gather_own_block),
                         ("reduce_scatter into its own block", _reduce_scatter_own_block),
                         ("gather and scatter, the root's own block",
                          _gather_scatter_own_block)):
            cases.append((f"{name}, {count} per block", functools.partial(fn, group, count)))
    return cases


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("single_copy", ["auto", "off"])
def test_output_sharing_memory_with_input(kind, world_size, single_copy):
    results = harness.run_ranks(_sweep, world_size, kind, timeout_s=JOB_TIMEOUT_S,
                                env=dict(SMALL_SLOT_ENV, SHMCOLL_SINGLE_COPY=single_copy))
    assert_rank_results(results)
