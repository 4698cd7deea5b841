"""Faults of backend "shm" across nodes (nodes simulated on this host): a rank or a whole
node lost, a stalled rank, collective mismatches within and across nodes, abort. Every
surviving rank must raise, in time, an error naming the rank and node; no process may
crash or hang (tests/_hier_ranks.py holds the rank side)."""

import signal
import time

import pytest

from _ranks import Job, error_class_names

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch]

NODES_2X2 = ["a", "a", "b", "b"]
GROUP_TIMEOUT_S = 30.0


class HierJob(Job):
    SCRIPT = "_hier_ranks.py"


@pytest.mark.parametrize("victims,count", [([3], 64), ([2, 3], 64), ([1], 100000)],
                         ids=["rank-small", "node-small", "rank-sharded"])
def test_lost_rank_or_node_fails_every_survivor_naming_it(tmp_path, victims, count):
    args = {"nodes": NODES_2X2, "victims": victims, "count": count}
    with HierJob("lost", 4, tmp_path, args, torch=True, timeout_s=GROUP_TIMEOUT_S) as job:
        job.all_ranks("ready")
        time.sleep(0.3)
        t_kill = time.monotonic()
        for v in victims:
            job.signal(v, signal.SIGKILL)
        survivors = [r for r in range(4) if r not in victims]
        for r in survivors:
            ev = job.event(r, "error", timeout_s=GROUP_TIMEOUT_S)
            assert "PeerLostError" in error_class_names(ev), ev
            assert ev["t"] - t_kill < 5.0, f"rank {r} took {ev['t'] - t_kill:.1f} s: {ev}"
            named = [f"rank {v} (node {NODES_2X2.index(NODES_2X2[v]) // 2}, " for v in victims]
            assert any(n in ev["msg"] for n in named), ev["msg"]
            if len(victims) == 2:
                assert "whole node lost: node 1" in ev["msg"] or ev["peer"] in victims, ev
            again = job.event(r, "again")
            assert "ok" not in again and "earlier failure" in again["msg"], again
            job.event(r, "closed", timeout_s=20)
        codes = job.join(30, ranks=survivors)
        assert all(c == 0 for c in codes.values()), (codes, [job.stderr(r)[-2000:] for r in
                                                             survivors if codes[r]])


def test_stalled_rank_times_out_naming_where_each_rank_was(tmp_path):
    args = {"nodes": NODES_2X2, "victim": 3, "op_timeout": 3.0}
    with HierJob("stall", 4, tmp_path, args, torch=True, timeout_s=GROUP_TIMEOUT_S) as job:
        job.all_ranks("ready")
        job.signal(3, signal.SIGSTOP)
        for r in range(4):
            job.send(r)
        messages = []
        for r in range(3):
            ev = job.event(r, "error", timeout_s=30)
            assert "CollectiveTimeoutError" in error_class_names(ev), ev
            assert ev["dt"] < 3.0 + 2.0, f"rank {r}: {ev['dt']:.1f} s"
            assert "Where each rank was" in ev["msg"], ev["msg"]
            assert "rank 3 (node 1, " in ev["msg"] and "no report" in ev["msg"], ev["msg"]
            messages.append(ev["msg"])
            job.event(r, "closed", timeout_s=20)
        assert any("Timed out waiting 3000ms" in m for m in messages), messages
        # the blocked ranks said where they were: in an intra-node or inter-node step
        assert any("rank 2 (node 1, " in m and "intra-node" in m for m in messages), messages


MISMATCHES = ["op_across", "count_across_small", "count_across", "kind_across", "intra"]


def test_mismatches_within_and_across_nodes_raise_on_every_rank(tmp_path):
    args = {"nodes": NODES_2X2, "cases": MISMATCHES}
    with HierJob("mismatch", 4, tmp_path, args, torch=True, timeout_s=GROUP_TIMEOUT_S) as job:
        for r in range(4):
            for i, case in enumerate(MISMATCHES):
                ev = job.event(r, "result", count=i + 1, timeout_s=60)
                assert ev["case"] == case and "ok" not in ev, ev
                assert "CollectiveMismatchError" in error_class_names(ev), ev
                assert ev["dt"] < 5.0, ev
                after = job.event(r, "after", count=i + 1)
                assert "ok" not in after, after  # the group failed on every rank
        codes = job.join(60)
        assert all(c == 0 for c in codes.values()), codes  # nobody crashed (gloo would)


def test_abort_from_another_thread_fails_the_group_everywhere(tmp_path):
    args = {"nodes": NODES_2X2, "late": 2}
    with HierJob("abort", 4, tmp_path, args, torch=True, timeout_s=GROUP_TIMEOUT_S) as job:
        job.all_ranks("ready")
        ev = job.event(0, "error", timeout_s=20)
        assert "ok" not in ev and ev["dt"] < 3.0, ev
        for r in (1, 3):
            ev = job.event(r, "error", timeout_s=20)
            assert "ok" not in ev and ev["dt"] < 5.0, ev
        job.send(2)
        ev = job.event(2, "error", timeout_s=20)
        assert "ok" not in ev, ev
        assert all(c == 0 for c in job.join(30).values())
