"""Compare two conformance tallies (written by run_suite.py).

    python -m tests.conformance.compare BASELINE.json CANDIDATE.json [--json gap.json] [--all]

Typically BASELINE = the gloo_plugin tally and CANDIDATE = the shm tally.  Prints the
"gap list" (tests that pass on the baseline but not on the candidate, with the
candidate's outcome and the last line of its message), the tests that pass only on the
candidate, and the totals of both.  Exit code 0 when the gap list is empty, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys


def load(path: str) -> dict:
    with open(path) as f:
        t = json.load(f)
    if "tests" not in t:
        raise SystemExit(f"{path}: not a run_suite tally (no 'tests')")
    return t


def last_line(msg: str, n: int = 160) -> str:
    lines = [ln for ln in (msg or "").strip().splitlines() if ln.strip()]
    return lines[-1].strip()[:n] if lines else ""


def totals(t: dict) -> str:
    s = (f"passed={t.get('passed', 0)} failed={t.get('failed', 0)} "
         f"errors={t.get('errors', 0)} skipped={t.get('skipped', 0)} "
         f"total={t.get('total', 0)} wall={t.get('wall_time_s', '?')}s")
    if t.get("setup_error"):
        s += "  SETUP ERROR: " + last_line(t["setup_error"])
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.conformance.compare",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("baseline", help="tally JSON of the reference run (gloo_plugin)")
    ap.add_argument("candidate", help="tally JSON of the run under test (shm)")
    ap.add_argument("--json", default=None, help="also write the gap list as JSON here")
    ap.add_argument("--all", action="store_true",
                    help="also list every test whose outcome differs")
    args = ap.parse_args(argv)
    base, cand = load(args.baseline), load(args.candidate)
    bt, ct = base["tests"], cand["tests"]
    bname, cname = base.get("backend", "baseline"), cand.get("backend", "candidate")

    gap = sorted(n for n, r in bt.items()
                 if r["outcome"] == "passed" and ct.get(n, {}).get("outcome") != "passed")
    extra = sorted(n for n, r in ct.items()
                   if r["outcome"] == "passed" and bt.get(n, {}).get("outcome") != "passed")

    print(f"== gap list: passing on {bname} but not on {cname}: {len(gap)} ==")
    for n in gap:
        r = ct.get(n)
        if r is None:
            print(f"  {n:60s} NOT RUN")
        else:
            print(f"  {n:60s} {r['outcome']:8s} {r.get('summary') or last_line(r.get('message', ''))}")
    print(f"\n== passing on {cname} but not on {bname}: {len(extra)} ==")
    for n in extra:
        print(f"  {n:60s} ({bname}: {bt.get(n, {}).get('outcome', 'not run')})")
    if args.all:
        diff = sorted(n for n in set(bt) | set(ct)
                      if bt.get(n, {}).get("outcome") != ct.get(n, {}).get("outcome"))
        print(f"\n== all outcome differences: {len(diff)} ==")
        for n in diff:
            print(f"  {n:60s} {bt.get(n, {}).get('outcome', '-'):8s} -> "
                  f"{ct.get(n, {}).get('outcome', '-')}")
    print("\n== totals ==")
    print(f"  {bname:14s} {totals(base)}")
    print(f"  {cname:14s} {totals(cand)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"baseline": bname, "candidate": cname, "gap": {
                n: ct.get(n, {"outcome": "not run"}) for n in gap}, "only_candidate": extra},
                f, indent=1)
    return 1 if gap else 0


if __name__ == "__main__":
    sys.exit(main())
