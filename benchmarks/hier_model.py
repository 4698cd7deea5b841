"""A cost model of hierarchical "shm" (docs/MULTINODE.md, "Cost model"), checked against
measured points and used to predict larger clusters.

    python -m benchmarks.hier_model docs/results/hier.jsonl docs/results/hier_2x1.jsonl \\
        docs/results/hier_1x2.jsonl
    python -m benchmarks.hier_model --predict     # 8 x 8 and 64 x 8, assumed clusters

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
              from SPLIT_MIN per rank: max(a, intra(all_gather, L, S / N))
              + (N - 1) * S / (N L) / B + intra(all_gather, L, S (N - 1) / N)
              (the node's own blocks gathered while the first round is in flight,
              the other nodes' blocks after the exchange)
  plain gloo  ring over W = N L ranks: all_reduce 2 (W - 1) (g + S / (W Bg)),
              all_gather (W - 1) (g + S / (W Bg))
(the intra-node reduce + broadcast of the leaders' path costs about one intra-node
all_reduce; reduce-scatter + all-gather is exactly the two-shot all_reduce.) a, B come
from 2 x 1 runs (one rank per node: x alone), g, Bg from plain gloo at 2 x 1, intra from
1 x L runs; each fit is a least-squares line through (bytes, us).
"""

import json
import os
import sys
from pathlib import Path

from shmcoll.hier.reduce import HIER_SHARD_MIN_NBYTES as SHARD_MIN
from shmcoll.hier.move import ALL_GATHER_SPLIT_MIN_NBYTES as SPLIT_MIN
from shmcoll.hier.reduce import RS_MIN_NBYTES as RS_MIN

__all__ = ["fit_line", "predict_cluster", "main"]


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


# Assumed clusters for predictions (not measured here; docs/MULTINODE.md says why each):
# us, bytes/us. "cpu": 25 GbE, one NIC per node shared by its L channels, gloo over TCP,
# this engine inside an 8-core node. "gpu": NVLink inside a node (cuda_ipc),
# one 200 Gb/s NIC per local rank, NCCL between nodes (the untested seam).
CLUSTERS = {
    "cpu": dict(a=30.0, o=5.0, b_link=3.1e3, per_rank_nic=False, a_in=20.0, b_in=5e3,
                g=30.0, b_ring=3.1e3),
    "gpu": dict(a=10.0, o=2.0, b_link=25e3, per_rank_nic=True, a_in=10.0, b_in=150e3,
                g=5.0, b_ring=25e3),
}


def predict_cluster(c, op, nodes, local, nbytes):
    """(hierarchical, flat ring) time in us under the assumed cluster `c`."""
    b = c["b_link"] if c["per_rank_nic"] else c["b_link"] / local

    def intra(which, n):  # an engine all_reduce moves ~2(L-1)/L of n through each rank
        factor = 2 * (local - 1) / local if which == "all_reduce" else (local - 1) / local
        return c["a_in"] + factor * n / c["b_in"]

    def x(s, members):  # one exchange: latency + per-peer overhead + bytes on the link
        return c["a"] + (members - 1) * (c["o"] + s / b)
    if op == "all_reduce":
        sharded = local > 1 and nbytes >= SHARD_MIN
        s = nbytes / local if sharded else nbytes
        bl = b if sharded else c["b_link"]  # leaders alone on the link
        if nodes >= 3 and s >= RS_MIN:
            inter = 2 * c["a"] + 2 * (nodes - 1) * (c["o"] + s / nodes / bl)
        else:
            inter = c["a"] + (nodes - 1) * (c["o"] + s / bl)
        hier = intra("all_reduce", nbytes) + inter
        ring = 2 * (nodes * local - 1) * c["g"] + \
            2 * (nodes * local - 1) / (nodes * local) * nbytes / c["b_ring"]
    else:
        per_rank = nbytes / (nodes * local)
        if local > 1 and per_rank >= SPLIT_MIN:
            hier = max(c["a"], intra("all_gather", nbytes / nodes)) + \
                (nodes - 1) * (c["o"] + per_rank / b) + \
                intra("all_gather", nbytes * (nodes - 1) / nodes)
        else:
            hier = x(per_rank, nodes) + intra("all_gather", nbytes / nodes)
        ring = (nodes * local - 1) * (c["g"] + per_rank / c["b_ring"])
    return hier, ring


