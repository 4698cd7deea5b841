"""Result rows of benchmarks.bench: how a row is made, printed, compared and merged.

A row is one (backend, op, world size, nbytes) measurement with the COLUMNS below;
busbw = algbw * the op's bus factor (collectives.py). Rows come from the torch ranks, the
mpi4py peer and the memcpy peer alike (make_row); Reporter prints them as they arrive and
writes them as JSON lines; ratio_table and memcpy_table compare backends; merge_rounds
keeps the median round of a --rounds sweep.
"""

from __future__ import annotations

import json
import math

from benchmarks.sizes import human

__all__ = ["MPI4PY", "MEMCPY", "DEEPSPEED", "COLUMNS", "MEMCPY_TARGET", "make_row",
           "table_title", "table_head", "table_row", "ratio_table", "memcpy_table",
           "load_jsonl", "merge_rounds", "Reporter"]

# The reference peers' names in --backends: not torch.distributed backends (benchmarks/peers.py).
MPI4PY, MEMCPY, DEEPSPEED = "mpi4py", "memcpy", "deepspeed"
COLUMNS = ("backend", "op", "world_size", "nbytes", "count", "dtype", "iters", "time_us",
           "algbw_GBps", "busbw_GBps", "wrong")


_W = dict(backend=8, op=14, world_size=10, nbytes=12, count=12, dtype=9, iters=6,
          time_us=12, algbw_GBps=11, busbw_GBps=11, wrong=7)


def table_title(op, backend, world_size, dtype) -> str:
    return f"\n## {op}  backend={backend}  world_size={world_size}  dtype={dtype}"


def table_head() -> str:
    return " ".join(f"{c:<{_W[c]}}" if c in ("backend", "op", "dtype") else f"{c:>{_W[c]}}"
                    for c in COLUMNS)


def table_row(r: dict) -> str:
    cells = []
    for c in COLUMNS:
        v = r.get(c)
        if c in ("backend", "op", "dtype"):
            cells.append(f"{v:<{_W[c]}}")
        elif c == "time_us":
            cells.append(f"{v:>{_W[c]}.2f}")
        elif c in ("algbw_GBps", "busbw_GBps"):
            cells.append(f"{v:>{_W[c]}.3f}")
        else:
            cells.append(f"{v:>{_W[c]}}")
    line = " ".join(cells)
    if r.get("wrong"):
        line += f"   <-- WRONG RESULT ({r['wrong']} bad elements): numbers meaningless"
    return line


def ratio_table(rows, a: str, b: str) -> str:
    """Compare backend ``a`` with backend ``b`` on every (op, world_size, nbytes) both have.

    lat a/b = time_us(a) / time_us(b)      (< 1: a has lower latency)
    busbw a/b = busbw(a) / busbw(b)        (> 1: a moves data faster)
    A row where either side produced a wrong result shows WRONG instead of ratios.
    Returns a printable string ('' if the two backends share no measurement).
    """
    index = {(r["backend"], r["op"], r["world_size"], r["nbytes"]): r
             for r in rows if r.get("record", "row") == "row"}
    keys = sorted({k[1:] for k in index if k[0] == a} & {k[1:] for k in index if k[0] == b},
                  key=lambda k: (k[0], k[1], k[2]))
    if not keys:
        return ""
    ha, hb = f"t_{a}_us", f"t_{b}_us"
    wa, wb = max(12, len(ha)), max(12, len(hb))
    lines = [f"\n## {a} vs {b}   (lat {a}/{b} < 1 and busbw {a}/{b} > 1 mean {a} is faster)",
             f"{'op':<14} {'world_size':>10} {'nbytes':>12} {ha:>{wa}} {hb:>{wb}} "
             f"{'lat ' + a + '/' + b:>16} {'busbw ' + a + '/' + b:>18}"]
    for op, ws, nb in keys:
        ra, rb = index[(a, op, ws, nb)], index[(b, op, ws, nb)]
        if ra.get("wrong") or rb.get("wrong"):
            who = "+".join(x for x, r in ((a, ra), (b, rb)) if r.get("wrong"))
            lat = bus = f"WRONG({who})"
        else:
            lat = _ratio(ra["time_us"], rb["time_us"])
            bus = _ratio(ra["busbw_GBps"], rb["busbw_GBps"])
        lines.append(f"{op:<14} {ws:>10} {nb:>12} {ra['time_us']:>{wa}.2f} "
                     f"{rb['time_us']:>{wb}.2f} {lat:>16} {bus:>18}")
    return "\n".join(lines)


def _ratio(x, y) -> str:
    if not y or not math.isfinite(x) or not math.isfinite(y):
        return "n/a"
    return f"{x / y:.3f}"


# Project target: shm all_reduce busbw at world size 2 from 16 MiB up >= 1/6 of single-core
# memcpy read+write bandwidth.
MEMCPY_TARGET = dict(backend="shm", op="all_reduce", world_size=2, min_nbytes=16 << 20,
                     ratio=1 / 6)


