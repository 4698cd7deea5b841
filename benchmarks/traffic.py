"""The traffic model of benchmarks.bench: how many bytes each shm row's algorithm moves per
rank, and the time this machine's copy bandwidth needs for them (the row's ceiling).

Every shm row records the algorithm `algorithms.select()` chose for it (`algorithm_of`,
asked in rank 0 of the run). `bytes_per_rank` counts, for that algorithm, the bytes one
rank reads plus the bytes it writes on the collective's critical path, with S the bytes
per rank the algorithm works on (all_reduce, broadcast: the buffer; all_gather: the input,
nbytes / N; reduce_scatter: the input) and N the world size:

| algorithm | read + written per rank | why |
|---|---|---|
| all_reduce_one_shot | (N + 3) S | copy in S (2S); read N copies, write S |
| all_reduce_two_shot | (5 + 1/N) S | copy in (2S); reduce S/N of N (S + 3S/N); gather 2(N-1)S/N |
| all_reduce_single_copy | (3N - 1) S | fetch (N-1) S into scratch (2(N-1)S); reduce N S, write S |
| broadcast_direct | 4 S | root copies in (2S), then the others copy out (2S): one after the other |
| broadcast_streamed | 2 S + 2 sub | the two copies overlap, but for the root's first sub-chunk |
| broadcast_single_copy | 2 S | the others read the root's buffer (S) and write theirs (S) |
| all_gather_direct | (2N + 2) S | copy in (2S); read and write N S |
| all_gather_single_copy | 2N S | read and write N S (peers' straight from their buffers) |
| reduce_scatter_direct | (3 + 1/N) S | copy in (2S); read N S/N, write S/N |
| reduce_scatter_single_copy | (3 - 1/N) S | fetch (N-1) S/N into scratch; read N S/N, write S/N |
| all_to_all_direct | (4 - 2/N) S up to a slot, else 2 S | riding with the size table: copy the peers' blocks in and out (4 (N-1)/N S), my own once (2S/N); above a slot, read and write S (peers' blocks straight from their buffers) |

The ceiling is that many bytes at the single-core copy bandwidth (read + write bytes per
second of one np.copyto of the row's size: the memcpy peer's rows when the run has them,
else `copy_bandwidth`, measured in the parent): every rank copies on its own core, in
parallel, and nothing else costs time. `ceiling_table` prints per row the ceiling and
t_ceiling / t, which is also busbw / the ceiling's busbw (1: at the limit).
"""

from __future__ import annotations

import math
import statistics
import time

from benchmarks.sizes import human

__all__ = ["MODEL", "per_rank_bytes", "bytes_per_rank", "algorithm_of", "copy_bandwidth",
           "ceiling_table"]

# algorithm -> bytes read + written per rank, as a function of (S, N, a size the algorithm
# works in: broadcast_streamed's sub-chunk, all_to_all_direct's slot).
MODEL = {
    "all_reduce_one_shot": lambda s, n, sub: (n + 3) * s,
    "all_reduce_two_shot": lambda s, n, sub: (5 + 1 / n) * s,
    "all_reduce_single_copy": lambda s, n, sub: (3 * n - 1) * s,
    "broadcast_direct": lambda s, n, sub: 4 * s,
    "broadcast_streamed": lambda s, n, sub: 2 * s + 2 * min(s, sub),
    "broadcast_single_copy": lambda s, n, sub: 2 * s,
    "all_gather_direct": lambda s, n, sub: (2 * n + 2) * s,
    "all_gather_single_copy": lambda s, n, sub: 2 * n * s,
    "reduce_scatter_direct": lambda s, n, sub: (3 + 1 / n) * s,
    "reduce_scatter_single_copy": lambda s, n, sub: (3 - 1 / n) * s,
    "all_to_all_direct": lambda s, n, slot: (4 - 2 / n) * s if _a2a_rides(s, n, slot) else 2 * s,
}


def _a2a_rides(s, n, slot):
    from shmcoll.protocol import a2a_head_nbytes
    return a2a_head_nbytes(n) + s - s // n <= slot


def per_rank_bytes(op, nbytes, world_size):
    """S: the bytes per rank the engine's algorithm works on (what select() is given)."""
    return nbytes // world_size if op == "all_gather" else nbytes


