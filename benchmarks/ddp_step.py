"""Training-step benchmark: time one optimizer step of DistributedDataParallel (or of FSDP2,
`--wrappers fsdp2`) on CPU, per backend, next to the same step of the plain model on one
rank (compute only).

    python -m benchmarks.ddp_step                          # shm,gloo x 2,4 ranks x mlp,convnet
    python -m benchmarks.ddp_step --backends shm,gloo --world-sizes 2,4 \\
        --models mlp,convnet --steps 30 --warmup 5 --out results/ddp_step.jsonl
    python -m benchmarks.ddp_step --wrappers ddp,fsdp2 --world-sizes 2 --models mlp

For every (model, world size, backend) the parent spawns `world_size` ranks (torch
multiprocessing, spawn context, `file://` rendezvous in a fresh temp dir). Every rank builds
the model from a fixed seed (the same on every rank and for every backend), wraps it in
DistributedDataParallel (default bucket settings), and trains it with SGD (lr 0.01) on
synthetic data seeded per rank. A step is zero_grad + forward + loss + backward (where DDP
all-reduces the gradient buckets) + optimizer.step. FSDP2 (torch >= 2.6) shards every layer
with parameters and the root over the group (benchmarks/ddp_step_rank.py): its step
all-gathers each layer's parameters (forward and backward) and reduce-scatters its
gradients, the collectives FSDP and ZeRO spend their communication on. `step_ms` is the
median step time of each rank, maximum over ranks. The "compute" row is the same step of
the plain model (no DDP, no process group) in one process: `step_ms - compute_ms` is what
DDP costs on top.

Verification: every rank hashes its final parameters; rank 0 checks that all replicas are
bitwise identical. The parent then checks that every backend started from the same initial
parameters and that the final parameters of each backend agree with those of the reference
backend (gloo when it runs) within allclose(rtol=1e-5, atol=1e-6).

Exit status: 0 all rows verified; 1 a mismatch; 3 no mismatch but a run failed or hung;
2 bad command line. See benchmarks/README.md; the ranks' side (models, data, one rank's
training loop) is benchmarks/ddp_step_rank.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench import _csv, _stop  # the CLI list parser; terminate, then kill, stragglers
from benchmarks.ddp_step_rank import LR, MODELS, WRAPPERS, _worker  # the models; one rank

__all__ = ["MODELS", "WRAPPERS", "run_benchmark", "format_table", "main"]

RTOL, ATOL = 1e-5, 1e-6
COMPUTE = "compute"  # backend name of the compute-only reference row
EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_ERROR = 0, 1, 2, 3


# ---------------------------------------------------------------------------------------
# the parent: one run = one set of ranks, with a deadline
# ---------------------------------------------------------------------------------------
def _shm_entries() -> set:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _unlink_segments_of(pids) -> list:
    """Unlink shmcoll segments ('shmcoll-<uid>-<token>-<rank>-<pid>') owned by killed ranks."""
    removed = []
    for entry in _shm_entries():
        if entry.startswith("shmcoll-"):
            try:
                owner = int(entry.rsplit("-", 1)[1])
            except ValueError:
                continue
            if owner in pids:
                try:
                    os.unlink(os.path.join("/dev/shm", entry))
                    removed.append(entry)
                except OSError:
                    pass
    return removed


def _first_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    if lines and lines[0].startswith("Traceback"):
        return lines[-1].strip()
    return lines[0].strip() if lines else "?"


def run_one(model: str, world_size: int, backend, steps: int, warmup: int, seed: int,
            timeout: float, keep_dir: Path, fail_grace: float = 10.0,
            inject_error=None, wrapper: str = "ddp") -> dict:
    """Spawn the ranks of one (model, wrapper, world size, backend) run and wait with a
    deadline.

    backend None = the compute-only reference (one process, plain model). Returns a row;
    on success its 'params' key holds the path of rank 0's final parameters (in keep_dir).
    """
    import torch.multiprocessing as mp

    label = backend if backend is not None else COMPUTE
    row = {"record": "row", "model": model, "wrapper": wrapper if backend is not None else None,
           "world_size": world_size, "backend": label,
           "batch": MODELS[model][0], "steps": steps, "warmup": warmup, "seed": seed}
    rundir = Path(tempfile.mkdtemp(prefix="shmcoll-ddp-step-"))
    n = world_size if backend is not None else 1
    cfg = {"rundir": str(rundir), "backend": backend, "world_size": n, "model": model,
           "steps": steps, "warmup": warmup, "seed": seed,
           "init_method": f"file://{rundir / 'rendezvous'}",
           "op_timeout": max(10.0, 0.75 * timeout), "inject_error": inject_error,
           "wrapper": wrapper}
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, cfg), daemon=True,
                         name=f"ddp-step-{label}-r{r}") for r in range(n)]
    start = time.monotonic()
    problem = None
    killed = []
    try:
        for p in procs:
            p.start()
        first_fail = None
        while True:
            codes = [p.exitcode for p in procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if first_fail is None and any(c not in (None, 0) for c in codes):
                first_fail = now
            if first_fail is not None and now - first_fail > fail_grace:
                problem = "peers of a failed rank did not exit"
                break
            if now - start > timeout:
                problem = f"HUNG: exceeded the {timeout:g}s deadline"
                break
            time.sleep(0.05)
    finally:
        alive = _stop(procs)
        for p in procs:
            p.join(5)
        killed = [procs.index(p) for p in alive]
        if alive:
            removed = _unlink_segments_of({p.pid for p in alive})
            if removed:
                row["unlinked_segments"] = removed
    row["wall_s"] = round(time.monotonic() - start, 2)

    try:
        fatals = {}
        for r in range(n):
            f = rundir / f"fatal.rank{r}.txt"
            if f.exists():
                fatals[r] = f.read_text().strip()
        result_file = rundir / "result.json"
        errors = []
        if fatals:
            kinds = {_first_line(t) for t in fatals.values()}
            errors.append(f"ranks {sorted(fatals)} failed: {'; '.join(sorted(kinds))}")
            row["detail"] = {str(r): t for r, t in sorted(fatals.items())}
        if killed:
            errors.append(f"{problem or 'interrupted'}; killed ranks {killed}")
        crashed = [r for r, p in enumerate(procs)
                   if p.exitcode not in (0, None) and r not in fatals and r not in killed]
        if crashed:
            errors.append(f"ranks {crashed} died without a report (exit codes "
                          f"{[procs[r].exitcode for r in crashed]})")
        if not result_file.exists() and not errors:
            errors.append("ranks exited without a result")
        if errors or not result_file.exists():
            row.update(verify="error", error=" | ".join(errors))
            return row
        res = json.loads(result_file.read_text())
        meds = [g["median_ns"] / 1e6 for g in res["ranks"]]
        row.update(
            step_ms=max(meds),
            rank_median_ms=[round(x, 4) for x in meds],
            step_ms_min=max(g["min_ns"] / 1e6 for g in res["ranks"]),
            step_ms_mean=max(g["mean_ns"] / 1e6 for g in res["ranks"]),
            params=res["init"]["numel"],
            grad_mib=round(res["init"]["numel"] * 4 / 2**20, 2),
            init_sha256=res["init"]["sha256"],
            final_sha256=res["ranks"][0]["final"]["sha256"],
            final_sum=res["ranks"][0]["final"]["sum"],
            loss=res["ranks"][0]["loss"],
            replicas_identical=res["replicas_identical"],
        )
        problems = []
        if res["ranks"][0]["final"]["numel"] != res["init"]["numel"]:  # FSDP2: gathered whole?
            problems.append(f"final parameters have {res['ranks'][0]['final']['numel']} "
                            f"elements, the model {res['init']['numel']}")
        if not res["replicas_identical"]:
            problems.append(f"replicas differ: ranks {res['diverged_ranks']} != rank 0 "
                            f"(sums {[g['final']['sum'] for g in res['ranks']]})")
        if not res["finite"]:
            problems.append("non-finite parameters")
        if not res["trained"]:
            problems.append("parameters did not change")
        row["verify"] = "mismatch" if problems else "ok"
        if problems:
            row["problems"] = problems
        dest = keep_dir / (f"{model}-{wrapper}-{world_size}-{label}-"
                           f"{len(os.listdir(keep_dir))}.pt")
        shutil.move(str(rundir / "params.pt"), dest)
        row["_params_file"] = str(dest)
        return row
    finally:
        shutil.rmtree(rundir, ignore_errors=True)


def cross_check(rows: list, reference: str) -> None:
    """Compare the final parameters of every backend with `reference` (same model, wrapper
    and world size): same initial parameters, allclose(RTOL, ATOL) final ones. Updates
    rows."""
    import torch

    ref = next((r for r in rows if r["backend"] == reference and r.get("_params_file")), None)
    if ref is None:
        for r in rows:
            if r.get("verify") == "ok" and r["backend"] != reference:
                r["vs_ref"] = f"not compared ({reference} has no result)"
        return
    ref_params = torch.load(ref["_params_file"])
    for r in rows:
        if r is ref or not r.get("_params_file"):
            continue
        r["ref_backend"] = reference
        problems = r.setdefault("problems", [])
        if r["init_sha256"] != ref["init_sha256"]:
            problems.append(f"initial parameters differ from {reference}'s")
        p = torch.load(r["_params_file"])
        if p.shape != ref_params.shape:
            problems.append(f"{p.numel()} parameters vs {ref_params.numel()} in {reference}")
        else:
            diff = (p.double() - ref_params.double()).abs()
            r["vs_ref_max_abs_diff"] = float(diff.max())
            r["vs_ref_bitwise"] = bool(torch.equal(p, ref_params))
            if not torch.allclose(p, ref_params, rtol=RTOL, atol=ATOL):
                bad = int((~torch.isclose(p, ref_params, rtol=RTOL, atol=ATOL)).sum())
                problems.append(f"final parameters differ from {reference}'s: {bad} elements "
                                f"outside rtol={RTOL:g} atol={ATOL:g} (max abs diff "
                                f"{r['vs_ref_max_abs_diff']:.3g})")
        if problems:
            r["verify"] = "mismatch"
        else:
            r.pop("problems")


def run_benchmark(models=("mlp", "convnet"), world_sizes=(2, 4), backends=("shm", "gloo"),
                  steps=30, warmup=5, seed=0, timeout=300.0, compute_only=True,
                  reference=None, on_row=None, inject_error=None, wrappers=("ddp",)) -> list:
    """Run every (model, wrapper, world size, backend) and return the rows (dicts).

    compute_only: also time the plain model in one process (backend "compute", world size 1,
    one row per model). reference: the backend whose final parameters the others must match
    (default gloo if it runs, else the first backend). on_row(row) is called as rows finish.
    inject_error ("replica" or "backend"; a self-test): after training, perturb one parameter
    on the last rank (replica) or on every rank (backend) of every non-reference backend.
    """
    models, world_sizes, backends = list(models), list(world_sizes), list(backends)
    for m in models:
        if m not in MODELS:
            raise ValueError(f"unknown model {m!r}; known: {', '.join(MODELS)}")
    for w in wrappers:
        if w not in WRAPPERS:
            raise ValueError(f"unknown wrapper {w!r}; known: {', '.join(WRAPPERS)}")
    if reference is None:
        reference = "gloo" if "gloo" in backends else backends[0]
    rows = []
    keep_dir = Path(tempfile.mkdtemp(prefix="shmcoll-ddp-step-params-"))
    try:
        for model in models:
            compute = None
            if compute_only:
                compute = run_one(model, 1, None, steps, warmup, seed, timeout, keep_dir)
                compute.pop("_params_file", None)
                compute["world_size"] = 1
                rows.append(compute)
                if on_row:
                    on_row(compute)
            for wrapper, ws in ((w, n) for w in wrappers for n in world_sizes):
                group = [run_one(model, ws, b, steps, warmup, seed, timeout, keep_dir,
                                 inject_error=inject_error if b != reference else None,
                                 wrapper=wrapper)
                         for b in backends]
                cross_check(group, reference)
                if compute is not None and compute.get("init_sha256"):
                    for r in group:
                        if r.get("init_sha256") and r["init_sha256"] != compute["init_sha256"]:
                            r.setdefault("problems", []).append(
                                "initial parameters differ from the compute-only run's")
                            r["verify"] = "mismatch"
                for r in group:
                    f = r.pop("_params_file", None)
                    if f:
                        os.unlink(f)
                    if compute is not None and "step_ms" in r and "step_ms" in compute:
                        r["compute_ms"] = compute["step_ms"]
                        r["overhead_ms"] = r["step_ms"] - compute["step_ms"]
                        r["overhead_pct"] = 100.0 * r["overhead_ms"] / compute["step_ms"]
                    rows.append(r)
                    if on_row:
                        on_row(r)
    finally:
        shutil.rmtree(keep_dir, ignore_errors=True)
    _add_ratios(rows, reference)
    return rows


def _add_ratios(rows, reference) -> None:
    index = {}
    for r in rows:  # a backend listed twice (noise check): compare with its first run
        if "step_ms" in r:
            index.setdefault((r["model"], r.get("wrapper"), r["world_size"], r["backend"]), r)
    for r in rows:
        ref = index.get((r["model"], r.get("wrapper"), r["world_size"], reference))
        if "step_ms" in r and ref is not None and r["backend"] != COMPUTE and ref["step_ms"]:
            r[f"ratio_vs_{reference}"] = r["step_ms"] / ref["step_ms"]


# ---------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------
def format_table(rows, reference="gloo") -> str:
    rk = f"ratio_vs_{reference}"
    head = (f"{'model':<8} {'wrapper':<7} {'world_size':>10} {'backend':<8} {'step_ms':>9} "
            f"{'min_ms':>9} "
            f"{'overhead_ms':>11} {'overhead':>9} {'/' + reference:>9}  verify")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "step_ms" not in r:
            lines.append(f"{r['model']:<8} {r.get('wrapper') or '-':<7} {r['world_size']:>10} "
                         f"{r['backend']:<8} {'-':>9} {'-':>9} {'-':>11} {'-':>9} {'-':>9}  "
                         f"ERROR: {r.get('error', '?')}")
            continue
        ov = f"{r['overhead_ms']:11.2f}" if "overhead_ms" in r else f"{'-':>11}"
        pct = f"{r['overhead_pct']:8.0f}%" if "overhead_pct" in r else f"{'-':>9}"
        ratio = f"{r[rk]:9.3f}" if rk in r else f"{'-':>9}"
        verify = r["verify"]
        if r.get("problems"):
            verify += ": " + "; ".join(r["problems"])
        elif r.get("vs_ref_bitwise") is True:
            verify += f" (= {reference} bitwise)"
        elif "vs_ref_max_abs_diff" in r:
            verify += f" (max |diff| vs {reference} {r['vs_ref_max_abs_diff']:.2g})"
        lines.append(f"{r['model']:<8} {r.get('wrapper') or '-':<7} {r['world_size']:>10} "
                     f"{r['backend']:<8} {r['step_ms']:9.2f} {r['step_ms_min']:9.2f} {ov} {pct} "
                     f"{ratio}  {verify}")
    return "\n".join(lines)


def _header(args) -> dict:
    import platform

    import torch

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    try:
        from benchmarks.bench import git_commit
        commit = git_commit()
    except Exception:  # noqa: BLE001
        commit = None
    return {"record": "header", "benchmark": "ddp_step",
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "host": platform.node(), "cpu_cores": os.cpu_count(), "cpu_cores_usable": usable,
            "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "git_commit": commit,
            "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "command": " ".join(["python", "-m", "benchmarks.ddp_step"] + sys.argv[1:]),
            "settings": {"models": args.models, "wrappers": args.wrappers,
                         "world_sizes": args.world_sizes,
                         "backends": args.backends, "steps": args.steps,
                         "warmup": args.warmup, "seed": args.seed, "timeout": args.timeout,
                         "threads_per_rank": 1, "lr": LR, "rtol": RTOL, "atol": ATOL,
                         "batch": {m: MODELS[m][0] for m in args.models}}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.ddp_step",
        description="Time a DDP or FSDP2 training step (CPU) per backend, against the plain "
                    "model's step on one rank; verify that replicas and backends agree.",
        epilog="exit status: 0 ok, 1 verification mismatch, 3 a run failed/hung, 2 usage.")
    a = p.add_argument
    a("--backends", default="shm,gloo", help="comma list (default shm,gloo)")
    a("--world-sizes", dest="world_sizes", default="2,4", help="comma list (default 2,4)")
    a("--models", default="mlp,convnet", help=f"comma list of {','.join(MODELS)}")
    a("--wrappers", default="ddp", help=f"comma list of {','.join(WRAPPERS)} (default ddp; "
      "fsdp2 needs torch >= 2.6)")
    a("--steps", type=int, default=30, help="timed steps (default 30)")
    a("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    a("--seed", type=int, default=0, help="model and data seed (default 0)")
    a("--timeout", type=float, default=300.0,
      help="deadline in seconds for one run (spawn, init, all steps); past it the ranks are "
           "killed and an error row is reported (default 300)")
    a("--no-compute", dest="compute_only", action="store_false",
      help="skip the compute-only reference rows")
    a("--out", help="write a header and one JSON line per row here")
    a("--inject-error", dest="inject_error", choices=("replica", "backend"),
      help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.backends = _csv(args.backends)
        args.world_sizes = [int(x) for x in _csv(args.world_sizes)]
        args.models = _csv(args.models)
        args.wrappers = _csv(args.wrappers)
        bad = [m for m in args.models if m not in MODELS]
        if bad:
            raise ValueError(f"unknown model(s) {bad}; known: {', '.join(MODELS)}")
        bad = [w for w in args.wrappers if w not in WRAPPERS]
        if bad:
            raise ValueError(f"unknown wrapper(s) {bad}; known: {', '.join(WRAPPERS)}")
        if not args.backends or not args.world_sizes or not args.models or not args.wrappers:
            raise ValueError("--backends, --world-sizes, --models and --wrappers must not be "
                             "empty")
        if any(w < 1 for w in args.world_sizes) or args.steps < 1 or args.warmup < 0:
            raise ValueError("need world sizes >= 1, --steps >= 1, --warmup >= 0")
    except ValueError as e:
        parser.error(str(e))
    reference = "gloo" if "gloo" in args.backends else args.backends[0]

    header = _header(args)
    print(f"# training step benchmark ({','.join(args.wrappers)})  torch {header['torch']}  "
          f"python {header['python']}  "
          f"{header['cpu_cores_usable']} usable cores  load avg "
          f"{' '.join(f'{x:.2f}' for x in header['load_avg'] or [])}")
    print(f"# models {','.join(args.models)}  world sizes "
          f"{','.join(map(str, args.world_sizes))}  backends {','.join(args.backends)}  "
          f"steps {args.steps} (+{args.warmup} warmup)  1 thread/rank  SGD lr {LR}")
    if max(args.world_sizes) > (header["cpu_cores_usable"] or 1):
        print(f"# note: world size {max(args.world_sizes)} > {header['cpu_cores_usable']} "
              "usable cores: ranks share cores, so those rows measure contention as well")
    out = None
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        out = open(args.out, "w")
        out.write(json.dumps(header) + "\n")

    def on_row(r):
        t = f"{r['step_ms']:.2f} ms/step" if "step_ms" in r else f"ERROR {r.get('error')}"
        tag = f"{r['model']} {r['wrapper']}" if r.get("wrapper") else r["model"]
        print(f"  [{tag} world_size={r['world_size']} {r['backend']}] {t}, "
              f"{r['verify']} ({r['wall_s']:.1f}s wall)", flush=True)

    t0 = time.monotonic()
    try:
        rows = run_benchmark(args.models, args.world_sizes, args.backends, args.steps,
                             args.warmup, args.seed, args.timeout, args.compute_only,
                             reference, on_row, args.inject_error, args.wrappers)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        if out is not None:
            out.close()
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")

    print()
    print(format_table(rows, reference))
    print(f"\n# step_ms: median step time per rank, max over ranks; min_ms: fastest step "
          f"(max over ranks); overhead = step_ms - compute step_ms (plain model, 1 process); "
          f"/{reference}: step_ms / {reference}'s step_ms")
    mismatches = [r for r in rows if r.get("verify") == "mismatch"]
    errors = [r for r in rows if r.get("verify") == "error"]
    print(f"# {len(rows)} rows in {time.monotonic() - t0:.1f}s: {len(mismatches)} mismatch, "
          f"{len(errors)} error" + (f"; results: {args.out}" if args.out else ""))
    if mismatches:
        print("FAILED: verification mismatch (see above); exit status 1")
        return EXIT_MISMATCH
    return EXIT_ERROR if errors else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
