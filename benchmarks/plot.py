"""Plots of benchmark rows: busbw vs size and latency vs size, one line per backend x world size.

    python -m benchmarks.plot results/bench.jsonl results/bench.png

One row of panels per op (left: busbw, right: time per op), log-log axes. Points whose
result was WRONG are drawn as large red crosses and labelled, so a fast wrong number is
never mistaken for a good one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullLocator  # noqa: E402

_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
_STYLES = ["-", "--", ":", "-."]


def _size_label(x, _pos=None) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if x >= scale:
            v = x / scale
            return f"{v:g}{unit}"
    return f"{x:g}B"


def plot_rows(rows, path, title=None) -> str:
    rows = [r for r in rows if r.get("record", "row") == "row"]
    if not rows:
        raise ValueError("no rows to plot")
    ops = list(dict.fromkeys(r["op"] for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    sizes_ws = sorted({r["world_size"] for r in rows})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    fig, axes = plt.subplots(len(ops), 2, figsize=(13, 4.2 * len(ops)), squeeze=False)
    for i, op in enumerate(ops):
        ax_bw, ax_t = axes[i]
        for b_idx, backend in enumerate(backends):
            for w_idx, ws in enumerate(sizes_ws):
                pts = sorted((r for r in rows if r["op"] == op and r["backend"] == backend
                              and r["world_size"] == ws), key=lambda r: r["nbytes"])
                if not pts:
                    continue
                style = dict(color=colors[b_idx % len(colors)],
                             linestyle=_STYLES[w_idx % len(_STYLES)],
                             marker=_MARKERS[w_idx % len(_MARKERS)], markersize=4,
                             label=f"{backend} n={ws}")
                x = [r["nbytes"] for r in pts]
                ax_bw.plot(x, [max(r["busbw_GBps"], 1e-9) for r in pts], **style)
                ax_t.plot(x, [r["time_us"] for r in pts], **style)
                for r in pts:
                    if r.get("wrong"):
                        for ax, y in ((ax_bw, max(r["busbw_GBps"], 1e-9)),
                                      (ax_t, r["time_us"])):
                            ax.plot([r["nbytes"]], [y], marker="X", color="red",
                                    markersize=14, linestyle="none", zorder=5)
                            ax.annotate("WRONG", (r["nbytes"], y), color="red",
                                        fontsize=8, xytext=(4, 6),
                                        textcoords="offset points")
        for ax, ylabel in ((ax_bw, "busbw (GB/s)"), (ax_t, "time per op (us)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ticks = sorted({r["nbytes"] for r in rows if r["op"] == op})
            if len(ticks) > 12:
                ticks = ticks[::-(-len(ticks) // 12)]
            ax.set_xticks(ticks)
            ax.xaxis.set_minor_locator(NullLocator())
            ax.xaxis.set_major_formatter(FuncFormatter(_size_label))
            ax.set_xlabel("size (bytes)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{op}: {ylabel.split(' (')[0]} vs size")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    height = fig.get_figheight()
    top = 1.0 - 0.15 / height
    if title:
        fig.text(0.5, top, title, ha="center", va="top", fontsize=10)
        top -= 0.25 / height
    if any(r.get("wrong") for r in rows):
        fig.text(0.5, top, "RED X = WRONG RESULT (the number is meaningless)", color="red",
                 ha="center", va="top", fontsize=11, weight="bold")
        top -= 0.3 / height
    fig.tight_layout(rect=(0, 0, 1, top))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jsonl", help="results written by `benchmarks.bench --out`")
    p.add_argument("png", help="where to save the figure")
    args = p.parse_args(argv)
    rows, title = [], None
    with open(args.jsonl) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec.get("record") == "header":
                title = (f"{rec.get('cpu_model')} ({rec.get('cpu_cores')} cores), "
                         f"torch {rec.get('torch')}, {rec.get('date')}")
            elif rec.get("record", "row") == "row":
                rows.append(rec)
    print(plot_rows(rows, args.png, title=title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
