"""Rank-side scenarios of the fuzz and soak tests (test_fuzz.py, test_soak.py), and the fuzz
reference model both sides use: the random program (`random_program`), the inputs
(`make_input`), the expected results (`reference_reduce`, on support/reference.py) and the
checker (`run_fuzz_op`).

Run by tests/_ranks.py (`python tests/_ranks.py '<json spec>'` dispatches a plain scenario name
here); each `scenario_<name>(c)` gets a `_ranks.Child`."""

import json
import os
import time

from support.reference import bf16_rne, bf16_widen
from support.reference import reference_reduce as _engine_reduce


def scenario_fuzz_worker(c):
    """Run programs (JSON lines on stdin) on the world group and lazily created subgroups;
    check every result against the numpy reference; report one event per program."""
    import numpy as np

    import shmcoll
    groups = {tuple(range(c.world_size)): c.new_group()}
    c.emit("ready", pid=os.getpid())
    while True:
        line = c.wait_cmd()
        if not line or line == "quit":
            break
        program = json.loads(line)
        if "seed" in program:  # every rank draws the same program from the shared seed
            program["ops"] = random_program(program["seed"], c.world_size, program["length"])
        problems, executed = [], 0
        try:
            for i, op in enumerate(program["ops"]):
                members = tuple(op.get("members") or range(c.world_size))
                if c.rank not in members:
                    continue
                g = groups.get(members)
                if g is None:
                    store = shmcoll.FileStore(os.path.join(c.spec["store"],
                                                           "sub-" + "-".join(map(str, members))))
                    g = groups[members] = shmcoll.new_shm_group(
                        store, members.index(c.rank), len(members), timeout_s=c.timeout_s)
                why = run_fuzz_op(g, op, members)
                executed += 1
                if why:
                    problems.append(f"op {i} {op}: {why}")
        except Exception as e:
            c.emit("done", id=program["id"], ok=False, problems=problems, **c.err(e))
            return
        c.emit("done", id=program["id"], ok=not problems, problems=problems[:5],
               executed=executed)
    for g in groups.values():
        g.close()


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def scenario_soak(c):
    """args: iters, checkpoints. Small mixed collectives; every result checked; RSS sampled."""
    import numpy as np
    c.new_group()
    g, ws, r = c.group, c.world_size, c.rank
    a = np.empty(16, np.float32)
    b = np.empty(32, np.int64)
    outs = np.empty(8 * ws, np.int32)
    x = np.empty(8, np.int32)
    bad, rss = 0, {}
    checkpoints = set(c.args["checkpoints"])
    t0 = time.monotonic()
    for i in range(c.args["iters"]):
        k = i % 4
        if k == 0:
            a[:] = r + i % 7
            g.all_reduce(a)
            bad += a[0] != ws * (i % 7) + ws * (ws - 1) / 2
        elif k == 1:
            b[:] = r * 1000 + i
            g.broadcast(b, i % ws)
            bad += b[-1] != (i % ws) * 1000 + i
        elif k == 2:
            x[:] = r + i
            g.all_gather(outs, x)
            bad += outs[-1] != ws - 1 + i
        else:
            g.barrier()
        if i + 1 in checkpoints:
            rss[i + 1] = _rss_bytes()
    c.emit("soak", bad=int(bad), rss=rss, seconds=time.monotonic() - t0,
           per_call_us=(time.monotonic() - t0) / max(1, c.args["iters"]) * 1e6)
    c.close()


# ============================================================= fuzz reference model (both sides)

FUZZ_DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64",
               "bool", "complex64")


def _np_dtype(name):
    import numpy as np
    return np.dtype(np.uint16) if name == "bfloat16" else np.dtype(name)


FUZZ_KINDS = ("all_reduce", "reduce", "broadcast", "all_gather", "gather", "scatter",
              "reduce_scatter", "all_to_all", "barrier")
