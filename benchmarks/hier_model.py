"""A cost model of hierarchical "shm" (docs/MULTINODE.md, "Cost model"), checked against
measured points and used to predict larger clusters.

    python -m benchmarks.hier_model docs/results/hier.jsonl docs/results/hier_2x1.jsonl \\
        docs/results/hier_1x2.jsonl

Model (N nodes, L ranks per node, S bytes per rank: the all_reduce buffer, or the
all_gather output):
  intra(op, L, S)     the single-node engine's time for `op` at L ranks (measured, 1 x L)
  x(N, s)             one inter-node exchange in which every member of a channel sends s
                      bytes to each of the N-1 others and the node partials are reduced:
                      a + (N - 1) * s / B   (a: exchange latency; B: bytes/s a channel
                      gets; L channels of a node share its link: B = B_node / L, or, with
                      one NIC per local rank, B = B_nic)
  all_reduce  leaders: intra(all_reduce, L, S) + x(N, S)             (S < shard_min)
              sharded: intra(all_reduce, L, S) + x(N, S / L)         (from shard_min)
              from 3 nodes and S / L >= RS_MIN the exchange is reduce-scatter +
              all-gather: 2a + 2 (N - 1) / N * (S / L) / B
  all_gather  intra(all_gather, L, S / N) + x(N, S / (N L))          (equal nodes)
  plain gloo  ring over W = N L ranks: all_reduce 2 (W - 1) (g + S / (W Bg)),
              all_gather (W - 1) (g + S / (W Bg))
(the intra-node reduce + broadcast of the leaders' path costs about one intra-node
all_reduce; reduce-scatter + all-gather is exactly the two-shot all_reduce.) a, B come
from 2 x 1 runs (one rank per node: x alone), g, Bg from plain gloo at 2 x 1, intra from
1 x L runs; each fit is a least-squares line through (bytes, us).
"""

import json
import sys
from pathlib import Path

from shmcoll.hier.reduce import HIER_SHARD_MIN_NBYTES as SHARD_MIN
from shmcoll.hier.reduce import RS_MIN_NBYTES as RS_MIN

__all__ = ["fit_line", "predict_hier", "predict_ring", "main"]


def _rows(path):
    return [r for r in (json.loads(x) for x in Path(path).read_text().splitlines())
            if r.get("record") == "row"]


def _median_by(rows, backend, op):
    """{nbytes: median time_us over rounds}."""
    found = {}
    for r in rows:
        if r["backend"] == backend and r["op"] == op:
            found.setdefault(r["nbytes"], []).append(r["time_us"])
    return {k: sorted(v)[(len(v) - 1) // 2] for k, v in found.items()}


def fit_line(points):
    """(intercept, slope) of the least-squares line through [(x, y)]."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - slope * mx, slope


def _interp(curve, nbytes):
    """Time at nbytes from measured points (log-linear between them, linear beyond)."""
    xs = sorted(curve)
    if nbytes <= xs[0]:
        return curve[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if lo <= nbytes <= hi:
            f = (nbytes - lo) / (hi - lo)
            return curve[lo] + f * (curve[hi] - curve[lo])
    a, b = fit_line([(x, curve[x]) for x in xs[-3:]])
    return a + b * nbytes


def exchange_us(nodes, s, a, per_byte):
    """x(N, s) in us (per_byte: us per byte a channel moves)."""
    return a + (nodes - 1) * s * per_byte


def predict_hier(op, nodes, local, nbytes, intra, a, per_byte):
    """Model time (us) of hierarchical `op`; intra(op, nbytes) -> us at `local` ranks."""
    if op == "all_reduce":
        s = nbytes / local if (local > 1 and nbytes >= SHARD_MIN) else nbytes
        if nodes >= 3 and s >= RS_MIN:
            x = 2 * a + 2 * (nodes - 1) / nodes * s * per_byte
        else:
            x = exchange_us(nodes, s, a, per_byte)
        return intra("all_reduce", nbytes) + x
    per_rank = nbytes / (nodes * local)
    return intra("all_gather", nbytes / nodes) + exchange_us(nodes, per_rank, a, per_byte)


def predict_ring(op, world, nbytes, g, per_byte):
    steps = 2 * (world - 1) if op == "all_reduce" else world - 1
    return steps * (g + nbytes / world * per_byte)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3:
        print(__doc__)
        return 2
    main_rows, inter_rows, intra_rows = (_rows(p) for p in argv)
    nodes = main_rows[0]["hosts"]
    local = main_rows[0]["ranks_per_host"]
    print(f"calibration: {argv[1]} (x alone) and {argv[2]} (intra alone); "
          f"checked against {argv[0]} ({nodes} x {local})")
    for op in ("all_reduce", "all_gather"):
        x = _median_by(inter_rows, "shm", op)
        ring = _median_by(inter_rows, "gloo", op)
        if op == "all_reduce":  # x measured as an all_reduce at 2 x 1: s bytes per member
            a, b = fit_line(list(x.items()))
            g, bg = fit_line([(n, t / 2) for n, t in ring.items()])  # 2 (W-1) = 2 steps
        intra_curve = _median_by(intra_rows, "shm", op)

        def intra(which, nbytes, _c=_median_by(intra_rows, "shm", "all_reduce"),
                  _g=intra_curve):
            return _interp(_c if which == "all_reduce" else _g, nbytes)
        hier = _median_by(main_rows, "shm", op)
        plain = _median_by(main_rows, "gloo", op)
        print(f"\n{op}: a = {a:.0f} us, B = {1 / b / 1e3 if b else float('inf'):.2f} GB/s "
              f"per channel; gloo g = {g:.0f} us, Bg = "
              f"{1 / bg / 1e3 if bg else float('inf'):.2f} GB/s")
        print(f"{'bytes':>11} | {'shm meas':>9} | {'shm model':>9} | {'gloo meas':>9} | "
              f"{'gloo model':>10}")
        for nbytes in sorted(hier):
            m = predict_hier(op, nodes, local, nbytes, intra, a, b)
            r = predict_ring(op, nodes * local, nbytes, g, bg)
            print(f"{nbytes:>11} | {hier[nbytes]:9.0f} | {m:9.0f} | "
                  f"{plain.get(nbytes, float('nan')):9.0f} | {r:10.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
