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
| all_to_all_read | 2 S | read and write S (peers' blocks straight from their buffers, my own from mine) |

The ceiling is what this machine's memory system makes of those bytes when every rank moves
them at once: the N ranks' bytes together (N x bytes per rank) at the aggregate copy
bandwidth of N ranks' copies of S at the same time: k = min(N, usable cores) processes,
each copying S between ceil(N / k) buffer pairs in turn, as the ranks that share its core
would (`copy_bandwidth`, measured in the parent on torch-allocated buffers, the ranks'
memory kind). Where the copies stay in the caches, k copiers run k times as fast as one
and the ceiling is bytes per rank at one core's bandwidth, every rank on its own core;
where they spill to memory they share its bandwidth (this 2-core VM: one 16 MiB copy
23-38 GB/s, two at once 31-69 GB/s together, by the hour); and ranks beyond the cores
share them. Nothing else
costs time in the ceiling: no waits, no cross-core transfers, no Python. `ceiling_table`
prints per row the ceiling and t_ceiling / t, which is also busbw / the ceiling's busbw.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import queue
import time

from benchmarks.sizes import human

__all__ = ["MODEL", "per_rank_bytes", "bytes_per_rank", "algorithm_of", "copy_bandwidth",
           "copiers_for", "usable_cores", "ceiling_table"]

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
    "all_to_all_read": lambda s, n, sub: 2 * s,
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


def usable_cores() -> int:
    """The cores this process may run on (its affinity), as the ranks it spawns."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def copiers_for(world_size) -> int:
    """How many of `world_size` ranks copy at the same time: one per usable core."""
    return max(1, min(world_size, usable_cores()))


def _copy_loop(n, seconds, start, pairs=1):
    """np.copyto of n bytes between two torch-allocated buffers, back to back (as a loop of
    calls reuses its buffers), taking `pairs` such pairs in turn (the ranks that share a
    core, each with its own buffers), for `seconds` from `start` (a time.monotonic()
    shared by the copiers): (copies, seconds they took)."""
    import numpy as np
    import torch
    bufs = []
    for _ in range(pairs):
        a = torch.empty(max(1, n // 4)).numpy()
        b = torch.empty_like(torch.from_numpy(a)).numpy()
        a[:] = 1.0
        bufs.append((b, a))
    for _ in range(3):  # warm: pages faulted in, caches as in a loop of calls
        for b, a in bufs:
            np.copyto(b, a)
    for b, _ in bufs:
        b[:] = 0.0
    while time.monotonic() < start:
        pass
    copies = 0
    t0 = time.monotonic()
    while True:
        np.copyto(*bufs[copies % pairs])
        copies += 1
        t = time.monotonic()
        if t - t0 >= seconds and copies >= 3 * pairs:
            break
    if not all(b[0] == 1.0 and b[-1] == 1.0 for b, _ in bufs):
        raise RuntimeError(f"copy_bandwidth: a {n}-byte copy came out wrong")
    return copies, t - t0


def _copier(sizes, pairs, windows, seconds, gap, results, go, start):
    """A spawned copier: once imported, says so and waits for `go`; then _copy_loop of
    every size, `windows` times each, window w of size k from start + (k * windows + w)
    * gap (`start`: a shared time.monotonic(), set before `go`)."""
    import numpy  # noqa: F401 - the imports before the start, not in the first window
    import torch  # noqa: F401
    results.put(None)
    if go.wait(60.0):
        results.put([_copy_loop(n, seconds, start.value + (k * windows + w) * gap, pairs)
                     for k, n in enumerate(sizes) for w in range(windows)])


def _collect(results, procs, count, deadline, what):
    """`count` items from `results`, failing fast if a copier died."""
    got = []
    while len(got) < count:
        try:
            got.append(results.get(timeout=0.5))
        except queue.Empty:
            lost = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if lost or time.monotonic() > deadline:
                raise RuntimeError(f"copy_bandwidth: copiers did not report {what} "
                                   f"(exit codes {lost})") from None
    return got


def copy_bandwidth(sizes, world_size=1, seconds=0.05, windows=3):
    """{S: read + write bytes per second of `world_size` ranks' copies of S bytes at once,
    all together}: copiers_for(world_size) processes, each copying for its share of the
    ranks (ceil(world_size / copiers) buffer pairs in turn: the memory the ranks touch),
    run _copy_loop in `windows` windows of `seconds` per size with a common start each; a
    window's aggregate is the sum of the copiers' rates, and the size's is its best window
    (a ceiling: what the machine did at its best; a shared host's memory bandwidth moves
    with its other tenants). One copier runs in this process; more are spawned processes
    (numpy and torch only)."""
    sizes = list(sizes)
    count = copiers_for(world_size)
    pairs = -(-world_size // count)
    if count == 1:
        done = [[_copy_loop(n, seconds, time.monotonic(), pairs) for n in sizes
                 for _ in range(windows)]]
    else:
        ctx = multiprocessing.get_context("spawn")
        results, go, start = ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
        gap = seconds + 0.15 * pairs  # each window's buffers made and warmed before its start
        procs = [ctx.Process(target=_copier, args=(sizes, pairs, windows, seconds, gap,
                                                   results, go, start), daemon=True)
                 for _ in range(count)]
        for p in procs:
            p.start()
        try:
            _collect(results, procs, count, time.monotonic() + 60.0, "ready")
            start.value = time.monotonic() + 0.3
            go.set()
            done = _collect(results, procs, count,
                            start.value + len(sizes) * windows * gap + 60.0, "their copies")
        finally:
            go.set()
            for p in procs:
                p.join(5.0)
                if p.is_alive():
                    p.kill()
    return {n: max(sum(2 * n * c / max(t, 1e-9) for c, t in (d[k * windows + w] for d in done))
                   for w in range(windows))
            for k, n in enumerate(sizes)}


def ceiling_table(rows, copy_bw) -> str:
    """Per shm row with an algorithm: bytes per rank, the aggregate copy bandwidth of its
    copiers at S (`copy_bw`: {world_size: {nbytes: B/s}} from copy_bandwidth(sizes,
    world_size); the nearest size, marked '~', where S is missing), the ceiling
    time of the N ranks' bytes at it, and t_ceiling / t."""
    rows = [r for r in rows if r.get("record", "row") == "row" and r.get("algorithm")
            and copy_bw.get(r["world_size"])]
    if not rows:
        return ""
    lines = ["\n## traffic model: bytes per rank of the algorithm and the ceiling they give: "
             "the N ranks' bytes at the bandwidth of N ranks' copies of S at once, by min(N, "
             "cores) copiers (t_ceiling/t = busbw / ceiling busbw; 1 = at the limit)",
             f"{'op':<14} {'world_size':>10} {'nbytes':>12} {'algorithm':<26} {'bytes/rank':>11} "
             f"{'x S':>6} {'copiers':>7} {'agg_GBps':>9} {'t_ceiling_us':>13} {'t_us':>10} "
             f"{'t_ceiling/t':>12}"]
    for r in sorted(rows, key=lambda r: (r["op"], r["world_size"], r["nbytes"])):
        op, n, nb, algo = r["op"], r["world_size"], r["nbytes"], r["algorithm"]
        moved = bytes_per_rank(algo, op, nb, n)
        s = per_rank_bytes(op, nb, n)
        bws = copy_bw[n]
        near = s if s in bws else min(bws, key=lambda m: abs(math.log(m / max(s, 1))))
        bw = bws[near]
        mark = "" if near == s else "~"
        if moved is None:
            lines.append(f"{op:<14} {n:>10} {nb:>12} {algo:<26} {'?':>11}")
            continue
        t_ceil = n * moved / bw * 1e6
        ratio = "WRONG" if r.get("wrong") else \
            f"{t_ceil / r['time_us']:.3f}" if r["time_us"] > 0 else "n/a"
        lines.append(f"{op:<14} {n:>10} {nb:>12} {algo:<26} {human(int(moved)):>11} "
                     f"{moved / max(s, 1):>6.2f} {copiers_for(n):>7} "
                     f"{mark + f'{bw / 1e9:.2f}':>9} "
                     f"{t_ceil:>13.2f} {r['time_us']:>10.2f} {ratio:>12}")
    return "\n".join(lines)
