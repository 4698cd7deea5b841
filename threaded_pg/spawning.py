"""spawn(fn, world_size): fn(rank, world_size, *args) on one thread per rank, with the default
process group (backend "threaded") initialised before and destroyed after.

Each rank thread gets its own torch.distributed world (threaded_pg.world), so dist.get_rank(),
dist.all_reduce, dist.new_group, object collectives, DDP, ... work unchanged; every spawn
has its own HashStore and its own Rendezvous, so spawns (one after another, or concurrently
from several threads) never meet. While it runs, a rank thread that reseeds torch's shared
generator outside rng_lock is warned (threaded_pg.rng). Failure and timeout semantics:
threaded_pg.runner.
"""

import datetime
import threading

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from . import rng, world
from .plugin import backend_name
from .runner import DEFAULT_TIMEOUT_S, _Run

__all__ = ["spawn"]


def spawn(fn, world_size, args=(), kwargs=None, timeout=DEFAULT_TIMEOUT_S, cfg=None):
    """Run fn(rank, world_size, *args, **kwargs) on `world_size` rank threads; return the
    list of their return values, by rank.

    `timeout` (seconds or timedelta) bounds the whole spawn; the groups' collective
    timeout is longer (group_timeout_s), so a stuck rank ends in the spawn's report.
    `cfg` (shmcoll.config.Config) overrides SHMCOLL_* settings.
    Raises RankFailedError ("rank r: <traceback>") or SpawnTimeoutError (what each rank
    was blocked in).
    """
    return _Spawn(fn, world_size, args, kwargs, timeout, cfg).run()


# The groups' collective timeout exceeds the spawn's by this much (at least; see
# group_timeout_s). With equal timeouts the ranks' own collective deadlines and the caller's
# spawn deadline fall in the same instant; on a loaded machine the caller thread can wake
# late, find the ranks already failing, and report them as "not in a collective" instead
# of what they were blocked in.
GROUP_TIMEOUT_MARGIN_S = 1.0


def group_timeout_s(spawn_timeout_s):
    """The collective timeout of a spawn's groups: twice the spawn's (at least
    GROUP_TIMEOUT_MARGIN_S more), so the spawn's report comes first unless the caller
    thread is a whole timeout late."""
    return spawn_timeout_s + max(GROUP_TIMEOUT_MARGIN_S, spawn_timeout_s)


class _Spawn(_Run):
    """A run whose ranks live inside an initialised default process group."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.store = dist.HashStore()
        self.store.set_timeout(datetime.timedelta(seconds=self.timeout_s))
        self.backend = backend_name()

    # One reference on the thread-local world for the spawn and one per rank thread, so a
    # rank thread left behind after a timeout keeps its world until it ends. The seed watch
    # (rng.py) lasts as long as the spawn.
    def _enter(self):
        world.install()
        try:
            rng.watch_seeding()
        except BaseException:
            world.uninstall()
            raise

    def _leave(self):
        rng.unwatch_seeding()
        world.uninstall()

    def _thread_enter(self, rank):
        world.install()

    def _thread_leave(self, rank):
        if threading.current_thread() is self.threads[rank]:  # not if start() failed
            world.unbind()
        world.uninstall()

    def _call(self, rank):
        world.bind()
        dist.init_process_group(self.backend, store=self.store, rank=rank,
                                world_size=self.world_size,
                                timeout=datetime.timedelta(
                                    seconds=group_timeout_s(self.timeout_s)))
        return self.fn(rank, self.world_size, *self.args, **self.kwargs)

    def _cleanup(self, rank):
        if dist.is_initialized():
            from .backend import ThreadedProcessGroup
            groups = [pg for pg in list(c10d._world.pg_map)
                      if isinstance(pg, ThreadedProcessGroup)]
            dist.destroy_process_group()
            # torch 2.4's destroy_process_group shuts down NCCL groups only (compat
            # DESTROY_SHUTS_DOWN): stop the rank's groups here, their threads with them
            # (a no-op for those torch already shut down)
            for pg in groups:
                pg.shutdown()
