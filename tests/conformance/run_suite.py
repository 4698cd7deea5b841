"""Run PyTorch's backend-agnostic distributed test suite against a plugin backend.

    python -m tests.conformance.run_suite --backend shm|gloo_plugin|shm_as_gloo|gloo_as_gloo|gloo \
        [--world-size 3] [--nodes N] [-k PATTERN] [--subset FILE] [--timeout-per-test 120] \
        [--junit out.xml] [--jobs N] [--chunk-size 60] [--out tally.json] \
        [--features plugin,ddp,subgroup[,gpu]] [--start-method spawn|forkserver] [--list]

How it runs (details in README.md):
  1. preflight: for shm modes, ``import shmcoll`` in a subprocess and check that it
     registered the "shm" plugin; a failure is reported (tally JSON with
     ``setup_error``, exit code 3) instead of a crash.
  2. collect: ``pytest --collect-only`` on tests/conformance/_suite.py (+ -k / subset).
  3. run: the test ids are cut into chunks; up to ``--jobs`` pytest processes run the
     chunks, each in its own session/process group with its own TEMP_DIR.  The
     _conformance_plugin streams per-test start/finish records; a watchdog kills a
     pytest process whose current test overruns (per-test timeout + grace), records
     that test as failed ("hang") and requeues the rest of the chunk.
  4. every process group that was started is SIGKILLed at the end (and on Ctrl-C), so
     no rank process survives the runner.
  5. writes the tally JSON (+ optional JUnit XML) and prints a summary line.

Exit codes: 0 all ran tests passed/skipped, 1 failures/errors, 3 setup error
(backend unavailable / collection failed), 130 interrupted.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SUITE_FILE = os.path.join(HERE, "_suite.py")
MODES = ("shm", "gloo_plugin", "shm_as_gloo", "gloo_as_gloo", "gloo")
SUITE_BACKEND = {"shm": "shm", "gloo_plugin": "gloo_plugin",
                 "shm_as_gloo": "gloo", "gloo_as_gloo": "gloo", "gloo": "gloo"}
# A subset file's "@as-gloo" section runs in the stand-in mode of the plugin it names.
AS_GLOO = {"shm": "shm_as_gloo", "gloo_plugin": "gloo_as_gloo"}
# beyond the in-suite timeout, before the runner kills pytest (env override for testing)
WATCHDOG_GRACE_S = int(os.environ.get("SHMCOLL_CONF_WATCHDOG_GRACE", "60"))
HEARTBEAT_S = 60


def log(msg: str) -> None:
    print(f"[conformance {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def base_env(args, temp_dir: str) -> dict:
    env = dict(os.environ)
    for k in ("BACKEND", "INIT_METHOD", "PYTEST_ADDOPTS"):
        env.pop(k, None)
    env.update(
        SHMCOLL_CONF_MODE=args.backend,
        BACKEND=SUITE_BACKEND[args.backend],
        WORLD_SIZE=str(args.world_size),
        TEMP_DIR=temp_dir,
        INIT_METHOD="env://",  # the suite's TestDistBackend uses file:// init anyway
        SHMCOLL_CONF_TEST_TIMEOUT=str(args.timeout_per_test),
        SHMCOLL_CONF_START_METHOD=args.start_method,
        SHMCOLL_CONF_FEATURES=args.features,
        SHMCOLL_CONF_NODES=str(args.nodes),
        PYTHONPATH=os.pathsep.join(
            [REPO, HERE] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        ),
        PYTHONUNBUFFERED="1",
        PYTHONFAULTHANDLER="1",
    )
    # keep the machine usable: ranks x jobs processes share few cores
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def pytest_cmd(ini: str, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "pytest",
        "-c", ini, "--rootdir", REPO,
        "--noconftest", "-p", "no:cacheprovider", "-p", "_conformance_plugin",
        "-W", "ignore::DeprecationWarning",
        "-q", "-rN", "--no-header", "--color=no",
    ] + extra


# ---------------------------------------------------------------- process control
_live_pgids: set[int] = set()


def kill_group(pgid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        except PermissionError:
            break
        if sig == signal.SIGTERM:
            deadline = time.time() + 3
            while time.time() < deadline:
                try:
                    os.killpg(pgid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
    _live_pgids.discard(pgid)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def kill_all() -> None:
    for pgid in list(_live_pgids):
        kill_group(pgid)


# ------------------------------------------------------------------- preflight
PREFLIGHT = r"""
import sys, traceback
mode = sys.argv[1]
try:
    import torch.distributed as dist
    if mode in ("shm", "shm_as_gloo"):
        import shmcoll
        if "SHM" not in dist.Backend._plugins:
            raise RuntimeError("'import shmcoll' did not register backend 'shm' "
                               "(dist.Backend.register_backend('shm', ...))")
    import expecttest
