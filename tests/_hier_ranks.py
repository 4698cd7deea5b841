"""Rank processes of the multi-node fault tests (tests/test_hier_faults.py): like _ranks.py,
whose Job and Child they use, with nodes simulated by SHMCOLL_NODE_ID (args["nodes"][rank]).
Run as `python tests/_hier_ranks.py '<json spec>'` by _ranks.Job with SCRIPT set to this file.
"""

import datetime
import os
import threading
import time

from _ranks import SETUP_TIMEOUT_S


def _init(c, timeout_s=None, store_suffix=""):
    os.environ["SHMCOLL_NODE_ID"] = c.args["nodes"][c.rank]
    if store_suffix:
        c.spec = dict(c.spec, store=os.path.join(c.spec["store"], store_suffix))
        os.makedirs(c.spec["store"], exist_ok=True)
    return c.new_group(timeout_s)


def _backend():
    import torch
    import torch.distributed as dist
    return dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))


def _all_reduce(c, count):
    import torch
    import torch.distributed as dist
    t = torch.empty(count)
    ws = c.world_size

    def run():
        t.fill_(c.rank + 1.0)
        dist.all_reduce(t)
        assert float(t[-1]) == ws * (ws + 1) / 2, float(t[-1])
    return run


def scenario_lost(c):
    """args: nodes, victims, count. Every rank loops all_reduce of `count` floats; the parent
    SIGKILLs the victims mid-loop. Survivors report their error, that the group stays
    failed, and that destroying it returns."""
    _init(c)
    run = _all_reduce(c, c.args["count"])
    run()
    c.emit("ready")
    if c.rank in c.args["victims"]:
        while True:
            run()
    try:
        while True:
            run()
    except Exception as e:
        c.emit("error", **c.err(e))
    try:
        run()
        c.emit("again", ok=True)
    except Exception as e:
        c.emit("again", **c.err(e))
    c.close()
    c.emit("closed")


def scenario_stall(c):
    """args: nodes, victim, op_timeout. The victim never enters the collective (the parent
    also SIGSTOPs it); the others time out after op_timeout."""
    _init(c, timeout_s=max(c.timeout_s, SETUP_TIMEOUT_S))
    run = _all_reduce(c, c.args.get("count", 64))
    run()
    _backend()._set_default_timeout(datetime.timedelta(seconds=c.args["op_timeout"]))
    c.emit("ready")
    c.wait_cmd()
    if c.rank == c.args["victim"]:
        c.wait_cmd()
        return
    t0 = time.monotonic()
    try:
        run()
        c.emit("error", ok=True)
    except Exception as e:
        c.emit("error", dt=time.monotonic() - t0, **c.err(e))
    c.close()
    c.emit("closed")


def _mismatch_call(c, case):
    import torch
    import torch.distributed as dist
    node = c.args["nodes"][c.rank]
    other = node != c.args["nodes"][0]  # ranks not on rank 0's node
    if case == "op_across":
        dist.all_reduce(torch.ones(8), dist.ReduceOp.MAX if other else dist.ReduceOp.SUM)
    elif case == "count_across_small":
        dist.all_reduce(torch.ones(20 if other else 10))
    elif case == "count_across":
        dist.all_reduce(torch.ones(3000 if other else 2000))
    elif case == "kind_across":
        t = torch.ones(16)
        dist.broadcast(t, 0) if other else dist.all_reduce(t)
    elif case == "intra":
        dist.all_reduce(torch.ones(6 if c.rank == 1 else 5))
    else:
        raise ValueError(case)


def scenario_mismatch(c):
    """args: nodes, cases. Per case: a fresh group, one mismatched call on every rank (it
    must raise, never crash the process), then a call on the failed group, then destroy."""
    import torch
    import torch.distributed as dist
    for case in c.args["cases"]:
        _init(c, store_suffix=case)
        dist.all_reduce(torch.ones(4))
        t0 = time.monotonic()
        try:
            _mismatch_call(c, case)
            c.emit("result", case=case, ok=True)
        except Exception as e:
            c.emit("result", case=case, dt=time.monotonic() - t0, **c.err(e))
        try:
            dist.all_reduce(torch.ones(4))
            c.emit("after", case=case, ok=True)
        except Exception as e:
            c.emit("after", case=case, **c.err(e))
        c.close()


def scenario_abort(c):
    """args: nodes, late. Every rank but `late` enters an all_reduce; rank 0 aborts its
    group from another thread after 0.5 s. `late` joins only after "go"."""
    _init(c)
    run = _all_reduce(c, 64)
    run()
    c.emit("ready")
    if c.rank == c.args["late"]:
        c.wait_cmd()
    elif c.rank == 0:
        threading.Timer(0.5, lambda: (c.emit("aborting"), _backend().abort())).start()
    t0 = time.monotonic()
    try:
        run()
        c.emit("error", ok=True)
    except Exception as e:
        c.emit("error", dt=time.monotonic() - t0, **c.err(e))
    c.close()
    c.emit("closed")


def main():
    """_ranks.main with these scenarios (and every stack on a crash: gloo terminates the
    process on some errors)."""
    import faulthandler

    import _ranks
    faulthandler.enable()
    _ranks.__dict__.update({k: v for k, v in globals().items() if k.startswith("scenario_")})
    _ranks.main()


if __name__ == "__main__":
    main()