def memcpy_table(rows) -> str:
    """busbw of every collective row / single-core memcpy read+write bandwidth (2*nbytes/time
    of the memcpy row of the same nbytes, else of the nearest size, marked '~').

    One line per (op, world_size, nbytes), one column per backend. '' without memcpy rows.
    """
    rows = [r for r in rows if r.get("record", "row") == "row"]
    mem = {r["nbytes"]: r for r in rows if r["backend"] == MEMCPY}
    coll = [r for r in rows if r["backend"] != MEMCPY]
    if not mem or not coll:
        return ""
    backends = list(dict.fromkeys(r["backend"] for r in coll))
    index = {(r["op"], r["world_size"], r["nbytes"], r["backend"]): r for r in coll}
    keys = sorted({k[:3] for k in index})
    t = MEMCPY_TARGET
    wb = max([14] + [len(f"busbw/memcpy {b}") for b in backends])
    lines = [f"\n## busbw / memcpy read+write bandwidth   (memcpy_rw = 2*nbytes/time of one "
             f"single-core np.copyto of nbytes; target: {t['backend']} {t['op']} world_size "
             f"{t['world_size']}, >= {human(t['min_nbytes'])}: ratio >= 1/"
             f"{round(1 / t['ratio'])} = {t['ratio']:.3f})",
             f"{'op':<14} {'world_size':>10} {'nbytes':>12} {'memcpy_rw_GBps':>15} "
             + " ".join(f"{'busbw/memcpy ' + b:>{wb}}" for b in backends) + "  target"]
    for op, ws, nb in keys:
        near = nb if nb in mem else min(mem, key=lambda m: abs(math.log(m / nb)))
        m = mem[near]
        mark = "" if near == nb else "~"
        cells, verdict = [], ""
        for b in backends:
            r = index.get((op, ws, nb, b))
            if r is None:
                cells.append(f"{'-':>{wb}}")
                continue
            if r.get("wrong") or m.get("wrong"):
                cells.append(f"{'WRONG':>{wb}}")
                val = None
            else:
                ratio = _ratio(r["busbw_GBps"], m["busbw_GBps"])
                cells.append(f"{mark + ratio:>{wb}}")
                val = float(ratio) if ratio != "n/a" else None
            if (b == t["backend"] and op == t["op"] and ws == t["world_size"]
                    and nb >= t["min_nbytes"]):
                verdict = ("WRONG" if val is None and r.get("wrong") else
                           "n/a" if val is None else
                           "ok" if val >= t["ratio"] else "BELOW")
        mem_cell = f"{m['busbw_GBps']:.3f}" + (f" @{human(near)}" if mark else "")
        lines.append(f"{op:<14} {ws:>10} {nb:>12} {mem_cell:>15} " + " ".join(cells)
                     + (f"  {verdict}" if verdict else ""))
    return "\n".join(lines)


def load_jsonl(path) -> list:
    records = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                records.append(json.loads(line))
    return records


def merge_rounds(rows) -> list:
    """One row per (backend, op, world size, size): with --rounds R, the round whose time
    is the median of the R (the middle one; the faster middle for even R), so one noisy
    round on a shared host moves no number. A row wrong in any round stays wrong."""
    groups = {}
    for r in rows:
        if r.get("record", "row") == "row":
            groups.setdefault((r["backend"], r["op"], r["world_size"], r["nbytes"]), []).append(r)
    merged = []
    for group in groups.values():
        ordered = sorted(group, key=lambda r: r["time_us"])
        pick = dict(ordered[(len(ordered) - 1) // 2])
        if len(group) > 1:
            pick["rounds"] = len(group)
            pick["wrong"] = max(r["wrong"] for r in group)
        merged.append(pick)
    return merged


def make_row(backend, spec, n, nbytes, count, dtype, iters, warm, medians_ns, mins_ns,
             wrong) -> dict:
    """One result row from every rank's median / fastest iteration (ns) and the summed wrong
    count. Shared by the torch ranks and the mpi4py peer (benchmarks/mpi_peer.py)."""
    med_us = [float(x) / 1e3 for x in medians_ns]
    t_us = max(med_us)
    algbw = nbytes / (t_us * 1e-6) / 1e9 if t_us > 0 else float("inf")
    return {
        "record": "row", "backend": backend, "op": spec.name,
        "world_size": n, "nbytes": nbytes, "count": count,
        "dtype": dtype, "time_us": t_us, "algbw_GBps": algbw,
        "busbw_GBps": algbw * spec.busbw_factor(n),
        "wrong": int(wrong), "iters": iters, "warmup": warm,
        "rank_median_us": [round(x, 3) for x in med_us],
        "time_us_min": max(float(x) / 1e3 for x in mins_ns),
    }


class Reporter:
    """Prints tables as rows arrive, keeps rows and error records."""

    def __init__(self, out_file=None):
        self.rows, self.errors, self.warnings, self.skips = [], [], [], []
        self._group = None
        self._out = out_file
        self.round = None  # with --rounds: the round the next rows belong to

    def _write(self, rec):
        if self._out is not None:
            self._out.write(json.dumps(rec) + "\n")
            self._out.flush()

    def row(self, r):
        if self.round is not None:
            r = {**r, "round": self.round}
        group = (r["op"], r["backend"], r["world_size"])
        if group != self._group:
            self._group = group
            print(table_title(r["op"], r["backend"], r["world_size"], r["dtype"]))
            print(table_head())
        print(table_row(r), flush=True)
        self.rows.append(r)
        self._write(r)

    def error(self, backend, world_size, kind, message, **extra):
        rec = {"record": "error", "backend": backend, "world_size": world_size, "kind": kind,
               **extra, "message": message}
        self.errors.append(rec)
        self._group = None
        where = " ".join(f"{k}={v}" for k, v in extra.items() if k != "detail")
        print(f"\n!! [{backend} world_size={world_size}{' ' + where if where else ''}] "
              f"{kind}: {message}", flush=True)
        self._write(rec)

    def skip(self, backend, world_size, reason):
        """A configuration that cannot run here, for a known reason: recorded, not an error."""
        rec = {"record": "skip", "backend": backend, "world_size": world_size,
               "reason": reason}
        self.skips.append(rec)
        self._group = None
        print(f"\n-- [{backend} world_size={world_size}] skipped: {reason}", flush=True)
        self._write(rec)

    def warn(self, backend, world_size, message):
        self.warnings.append(f"[{backend} world_size={world_size}] {message}")
        print(f"\n?? [{backend} world_size={world_size}] {message}", flush=True)
