"""Markdown tables of a benchmarks.bench run (the README's report), from its JSON lines.

    python -m benchmarks.bench --report --out results/report.jsonl --plot results/report.png
    python -m benchmarks.report results/report.jsonl

Per collective and world size: latency (median time per call, us) at the small sizes and
busbw (GB/s) at the large ones, shm and the peers of the run (gloo, mpi4py, deepspeed) side
by side, gloo's time over shm's, and shm's busbw as a fraction of the machine's single-core
memcpy read+write bandwidth at the same size (the memcpy rows of the run). Sizes missing from the
run are left out; a backend that failed shows "-".
"""

from __future__ import annotations

import json
import sys

LATENCY_SIZES = (8, 1 << 10, 64 << 10)
BUSBW_SIZES = (1 << 20, 16 << 20, 256 << 20)
PEERS = ("gloo", "mpi4py", "deepspeed")  # those present in the run


def load(path):
    """Rows by (backend, op, world size, size); with several rounds, the median round's
    (bench.merge_rounds)."""
    from benchmarks.bench import merge_rounds

    rows = [json.loads(line) for line in open(path) if line.strip()]
    return {(r["backend"], r["op"], r["world_size"], r["nbytes"]): r
            for r in merge_rounds(rows) if not r.get("wrong")}


def _size(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} B"


def _near(rows, backend, op, ws, nbytes):
    """The row of this size; all_gather/reduce_scatter round sizes to multiples of ws."""
    for (b, o, w, n), r in rows.items():
        if b == backend and o == op and w == ws and nbytes <= n < nbytes + 16 * ws:
            return r
    return None


def tables(rows):
    out = []
    ops = sorted({k[1] for k in rows if k[0] != "memcpy"},
                 key=lambda o: ("all_reduce", "broadcast", "all_gather", "reduce_scatter",
                                "reduce", "all_to_all").index(o))
    peers = [p for p in PEERS if any(k[0] == p for k in rows)]
    memcpy = {k[3]: r for k, r in rows.items() if k[0] == "memcpy"}
    for op in ops:
        sizes_l = [n for n in LATENCY_SIZES if any(_near(rows, "shm", op, w, n)
                                                   for w in (2, 4, 8))]
        sizes_b = [n for n in BUSBW_SIZES if any(_near(rows, "shm", op, w, n)
                                                 for w in (2, 4, 8))]
        head = ["ranks"] + [f"{_size(n)} us (shm / {' / '.join(peers)})" for n in sizes_l] + \
            [f"{_size(n)} busbw GB/s (shm / {' / '.join(peers)})" for n in sizes_b] + \
            ["shm x gloo (time)", "shm / memcpy r+w"]
        out += [f"**{op}**", "", "| " + " | ".join(head) + " |",
                "|" + "---|" * len(head)]
        for ws in sorted({k[2] for k in rows if k[1] == op and k[0] == "shm"}):
            cells, speed, mem = [str(ws)], [], []
            for n in sizes_l + sizes_b:
                got = {b: _near(rows, b, op, ws, n) for b in ("shm", *peers)}
                lat = n in sizes_l
                key = "time_us" if lat else "busbw_GBps"
                fmt = "{:.0f}" if lat else "{:.2f}"
                cells.append(" / ".join(fmt.format(got[b][key]) if got[b] else "-"
                                        for b in ("shm", *peers)))
                if got["shm"] and got.get("gloo"):
                    speed.append(got["gloo"]["time_us"] / got["shm"]["time_us"])
                if not lat and got["shm"] and got["shm"]["nbytes"] in memcpy:
                    mem.append(got["shm"]["busbw_GBps"] /
                               memcpy[got["shm"]["nbytes"]]["busbw_GBps"])
                elif not lat and got["shm"]:
                    m = _near(rows, "memcpy", "memcpy", 1, n)
                    if m:
                        mem.append(got["shm"]["busbw_GBps"] / m["busbw_GBps"])
            cells.append(f"{min(speed):.1f}-{max(speed):.1f}x" if speed else "-")
            cells.append(" / ".join(f"{m:.2f}" for m in mem) if mem else "-")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    if memcpy:
        out.append("memcpy (single core, read+write GB/s): " + ", ".join(
            f"{_size(n)} {r['busbw_GBps']:.1f}" for n, r in sorted(memcpy.items())
            if n in BUSBW_SIZES))
    return "\n".join(out)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(tables(load(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