REDUCING = ("all_reduce", "reduce", "reduce_scatter")
BITWISE = ("BAND", "BOR", "BXOR")


def ops_for(dtype):
    """Reduce ops the engine supports for `dtype` (names)."""
    from shmcoll.native.ops import _OPS_BY_KIND, DTYPES
    return sorted(o.name for o in _OPS_BY_KIND[DTYPES[dtype].kind])


def random_program(seed, world_size, length, max_count=3000):
    """`length` random ops for `world_size` ranks from `seed` (numpy only, identical on every
    rank): collectives, dtypes, sizes (many beyond one slot), ops, roots, subgroups,
    strided views, uneven reduce_scatter/all_to_all splits."""
    import numpy as np
    rng = np.random.default_rng(seed)
    ops = []
    for _ in range(length):
        kind = FUZZ_KINDS[rng.integers(len(FUZZ_KINDS))]
        dtype = FUZZ_DTYPES[rng.integers(len(FUZZ_DTYPES))]
        members = None
        if world_size > 2 and rng.random() < 0.3:
            k = int(rng.integers(2, world_size + 1))
            members = sorted(int(m) for m in rng.choice(world_size, k, replace=False))
        n = len(members) if members else world_size
        count = int(rng.integers(0, 17) if rng.random() < 0.6 else rng.integers(17, max_count))
        op = {"kind": kind, "dtype": dtype, "count": count, "members": members,
              "root": int(rng.integers(n)), "seed": int(rng.integers(1 << 31)),
              "strided": bool(rng.random() < 0.3)}
        if kind in REDUCING:
            names = ops_for(dtype)
            op["op"] = names[rng.integers(len(names))]
        if kind == "reduce_scatter" and rng.random() < 0.5:
            op["sizes"] = [int(v) for v in rng.integers(0, 40, n)]
        if kind == "all_to_all":
            op["matrix"] = [[int(v) for v in rng.integers(0, 600, n)] for _ in range(n)]
        ops.append(op)
    return ops


def make_input(seed, rank, dtype, count, bitwise=False):
    """The input of `rank` for one op: small integers (exact in every dtype, sums and
    products of 4 of them too), bit patterns for bitwise ops."""
    import numpy as np
    rng = np.random.default_rng([seed, rank])
    if dtype == "bool":
        return rng.integers(0, 2, count).astype(bool)
    if bitwise or dtype == "uint8":
        vals = rng.integers(0, 4 if not bitwise else 64, count)
    else:
        vals = rng.integers(-3, 4, count)
    if dtype == "bfloat16":
        return bf16_rne(vals.astype(np.float32))
    if dtype == "complex64":
        return (vals + 1j * rng.integers(-3, 4, count)).astype(np.complex64)
    return vals.astype(dtype)


def reference_reduce(inputs, dtype, op, premul=2.0):
    """The engine's reduction over ranks of `inputs` (list of arrays), `op` by name."""
    return _engine_reduce(inputs, dtype, op, len(inputs), premul)


def _same(got, want, dtype, op):
    import numpy as np
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    if op in ("AVG",) and dtype not in ("bool",):
        g = bf16_widen(got) if dtype == "bfloat16" else got
        w = bf16_widen(want) if dtype == "bfloat16" else want
        ok = np.allclose(g.astype(np.complex128), w.astype(np.complex128), rtol=1e-2, atol=1e-2)
    else:
        ok = np.array_equal(got.view(np.uint8) if got.dtype == bool else got,
                            want.view(np.uint8) if want.dtype == bool else want)
    if ok:
        return None
    bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))[:4]
    return (f"{dtype} {op}: got {got.reshape(-1)[bad].tolist()} want "
            f"{want.reshape(-1)[bad].tolist()} at {bad.tolist()}")


def _strided(arr, strided):
    """`arr`'s values in a strided view (every other element of a 2x buffer)."""
    import numpy as np
    if not strided or arr.ndim != 1:
        return arr
    buf = np.zeros(arr.size * 2, arr.dtype)
    view = buf[::2]
    view[:] = arr
    return view


