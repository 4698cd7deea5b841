"""A/B of two versions of this repository through benchmarks.bench, alternating in one run.

    python -m lab.ab --base 99d83ec --rounds 4 -- --quick --backends shm
    python -m lab.ab --base 99d83ec -- --latency --backends shm --world-sizes 2

`--base` is a git revision of this repository (exported with `git archive` into a temporary
directory) or a directory holding another copy. Every round runs `python -m benchmarks.bench
<args after -->` once from each tree, the order alternating between rounds, each tree on its
own PYTHONPATH with its numba kernels warmed first (`python -m shmcoll.engine.warmup`), so both
meet the same machine state within minutes of each other. Per row (op, world size, bytes,
dtype): the median time of each version over the rounds, their ratio (B / A: below 1, this
tree is faster) and the ratio of every round.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.header import engine_module, export_revision

__all__ = ["main"]

_HERE = Path(__file__).resolve().parent.parent


def _env(tree):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    return env


def _bench(tree, args, out):
    cmd = [sys.executable, "-m", "benchmarks.bench", *args, "--out", str(out)]
    r = subprocess.run(cmd, cwd=tree, env=_env(tree), capture_output=True, text=True)
    if r.returncode not in (0,):
        sys.stdout.write(r.stdout[-3000:] + r.stderr[-3000:])
        raise SystemExit(f"benchmarks.bench failed in {tree} (exit {r.returncode})")
    rows = {}
    for line in Path(out).read_text().splitlines():
        rec = json.loads(line)
        if "time_us" in rec and not rec.get("wrong"):
            key = (rec["backend"], rec["op"], rec["world_size"], rec["nbytes"], rec["dtype"])
            rows[key] = rec["time_us"]
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision or directory (version A)")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv[:split])
    bench_args = argv[split + 1:]
    with tempfile.TemporaryDirectory(prefix="shmcoll-ab-") as tmp:
        base = Path(args.base) if os.path.isdir(args.base) else export_revision(args.base, tmp)
        trees = {"A": base.resolve(), "B": _HERE}
        for tree in trees.values():
            subprocess.run([sys.executable, "-m", engine_module(tree, "warmup")], cwd=tree,
                           env=_env(tree), check=True, capture_output=True)
        times = {"A": [], "B": []}
        for r in range(args.rounds):
            for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                rows = _bench(trees[name], bench_args, Path(tmp) / f"{name}{r}.jsonl")
                times[name].append(rows)
                print(f"round {r + 1} {name}: " + "  ".join(
                    f"{k[1]} {k[3]}B {v:.1f}us" for k, v in sorted(rows.items())), flush=True)
    print(f"\nA = {args.base}, B = this tree ({_HERE}); median time over {args.rounds} rounds")
    print(f"{'op':>14} {'ranks':>5} {'bytes':>10} {'A us':>10} {'B us':>10} {'B/A':>6}  "
          f"per round B/A")
    for key in sorted(times["A"][0]):
        a = [rows[key] for rows in times["A"] if key in rows]
        b = [rows[key] for rows in times["B"] if key in rows]
        if not a or not b:
            continue
        per = " ".join(f"{y / x:.2f}" for x, y in zip(a, b))
        print(f"{key[1]:>14} {key[2]:>5} {key[3]:>10} {statistics.median(a):>10.1f} "
              f"{statistics.median(b):>10.1f} {statistics.median(b) / statistics.median(a):>6.2f}"
              f"  {per}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
