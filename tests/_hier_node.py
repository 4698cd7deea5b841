"""One rank of a multi-node job on namespaced hosts: tests/test_hier_namespaces.py starts it
with torchrun on every host (benchmarks/hosts.py). No SHMCOLL_NODE_ID: the nodes must be
found by detection, which sees one boot id but a private /dev/shm per host.

Environment (set by the test):
  SHMCOLL_TEST_NODE_SIZES  ranks per host, "2,2"; torchrun numbers ranks host by host
  SHMCOLL_TEST_MODE        "checks" (every hier_cases check) or "lost" (loop all_reduce
                           until the test kills a host, then report the error)
  SHMCOLL_TEST_OUT         directory for rank<r>.json (the result) and rank<r>.ready
"""

import datetime
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _write(name, data):
    path = os.path.join(os.environ["SHMCOLL_TEST_OUT"], name)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def _lost(rank, world_size):
    import torch
    import torch.distributed as dist
    t = torch.empty(64)
    dist.all_reduce(t)
    _write(f"rank{rank}.ready", {})
    t0 = None
    try:
        while True:
            t.fill_(1.0)
            dist.all_reduce(t)
            t0 = time.monotonic()
    except Exception as e:
        return {"ok": False, "error": str(e), "type": type(e).__name__,
                "mro": [k.__name__ for k in type(e).__mro__], "peer": getattr(e, "peer", None),
                "t_error": time.monotonic(), "t_last_ok": t0}


def main():
    import torch
    import torch.distributed as dist

    import hier_cases
    import shmcoll  # noqa: F401  (registers "shm")
    from shmcoll.torch_backend import HierProcessGroup

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    sizes = [int(x) for x in os.environ["SHMCOLL_TEST_NODE_SIZES"].split(",")]
    nodes = [f"host{k}" for k, n in enumerate(sizes) for _ in range(n)]
    try:
        dist.init_process_group("shm", timeout=datetime.timedelta(seconds=60))
        pg = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).made()
        assert isinstance(pg, HierProcessGroup), f"{type(pg).__name__}: nodes not detected"
        assert list(pg.layout.hosts) == nodes, (pg.layout.hosts, nodes)
        if os.environ["SHMCOLL_TEST_MODE"] == "lost":
            result = _lost(rank, world_size)
        else:
            digests = []
            for check in hier_cases.ALL:
                digests.extend(check(rank, world_size, nodes) or [])
            result = {"ok": True, "digests": digests}
        result["layout"] = [list(m) for m in pg.layout.nodes]
        dist.destroy_process_group()
    except Exception:
        result = {"ok": False, "error": traceback.format_exc()}
    _write(f"rank{rank}.json", result)
    sys.exit(0 if result.get("ok") or os.environ["SHMCOLL_TEST_MODE"] == "lost" else 1)


if __name__ == "__main__":
    main()
