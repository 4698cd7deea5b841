"""pytest plugin used by run_suite.py (loaded with ``-p _conformance_plugin``).

* Streams one JSON line per test start/finish to ``$SHMCOLL_CONF_PROGRESS`` (flushed
  immediately) so the runner's watchdog knows which test is running and can kill a
  wedged pytest process without losing the results already produced.
* After every test, reaps rank processes that MultiProcessTestCase left behind (its
  tearDown only sends SIGTERM and never joins), so a stuck rank of test N can never
  bleed into test N+1.
"""

from __future__ import annotations

import json
import multiprocessing
import re
import os
import time

_PROGRESS = os.environ.get("SHMCOLL_CONF_PROGRESS")
_reports: dict[str, list] = {}
_starts: dict[str, float] = {}


def _emit(rec: dict) -> None:
    if not _PROGRESS:
        return
    rec["t"] = time.time()
    with open(_PROGRESS, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _message(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    try:
        text = report.longreprtext or ""
    except Exception:  # pragma: no cover
        text = str(report.longrepr or "")
    # keep the tail: the interesting part (rank tracebacks) is at the end
    return text[-6000:]


_ERR_RE = re.compile(r"^(?:E\s+)?([A-Za-z_.]*(?:Error|Exception|Timeout)\b.*)$")


def summary_line(msg: str) -> str:
    """Most informative single line of a failure text: the last 'XxxError: ...' line
    (rank tracebacks are embedded in the parent's RuntimeError), else the last line."""
    lines = [ln.strip() for ln in (msg or "").splitlines() if ln.strip()]
    for ln in reversed(lines):
        m = _ERR_RE.match(ln)
        if m and not m.group(1).startswith("RuntimeError: Process ") and ":" in m.group(1):
            return m.group(1)[:300]
    return lines[-1][:300] if lines else ""


def pytest_runtest_logstart(nodeid, location):
    _starts[nodeid] = time.time()
    _reports[nodeid] = []
    _emit({"event": "start", "nodeid": nodeid, "pid": os.getpid()})


def pytest_runtest_logreport(report):
    _reports.setdefault(report.nodeid, []).append(report)


def _reap_children() -> int:
    leaked = 0
    for p in multiprocessing.active_children():
        p.join(timeout=5)
        if p.is_alive():
            leaked += 1
            p.kill()
            p.join(timeout=5)
    return leaked


def pytest_runtest_logfinish(nodeid, location):
    reps = _reports.pop(nodeid, [])
    outcome, message = "passed", ""
    by_when = {r.when: r for r in reps}
    setup, call, teardown = (by_when.get(w) for w in ("setup", "call", "teardown"))
    if setup is not None and setup.failed:
        outcome, message = "error", _message(setup)
    elif setup is not None and setup.skipped:
        outcome, message = "skipped", _message(setup)
    elif call is not None and call.failed:
        outcome, message = "failed", _message(call)
    elif call is not None and call.skipped:
        outcome, message = "skipped", _message(call)
    elif call is None:
        outcome, message = "error", "no call phase recorded"
    if teardown is not None and teardown.failed and outcome in ("passed", "skipped"):
        outcome, message = "error", "teardown: " + _message(teardown)
    if call is not None and hasattr(call, "wasxfail"):
        outcome = "skipped" if call.skipped else "passed"
    leaked = _reap_children()
    _emit(
        {
            "event": "finish",
            "nodeid": nodeid,
            "outcome": outcome,
            "duration": round(time.time() - _starts.pop(nodeid, time.time()), 3),
            "message": message,
            "summary": summary_line(message) if outcome != "passed" else "",
            "leaked_rank_processes": leaked,
        }
    )
