"""init_process_group("shm") returns while the group is made in the background
(shmcoll/torch_backend/deferred.py): the group's first call waits for it, a failed creation
fails that call (and every later one) with the cause, SHMCOLL_EAGER_INIT=1 waits inside
init_process_group instead, and shutdown, abort, fork and several groups in a row behave as
with a group made inside the call.

Whether the creation really leaves init_process_group is shown by order, not by time: a
rank that only calls init_process_group after its peer's returned would deadlock an init
that waited for the group.
"""

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

import harness

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch, pytest.mark.timeout(300)]

JOB_TIMEOUT_S = 120


def _init(rank, world_size, store, timeout_s=60.0):
    import shmcoll  # noqa: F401  (registers "shm")
    dist.init_process_group("shm", init_method=f"file://{store.path}/torch_rendezvous",
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _backend():
    return dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))


def _returns_before_peer(rank, world_size, store):
    """Rank 1 calls init_process_group only once rank 0's returned."""
    if rank == 1:
        store.get("rank0_init_returned")
    _init(rank, world_size, store)
    if rank == 0:
        store.set("rank0_init_returned", "1")
    made_before_first_call = _backend()._creation.done.is_set()
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t)
    assert t.tolist() == [3.0] * 5, t
    name = type(_backend()).__name__
    dist.destroy_process_group()
    return made_before_first_call, name


def test_init_returns_before_the_group_is_made():
    (made0, name0), (_, name1) = harness.run_ranks(_returns_before_peer, 2, "processes",
                                                   JOB_TIMEOUT_S)
    assert not made0  # rank 0's group could not be made before rank 1 arrived
    assert name0 == name1 == "DeferredProcessGroup"


def _peer_never_comes(rank, world_size, store):
    if rank == 1:
        return None  # never calls init_process_group
    start = time.monotonic()
    try:
        _init(rank, world_size, store, timeout_s=3.0)
    except Exception as e:  # noqa: BLE001 -- SHMCOLL_EAGER_INIT=1: raised here
        return {"at": "init", "error": type(e).__name__, "text": str(e),
                "waited_s": time.monotonic() - start}
    errors = []
    for _ in range(2):  # the first call and a later one both fail, with the cause
        with pytest.raises(dist.DistBackendError) as info:
            dist.all_reduce(torch.ones(3))
        errors.append(str(info.value))
    dist.destroy_process_group()  # nothing was made: nothing to release, no error
    return {"at": "first call", "errors": errors}


def test_failed_creation_fails_the_first_call_with_its_cause():
    got, _ = harness.run_ranks(_peer_never_comes, 2, "processes", JOB_TIMEOUT_S)
    assert got["at"] == "first call", got
    for text in got["errors"]:
        assert "[Rank 0] allreduce: creating process group" in text, text
        assert "backend shm) failed" in text and "SHMCOLL_EAGER_INIT=1" in text, text


def test_eager_init_raises_inside_init_process_group():
    try:
        got, _ = harness.run_ranks(_peer_never_comes, 2, "processes", JOB_TIMEOUT_S,
                                   env={"SHMCOLL_EAGER_INIT": "1"})
    finally:
        # torch counted the group whose init failed (as for any backend): rank 0's next
        # default group would be named differently from a fresh peer's. Fresh workers.
        harness.shutdown_pool()
    assert got["at"] == "init", got
    assert got["error"] == "DistBackendError", got
    assert "init_process_group: creating process group" in got["text"], got
    assert "SHMCOLL_EAGER_INIT" not in got["text"], got