def print_predictions():
    sizes = [8, 64 << 10, 1 << 20, 16 << 20, 256 << 20]
    for name, c in CLUSTERS.items():
        for nodes, local in ((8, 8), (64, 8)):
            print(f"\n{name} cluster, {nodes} nodes x {local} ranks: predicted us "
                  f"(hierarchical / flat ring, ratio)")
            for op in ("all_reduce", "all_gather"):
                cells = []
                for n in sizes:
                    h, r = predict_cluster(c, op, nodes, local, n)
                    cells.append(f"{n:>10} B {h:10.0f} / {r:10.0f} ({r / h:5.2f}x)")
                print(f"  {op}:\n    " + "\n    ".join(cells))


def fit_latency_bandwidth(curve):
    """(a us, us per byte) of T = a + n * per_byte: a from the sizes up to 4 KiB (their
    median), per_byte from the slope through the sizes from 16 MiB."""
    small = sorted(t for n, t in curve.items() if n <= 4096)
    a = small[len(small) // 2] if small else 0.0
    big = [(n, t) for n, t in curve.items() if n >= 16 << 20]
    per_byte = fit_line(big)[1] if len(big) >= 2 else 0.0
    return a, per_byte


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--predict"]:
        print_predictions()
        return 0
    if len(argv) != 3:
        print(__doc__)
        return 2
    main_rows, inter_rows, intra_rows = (_rows(p) for p in argv)
    nodes, local = main_rows[0]["hosts"], main_rows[0]["ranks_per_host"]
    cores = os.cpu_count() or 1
    # every node of the checked run shares this machine's cores: CPU-bound steps run
    # `share` times slower than in the calibration runs (2 ranks each)
    share = max(1.0, nodes * local / cores) / max(1.0, 2 / cores)
    print(f"calibration: {argv[1]} (the inter-node exchange alone, 2 x 1) and {argv[2]} "
          f"(intra-node alone, 1 x 2); checked against {argv[0]} ({nodes} x {local}; "
          f"machine sharing factor {share:g})")
    for op in ("all_reduce", "all_gather"):
        x = _median_by(inter_rows, "shm", op)
        ring2 = _median_by(inter_rows, "gloo", op)
        intra_curve = _median_by(intra_rows, "shm", op)
        a, per_byte = fit_latency_bandwidth(_median_by(inter_rows, "shm", "all_reduce"))
        g2, gb2 = fit_latency_bandwidth(ring2)
        hier = _median_by(main_rows, "shm", op)
        plain = _median_by(main_rows, "gloo", op)
        print(f"\n{op}: exchange a = {a:.0f} us, {1 / per_byte / 1e3 if per_byte else 0:.2f} "
              f"GB/s; gloo at 2 ranks {g2:.0f} us, {1 / gb2 / 1e3 if gb2 else 0:.2f} GB/s")
        print(f"{'bytes':>11} | {'shm meas':>9} | {'shm model':>9} | {'ratio':>5} | "
              f"{'gloo meas':>9} | {'gloo model':>10} | {'ratio':>5}")
        w = nodes * local
        for nbytes in sorted(hier):
            if op == "all_reduce":
                s_x = nbytes / local if (local > 1 and nbytes >= SHARD_MIN) else nbytes
                model = share * (_interp(intra_curve, nbytes) + _interp(x, s_x))
                # ring: 2(W-1) steps; at 2 ranks g2 = 2 steps, gb2 = per byte of S
                ring = share * ((w - 1) * g2 + 2 * (w - 1) / w * nbytes * gb2)
            else:
                per_rank = nbytes / w
                own = _interp(intra_curve, nbytes / nodes)
                if local > 1 and per_rank >= SPLIT_MIN:  # own blocks during the first round
                    far = _interp(intra_curve, nbytes * (nodes - 1) / nodes)
                    model = share * (max(a, own) + _interp(x, 2 * per_rank) - a + far)
                else:
                    model = share * (own + _interp(x, 2 * per_rank))
                # ring: W-1 steps of S/W; at 2 ranks g2 = 1 step, gb2 = per byte of S/2
                ring = share * ((w - 1) * g2 + 2 * (w - 1) / w * nbytes * gb2)
            m, p = hier[nbytes], plain.get(nbytes, float("nan"))
            print(f"{nbytes:>11} | {m:9.0f} | {model:9.0f} | {model / m:5.2f} | {p:9.0f} | "
                  f"{ring:10.0f} | {ring / p:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
