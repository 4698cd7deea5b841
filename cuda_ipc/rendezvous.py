"""The control plane of a device arena: all-gathers of short strings and host regions.

Rank threads of one process (threaded_pg) use ThreadRendezvous instead: the spawn's
in-process store and object table, in-process host regions (threaded_pg.arena.ThreadRegions)
and device memory shared by pointer, since CUDA IPC cannot be opened in the process that
exported it.

Ranks that are processes rendezvous through the process group's c10d store (the same
store the shm segments were named through): every value lives under a per-rank
generation prefix, so a group re-created on the same store never reads an old value, and
every wait has the group's deadline and gives up as soon as the awaited rank's process
exits (shm.wait_key). The host region of the arena (flag words; host-tier slots) is a
shm.ShmRegions segment with its own layout: created O_EXCL 0600, verified on attach and
unlinked once every rank attached, exactly like the engine's own regions.
"""

import time

from shmcoll.shm.segments import ShmRegions, wait_key

__all__ = ["ProcessRendezvous", "ThreadRendezvous"]


class ProcessRendezvous:
    """Rendezvous of rank processes over `store` (set/get/add, and check for deadlines)."""

    in_process = False

    def __init__(self, store, rank, world_size, pids, timeout_s, shm_dir="/dev/shm"):
        self.rank = rank
        self.world_size = world_size
        self._store = store
        self._pids = list(pids)
        self._timeout_s = float(timeout_s)
        self._shm_dir = shm_dir
        self._deadline = time.monotonic() + self._timeout_s
        gen = store.add(f"cuda_ipc/gen/{rank}", 1)
        self._base = f"cuda_ipc/{gen}"

    def all_gather(self, what, text):
        """Every rank's `text` for `what`, in rank order (mine included)."""
        self._store.set(f"{self._base}/{what}/{self.rank}", text)
        values = []
        for peer in range(self.world_size):
            if peer == self.rank:
                values.append(text)
                continue
            values.append(wait_key(self._store, f"{self._base}/{what}/{peer}", self._deadline,
                                    self._timeout_s, f"rank {peer}'s {what}",
                                    pid=self._pids[peer] or None))
        return values

    def host_regions(self, layout):
        """Map every rank's host region of `layout` (ShmRegions: .regions, .close())."""
        left = max(1.0, self._deadline - time.monotonic())
        return ShmRegions(self._store, self.rank, self.world_size, layout, left,
                          self._shm_dir, single_copy="off")


class ThreadRendezvous:
    """Rendezvous of the rank threads of one threaded_pg spawn (`rendezvous`): values and
    objects through its in-process table, under a key the group's members agree on (the
    group name and how often this rank built a device arena for it). `regions_class`: how
    the host regions are made in process (threaded_pg's ThreadRegions, given by threaded_pg:
    it sits above cuda_ipc, which never imports it)."""

    in_process = True

    def __init__(self, rendezvous, group, global_rank, regions_class):
        self.rank = group.rank
        self._regions_class = regions_class
        self.world_size = group.world_size
        self._rv = rendezvous
        self._timeout_s = group.timeout_s
        gen = rendezvous.add(f"cuda_ipc/gen/{group.name}/{global_rank}", 1)
        self._base = f"cuda_ipc/{group.name}/{gen}"

    def all_gather(self, what, text):
        self._rv.set(f"{self._base}/{what}/{self.rank}", text)
        return [self._rv.get(f"{self._base}/{what}/{p}", self._timeout_s).decode()
                for p in range(self.world_size)]

    def share(self, what, obj=None):
        """Publish my `obj` for `what`, then every rank's (waits for the others)."""
        self._rv.publish(f"{self._base}/{what}/{self.rank}", obj)
        return [self._rv.lookup(f"{self._base}/{what}/{p}", self._timeout_s)
                for p in range(self.world_size)]

    def host_regions(self, layout):
        regions = self._rv.shared_object(f"{self._base}/regions",
                                         lambda: self._regions_class(layout, self.world_size))
        return _InProcessRegions(regions.regions)


class _InProcessRegions:
    """ShmRegions' surface over in-process buffers: nothing to unmap (the GC frees them)."""

    def __init__(self, regions):
        self.regions = regions

    def close(self):
        self.regions = []