except BaseException:
    traceback.print_exc()
    sys.exit(1)
"""


def preflight(args, env) -> str | None:
    try:
        r = subprocess.run([sys.executable, "-c", PREFLIGHT, args.backend], env=env,
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "preflight timed out after 300 s (import shmcoll hangs?)"
    if r.returncode != 0:
        return (r.stdout + r.stderr).strip()[-6000:]
    return None


# ------------------------------------------------------------------- collection
def collect(args, env, ini) -> tuple[list[str], str | None]:
    extra = ["--collect-only", SUITE_FILE]
    if args.k:
        extra += ["-k", args.k]
    r = subprocess.run(pytest_cmd(ini, extra), env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=600)
    ids = [ln.strip() for ln in r.stdout.splitlines() if "::" in ln and " " not in ln.strip()]
    if r.returncode not in (0, 5) or (r.returncode != 0 and not ids):
        return ids, (r.stdout + r.stderr).strip()[-8000:]
    return ids, None


def test_name(nodeid: str) -> str:
    return nodeid.rsplit("::", 1)[-1]


def read_subset(path: str) -> tuple[list[str], dict, list[str]]:
    """Test names, one per line ('#' comments).  Directive lines set defaults that the
    command line overrides: '@features a,b,c' and '@start-method spawn|forkserver'.  The
    names after an '@as-gloo' line are the third value: tests gated on the literal backend
    name "gloo", run in the plugin's stand-in mode (AS_GLOO; README "Stand-in mode")."""
    names, directives, as_gloo = [], {}, []
    section = names
    with open(path) as f:
        for ln in f:
            ln = ln.split("#", 1)[0].strip()
            if ln == "@as-gloo":
                section = as_gloo
            elif ln.startswith("@"):
                key, _, val = ln[1:].partition(" ")
                directives[key.strip()] = val.strip().replace(" ", "")
            elif ln:
                section.append(ln)
    unknown = set(directives) - {"features", "start-method"}
    if unknown:
        raise SystemExit(f"{path}: unknown directive(s) {sorted(unknown)}")
    return names, directives, as_gloo


# ------------------------------------------------------------------- execution
class Slot:
    def __init__(self, idx: int, workdir: str):
        self.idx = idx
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None
        self.chunk: list[str] = []
        self.progress = ""
        self.offset = 0
        self.current: str | None = None
        self.current_since = 0.0
        self.done: set[str] = set()
        self.logf = None
        self.runs = 0
        self.last_activity = 0.0


def effective_timeout(name: str, default: int) -> int:
    # mirrors _suite.py: upstream TIMEOUT_OVERRIDE entries are kept when longer
    overrides = {"test_ddp_uneven_inputs": 400, "test_DistributedDataParallel": 500}
    return max(default, overrides.get(name, 0))


