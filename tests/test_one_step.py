"""The one-step latency path (Arena.one_step): small all_reduce, broadcast, all_gather (into
one array) and reduce_scatter (of one array) run as one compiled call, framing included. It must be interchangeable
with the general path of the same collective -- same slot, step and fingerprint -- because
whether a rank takes it depends on that rank's own array (a strided one takes the general
path); and it must hand late peers, mismatches and aborts to the same Python."""

import time

import numpy as np
import pytest

import harness
from shmcoll import CollectiveMismatchError, ReduceOp

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

ROUNDS = 12
JOB_TIMEOUT_S = 200


def _array(values, strided):
    """`values`, or a strided view holding them (every other element of a buffer)."""
    if not strided:
        return values.copy()
    buf = np.zeros(2 * values.size, values.dtype)
    buf[::2] = values
    return buf[::2]


def _late(rank, world_size, i):
    """Every third call one rank arrives 50 ms late: the others' compiled wait gives up its
    fast tiers (~2 ms) and Python finishes it (the slow path of Arena.one_step)."""
    if i % 3 == 2 and rank == (i + 1) % world_size:
        time.sleep(0.05)


def _took_one_step(group, key, contiguous):
    plan = group._plans.get(key)
    return bool(contiguous and plan is not None and plan.mode is not None)


def _values(count, rank, i, dtype=np.float32):
    return (np.arange(count) + rank * 1000 + i).astype(dtype)


COUNTS = (2, 3333)


def _job(rank, world_size, store, collective, counts=COUNTS):
    group = harness.new_group(store, rank, world_size)
    try:
        got, one_step = [], []
        for i in range(ROUNDS):
            count = counts[i % len(counts)]
            strided = (rank + i) % 2 == 1
            _late(rank, world_size, i)
            if collective == "all_reduce":
                array = _array(_values(count, rank, i), strided)
                group.all_reduce(array)
                key = ("all_reduce", array.dtype, array.shape, ReduceOp.SUM, None, 1.0)
                got.append(array.tolist())
            elif collective == "broadcast":
                root = i % world_size
                array = _array(_values(count, rank, i), strided)
                group.broadcast(array, root)
                key = ("broadcast", array.dtype, array.shape, root)
                got.append(array.tolist())
            elif collective == "all_gather":
                array = _array(_values(count, rank, i, np.int16), strided)
                out = np.full(world_size * count, -1, np.int16)
                group.all_gather(out, array)
                key = ("all_gather", array.dtype, array.shape)
                got.append(out.tolist())
            else:  # reduce_scatter: a strided output takes the general path
                ins = _values(world_size * count, rank, i)
                array = _array(np.full(count, -1, np.float32), strided)
                group.reduce_scatter(array, ins)
                key = ("reduce_scatter", ins.dtype, ins.shape, array.shape, ReduceOp.SUM,
                       None, 1.0)
                got.append(array.tolist())
            # all_gather copies a strided input contiguous first: it takes the path anyway
            one_step.append(_took_one_step(group, key, collective == "all_gather"
                                           or array.flags.c_contiguous))
        # a mismatch seen on the slow path (the odd rank out is late), then a matched call
        x = np.ones(8, np.float32)
        if rank == 1:
            time.sleep(0.05)
        try:
            if collective == "all_reduce":
                group.all_reduce(x, op=ReduceOp.MAX if rank == 1 else ReduceOp.SUM)
            elif collective == "broadcast":
                group.broadcast(x, 1 if rank == 1 else 0)
            elif collective == "reduce_scatter":
                group.reduce_scatter(np.zeros(4, np.float32), np.ones(4 * world_size,
                                                                      np.float32),
                                     op=ReduceOp.MAX if rank == 1 else ReduceOp.SUM)
            else:
                group.all_gather(np.zeros(world_size * (9 if rank == 1 else 8), np.float32),
                                 np.ones(9 if rank == 1 else 8, np.float32))
            mismatch = None
        except CollectiveMismatchError as e:
            mismatch = str(e)
        group.all_reduce(x)
        return got, one_step, mismatch, x.tolist()
    finally:
        group.close()


