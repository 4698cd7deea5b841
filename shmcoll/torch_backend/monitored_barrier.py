"""monitored_barrier over the c10d store, with gloo's messages and gloo's order of checks.

Rank 0 waits for every other rank's "arrived" key, then sets an "ack" key per rank
(ProcessGroupGloo::monitoredBarrier does the same with send/recv pairs). It goes through
the store, not the engine, so a rank stuck in an earlier collective cannot block it.
"""

import time

from .work import torch_error

__all__ = ["monitored_barrier_peer", "monitored_barrier_root"]

_POLL_MAX_S = 0.01  # store polling interval ceiling


def monitored_barrier_peer(store, base, rank, timeout_s, alive):
    """A non-zero rank's monitored_barrier: arrive, then wait for rank 0's ack up to the
    group's timeout; rank 0 failing the barrier (or exiting: alive(0) False) ends it."""
    store.set(f"{base}/arrived/{rank}", "1")
    got = _store_wait(store, [f"{base}/ack/{rank}", f"{base}/failed"],
                      time.monotonic() + timeout_s, lambda: alive(0))
    if got != f"{base}/ack/{rank}":
        why = {None: f"waited {timeout_s:.0f} s", f"{base}/failed": "rank 0 failed it"}.get(
            got, "rank 0 exited")
        raise torch_error(RuntimeError(
            f"Rank {rank} successfully reached monitoredBarrier, but received errors while "
            f"waiting for send/recv from rank 0. Please check rank 0 logs for faulty rank "
            f"({why})."))


def monitored_barrier_root(store, base, size, ms, wait_all_ranks, alive):
    """Rank 0's monitored_barrier, in gloo's order: wait for ranks 1..N-1 in turn, each
    with the time left (wait_all_ranks: each the whole timeout; a rank that exited
    (alive(r) False) fails at once), then ack every rank."""
    start = time.monotonic()

    def left_ms(processed):
        if wait_all_ranks:
            return ms
        left = ms - int((time.monotonic() - start) * 1000)
        if left <= 0:  # gloo: no time left is -1, and checkRemainingTime throws
            done = (f"Successfully processed ranks: {', '.join(map(str, processed))}"
                    if processed else "No ranks successfully processed in monitoredBarrier.")
            raise torch_error(RuntimeError(
                f"Rank 0 timed out in monitoredBarrier after {ms} ms.\n{done}"))
        return left

    processed, failed = [], []
    for r in range(1, size):
        left = left_ms(processed)
        key = f"{base}/arrived/{r}"
        if _store_wait(store, [key], time.monotonic() + left / 1000, lambda: alive(r)) == key:
            processed.append(r)
        elif wait_all_ranks:
            failed.append(r)
        else:
            raise torch_error(RuntimeError(
                f"[Rank 0]: Rank {r} failed to pass monitoredBarrier in {ms} ms"))
    if failed:
        raise torch_error(RuntimeError(
            f"[Rank 0]: Ranks {', '.join(map(str, failed))} failed to pass "
            f"monitoredBarrier in {ms} ms"))
    processed = []
    for r in range(1, size):  # gloo acks all, then checks the time before each ack's wait
        store.set(f"{base}/ack/{r}", "1")
    for r in range(1, size):
        left_ms(processed)
        processed.append(r)


def _store_wait(store, keys, deadline, peer_alive):
    """Poll `store` until one of `keys` exists, `deadline` (monotonic) passes (None) or the
    peer waited for exits (peer_alive() False: "exited"). The first key found, else
    None / "exited". One check is always made, so a key already set is found even after
    the deadline."""
    sleep_s = 1e-3
    while True:
        for key in keys:
            if store.check([key]):
                return key
        if not peer_alive():
            return "exited"
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        time.sleep(min(sleep_s, remaining))
        sleep_s = min(sleep_s * 2, _POLL_MAX_S)