def bytes_per_rank(algorithm, op, nbytes, world_size):
    """Bytes one rank reads + writes for the row (None: no model for that algorithm)."""
    model = MODEL.get(algorithm)
    if model is None:
        return None
    sub = 0
    if algorithm == "broadcast_streamed":
        from shmcoll.algorithms.broadcast import BROADCAST_SUB_NBYTES
        sub = BROADCAST_SUB_NBYTES
    elif algorithm == "all_to_all_direct":  # the messages ride up to a slot (its docstring)
        from shmcoll import config
        sub = config.from_env().slot_nbytes
    return float(model(per_rank_bytes(op, nbytes, world_size), world_size, sub))


def algorithm_of(op, nbytes, world_size):
    """The name of the algorithm shm's default group runs `op` of the bench's `nbytes` with
    (rank side, after init_process_group("shm")), or None where it cannot tell."""
    try:
        import torch
        import torch.distributed as dist
        pg = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        return pg.group.algorithm_name(op, per_rank_bytes(op, nbytes, world_size))
    except Exception:  # noqa: BLE001 - another backend, a hierarchical group: no model
        return None


def copy_bandwidth(sizes, reps=15):
    """{nbytes: read + write bytes per second of one single-core np.copyto}, measured now on
    torch-allocated buffers (the ranks' memory kind), median of `reps` after a warm-up."""
    import numpy as np
    import torch
    out = {}
    for n in sizes:
        a = torch.empty(max(1, n // 4)).numpy()
        b = torch.empty_like(torch.from_numpy(a)).numpy()
        a[:] = 1.0
        b[:] = 0.0
        times = []
        for k in range(reps + 3):
            b.fill(0.0)  # as the memcpy peer: the destination written just before
            t = time.perf_counter()
            np.copyto(b, a)
            if k >= 3:
                times.append(time.perf_counter() - t)
        out[n] = 2 * a.nbytes / max(statistics.median(times), 1e-9)
    return out


def ceiling_table(rows, copy_bw) -> str:
    """Per shm row with an algorithm: bytes per rank, the copy bandwidth at S (`copy_bw`:
    {nbytes: B/s}, nearest size, marked '~'), the ceiling time, and t_ceiling / t."""
    rows = [r for r in rows if r.get("record", "row") == "row" and r.get("algorithm")]
    if not rows or not copy_bw:
        return ""
    lines = ["\n## traffic model: bytes per rank of the algorithm and the ceiling they give at "
             "this machine's single-core copy bandwidth (t_ceiling/t = busbw / ceiling busbw; "
             "1 = at the limit)",
             f"{'op':<14} {'world_size':>10} {'nbytes':>12} {'algorithm':<26} {'bytes/rank':>11} "
             f"{'x S':>6} {'copy_GBps':>10} {'t_ceiling_us':>13} {'t_us':>10} "
             f"{'t_ceiling/t':>12}"]
    for r in sorted(rows, key=lambda r: (r["op"], r["world_size"], r["nbytes"])):
        op, n, nb, algo = r["op"], r["world_size"], r["nbytes"], r["algorithm"]
        moved = bytes_per_rank(algo, op, nb, n)
        s = per_rank_bytes(op, nb, n)
        near = s if s in copy_bw else min(copy_bw, key=lambda m: abs(math.log(m / max(s, 1))))
        bw = copy_bw[near]
        mark = "" if near == s else "~"
        if moved is None:
            lines.append(f"{op:<14} {n:>10} {nb:>12} {algo:<26} {'?':>11}")
            continue
        t_ceil = moved / bw * 1e6
        ratio = "WRONG" if r.get("wrong") else \
            f"{t_ceil / r['time_us']:.3f}" if r["time_us"] > 0 else "n/a"
        lines.append(f"{op:<14} {n:>10} {nb:>12} {algo:<26} {human(int(moved)):>11} "
                     f"{moved / max(s, 1):>6.2f} {mark + f'{bw / 1e9:.2f}':>10} "
                     f"{t_ceil:>13.2f} {r['time_us']:>10.2f} {ratio:>12}")
    return "\n".join(lines)