def _expected(collective, world_size, i, rank, counts=COUNTS):
    count = counts[i % len(counts)]
    if collective == "all_reduce":
        return sum(_values(count, r, i) for r in range(world_size)).tolist()
    if collective == "broadcast":
        return _values(count, i % world_size, i).tolist()
    if collective == "reduce_scatter":
        return sum(_values(world_size * count, r, i) for r in range(world_size))[
            rank * count:(rank + 1) * count].tolist()
    return np.concatenate([_values(count, r, i, np.int16) for r in range(world_size)]).tolist()


MISMATCH_WORDS = {"all_reduce": ("op=SUM", "op=MAX"), "broadcast": ("root=0", "root=1"),
                  "all_gather": ("count=8", "count=9"),
                  "reduce_scatter": ("op=SUM", "op=MAX")}


@pytest.mark.parametrize("collective", ["all_reduce", "broadcast", "all_gather",
                                        "reduce_scatter"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_one_step_path_matches_the_general_path(kind, world_size, collective):
    """Guards: results are exact whether a rank takes the one-step path or the general one
    at the same seq (without the same slot, step and fingerprint the mixed calls deadlock,
    mismatch or read the wrong slot), when a peer is late (the kernel's slow-path hand-off;
    without the consume after it the late calls are wrong), and after a mismatch, which
    names both sides on every rank and leaves the group usable."""
    results = harness.run_ranks(_job, world_size, kind, timeout_s=JOB_TIMEOUT_S,
                                args=(collective,))
    for rank, (got, one_step, mismatch, after) in enumerate(results):
        for i, values in enumerate(got):
            assert values == _expected(collective, world_size, i, rank), (rank, i)
        want = [collective == "all_gather" or (rank + i) % 2 == 0 for i in range(ROUNDS)]
        assert one_step == want, (rank, one_step)
        a, b = MISMATCH_WORDS[collective]
        assert mismatch is not None and a in mismatch and b in mismatch, (rank, mismatch)
        assert after == [float(world_size)] * 8, (rank, after)


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather"])
def test_one_step_up_to_a_mebibyte(kind, collective):
    """A one-shot all_reduce or an all_gather into one array of more than one streaming
    sub-chunk (512 KiB) but at most UNSPLIT_MAX_NBYTES goes as one sub-chunk, so it is one
    step (all_reduce: mixed with ranks on the general path, which must split it the same
    way: different step counts deadlock or read the wrong sub-slot); a message over it
    streams in sub-chunks, on the general path, and its results are as exact."""
    from shmcoll.algorithms.all_reduce import STREAM_NBYTES, UNSPLIT_MAX_NBYTES

    itemsize = 4 if collective == "all_reduce" else 2  # _job's float32 / int16
    counts = (STREAM_NBYTES // itemsize + 1, UNSPLIT_MAX_NBYTES // itemsize,
              UNSPLIT_MAX_NBYTES // itemsize + 1)
    results = harness.run_ranks(_job, 2, kind, timeout_s=JOB_TIMEOUT_S,
                                args=(collective, counts))
    for rank, (got, one_step, _mismatch, after) in enumerate(results):
        for i, values in enumerate(got):
            assert values == _expected(collective, 2, i, rank, counts), (rank, i)
        # the third size is over UNSPLIT_MAX_NBYTES: streamed, never one step; all_gather
        # takes the one step also from a strided input (through its contiguous copy)
        want = [(collective == "all_gather" or (rank + i) % 2 == 0) and i % 3 != 2
                for i in range(ROUNDS)]
        assert one_step == want, (rank, one_step)
        assert after == [2.0] * 8, (rank, after)


def test_one_step_waits_for_its_slot_before_writing_it():
    """Guards rule 6 on the one-step path: a slot a peer may still read (free_at ahead of
    what every peer is known to have posted) is claimed -- waited for -- before the kernel
    copies into it or posts. Without the claim, rank 0 would overwrite the slot under a
    reading peer; here the peer never posts, so the claim times out with nothing posted."""
    from shmcoll import CollectiveTimeoutError
    from shmcoll import protocol
    from shmcoll.engine.group import Group

    layout = protocol.RegionLayout(4096, 2)
    regions = [np.zeros(layout.nbytes, np.uint8) for _ in range(2)]
    arenas = [protocol.Arena(regions, r, layout, lambda p: True) for r in range(2)]
    g = Group(arenas[0], 0, 2, timeout_s=0.2)
    a0 = arenas[0]
    clock = a0._clock
    clock.hold(clock.next_slot, clock.known_min + 1)  # as if rank 1 still read the slot
    slot_before = regions[0][layout.data_offset:layout.data_offset + 64].copy()
    x = np.full(4, 7.0, np.float32)
    with pytest.raises(CollectiveTimeoutError, match=r"all_reduce \(seq 1\)"):
        g.all_reduce(x)
    assert a0.step == 0, "posted before its slot was free"
    assert np.array_equal(regions[0][layout.data_offset:layout.data_offset + 64],
                          slot_before), "wrote the slot before it was free"
    assert g._plans and all(p.mode is not None for p in g._plans.values())
    g.close()


def _list_forms(rank, world_size, store):
    """all_gather into a list and reduce_scatter of a list, at sizes on both sides of
    algorithms.LIST_STAGED_MAX_NBYTES, rank 0's arrays strided and the others'
    contiguous; below the limit, also a rank calling the one-array form beside ranks calling
    the list form. Returns [(values, whether the one-array path planned it)] per call,
    the mixed-form call's values and the staging array's size."""
    from shmcoll import algorithms
    limit = algorithms.LIST_STAGED_MAX_NBYTES
    group = harness.new_group(store, rank, world_size)
    try:
        rows = []
        strided = rank == 0
        for i, count in enumerate((3, 3333, limit // 8, limit // 8 + 1)):  # float64
            _late(rank, world_size, i)
            src = _array(_values(count, rank, i, np.float64), strided)
            outs = [_array(np.full(count, -1.0), strided) for _ in range(world_size)]
            group.all_gather(outs, src)
            key = ("all_gather", src.dtype, src.shape)
            rows.append(([o.tolist() for o in outs], key in group._plans))
            ins = [_array(_values(count, rank, i, np.float64) * (j + 1), strided)
                   for j in range(world_size)]
            out = _array(np.full(count, -1.0), strided)
            group.reduce_scatter(out, ins)
            key = ("reduce_scatter", out.dtype, (world_size * count,), out.shape,
                   ReduceOp.SUM, None, 1.0)
            rows.append((out.tolist(), key in group._plans))
        # the list form runs the one-array form's path below the limit: a rank calling the
        # other form takes part in the same collective
        src = _values(5, rank, 9, np.float64)
        if rank == world_size - 1:
            out = np.zeros(world_size * 5)
            group.all_gather(out, src)
            mixed = [part.tolist() for part in np.split(out, world_size)]
        else:
            outs = [np.zeros(5) for _ in range(world_size)]
            group.all_gather(outs, src)
            mixed = [o.tolist() for o in outs]
        return rows, mixed, group._scratch.nbytes
    finally:
        group.close()


@pytest.mark.parametrize("world_size", [2, 3])
def test_list_forms_ride_the_one_array_path_below_the_staging_limit(kind, world_size):
    """Guards the list forms' staging (Group.all_gather, Group.reduce_scatter): results are
    exact on both sides of the limit, also when one rank's outputs or inputs are strided
    and the others' are not (the route depends on the size only: a route chosen by layout
    would fingerprint differently across ranks and end in a mismatch); below the limit the
    one-array path ran (its plan; reduce_scatter's takes a contiguous output) and a rank may
    call the other form; the staging array never grows past world_size x the limit."""
    from shmcoll import algorithms
    limit = algorithms.LIST_STAGED_MAX_NBYTES
    counts = (3, 3333, limit // 8, limit // 8 + 1)
    results = harness.run_ranks(_list_forms, world_size, kind, timeout_s=JOB_TIMEOUT_S)
    for rank, (rows, mixed, scratch) in enumerate(results):
        for i, count in enumerate(counts):
            gathered, gather_planned = rows[2 * i]
            assert gathered == [_values(count, r, i, np.float64).tolist()
                                for r in range(world_size)], (rank, count)
            assert gather_planned == (count * 8 <= limit), (rank, count)
            reduced, reduce_planned = rows[2 * i + 1]
            want = sum(_values(count, r, i, np.float64) for r in range(world_size)) * (rank + 1)
            assert reduced == want.tolist(), (rank, count)
            assert reduce_planned == (count * 8 <= limit and rank != 0), (rank, count)
        assert mixed == [_values(5, r, 9, np.float64).tolist() for r in range(world_size)], rank
        assert 0 < scratch <= world_size * limit, (rank, scratch)
