"""Backend "shm" across nodes, with nodes simulated on this host (SHMCOLL_NODE_ID): node
discovery, and every collective and point-to-point op at 2x2, 3x2, 3+1 and interleaved
layouts (tests/hier_cases.py). Real hosts (namespaces): test_hier_namespaces.py; faults:
test_hier_faults.py."""

import gc
import threading
import time
import weakref

import numpy as np
import pytest

import harness
import hier_cases
from shmcoll import FileStore, config
from shmcoll.errors import SegmentError
from shmcoll.hier import NodeLayout, discover, identity, nodes, wire

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch]


# ---------------------------------------------------------------------------- layouts

def test_layout_numbers_nodes_by_lowest_rank_and_orders_members():
    layout = NodeLayout.from_keys(["b", "a", "b", "a", "c"], ["hb", "ha", "hb", "ha", "hc"])
    assert layout.nodes == ((0, 2), (1, 3), (4,))
    assert layout.node_of == (0, 1, 0, 1, 2)
    assert [layout.local_rank(r) for r in range(5)] == [0, 0, 1, 1, 0]
    assert layout.shards == 1 and not layout.even and not layout.single_node
    assert layout.channel_members(0) == (0, 1, 4)
    assert layout.describe(3) == "rank 3 (node 1, ha)"
    even = NodeLayout.from_keys(["x", "x", "y", "y", "z", "z"])
    assert even.even and even.shards == 2 and even.channel_members(1) == (1, 3, 5)
    assert even.rank_of(2, 1) == 5
    assert NodeLayout.from_keys(["x"] * 4).single_node


def test_identity_override_and_auto_key():
    assert identity(config.from_env({"SHMCOLL_NODE_ID": "rack7"})) == "id:rack7"
    auto = identity(config.from_env({}))
    boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    assert auto.startswith(f"auto:{boot}|") and auto.count("|") == 2


def _discover_threads(keys_env, tmp_path, probe=None):
    store = FileStore(str(tmp_path / "store"))
    results, errors = [None] * len(keys_env), []

    def rank(r):
        try:
            cfg = config.from_env(keys_env[r])
            results[r] = discover(store, r, len(keys_env), 30.0, cfg)
        except Exception as e:  # surfaced below
            errors.append(e)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(keys_env))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert all(r == results[0] for r in results)
    return results[0]


def test_discover_groups_ranks_by_node_id(tmp_path):
    envs = [{"SHMCOLL_NODE_ID": k} for k in ("n0", "n1", "n0", "n1", "n2")]
    layout = _discover_threads(envs, tmp_path)
    assert layout.nodes == ((0, 2), (1, 3), (4,))


def test_discover_without_override_finds_one_node(tmp_path):
    assert _discover_threads([{}, {}, {}], tmp_path).single_node


def test_discover_splits_a_rank_that_cannot_read_its_leaders_probe(tmp_path, monkeypatch):
    # the second member's probe read fails: it becomes a node of its own
    real = nodes._read_probe
    calls = []

    def read(name):
        calls.append(name)
        return b"" if len(calls) == 2 else real(name)
    monkeypatch.setattr(nodes, "_read_probe", read)
    layout = _discover_threads([{}, {}, {}], tmp_path)
    assert layout.num_nodes == 2 and sorted(map(len, layout.nodes)) == [1, 2]


def test_discover_on_a_store_left_by_a_crashed_start_fails_fast_and_says_why(tmp_path):
    """A store kept across a restart (torchrun's agent store) that holds an unfinished
    discovery: rank 0's earlier process began generation 1 and wrote its id, rank 1's died
    before it began. Now rank 0 is at generation 2 and rank 1 at 1 and they never meet.
    Rank 1 (behind: rank 0's counter is past its own) fails at its first look, long before
    its 600 s timeout, naming the generations and the per-attempt store; rank 0 (ahead by
    one: rank 1 might only be late) times out as before."""
    store = FileStore(str(tmp_path / "store"))
    store.add(nodes._gen_key(0), 1)  # the dead process's traces
    store.set("shmcoll/nodes/1/id/0", "host\nboot\nauto:x\n/shmcoll-gone\n00")
    errors = _discover_failures(store, {0: 3.0, 1: 600.0})
    assert "node discovery: rank 1 is at rendezvous generation 1 of this store, rank 0 " \
        "at 2" in str(errors[1]) and "TORCHELASTIC_RESTART_COUNT" in str(errors[1])
    assert str(errors[0]) == "node discovery: timed out after 3.0 s waiting for store keys " \
        "['shmcoll/nodes/2/id/1']"


