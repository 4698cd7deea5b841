"""new_shm_group: a Group whose ranks are processes sharing POSIX segments (shm.py)."""

from . import config as _config
from .group import Group, describe_fingerprint, is_oversubscribed
from .protocol import Arena, RegionLayout
from .shm import PidLiveness, ShmRegions

__all__ = ["new_shm_group"]


def new_shm_group(store, rank, world_size, timeout_s=1800.0, cfg=None, name=""):
    """Rendezvous through `store` (set/get/add, e.g. a c10d Store or shmcoll.FileStore) and
    return a ready Group. Every rank of the group must call this with the same arguments."""
    if not 0 <= rank < world_size:
        raise ValueError(f"new_shm_group: rank {rank} is outside world size {world_size}")
    cfg = cfg or _config.from_env()
    if world_size == 1:
        return Group(None, 0, 1, timeout_s, cfg.direct_max_nbytes, name=name)
    layout = RegionLayout(cfg.slot_nbytes, cfg.nslots)
    regions = ShmRegions(store, rank, world_size, layout, timeout_s, cfg.shm_dir)
    liveness = PidLiveness(regions.pids)
    spin = {"spin": False, "yield": True}.get(cfg.spin, is_oversubscribed(world_size))
    arena = Arena(regions.regions, rank, layout, liveness, describe_fingerprint, oversubscribed=spin)
    return Group(arena, rank, world_size, timeout_s, cfg.direct_max_nbytes,
                 closers=[liveness.close, regions.close], name=name)