def _abort_while_making(rank, world_size, store):
    """Rank 0 aborts its group while it waits for rank 1; abort does not wait."""
    if rank == 1:
        store.get("rank0_aborted")
        _init(rank, world_size, store, timeout_s=30.0)
        try:
            dist.all_reduce(torch.ones(2))  # rank 0's group was aborted as it was made
        except Exception as e:  # noqa: BLE001
            error = type(e).__name__
        else:
            error = None
        dist.destroy_process_group()
        return error
    _init(rank, world_size, store, timeout_s=30.0)
    pg = _backend()
    start = time.monotonic()
    pg.abort()
    waited = time.monotonic() - start
    store.set("rank0_aborted", "1")
    with pytest.raises(dist.DistBackendError, match="abort"):
        dist.all_reduce(torch.ones(2))  # waits for the group, which was aborted once made
    dist.destroy_process_group()
    return waited


def test_abort_before_the_group_is_made_does_not_wait():
    waited, peer_error = harness.run_ranks(_abort_while_making, 2, "processes", JOB_TIMEOUT_S)
    assert waited < 5.0, waited  # rank 1 had not even started: a wait would be 30 s
    assert peer_error is not None  # its peer aborted: its call failed, it did not hang


def _groups_in_a_row(rank, world_size, store):
    """Groups made back to back (their creations queue in order), used in reverse."""
    _init(rank, world_size, store)
    groups = [dist.new_group(list(range(world_size))) for _ in range(4)]
    groups.append(dist.new_group([0, 1]))
    out = []
    for i, g in reversed(list(enumerate(groups))):
        t = torch.full((3,), float(rank + 10 * i))
        dist.all_reduce(t, group=g)
        out.append(t[0].item())
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_groups_made_in_a_row_then_used_in_any_order(world_size):
    results = harness.run_ranks(_groups_in_a_row, world_size, "processes", JOB_TIMEOUT_S)
    for rank, out in enumerate(results):
        want = []
        for i in reversed(range(5)):
            members = range(world_size) if i < 4 else range(2)
            want.append(float(sum(r + 10 * i for r in members)) if rank in members
                        else float(rank + 10 * i))  # not a member: the call does nothing
        assert out == want, (rank, out, want)


