"""First-collective latency, cold (empty numba cache) against warm, for processes and threads.

    python -m benchmarks.first_call                  # 3 rounds, the table below
    python -m benchmarks.first_call --rounds 5 --out results/first_call.jsonl
    python -m benchmarks.first_call --python /tmp/venv/bin/python   # an installed wheel

Every case is a fresh process (a fresh interpreter per rank): nothing compiled survives
in memory. "cold" points NUMBA_CACHE_DIR at a new empty directory, so every kernel a case
needs is compiled (as after a fresh install, a new virtualenv or a container without the
cache); "warm" runs the same case again on the cache the cold run filled. Rounds alternate
cold and warm and report the median, so both meet the same machine state.

processes: 2 ranks (torch.multiprocessing is not involved: two `python -c` processes with
    file:// rendezvous) time init_process_group("shm"), the first float32 all_reduce, then
    the first call of each other dtype and op, and a second float32 all_reduce. Each time
    is the slowest rank's (a collective ends when its last rank arrives).
threads: `threaded_pg.spawn` of a 2-rank float32 all_reduce in a fresh process (what a
    test suite's first threaded test costs), then of the other dtypes and ops.
warm-up: `python -m shmcoll.engine.warmup` (every kernel for every dtype).

Each case also counts the functions numba compiled (its compile events; summed over the
ranks) and the kernel versions loaded from the kernels a wheel ships (shmcoll/native/prebuilt.py).
By default the ranks run this source tree, which ships none: cold, they compile. With
`--python`, they run that interpreter (a virtualenv with the built wheel installed) from
outside this tree, so they import the installed package: cold is then a fresh install.

Targets ("above warm" = cold minus warm). An installed wheel (issue 25): init + first
float32 all_reduce <= 1 s above warm; the first bfloat16 all_reduce and every other first
collective <= 0.3 s; threaded_pg's first test <= 0.5 s above warm. The source tree (issue
16): <= 3 s above warm; any other dtype or op <= 1 s; threads <= 1.5 s above warm; the full
warm-up <= 20 s. Every result is verified.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main"]

_REPO = Path(__file__).resolve().parent.parent

# The collectives timed after the first float32 all_reduce: (name, code run in each rank;
# `t` is the rank's result and must equal `want`).
_OTHERS = (
    ("bfloat16 all_reduce", "t = torch.full((1024,), r + 1.0, dtype=torch.bfloat16); "
                            "dist.all_reduce(t); want = 3.0"),
    ("float64 all_reduce", "t = torch.full((1024,), r + 1.0, dtype=torch.float64); "
                           "dist.all_reduce(t); want = 3.0"),
    ("int64 all_reduce", "t = torch.full((1024,), r + 1, dtype=torch.int64); "
                         "dist.all_reduce(t); want = 3"),
    ("float32 MAX", "t = torch.full((1024,), r + 1.0); "
                    "dist.all_reduce(t, op=dist.ReduceOp.MAX); want = 2.0"),
    ("float32 AVG", "t = torch.full((1024,), r + 1.0); "
                    "dist.all_reduce(t, op=dist.ReduceOp.AVG); want = 1.5"),
    ("broadcast", "t = torch.full((1024,), r + 1.0); dist.broadcast(t, 1); want = 2.0"),
    ("all_gather_into_tensor", "s = torch.full((512,), r + 1.0); t = torch.empty(1024); "
                               "dist.all_gather_into_tensor(t, s); t = t[-1:]; want = 2.0"),
    ("reduce_scatter_tensor", "s = torch.full((1024,), r + 1.0); t = torch.empty(512); "
                              "dist.reduce_scatter_tensor(t, s); want = 3.0"),
    ("barrier", "dist.barrier(); t = torch.ones(1); want = 1.0"),
    ("16 MiB all_reduce", "t = torch.full((4 << 20,), r + 1.0); dist.all_reduce(t); "
                          "want = 3.0"),
    ("send/recv", "t = torch.full((256,), r + 1.0)\n"
                  "if r == 0: dist.send(t, 1); want = 1.0\n"
                  "else: dist.recv(t, 0); want = 1.0"),
)

# Counts numba's compilations in the process (one type inference pass per function).
_COUNT = r'''
from numba.core import event as _event
_compiled = []

class _Count(_event.Listener):
    def on_start(self, ev):
        pass

    def on_end(self, ev):
        if ev.data["name"].startswith("nopython_type_inference"):
            _compiled.append(ev.data["qualname"])

_event.register("numba:run_pass", _Count())

def _counts(out):
    out["numba compilations"] = len(_compiled)
    try:
        from shmcoll.native import prebuilt
        out["shipped kernels loaded"] = prebuilt.counts()["shipped"]
    except ImportError:  # a tree from before them
        pass
'''

_RANK = r'''
import json, sys, time
t0 = time.perf_counter()
r, init_file = int(sys.argv[1]), sys.argv[2]
import torch, torch.distributed as dist
torch.set_num_threads(1)
import shmcoll
out = {"import_s": time.perf_counter() - t0}
t = time.perf_counter()
dist.init_process_group("shm", init_method="file://" + init_file, rank=r, world_size=2)
out["init_s"] = time.perf_counter() - t

def timed(name, code):
    env = {"torch": torch, "dist": dist, "r": r}
    t = time.perf_counter()
    exec(code, env)
    out[name] = time.perf_counter() - t
    if not bool((env["t"] == env["want"]).all()):
        raise AssertionError(f"rank {r} {name}: got {env['t'][:4]}, want {env['want']}")

timed("first float32 all_reduce", "t = torch.full((1024,), r + 1.0); dist.all_reduce(t); "
                                  "want = 3.0")
for name, code in OTHERS:
    timed(name, code)
timed("second float32 all_reduce", "t = torch.full((1024,), r + 1.0); dist.all_reduce(t); "
                                   "want = 3.0")
dist.destroy_process_group()
_counts(out)
print(json.dumps(out))
'''

_THREADS = r'''
import json, time
t0 = time.perf_counter()
import torch, torch.distributed as dist
import threaded_pg
out = {"import_s": time.perf_counter() - t0}

def case(code):
    def fn(r, world_size):
        env = {"torch": torch, "dist": dist, "r": r}
        exec(code, env)
        return bool((env["t"] == env["want"]).all())
    t = time.perf_counter()
    if threaded_pg.spawn(fn, 2) != [True, True]:
        raise AssertionError("wrong result: " + code)
    return time.perf_counter() - t

out["first test (float32 all_reduce)"] = case(
    "t = torch.full((1024,), r + 1.0); dist.all_reduce(t); want = 3.0")
for name, code in OTHERS:
    out[name] = case(code)
out["second test (float32 all_reduce)"] = case(
    "t = torch.full((1024,), r + 1.0); dist.all_reduce(t); want = 3.0")
_counts(out)
print(json.dumps(out))
'''


# The interpreter the cases run, and whether it is an installed wheel (--python) rather than
# this source tree.
_PYTHON = {"exe": sys.executable, "installed": False}
_COUNTS = ("numba compilations", "shipped kernels loaded")  # summed over ranks, not seconds


def _env(cache_dir):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir), OMP_NUM_THREADS="1")
    if _PYTHON["installed"]:  # the installed package only: no tree on the path
        env.pop("PYTHONPATH", None)
        return env
    env["PYTHONPATH"] = os.pathsep.join([str(_REPO)] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _cwd():
    return tempfile.gettempdir() if _PYTHON["installed"] else None


def _code(body):
    return f"OTHERS = {_OTHERS!r}\n" + _COUNT + body


def run_processes(cache_dir, timeout_s=600):
    """One 2-rank job in fresh processes: {measure: seconds}, slowest rank, plus the wall
    time from starting the ranks to their exit."""
    init_file = tempfile.mktemp(prefix="shmcoll-first-call-")
    t = time.perf_counter()
    procs = [subprocess.Popen([_PYTHON["exe"], "-c", _code(_RANK), str(r), init_file],
                              env=_env(cache_dir), cwd=_cwd(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout_s)
        if p.returncode != 0:
            raise RuntimeError(f"rank failed (exit {p.returncode}):\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    wall = time.perf_counter() - t
    merged = {k: (sum if k in _COUNTS else max)(r[k] for r in results) for k in results[0]}
    merged["init + first float32 all_reduce"] = max(
        r["init_s"] + r["first float32 all_reduce"] for r in results)
    merged["job wall (start to exit)"] = wall
    return merged


def run_threads(cache_dir, timeout_s=600):
    t = time.perf_counter()
    r = subprocess.run([_PYTHON["exe"], "-c", _code(_THREADS)], env=_env(cache_dir),
                       cwd=_cwd(), capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"threads case failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["process wall (start to exit)"] = time.perf_counter() - t
    return out


def run_warmup(cache_dir, timeout_s=600):
    t = time.perf_counter()
    subprocess.run([_PYTHON["exe"], "-m", "shmcoll.engine.warmup"], env=_env(cache_dir), cwd=_cwd(),
                   check=True, capture_output=True, timeout=timeout_s)
    return {"python -m shmcoll.engine.warmup": time.perf_counter() - t}


def _target(case, measure, cold, warm):
    """(text, met) of the issue's target for this row, or None."""
    if _PYTHON["installed"]:
        return _target_installed(case, measure, cold, warm)
    if case == "processes" and measure == "init + first float32 all_reduce":
        return f"<= 3 s above warm: {cold - warm:+.2f} s", cold - warm <= 3.0
    if case == "processes" and measure in dict(_OTHERS):
        return f"<= 1 s: {cold:.2f} s", cold <= 1.0
    if case == "threads" and measure == "first test (float32 all_reduce)":
        return f"<= 1.5 s above warm: {cold - warm:+.2f} s", cold - warm <= 1.5
    if case == "threads" and measure in dict(_OTHERS):
        return f"<= 1 s: {cold:.2f} s", cold <= 1.0
    if case == "warm-up":
        return f"<= 20 s: {cold:.1f} s", cold <= 20.0
    return None


