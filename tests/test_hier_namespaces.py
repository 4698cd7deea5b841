"""Backend "shm" on hosts that really cannot share memory: each host a network namespace
(veth into a private bridge, 10.77.0.0/24), a mount namespace with its own tmpfs /dev/shm
and its own hostname (benchmarks/hosts.py), and `torchrun --nnodes N --node-rank k` on
each. The ranks find their nodes by detection alone (tests/_hier_node.py). Skipped where
namespaces cannot be made (not root, no `ip` / `unshare`)."""

import json
import os
import subprocess
import time

import pytest

from benchmarks.hosts import Hosts, leftovers

HERE = os.path.dirname(os.path.abspath(__file__))
_OK, _WHY = Hosts.available()
pytestmark = [pytest.mark.multiprocess, pytest.mark.torch,
              pytest.mark.skipif(not _OK, reason=f"namespaced hosts unavailable: {_WHY}")]


def _torchrun(hosts, sizes, mode, out):
    """torchrun of _hier_node.py on every host; -> the Popen objects (out/host<k>.log)."""
    env = {"SHMCOLL_TEST_NODE_SIZES": ",".join(map(str, sizes)), "SHMCOLL_TEST_MODE": mode,
           "SHMCOLL_TEST_OUT": out, "SHMCOLL_HIER_SHARD_MIN_BYTES": str(64 << 10)}
    return hosts.torchrun(sizes, [os.path.join(HERE, "_hier_node.py")], env=env,
                          logs=[os.path.join(out, f"host{k}.log") for k in range(len(sizes))])


def _logs(out, sizes):
    text = []
    for k in range(len(sizes)):
        try:
            with open(os.path.join(out, f"host{k}.log"), errors="replace") as f:
                text.append(f"--- host{k} ---\n" + f.read()[-4000:])
        except OSError:
            pass
    return "\n".join(text)


def _results(out, world_size):
    found = {}
    for r in range(world_size):
        try:
            with open(os.path.join(out, f"rank{r}.json")) as f:
                found[r] = json.load(f)
        except OSError:
            pass
    return found


def _wait(procs, timeout_s):
    deadline = time.monotonic() + timeout_s
    return [p.wait(max(0.1, deadline - time.monotonic())) for p in procs]


@pytest.fixture
def out(tmp_path):
    yield str(tmp_path)
    assert not leftovers(), f"namespaces left behind: {leftovers()}"


# 3 hosts x 2 ranks (6 ranks on this 2-core machine, ~30 s) only with -m slow: three
# simulated nodes are in CI through tests/test_hier.py (every collective, 3x2)
@pytest.mark.parametrize("sizes", [(2, 2), pytest.param((2, 2, 2), marks=pytest.mark.slow),
                                   (3, 1)], ids=["2x2", "3x2", "3+1"])
def test_every_collective_on_namespaced_hosts(out, sizes):
    world_size = sum(sizes)
    with Hosts(len(sizes)) as hosts:
        procs = _torchrun(hosts, sizes, "checks", out)
        try:
            codes = _wait(procs, 100)
        except subprocess.TimeoutExpired:
            pytest.fail(f"torchrun did not finish in 100 s\n{_logs(out, sizes)}")
        results = _results(out, world_size)
        assert codes == [0] * len(sizes) and len(results) == world_size, \
            f"{codes}\n{results}\n{_logs(out, sizes)}"
        assert all(r["ok"] for r in results.values()), results
        want = [list(range(sum(sizes[:k]), sum(sizes[:k + 1]))) for k in range(len(sizes))]
        assert all(r["layout"] == want for r in results.values()), results
        assert len({json.dumps(r["digests"]) for r in results.values()}) == 1
        for k in range(len(sizes)):  # nothing left in any host's own /dev/shm
            assert hosts.shm_left(k) == [], (k, hosts.shm_left(k))


def test_lost_host_fails_every_survivor_naming_it(out):
    sizes = (2, 2)
    with Hosts(2) as hosts:
        procs = _torchrun(hosts, sizes, "lost", out)
        deadline = time.monotonic() + 90
        while not all(os.path.exists(os.path.join(out, f"rank{r}.ready")) for r in range(4)):
            assert time.monotonic() < deadline, f"not ready\n{_logs(out, sizes)}"
            assert procs[0].poll() is None and procs[1].poll() is None, _logs(out, sizes)
            time.sleep(0.2)
        time.sleep(0.5)
        t_kill = time.monotonic()
        assert hosts.kill(1), "host 1 had no processes"
        # not torchrun's exit: its agent then waits in an exit barrier for the lost host
        while set(_results(out, 4)) < {0, 1}:
            assert time.monotonic() < t_kill + 60, f"no result\n{_logs(out, sizes)}"
            time.sleep(0.2)
        results = _results(out, 4)
        for r in (0, 1):
            res = results[r]
            assert "PeerLostError" in res["mro"], res
            assert res["t_error"] - t_kill < 5.0, (r, res["t_error"] - t_kill, res)
            assert "node 1 (host1: ranks 2, 3)" in res["error"] or \
                "rank 2 (node 1, host1)" in res["error"], res["error"]
