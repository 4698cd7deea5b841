"""new_shm_group: a Group whose ranks are processes sharing POSIX segments (shm.py)."""

import numpy as np

from .. import config as _config
from ..engine.group import Group, describe_fingerprint, is_oversubscribed
from ..engine.init_phases import phase
from ..p2p import P2PEngine
from ..native.pages import numpy_buffers_small_pages
from ..protocol import YIELD_NS, Arena, RegionLayout
from .segments import PidLiveness, ShmRegions

__all__ = ["new_shm_group"]


def new_shm_group(store, rank, world_size, timeout_s=1800.0, cfg=None, name="",
                  small_pages=None, ranks_here=None, yield_ns=None, token=None):
    """Rendezvous through `store` (set/get/add, e.g. a c10d Store or shmcoll.FileStore) and
    return a ready Group. Every rank of the group must call this with the same arguments.
    The kernels load in a thread started here, once the group is made (warmup.py); the
    group is returned without waiting for them, and its first call waits
    (Group.wait_kernels). The thread starts after the rendezvous, not before: it imports
    numba (~0.3 s of imports, then its runtime and the kernels' loads), which holds the GIL
    in stretches of up to the switch interval (5 ms), and every return of the rendezvous
    from a store wait or a syscall would queue behind it
    (docs/notes/2026-11-28-warm-init-2.md).
    `small_pages`: whether this rank's buffers are likely on 4 KiB pages (see pages.py;
    None: numpy's arrays); the group takes True if any rank says so. `ranks_here`: busy
    ranks on this machine when the group is one node of several sharing it (simulated
    or namespaced nodes): they decide, with the cores, whether waits may spin. `yield_ns`:
    the waits' sched_yield tier when not protocol.YIELD_NS (see hier/__init__.py).
    `token`: a random hex group token every rank already has (node discovery's:
    torch_backend.new_process_group), the same on every rank; None: rank 0 makes one and
    the ranks read it in a store round (shm.ShmRegions)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"new_shm_group: rank {rank} is outside world size {world_size}")
    # Imported here, not at module level: `python -m shmcoll.engine.warmup` imports the package
    # first, and a module already imported by it would run twice (runpy warns).
    from ..engine.warmup import ensure, wait_ready, warm_up_async
    cfg = cfg or _config.from_env()
    if world_size == 1:  # no shared memory; a private region carries self-sends
        layout = RegionLayout(64, 2, 1, _config.p2p_cells(cfg, 1), cfg.p2p_cell_nbytes)
        p2p = P2PEngine([np.zeros(layout.nbytes, np.uint8)], 0, layout, lambda peer: True,
                        name=name, ready=wait_ready)
        # the gate too: a first call loads nothing beside the warm-up (a reduction's
        # reducer, the hierarchical group's node group of one rank)
        group = Group(None, 0, 1, timeout_s, cfg.direct_max_nbytes, closers=[p2p.close],
                      name=name, aborter=p2p.abort, kernels=ensure)
        group.attach_p2p(p2p)
        warm_up_async()
        return group
    layout = RegionLayout(cfg.slot_nbytes, cfg.nslots, world_size,
                          _config.p2p_cells(cfg, world_size), cfg.p2p_cell_nbytes)
    if small_pages is None:
        small_pages = numpy_buffers_small_pages()
    with phase("segments"):
        regions = ShmRegions(store, rank, world_size, layout, timeout_s, cfg.shm_dir,
                             cfg.single_copy, small_pages, token)
    liveness = PidLiveness(regions.pids)
    spin = {"spin": False, "yield": True}.get(cfg.spin,
                                              is_oversubscribed(ranks_here or world_size))
    with phase("arena"):
        arena = Arena(regions.regions, rank, layout, liveness, describe_fingerprint,
                      oversubscribed=spin, pids=regions.pids, single_copy=regions.single_copy,
                      yield_ns=YIELD_NS if yield_ns is None else yield_ns, load_kernels=False)
    try:
        with phase("p2p engine"):
            p2p = P2PEngine(regions.regions, rank, layout, liveness, oversubscribed=spin,
                            name=name, ready=wait_ready)
    except BaseException:
        liveness.close()
        regions.close()
        raise
    # NOTE: order matters: the p2p thread is joined before the regions are unmapped.
    group = Group(arena, rank, world_size, timeout_s, cfg.direct_max_nbytes,
                  closers=[p2p.close, liveness.close, regions.close], name=name,
                  aborter=p2p.abort, single_copy_always=cfg.single_copy == "always",
                  small_pages=regions.small_pages, kernels=ensure)
    group.attach_p2p(p2p)
    warm_up_async()  # the kernels load from here on; the first call waits for them
    return group