def _fork_while_making(rank, world_size, store):
    """A fork right after init waits for the running creation (register_at_fork): the
    child never holds a lock of a thread it does not have."""
    if rank == 1:
        store.get("rank0_init_returned")
        time.sleep(0.5)  # rank 0 forks while its creation waits for this rank
    _init(rank, world_size, store)
    made_at_fork = None
    if rank == 0:
        store.set("rank0_init_returned", "1")
        pid = os.fork()
        if pid == 0:  # the child has no creation thread, and knows it
            from shmcoll.torch_backend import deferred
            os._exit(0 if not deferred._running and deferred._last_done is None else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        made_at_fork = _backend()._creation.done.is_set()
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    dist.destroy_process_group()
    return made_at_fork, t.tolist()


def test_fork_waits_for_the_running_creation():
    (made_at_fork, t0), (_, t1) = harness.run_ranks(_fork_while_making, 2, "processes",
                                                    JOB_TIMEOUT_S)
    assert made_at_fork is True
    assert t0 == t1 == [3.0] * 4


def _torch_asks_without_waiting(rank, world_size, store):
    """What torch and a user ask of a fresh group (name, store, backend name, rank) is
    answered before the group is made; the engine's attributes wait for it."""
    if rank == 1:
        store.get("rank0_asked")
    _init(rank, world_size, store)
    pg = _backend()
    answers = None
    if rank == 0:
        answers = (pg.getBackendName(), pg.name(), pg.rank(), pg.size(),
                   pg._get_sequence_number_for_group(), pg.group_name,
                   pg._creation.done.is_set(), dist.get_backend())
        store.set("rank0_asked", "1")
    world = pg.group.world_size  # the engine group: waits for it
    dist.destroy_process_group()
    return answers, world


def test_what_torch_asks_does_not_wait():
    (answers, world), _ = harness.run_ranks(_torch_asks_without_waiting, 2, "processes",
                                            JOB_TIMEOUT_S)
    backend, name, rank, size, seq, group_name, made, dist_backend = answers
    assert (backend, name, rank, size, seq, dist_backend) == ("shm", "shm", 0, 2, 0, "shm")
    assert group_name and not made
    assert world == 2


def _environment_of_the_call(rank, world_size, store):
    """SHMCOLL_* variables set around init_process_group only, then changed: the group is
    made (on its own thread, later) with those of the call."""
    if rank == 1:
        store.get("rank0_init_returned")  # rank 0's group is made after its call returned
    with harness.patched_environ({"SHMCOLL_SLOT_BYTES": str(1 << 20)}):
        _init(rank, world_size, store)
    if rank == 0:
        store.set("rank0_init_returned", "1")
    os.environ["SHMCOLL_SLOT_BYTES"] = str(2 << 20)  # after the call: not the group's
    try:
        t = torch.full((4,), float(rank + 1))
        dist.all_reduce(t)
        slot = _backend().group._arena.slot_nbytes
    finally:
        del os.environ["SHMCOLL_SLOT_BYTES"]
    dist.destroy_process_group()
    return slot, t.tolist()


def test_the_group_is_made_with_the_environment_of_the_call():
    for slot, t in harness.run_ranks(_environment_of_the_call, 2, "processes", JOB_TIMEOUT_S):
        assert slot == 1 << 20
        assert t == [3.0] * 4


def test_every_method_torch_reaches_is_forwarded_or_answered():
    """Guards: a ProcessGroup method the adapter overrides (torch reaches it through the
    pybind trampolines, or its Python calls it on a backend) that DeferredProcessGroup
    neither forwards nor defines would reach the C++ base instead: "not implemented"."""
    from shmcoll.torch_backend.deferred import FORWARDED, DeferredProcessGroup
    from shmcoll.torch_backend.hier_pg import HierProcessGroup, ProcessGroupShm
    from shmcoll.torch_backend.process_group import EngineProcessGroup

    public = set()
    for cls in (EngineProcessGroup, ProcessGroupShm, HierProcessGroup):
        for klass in cls.__mro__:
            if klass.__module__.startswith("shmcoll.torch_backend"):
                public |= {n for n in vars(klass) if not n.startswith("__")
                           and (n in dir(dist.ProcessGroup) or not n.startswith("_"))}
    mine = {n for n in vars(DeferredProcessGroup) if not n.startswith("__")}
    internal = {"BACKEND_NAME", "Options", "executor_class"}  # class-level, not per call
    missing = sorted(public - set(FORWARDED) - mine - internal)
    assert not missing, missing


def _shm_mappings():
    with open("/proc/self/maps") as f:
        return sum("shmcoll" in line for line in f)


def _init_destroy_cycles(rank, world_size, store, n):
    """init_process_group / destroy_process_group n times, a collective in every other
    cycle (the rest destroy a group whose creation may still be running)."""
    import threading
    before = _shm_mappings()
    for i in range(n):
        import shmcoll  # noqa: F401
        dist.init_process_group("shm", init_method=f"file://{store.path}/rdv{i}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=60))
        if i % 2:
            t = torch.full((3,), float(rank + i))
            dist.all_reduce(t)
            assert t.tolist() == [float(sum(r + i for r in range(world_size)))] * 3, t
        dist.destroy_process_group()
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and any(
            t.name == "shmcoll-create" for t in threading.enumerate()):
        time.sleep(0.01)  # a creation's thread ends right after it reports
    creating = [t.name for t in threading.enumerate() if t.name == "shmcoll-create"]
    return _shm_mappings() - before, creating


def test_init_destroy_cycles_leave_no_mapping_and_no_thread():
    """30 lifetimes of a default group through torch, half of them never used: no mapping
    of a segment left in the process, no creation thread left (and no segment in
    /dev/shm: conftest checks)."""
    for mappings, threads in harness.run_ranks(_init_destroy_cycles, 2, "processes",
                                               JOB_TIMEOUT_S, args=(30,)):
        assert mappings == 0
        assert threads == []