def test_discover_fails_fast_when_a_rank_is_two_generations_behind(tmp_path):
    """Rank 1's counter two behind rank 0's is no late arrival (that is one behind): a
    generation rank 0 began never had rank 1, and never will."""
    store = FileStore(str(tmp_path / "store"))
    store.add(nodes._gen_key(0), 2)
    errors = _discover_failures(store, {0: 600.0})
    assert str(errors[0]).startswith("node discovery: rank 0 is at rendezvous generation 3 "
                                     "of this store, rank 1 at 0: ")


def _discover_failures(store, timeouts):
    """{rank: error} of discover(store, rank, 2) on a thread per rank in `timeouts`."""
    errors = {}

    def rank(r, timeout_s):
        try:
            discover(store, r, 2, timeout_s, config.from_env({}))
        except Exception as e:  # checked by the caller
            errors[r] = e

    threads = [threading.Thread(target=rank, args=item, daemon=True)
               for item in timeouts.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "discovery did not end (a 600 s wait)"
    assert sorted(errors) == sorted(timeouts), errors
    for e in errors.values():
        assert isinstance(e, SegmentError), e
    return errors


def test_first_round_frames_compare_headers():
    mine = wire.frame(5, (2, 3, 10, 0, 0, 77), np.arange(4, dtype=np.float32))
    rows = np.stack([mine, mine.copy(), wire.frame(5, (2, 3, 10, 0, 4, 77))])
    assert wire.check_frames(rows[:2], mine) == -1
    assert wire.check_frames(rows, mine) == 2
    assert wire.header_of(rows[2]) == (5, (2, 3, 10, 0, 4, 77))
    assert rows[0, wire.HEADER_NBYTES:wire.HEADER_NBYTES + 16].view(np.float32).tolist() == \
        [0, 1, 2, 3]


# --------------------------------------------------------------------------- batteries

def _checks(rank, world_size, nodes, names):
    out = []
    for name in names:
        out.extend(getattr(hier_cases, name)(rank, world_size, nodes) or [])
    return out


def _job(rank, world_size, store, nodes, names, env, timeout_s):
    with harness.patched_environ({"SHMCOLL_NODE_ID": nodes[rank], **env}):
        return harness._torch_job(rank, world_size, store, _checks, "shm", "file", 0,
                                  timeout_s, (nodes, names))


# hier_cases' largest counts (40000 floats and up) take the sharded paths at this threshold
SHARD_ENV = {"SHMCOLL_HIER_SHARD_MIN_BYTES": str(64 << 10)}


def run_hier(nodes, names, env=None, timeout_s=60):
    """The checks `names` of hier_cases on len(nodes) ranks (rank r on node nodes[r]);
    asserts that the digests agree across ranks."""
    results = harness.run_ranks(_job, len(nodes), "processes", timeout_s + 20,
                                (list(nodes), list(names), dict(SHARD_ENV, **(env or {})),
                                 timeout_s))
    assert all(r == results[0] for r in results), "ranks disagree on reduction results"
    return results


LAYOUTS = {
    "2x2": ["a", "a", "b", "b"],
    "3x2": ["a", "a", "b", "b", "c", "c"],
    "3+1": ["a", "a", "a", "b"],
    "interleaved": ["a", "b", "a", "b"],  # node members are not consecutive ranks
}
ALL_CHECKS = [c.__name__ for c in hier_cases.ALL]


@pytest.mark.parametrize("name", ["2x2", "3x2", "3+1"])
def test_every_collective_and_p2p(name):
    run_hier(LAYOUTS[name], ALL_CHECKS)


def test_interleaved_ranks_and_small_shard_threshold():
    """Nodes whose ranks are not consecutive, and every reduction sharded (threshold 0)."""
    run_hier(LAYOUTS["interleaved"], ["check_all_reduce", "check_reduce_scatter",
                                      "check_broadcast", "check_all_gather"],
             env={"SHMCOLL_HIER_SHARD_MIN_BYTES": "0"})


def test_inter_node_p2p_future_fails_with_the_error():
    """A failed send/recv across nodes fails its future and its wait(), naming the op."""
    import torch
    from shmcoll.torch_backend.hier_pg import _P2PWork

    class _Failing:
        def wait(self):
            raise RuntimeError("connection closed by peer")

    class _Group:
        poisoned = None

    work = _P2PWork("recv", _Failing(), [torch.zeros(2)], _Group())
    with pytest.raises(RuntimeError, match="recv: connection closed by peer"):
        work.get_future().wait()
    with pytest.raises(RuntimeError, match="recv: connection closed by peer"):
        work.wait()


def _two_nodes(rank, world_size, store):
    """init_process_group("shm") with each rank a node of its own (SHMCOLL_NODE_ID)."""
    import torch.distributed as dist

    import shmcoll  # noqa: F401  (registers "shm")
    with harness.patched_environ({"SHMCOLL_NODE_ID": "ab"[rank]}):
        dist.init_process_group("shm", init_method=f"file://{store.path}/rdv", rank=rank,
                                world_size=world_size)
    return dist


def _watchdog_after_destroy(rank, world_size, store):
    import torch

    def watchdogs():
        return [t for t in threading.enumerate() if t.name == "shmcoll-hier-watchdog"]

    dist = _two_nodes(rank, world_size, store)
    sub = dist.new_group([0, 1])  # the user keeps a handle past destroy_process_group
    t = torch.full((8,), float(rank + 1))
    dist.all_reduce(t, group=sub)
    had = bool(watchdogs())
    group = weakref.ref(sub._get_backend(torch.device("cpu")).group)
    dist.destroy_process_group()
    deadline = time.monotonic() + 5.0
    while watchdogs() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = bool(watchdogs())
    held = sub is not None and group() is not None
    del sub
    gc.collect()
    return t.tolist(), had, left, held, group() is None


def _watchdog_holds_no_group(rank, world_size, store):
    """A closed group the user lets go of is freed there and then, by the thread that drops
    it, not later by the watchdog thread (which, exiting with the process, aborted it)."""
    import torch

    dist = _two_nodes(rank, world_size, store)
    pg = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    freed_by = []
    group = weakref.ref(pg.group, lambda _: freed_by.append(threading.current_thread().name))
    t = torch.full((8,), float(rank + 1))
    for _ in range(3):  # ticks of the watchdog (100 ms) pass while the group is open
        dist.all_reduce(t)
        time.sleep(0.06)
    gc.disable()  # no automatic collection in some other thread: only the last reference
    try:  # dropped, or the collection below, may free the group
        del pg
        dist.destroy_process_group()
        gc.collect()
        deadline = time.monotonic() + 5.0
        while group() is not None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        gc.enable()
    return freed_by


def test_watchdog_thread_ends_when_the_groups_close():
    """Guards: the per-process hierarchical watchdog (100 ms polls) ends once every group
    it watches is closed, even while the user still holds a group's handle."""
    results = harness.run_ranks(_watchdog_after_destroy, 2, "processes", 80)
    for values, had, left, held, freed in results:
        assert values == [3.0] * 8
        assert had, "no watchdog thread while a hierarchical group was open"
        assert not left, "the watchdog thread outlived every group it watched"
        assert held and freed, (held, freed)


def test_watchdog_thread_holds_no_group_it_watched():
    """Guards: the watchdog keeps no reference to a group past its tick, so a group is
    freed by the thread that lets go of it. A reference left in the watchdog's frame kept
    the last group alive until the thread ended, which then freed it (its gloo channels)
    in a daemon thread while the interpreter exited: SIGABRT, "terminate called without
    an active exception", on a one-rank node of tests/test_hier_namespaces.py."""
    freed_by = harness.run_ranks(_watchdog_holds_no_group, 2, "processes", 80)
    assert freed_by == [["MainThread"], ["MainThread"]], freed_by
