"""Warm init_process_group at 2 ranks, gloo against shm variants that take one cost out
before the clock starts: where shm's init time goes (issue 23, item 6;
docs/notes/2026-11-29-warm-init-imports.md).

    python -m lab.init_variants                       # gloo,shm,factory,preimported 7 rounds
    python -m lab.init_variants --variants shm,preimported --rounds 11

Variants (each rank has imported torch and shmcoll before the clock, as in
benchmarks.init_time):
  gloo         init_process_group("gloo")
  shm          init_process_group("shm")
  factory      shm, with shmcoll.shm.factory (the engine group's modules) imported first
  preimported  shm, with every module group creation imports imported first (the adapter,
               the hierarchical discovery, the engine, the warm-up)
  floor        a Python backend whose creator returns a bare dist.ProcessGroup: torch's
               own part of init_process_group for any backend written in Python
  floor_store  the same, after one store round (every rank sets a key, reads all): the
               least a backend that must exchange anything (segment names) adds
Each round runs every variant once, in an order that alternates between rounds, in fresh
rank processes that start init_process_group together when the parent says go. shmcoll's
bytecode is compiled first (a shell with PYTHONDONTWRITEBYTECODE=1 would otherwise leave
edited modules to be compiled again at every import: 2-3x the import time). Per
variant: the median over rounds of the slowest rank's init and init + a first 4 KiB
all_reduce (verified), and every round's init.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

__all__ = ["main"]

_PREIMPORT = {
    "factory": ["shmcoll.shm.factory"],
    "preimported": ["shmcoll.torch_backend.process_group", "shmcoll.torch_backend.hier_pg",
                    "shmcoll.shm.factory", "shmcoll.hier.nodes", "shmcoll.engine.warmup"],
}

_RANK = r'''
import importlib, json, os, sys, time
rank, port, variant, go = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
modules = json.loads(sys.argv[5])
import torch, torch.distributed as dist
import shmcoll
torch.set_num_threads(1)
for m in modules:
    importlib.import_module(m)
floor = variant.startswith("floor")
if floor:
    def creator(opts, pg_options=None):
        if variant == "floor_store":
            opts.store.set(f"floor{opts.group_rank}", "x" * 64)
            for p in range(opts.group_size):
                opts.store.get(f"floor{p}")
        return dist.ProcessGroup(opts.group_rank, opts.group_size)
    dist.Backend.register_backend("floorlab", creator, extended_api=True, devices=["cpu"])
while not os.path.exists(go):
    time.sleep(0.0005)
t = time.perf_counter()
dist.init_process_group("gloo" if variant == "gloo" else "floorlab" if floor else "shm",
                        init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
t1 = time.perf_counter()
if not floor:
    x = torch.ones(1024)
    dist.all_reduce(x)
    assert bool((x == 2).all())
t2 = time.perf_counter()
print(json.dumps({"init": (t1 - t) * 1e3, "first": (t2 - t) * 1e3}), flush=True)
if floor:  # no collectives: rank 0 (the store's host) leaves last
    store = dist.distributed_c10d._get_default_store()
    store.add("floor_done", 1)
    while store.add("floor_done", 0) < 2:
        time.sleep(0.001)
    time.sleep(0.05)
    os._exit(0)
dist.destroy_process_group()
'''


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _round(variant, tmp):
    go = os.path.join(tmp, f"go-{variant}-{time.monotonic_ns()}")
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(port), variant, go,
                               json.dumps(_PREIMPORT.get(variant, []))],
                              stdout=subprocess.PIPE, text=True) for r in range(2)]
    time.sleep(3.0)  # both ranks have imported (a rank not ready by then shows as an outlier)
    open(go, "w").close()
    outs = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
    return max(o["init"] for o in outs), max(o["first"] for o in outs)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lab.init_variants",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="gloo,shm,factory,preimported")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    bad = set(variants) - {"gloo", "shm", "floor", "floor_store"} - set(_PREIMPORT)
    if bad:
        ap.error(f"unknown variants {sorted(bad)}")
    import shmcoll
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.dirname(shmcoll.__file__)],
                   check=True)
    results = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="shmcoll-init-lab-") as tmp:
        for i in range(args.rounds):
            for v in variants if i % 2 == 0 else variants[::-1]:
                results[v].append(_round(v, tmp))
    print(f"2 ranks, tcp://, {args.rounds} rounds; ms, slowest rank")
    for v in variants:
        inits = [r[0] for r in results[v]]
        first = "      -" if v.startswith("floor") else \
            f"{statistics.median(r[1] for r in results[v]):7.1f}"
        print(f"{v:<12} init {statistics.median(inits):7.1f}  init + first {first}  rounds: "
              + " ".join(f"{x:.1f}" for x in inits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