def run_tests(args, env_base, ini, ids, results, logdir) -> None:
    queue = collections.deque()
    cs = max(1, args.chunk_size)
    for i in range(0, len(ids), cs):
        queue.append(ids[i:i + cs])
    slots = [Slot(i, tempfile.mkdtemp(prefix=f"conf_slot{i}_")) for i in range(args.jobs)]
    total = len(ids)
    last_beat = time.time()

    def start(slot: Slot, chunk: list[str]) -> None:
        slot.runs += 1
        slot.chunk = chunk
        slot.done = set()
        slot.current = None
        slot.progress = os.path.join(slot.workdir, f"progress{slot.runs}.jsonl")
        slot.offset = 0
        temp_dir = os.path.join(slot.workdir, f"tmp{slot.runs}")
        os.makedirs(temp_dir, exist_ok=True)
        env = dict(env_base, TEMP_DIR=temp_dir, SHMCOLL_CONF_PROGRESS=slot.progress,
                   TMPDIR=temp_dir)
        if slot.logf is None:
            slot.logf = open(os.path.join(logdir, f"slot{slot.idx}.log"), "a")
        slot.logf.write(f"\n===== run {slot.runs}: {len(chunk)} tests =====\n")
        slot.logf.flush()
        slot.last_activity = time.time()
        slot.proc = subprocess.Popen(pytest_cmd(ini, chunk), env=env, cwd=REPO,
                                     stdout=slot.logf, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        _live_pgids.add(slot.proc.pid)

    def drain(slot: Slot) -> None:
        try:
            with open(slot.progress) as f:
                f.seek(slot.offset)
                data = f.read()
        except FileNotFoundError:
            return
        # only consume complete lines
        cut = data.rfind("\n") + 1
        slot.offset += len(data[:cut].encode())
        for ln in data[:cut].splitlines():
            try:
                rec = json.loads(ln)
            except ValueError:
                continue
            nid = rec.get("nodeid")
            slot.last_activity = time.time()
            if rec["event"] == "start":
                slot.current, slot.current_since = nid, rec["t"]
            elif rec["event"] == "finish":
                slot.done.add(nid)
                slot.current = None
                results[test_name(nid)] = {
                    "outcome": rec["outcome"],
                    "duration": rec["duration"],
                    "summary": rec.get("summary", ""),
                    "message": rec.get("message", ""),
                    "leaked_rank_processes": rec.get("leaked_rank_processes", 0),
                }
                if rec["outcome"] in ("failed", "error") and args.verbose:
                    log(f"{rec['outcome'].upper()} {test_name(nid)}")

    def finish_slot(slot: Slot, reason: str | None) -> None:
        """Reap the slot's process group; requeue unfinished tests, blame the current one."""
        pgid = slot.proc.pid
        kill_group(pgid)
        try:
            slot.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        drain(slot)
        rc = slot.proc.returncode
        if slot.current and slot.current not in slot.done:
            name = test_name(slot.current)
            msg = reason or f"pytest process died (rc={rc}) while running this test"
            results[name] = {"outcome": "failed" if reason else "error",
                             "duration": round(time.time() - slot.current_since, 3),
                             "summary": msg, "message": msg, "leaked_rank_processes": 0}
            slot.done.add(slot.current)
            log(f"{'HANG' if reason else 'CRASH'} {name}: {msg}")
        rest = [n for n in slot.chunk if n not in slot.done]
        if rest:
            if slot.done and (rc not in (0, 1) or reason):
                # the process was killed/crashed: retry the rest of the chunk
                queue.appendleft(rest)
            else:
                # pytest ran none of them, or exited normally without running them
                for n in rest:
                    msg = f"not run by pytest (rc={rc}); see logs in {logdir}"
                    results[test_name(n)] = {
                        "outcome": "error", "duration": 0.0, "leaked_rank_processes": 0,
                        "summary": msg, "message": msg}
        slot.proc = None
        slot.current = None

    try:
        while queue or any(s.proc for s in slots):
            for slot in slots:
                if slot.proc is None:
                    if queue:
                        start(slot, queue.popleft())
                    continue
                drain(slot)
                if slot.proc.poll() is not None:
                    finish_slot(slot, None)
                    if queue:
                        start(slot, queue.popleft())
                    continue
                if slot.current:
                    limit = effective_timeout(test_name(slot.current),
                                              args.timeout_per_test) + WATCHDOG_GRACE_S
                    elapsed = time.time() - slot.current_since
                    if elapsed > limit:
                        finish_slot(slot, f"hang: still running after {elapsed:.0f} s; "
                                          "killed by the runner watchdog")
                        if queue:
                            start(slot, queue.popleft())
                elif time.time() - slot.last_activity > args.timeout_per_test + WATCHDOG_GRACE_S + 120:
                    finish_slot(slot, "pytest made no progress outside any test "
                                      "(stuck importing/collecting?); killed by the runner watchdog")
                    if queue:
                        start(slot, queue.popleft())
            if time.time() - last_beat > HEARTBEAT_S:
                last_beat = time.time()
                c = collections.Counter(r["outcome"] for r in results.values())
                running = ", ".join(test_name(s.current) for s in slots if s.current)
                log(f"{len(results)}/{total} done {dict(c)}; running: {running}")
            time.sleep(0.25)
    finally:
        for slot in slots:
            if slot.proc is not None:
                kill_group(slot.proc.pid)
            if slot.logf:
                slot.logf.close()
            shutil.rmtree(slot.workdir, ignore_errors=True)


# --------------------------------------------------------------------- reports
def write_junit(path: str, results: dict, suite_name: str, wall: float) -> None:
    c = collections.Counter(r["outcome"] for r in results.values())
    ts = ET.Element("testsuite", name=suite_name, tests=str(len(results)),
                    failures=str(c["failed"]), errors=str(c["error"]),
                    skipped=str(c["skipped"]), time=f"{wall:.1f}")
    for name in sorted(results):
        r = results[name]
        tc = ET.SubElement(ts, "testcase", classname=f"conformance.{suite_name}",
                           name=name, time=str(r["duration"]))
        msg = r.get("message", "")
        first = r.get("summary") or (msg.strip().splitlines() or [""])[-1][:500]
        if r["outcome"] == "failed":
            ET.SubElement(tc, "failure", message=first).text = msg
        elif r["outcome"] == "error":
            ET.SubElement(tc, "error", message=first).text = msg
        elif r["outcome"] == "skipped":
            ET.SubElement(tc, "skipped", message=first)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    root = ET.Element("testsuites")
    root.append(ts)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _run_pass(args, names, work, ini, logdir, results, tally) -> int:
    """Preflight, collect and run the tests `names` (None: all) in mode args.backend,
    adding to `results` and `tally`; 0, or 3 on a setup error (recorded in tally)."""
    env = base_env(args, os.path.join(work, "collect_tmp"))
    os.makedirs(env["TEMP_DIR"], exist_ok=True)
    err = preflight(args, env)
    if err:
        tally["setup_error"] = f"backend {args.backend!r} is not usable:\n{err}"
        log(tally["setup_error"])
        return 3
    ids, err = collect(args, env, ini)
    if err:
        tally["setup_error"] = f"collection failed:\n{err}"
        log(tally["setup_error"])
        return 3
    if names is not None:
        by_name = {test_name(i): i for i in ids}
        missing = [n for n in names if n not in by_name]
        if missing:
            log(f"subset names not in the suite (ignored): {missing}")
            tally.setdefault("subset_missing", []).extend(missing)
        ids = [by_name[n] for n in names if n in by_name]
    tally["selected"] = tally.get("selected", 0) + len(ids)
    if args.list:
        print("\n".join(test_name(i) for i in ids))
        return 0
    log(f"{len(ids)} tests, backend={args.backend} "
        f"(BACKEND={SUITE_BACKEND[args.backend]}), world_size={args.world_size}, "
        f"features={args.features}, jobs={args.jobs}, start={args.start_method}, "
        f"timeout={args.timeout_per_test}s, logs: {logdir}")
    run_tests(args, env, ini, ids, results, logdir)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.conformance.run_suite",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", required=True, choices=MODES)
    ap.add_argument("--world-size", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=0,
                    help="simulate this many nodes (SHMCOLL_NODE_ID per rank, consecutive "
                         "blocks of ranks): backend shm then runs hierarchically")
    ap.add_argument("-k", dest="k", default=None, help="pytest -k expression")
    ap.add_argument("--subset", default=None,
                    help="file with one test name per line (# comments allowed)")
    ap.add_argument("--timeout-per-test", type=int, default=120,
                    help="seconds; the suite's own join timeout, the watchdog adds "
                         f"{WATCHDOG_GRACE_S}s grace")
    ap.add_argument("--junit", default=None, help="write JUnit XML here")
    ap.add_argument("--jobs", type=int, default=1, help="parallel pytest processes")
    ap.add_argument("--chunk-size", type=int, default=60,
                    help="tests per pytest process (amortizes the ~4 s import)")
    ap.add_argument("--out", default=None,
                    help="tally JSON path (default tests/conformance/results/<backend>.json)")
    ap.add_argument("--start-method", choices=("spawn", "forkserver"), default=None,
                    help="how ranks are started: spawn = upstream (default, or the subset "
                         "file's @start-method); forkserver = ranks forked from a server "
                         "that preloaded torch and the suite, ~10x cheaper per test")
    ap.add_argument("--features", default=None,
                    help="DistTestCases.backend_feature sets granted to the plugin name, "
                         "comma separated (default plugin,ddp,subgroup, or the subset "
                         "file's @features line); 'gpu' unlocks ~33 CPU tests")
    ap.add_argument("--list", action="store_true", help="only list the selected tests")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.world_size < 2:
        ap.error("--world-size must be >= 2")
    subset_names, as_gloo_names = None, []
    if args.subset:
        subset_names, directives, as_gloo_names = read_subset(args.subset)
        if args.features is None:
            args.features = directives.get("features")
        if args.start_method is None:
            args.start_method = directives.get("start-method")
    if args.features is None:
        args.features = "plugin,ddp,subgroup"
    if args.start_method is None:
        args.start_method = "spawn"
    if args.start_method not in ("spawn", "forkserver"):
        ap.error(f"bad start method {args.start_method!r}")
    out = args.out or os.path.join(HERE, "results", f"{args.backend}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    logdir = os.path.splitext(os.path.abspath(out))[0] + "-logs"
    shutil.rmtree(logdir, ignore_errors=True)
    os.makedirs(logdir, exist_ok=True)

    def _on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_term)

    work = tempfile.mkdtemp(prefix="shmcoll_conformance_")
    ini = os.path.join(work, "pytest.ini")
    with open(ini, "w") as f:  # isolates us from any project pytest config/addopts
        f.write("[pytest]\naddopts =\n")
    tally = {
        "backend": args.backend,
        "suite_backend": SUITE_BACKEND[args.backend],
        "world_size": args.world_size,
        "timeout_per_test": args.timeout_per_test,
        "jobs": args.jobs,
        "features": args.features if args.backend in ("shm", "gloo_plugin") else None,
        "start_method": args.start_method,
        "k": args.k,
        "subset": args.subset,
        "python": sys.version.split()[0],
    }
    t0 = time.time()
    shm_before = shm_entries()
    results: dict[str, dict] = {}
    rc = 0
    try:
        try:
            from importlib.metadata import version
            tally["torch"] = version("torch")
        except Exception:
            tally["torch"] = None
        passes = [(args.backend, subset_names)]
        if as_gloo_names and args.backend in AS_GLOO:
            passes.append((AS_GLOO[args.backend], as_gloo_names))
            tally["as_gloo"] = {"backend": AS_GLOO[args.backend], "tests": as_gloo_names}
        for mode, names in passes:
            rc = _run_pass(argparse.Namespace(**dict(vars(args), backend=mode)), names,
                           work, ini, logdir, results, tally)
            if rc:
                break
        if args.list:
            return 0
    except KeyboardInterrupt:
        log("interrupted; killing all spawned processes")
        tally["interrupted"] = True
        rc = 130
    finally:
        kill_all()
        shutil.rmtree(work, ignore_errors=True)

    wall = time.time() - t0
    c = collections.Counter(r["outcome"] for r in results.values())
    tally.update(
        wall_time_s=round(wall, 1),
        total=len(results),
        passed=c["passed"],
        failed=c["failed"],
        skipped=c["skipped"],
        errors=c["error"],
        leaked_rank_processes=sum(r.get("leaked_rank_processes", 0) for r in results.values()),
        new_dev_shm_entries=sorted(shm_entries() - shm_before),
        tests=dict(sorted(results.items())),
    )
    with open(out, "w") as f:
        json.dump(tally, f, indent=1)
    if args.junit:
        write_junit(args.junit, results, args.backend, wall)
    bad = sorted(n for n, r in results.items() if r["outcome"] in ("failed", "error"))
    for n in bad:
        first = results[n].get("summary") or results[n]["message"].strip()[-200:]
        print(f"  {results[n]['outcome'].upper():7s} {n}: {first}")
    if tally["new_dev_shm_entries"]:
        log(f"note: {len(tally['new_dev_shm_entries'])} /dev/shm entries appeared during the run "
            "and are still there (they may belong to other processes on this machine): "
            f"{tally['new_dev_shm_entries'][:10]}")
    if "setup_error" in tally:
        print(f"conformance: SETUP ERROR for backend {args.backend!r} (see above); no test ran")
        return rc
    # plain closing line (N passed, N failed, N skipped) for CI log readers
    log(f"backend={args.backend}: {len(results)} tests in {wall:.0f} s "
        f"({c['error']} of the failures are errors); tally: {out}")
    print(f"conformance: {c['passed']} passed, {c['failed'] + c['error']} failed, "
          f"{c['skipped']} skipped")
    if rc == 0 and (c["failed"] or c["error"]):
        rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
