"""Where creating a group spends its time: named phases with their start and end.

Group creation (node discovery, segments, kernel loads, the p2p engine) records each phase
with `phase(name)`: two time.perf_counter_ns() reads and an append, a few microseconds per
group, so it is always on. `take()` returns the phases recorded in this process since the
last take() and forgets them; benchmarks/init_time.py prints them per rank. perf_counter is
CLOCK_MONOTONIC on Linux, one clock for every process of the machine, so the ranks' phases
line up. Only the last MAX_PHASES are kept: a process that makes groups and never asks
holds a bounded list.
"""

import collections
import contextlib
import threading
import time

__all__ = ["phase", "take", "MAX_PHASES"]

MAX_PHASES = 256

# (name, start_ns, end_ns, thread name); deque.append is atomic: the warm-up thread and the
# thread creating the group both record
_phases = collections.deque(maxlen=MAX_PHASES)


@contextlib.contextmanager
def phase(name):
    """Record the time spent inside the with-block as phase `name` (also when it raises)."""
    start = time.perf_counter_ns()
    try:
        yield
    finally:
        _phases.append((name, start, time.perf_counter_ns(), threading.current_thread().name))


def take():
    """The phases recorded since the last take(), oldest first, as dicts (name, start_ns,
    end_ns, thread); clears them."""
    out = []
    while True:
        try:
            name, start, end, thread = _phases.popleft()
        except IndexError:
            return out
        out.append({"name": name, "start_ns": start, "end_ns": end, "thread": thread})