def _target_installed(case, measure, cold, warm):
    """Issue 25's targets, for an installed wheel that ships its kernels."""
    if measure in _COUNTS:
        return None
    if case == "processes" and measure == "init + first float32 all_reduce":
        return f"<= 1 s above warm: {cold - warm:+.2f} s", cold - warm <= 1.0
    if case == "threads" and measure == "first test (float32 all_reduce)":
        return f"<= 0.5 s above warm: {cold - warm:+.2f} s", cold - warm <= 0.5
    if case in ("processes", "threads") and measure in dict(_OTHERS):
        return f"<= 0.3 s: {cold:.2f} s", cold <= 0.3
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.first_call",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default="processes,threads,warm-up")
    ap.add_argument("--out", help="append one JSON line per (round, case, cold|warm)")
    ap.add_argument("--python", help="run the cases with this interpreter (a virtualenv with "
                                     "the built wheel installed), outside this tree")
    args = ap.parse_args(argv)
    if args.python:
        _PYTHON.update(exe=args.python, installed=True)
    runners = {"processes": run_processes, "threads": run_threads, "warm-up": run_warmup}
    cases = [c for c in args.cases.split(",") if c]
    rows = {}  # (case, cold|warm) -> [results]
    out = open(args.out, "a") if args.out else None
    for rnd in range(args.rounds):
        for case in cases:
            with tempfile.TemporaryDirectory(prefix="shmcoll-numba-cache-") as cache:
                for state in ("cold", "warm") if case != "warm-up" else ("cold",):
                    res = runners[case](cache)
                    rows.setdefault((case, state), []).append(res)
                    print(f"round {rnd + 1} {case} {state}: " + ", ".join(
                        f"{k} {v:.2f} s" for k, v in res.items()), flush=True)
                    if out:
                        out.write(json.dumps({"round": rnd, "case": case, "state": state,
                                              "python": _PYTHON["exe"], **res}) + "\n")
    if out:
        out.close()
    print(f"\nmedian of {args.rounds} rounds (seconds; cold = empty numba cache, fresh "
          f"processes)")
    print(f"{'case':10} {'measure':34} {'cold':>7} {'warm':>7}  target")
    missed = 0
    for case in cases:
        cold = rows[(case, "cold")]
        warm = rows.get((case, "warm"))
        for measure in cold[0]:
            c = statistics.median(r[measure] for r in cold)
            w = statistics.median(r[measure] for r in warm) if warm else float("nan")
            target = _target(case, measure, c, w)
            note = "" if target is None else f"{target[0]} {'met' if target[1] else 'MISSED'}"
            missed += target is not None and not target[1]
            fmt = "7.0f" if measure in _COUNTS else "7.2f"
            print(f"{case:10} {measure:34} {c:{fmt}} {w:{fmt}}  {note}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
