"""The barriers of EngineProcessGroup (a mixin): barrier, an engine collective queued in
issue order like the others, and monitored_barrier, gloo's monitoredBarrier, which goes
through the store instead (monitored_barrier.py holds its two halves) and names the ranks
that did not arrive.

`BarrierMixin` is a part of process_group.EngineProcessGroup, one of its mixins by kind
(beside reductions.py, movement.py, gather_scatter.py, p2p.py): it uses the group's _submit,
_op_timeout, _closed_error, _lock, _monitored_barriers (the count its __init__ starts),
_store, group, rank() and size().
"""

import datetime
import re

import torch.distributed as dist

from ..errors import CollectiveTimeoutError
from .convert import to_seconds
from .monitored_barrier import monitored_barrier_peer, monitored_barrier_root
from .pg_args import set_timeout

__all__ = ["BarrierMixin"]


class BarrierMixin:
    """barrier and monitored_barrier of EngineProcessGroup (see the module docstring)."""

    def barrier(self, opts=None, timeout=None):
        """barrier(opts) | barrier(timeout=None). Completes after every operation issued
        before it on this group (ops run in order)."""
        if isinstance(opts, datetime.timedelta):
            opts, timeout = None, opts
        opts = set_timeout(opts or dist.BarrierOptions(), timeout)
        t_s = self._op_timeout(opts)

        def run():
            try:
                self.group.barrier(t_s)
            except CollectiveTimeoutError as e:
                if dist.get_debug_level() == dist.DebugLevel.DETAIL:
                    missing = re.search(r"for ranks \[([^\]]*)\]", str(e))
                    ranks = missing.group(1) if missing else "?"
                    raise CollectiveTimeoutError(
                        f"{e}; [Rank {self.rank()}] (TORCH_DISTRIBUTED_DEBUG=DETAIL) rank(s) "
                        f"{ranks} failed to pass monitoredBarrier in {int(round(t_s * 1000))} "
                        f"ms") from None
                raise
        return self._submit("barrier", run, [], opts=opts)

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """gloo's monitoredBarrier: rank 0 waits for every other rank (through the store,
        independent of queued collectives) and names the ranks that did not arrive in time:
        "Rank 1 failed to pass monitoredBarrier in 1000 ms" (with wait_all_ranks: every
        such rank, "Ranks 1, 2 failed ..."); the others then fail too. Synchronous.

        Rank 0 checks in gloo's order (ProcessGroupGloo::monitoredBarrier): before waiting
        for each rank, unless wait_all_ranks, the time left in whole ms; none left raises
        "Rank 0 timed out in monitoredBarrier after N ms." naming the ranks processed so
        far. Only rank 0 enforces the timeout (so it reports which rank is late); the
        others wait up to the group's timeout, and fail at once when rank 0 fails."""
        if self._closed:
            raise self._closed_error("monitoredBarrier")
        t_s = self.group.timeout_s if timeout is None else to_seconds(timeout)
        ms = int(round(t_s * 1000))
        n = self._next_monitored_barrier()
        rank, size = self.rank(), self.size()
        if size == 1:
            return None
        if self._store is None:
            self.barrier(timeout=datetime.timedelta(seconds=t_s)).wait()
            return None
        base = f"shmcoll/monitored_barrier/{n}"
        if rank != 0:
            monitored_barrier_peer(self._store, base, rank, self.group.timeout_s,
                                   self.group.is_peer_alive)
        else:
            try:
                monitored_barrier_root(self._store, base, size, ms, wait_all_ranks,
                                       self.group.is_peer_alive)
            except RuntimeError:
                self._store.set(f"{base}/failed", "1")  # the others fail now, not at timeout
                raise
        return None