def run_fuzz_op(g, op, members):
    """Run one fuzz op on group `g` (this rank's part); return a problem string or None."""
    import numpy as np

    import shmcoll
    kind, dtype, count, seed = op["kind"], op["dtype"], op["count"], op["seed"]
    n, me = len(members), g.rank
    root = op.get("root", 0) % n
    red = op.get("op", "SUM")
    bitwise = red in ("BAND", "BOR", "BXOR")
    eng_dtype = "bfloat16" if dtype == "bfloat16" else None
    premul = 2.0
    ins = [make_input(seed, j, dtype, count, bitwise) for j in range(n)]
    strided = op.get("strided", False)
    if kind == "barrier":
        g.barrier()
        return None
    if kind == "all_reduce":
        a = _strided(ins[me].copy(), strided)
        g.all_reduce(a, shmcoll.ReduceOp[red], eng_dtype, premul=premul)
        return _same(np.ascontiguousarray(a), reference_reduce(ins, dtype, red, premul), dtype,
                     red)
    if kind == "reduce":
        a = _strided(ins[me].copy(), strided)
        g.reduce(a, root, shmcoll.ReduceOp[red], eng_dtype, premul=premul)
        want = reference_reduce(ins, dtype, red, premul) if me == root else ins[me]
        return _same(np.ascontiguousarray(a), want, dtype, red if me == root else "SUM")
    if kind == "broadcast":
        a = _strided(ins[me].copy(), strided)
        g.broadcast(a, root)
        return _same(np.ascontiguousarray(a), ins[root], dtype, "SUM")
    if kind == "all_gather":
        outs = [np.zeros(count, ins[0].dtype) for _ in range(n)]
        g.all_gather(outs, _strided(ins[me], strided))
        for j in range(n):
            why = _same(outs[j], ins[j], dtype, "SUM")
            if why:
                return f"from rank {j}: {why}"
        return None
    if kind == "gather":
        outs = [np.zeros(count, ins[0].dtype) for _ in range(n)] if me == root else None
        g.gather(_strided(ins[me], strided), outs, root)
        for j in range(n if me == root else 0):
            why = _same(outs[j], ins[j], dtype, "SUM")
            if why:
                return f"from rank {j}: {why}"
        return None
    if kind == "scatter":
        rng = np.random.default_rng([seed, 999])
        pieces = [make_input(int(rng.integers(1 << 30)), j, dtype, count) for j in range(n)]
        out = _strided(np.zeros(count, pieces[0].dtype), strided)
        g.scatter(out, pieces if me == root else None, root)
        return _same(np.ascontiguousarray(out), pieces[me], dtype, "SUM")
    if kind == "reduce_scatter":
        sizes = op.get("sizes") or [count] * n
        blocks = {j: [make_input(seed * 31 + j, k, dtype, sizes[k], bitwise) for k in range(n)]
                  for j in range(n)}  # blocks[j][k]: rank j's contribution to rank k
        out = np.zeros(sizes[me], blocks[0][0].dtype)
        g.reduce_scatter(out, blocks[me], shmcoll.ReduceOp[red], eng_dtype, premul=premul)
        want = reference_reduce([blocks[j][me] for j in range(n)], dtype, red, premul)
        return _same(out, want, dtype, red)
    if kind == "all_to_all":
        sz = op["matrix"]  # sz[j][k]: elements rank j sends to rank k
        data = {j: [make_input(seed * 17 + j, k, dtype, sz[j][k]) for k in range(n)]
                for j in range(n)}
        outs = [np.zeros(sz[j][me], data[0][0].dtype) for j in range(n)]
        g.all_to_all(outs, data[me])
        for j in range(n):
            why = _same(outs[j], data[j][me], dtype, "SUM")
            if why:
                return f"from rank {j}: {why}"
        return None
    raise ValueError(kind)
