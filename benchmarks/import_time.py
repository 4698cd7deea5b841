"""What shmcoll adds to `import torch` (the `torch.backends` entry points), and what
`import shmcoll` costs against another revision: fresh processes, arms alternating, medians.

    python -m benchmarks.import_time                       # 30 rounds of each
    python -m benchmarks.import_time --rounds 60 --base main

import torch: every round runs `import torch` twice in fresh interpreters of this
environment, once with shmcoll's entry points and once without (importlib.metadata's
entry_points filtered in that process: torch reads the same metadata in both arms, so the
difference is the plugins' import and registration), in alternating order; the "with" arm
also times what runs inside shmcoll's entry points (their modules' import and the call).
Needs the entry points installed (`pip install -e .`); the arm without them is then the
same as an environment without shmcoll.
import torch after import shmcoll (autoload off): with its import hook against without it.
import shmcoll: this tree against `--base` (exported with git archive), each imported with
TORCH_DEVICE_BACKEND_AUTOLOAD=0 (the base's registration would otherwise look for this
tree's plugin modules), also alternating; and which of torch, numba, numpy each one loads.
Times are inside the process (perf_counter around the import statement) and of the
process (start to exit); medians, with the lower and upper quartile. Bytecode is written
and used (one uncounted run first), whatever PYTHONDONTWRITEBYTECODE says.
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

_IMPORT_TORCH = r'''
import importlib.metadata as md, json, sys, time
t0 = time.perf_counter()
spent = []  # the "with" arm: seconds in each of our entry points (module import + call)


class Timed:  # what torch uses of an entry point: .name, .load(), then calls the result
    def __init__(self, ep):
        self.name, self._ep = ep.name, ep

    def load(self):
        t = time.perf_counter()
        fn = self._ep.load()

        def timed():
            fn()
            spent.append(time.perf_counter() - t)
        return timed


_entry_points = md.entry_points
ours = ("shmcoll.", "threaded_pg.")


def entry_points(**kw):  # torch: entry_points(group="torch.backends")
    eps = list(_entry_points(**kw))
    if sys.argv[1] == "without":
        return [e for e in eps if not e.value.startswith(ours)]
    return [Timed(e) if e.value.startswith(ours) else e for e in eps]


md.entry_points = entry_points
import torch
t = time.perf_counter() - t0
import torch.distributed as dist
print(json.dumps({"s": t, "plugins_s": sum(spent), "shm": "SHM" in dist.Backend._plugins}))
'''

_HOOKED_IMPORT_TORCH = r'''
import json, sys, time
import shmcoll  # (autoload off) registers through its import hook, when torch.distributed loads
from shmcoll.torch_backend import import_hook
watchers = [f for f in sys.meta_path if isinstance(f, import_hook._Watcher)]
calls = [0]
if sys.argv[1] == "without":  # no hook: `import shmcoll` after torch would register
    for f in watchers:
        sys.meta_path.remove(f)
else:  # count the finder's calls (wrapping it costs about what it counts: said so below)
    find_spec = watchers[0].find_spec

    def counted(*a, **kw):
        calls[0] += 1
        return find_spec(*a, **kw)
    watchers[0].find_spec = counted
t0 = time.perf_counter()
import torch
t = time.perf_counter() - t0
import torch.distributed as dist
print(json.dumps({"s": t, "calls": calls[0], "shm": "SHM" in dist.Backend._plugins}))
'''

_IMPORT_SHMCOLL = r'''
import json, sys, time
t0 = time.perf_counter()
import shmcoll
t = time.perf_counter() - t0
print(json.dumps({"s": t, "loaded": sorted({m.split(".")[0] for m in sys.modules} &
                                           {"torch", "numba", "numpy"})}))
'''


def _run(code, arg, env, cwd):
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, arg], env=env, capture_output=True,
                         text=True, timeout=300, check=True, cwd=cwd).stdout
    record = json.loads(out.strip().splitlines()[-1])
    record["process_s"] = time.perf_counter() - t
    return record


def _quartiles(values):
    q = statistics.quantiles(values, n=4)
    return f"{statistics.median(values) * 1e3:8.1f} ms  [{q[0] * 1e3:7.1f}, {q[2] * 1e3:7.1f}]"


def _alternate(rounds, arms):
    """{arm: [record]}: every round runs each arm once, the order flipped every round."""
    names = list(arms)
    results = {n: [] for n in names}
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            results[name].append(arms[name]())
    return results


def _report(title, results):
    print(title)
    for name, records in results.items():
        print(f"  {name:>10}: in process {_quartiles([r['s'] for r in records])}   "
              f"process {_quartiles([r['process_s'] for r in records])}")


def _export(rev, into):
    archive = subprocess.run(["git", "-C", str(_REPO), "archive", rev, "shmcoll"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return Path(into)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.import_time",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--base", default="main", help="revision for the import shmcoll A/B")
    args = ap.parse_args(argv)
    # Bytecode on (as for an installed package): with PYTHONDONTWRITEBYTECODE every run
    # would compile shmcoll's sources again (~4 ms a module here), which no install does.
    drop = ("TORCH_DEVICE_BACKEND_AUTOLOAD", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = str(_REPO)
    cwd = tempfile.gettempdir()  # not the checkout: `python -c` puts the cwd on sys.path
    _run(_IMPORT_TORCH, "with", env, cwd)  # writes the .pyc files; not counted
    results = _alternate(args.rounds, {
        "with": lambda: _run(_IMPORT_TORCH, "with", env, cwd),
        "without": lambda: _run(_IMPORT_TORCH, "without", env, cwd)})
    if not all(r["shm"] for r in results["with"]) or any(r["shm"] for r in results["without"]):
        print("import torch: the entry points are not installed here (pip install -e .): "
              "both arms are the same", file=sys.stderr)
        return 1
    _report(f"import torch, {args.rounds} rounds (median [quartiles]); with / without "
            f"shmcoll's entry points", results)
    diff = [a["s"] - b["s"] for a, b in zip(results["with"], results["without"])]
    print(f"  with - without, paired by round: median {statistics.median(diff) * 1e3:+.1f} ms")
    print(f"  inside shmcoll's entry points (import + register), with: "
          f"{_quartiles([r['plugins_s'] for r in results['with']])}")

    off = dict(env, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    results = _alternate(args.rounds, {
        "hook": lambda: _run(_HOOKED_IMPORT_TORCH, "with", off, cwd),
        "no hook": lambda: _run(_HOOKED_IMPORT_TORCH, "without", off, cwd)})
    _report(f"import torch after import shmcoll, autoload off, {args.rounds} rounds (median "
            f"[quartiles]); with / without the import hook (its finder counted: "
            f"{results['hook'][0]['calls']} calls, once per module torch imports)", results)
    if not all(r["shm"] for r in results["hook"]):
        print("import hook: 'shm' not registered", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="shmcoll-import-time-") as tmp:
        base = Path(tmp) / "base"
        base.mkdir()
        base_env = dict(off, PYTHONPATH=str(_export(args.base, base)))
        _run(_IMPORT_SHMCOLL, "", base_env, tmp)  # .pyc files, as above
        results = _alternate(args.rounds, {
            args.base: lambda: _run(_IMPORT_SHMCOLL, "", base_env, tmp),
            "this tree": lambda: _run(_IMPORT_SHMCOLL, "", off, tmp)})
    _report(f"import shmcoll, {args.rounds} rounds (median [quartiles])", results)
    for name, records in results.items():
        loaded = ', '.join(records[0]['loaded']) or 'none of torch, numba, numpy'
        print(f"  {name:>10} loads: {loaded}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
