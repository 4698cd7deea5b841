"""Rank processes for the lab's scripts: spawn them, gather what each one reports."""

import multiprocessing
import queue as queues
import time

__all__ = ["run_ranks"]


def run_ranks(target, world_size, args_of, timeout_s=1800):
    """Run target(*args_of(rank), queue) in `world_size` spawned processes, each of which
    puts (rank, result) on the queue; return {rank: result}. A rank that dies without
    reporting, or a run past `timeout_s`, raises RuntimeError; a rank still alive a minute
    after the results (or the error) is killed."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_of(rank), queue))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    results, deadline = {}, time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            try:
                rank, result = queue.get(timeout=1.0)
                results[rank] = result
                continue
            except queues.Empty:
                pass
            dead = [r for r, p in enumerate(procs)
                    if r not in results and p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"rank {dead[0]} exited with status "
                                   f"{procs[dead[0]].exitcode} before reporting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no result from ranks "
                                   f"{sorted(set(range(world_size)) - set(results))} "
                                   f"after {timeout_s} s")
        return results
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
