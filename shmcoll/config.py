"""Every SHMCOLL_* environment variable: name, default, parser and meaning; read once per group.

A group is made with the environment of the call that asked for it: one made on a
background thread (torch_backend/deferred.py) reads a snapshot of the environment taken in
init_process_group / new_group (`environment(snapshot)`; `current_environ()` is what the
readers consult), so that a variable set around that call, or changed after it, applies as
it did when the group was made inside the call.
"""

import contextlib
import os
import threading
from typing import NamedTuple

__all__ = ["Config", "from_env", "p2p_cells", "compile_timeout_s", "environment",
           "current_environ"]

_pinned = threading.local()  # .environ: this thread's snapshot (environment()'s only)


@contextlib.contextmanager
def environment(snapshot):
    """Within the block, on this thread, the environment is `snapshot` (a mapping) for
    every reader of current_environ()."""
    before = getattr(_pinned, "environ", None)
    _pinned.environ = snapshot
    try:
        yield
    finally:
        _pinned.environ = before


def current_environ():
    """The environment a group being made on this thread reads: environment()'s snapshot,
    else os.environ."""
    pinned = getattr(_pinned, "environ", None)
    return os.environ if pinned is None else pinned

MIB = 1 << 20


class Config(NamedTuple):
    """Per-group tunables. Defaults are chosen for a small host; see benchmarks/ for evidence.

    Immutable; a NamedTuple rather than a frozen dataclass: defining a frozen dataclass of
    this many fields costs ~2.5 ms at import (its methods are generated and exec'd), a
    NamedTuple ~0.4 ms, and every process that makes a group imports this module."""

    slot_nbytes: int = 4 * MIB  # chunk size: 2 x 4 MiB per rank stays inside a 64 MB /dev/shm at 8 ranks
    nslots: int = 2  # double buffering: copy-in of chunk c+1 overlaps peers reading chunk c
    direct_max_nbytes: int = -1  # all_reduce one-shot threshold; -1 = the table in algorithms.select
    spin: str = "auto"  # "auto" | "spin" | "yield": spin tier on/off (auto: off when ranks > cores)
    shm_dir: str = "/dev/shm"  # where POSIX segments live (for the capacity check and stale-segment GC)
    # point-to-point mailboxes (p2p.py): per (sender -> receiver) pair, p2p_cells cells of
    # p2p_cell_nbytes in the sender's region; larger messages stream through in cell-sized
    # chunks. 0 cells = auto: about P2P_AUTO_REGION_NBYTES of mailboxes per region, 4 to 16
    # cells per pair (16 at 2 ranks, 8 at 4, 4 at 8 and up). On the loaded 2-core dev VM a
    # 320 MiB message took 0.88 / 0.60 / 0.30 s through 4 / 8 / 16 cells of 64 KiB (a
    # 4 MiB-slot broadcast: 0.34 s): the ring's size sets how often the ranks hand over.
    p2p_cell_nbytes: int = 64 << 10
    p2p_cells: int = 0
    # "auto": large collectives read peers' buffers in place (process_vm_readv) when every
    # rank can (single_copy.py, algorithms.SINGLE_COPY_MIN); "off": always through the
    # slots; "always": single-copy at every size where it can (tests, measurements).
    single_copy: str = "auto"
    # cuda_ipc (device tensors): per rank, cuda_nslots device slots of cuda_slot_nbytes
    # (a collective moves through them in chunks; not yet tuned on a GPU: the size trades
    # device memory against per-chunk overhead, ~10 us of host work and two flag round
    # trips per chunk), and in the host-staged tier (GPUs without P2P) host slots of
    # cuda_host_slot_nbytes in /dev/shm. cuda_tier: "auto" | "ipc" (fail if peers'
    # memory cannot be mapped) | "host" (always stage through host memory).
    cuda_slot_nbytes: int = 32 * MIB
    cuda_nslots: int = 2
    cuda_host_slot_nbytes: int = 4 * MIB
    cuda_tier: str = "auto"
    # Tests only: run cuda_ipc on the simulated device (cuda_ipc/sim.py). "inline": every
    # CPU tensor of backend "shm" takes the device path (the whole torch.distributed surface
    # through cuda_ipc's code on the CPU); "" (default): off. cuda_sim_device: this rank's
    # simulated device index (equal indices = one "GPU"); cuda_sim_p2p: whether different
    # simulated devices can map each other's memory (0: the host-staged tier).
    cuda_sim: str = ""
    cuda_sim_device: int = 0
    cuda_sim_p2p: bool = True
    # Several hosts (shmcoll/hier/): ranks with equal node ids form one node (shared memory
    # inside it, gloo between nodes). "" = detect (boot id, /dev/shm identity, pid
    # namespace, then a probe segment); any string overrides, e.g. to simulate nodes on one
    # host or for setups detection gets wrong.
    node_id: str = ""
    # init_process_group / new_group return once the group's creation has started on a
    # background thread (torch_backend/deferred.py); True: they wait for it, and a failed
    # creation raises there instead of at the group's first call
    eager_init: bool = False
    # The compiled latency path of "shm" process groups (torch_backend/lane.py): False keeps
    # every call on the Python one (same results; for comparison and as a fallback)
    lane: bool = True
    # Hierarchical all_reduce (and broadcast, reduce_scatter_tensor): below this many bytes
    # the node leaders alone talk to other nodes (intra reduce, leaders' exchange, intra
    # broadcast); from it every local rank exchanges its 1/L shard (intra reduce-scatter,
    # L parallel exchanges, intra all-gather). -1 = hier/reduce.py's HIER_SHARD_MIN_NBYTES.
    hier_shard_min_nbytes: int = -1


P2P_AUTO_REGION_NBYTES = 2 * MIB
P2P_AUTO_CELLS = (4, 16)


def p2p_cells(cfg, world_size):
    """Mailbox cells per pair for a group of `world_size` ranks (cfg.p2p_cells, or auto)."""
    if cfg.p2p_cells:
        return cfg.p2p_cells
    lo, hi = P2P_AUTO_CELLS
    return max(lo, min(hi, P2P_AUTO_REGION_NBYTES // (world_size * cfg.p2p_cell_nbytes)))


_ENV = {
    "SHMCOLL_SLOT_BYTES": ("slot_nbytes", int),
    "SHMCOLL_NSLOTS": ("nslots", int),
    "SHMCOLL_DIRECT_MAX_BYTES": ("direct_max_nbytes", int),
    "SHMCOLL_SPIN": ("spin", str),
    "SHMCOLL_SHM_DIR": ("shm_dir", str),
    "SHMCOLL_P2P_CELL_BYTES": ("p2p_cell_nbytes", int),
    "SHMCOLL_P2P_CELLS": ("p2p_cells", int),
    "SHMCOLL_SINGLE_COPY": ("single_copy", str),
    "SHMCOLL_CUDA_SLOT_BYTES": ("cuda_slot_nbytes", int),
    "SHMCOLL_CUDA_NSLOTS": ("cuda_nslots", int),
    "SHMCOLL_CUDA_HOST_SLOT_BYTES": ("cuda_host_slot_nbytes", int),
    "SHMCOLL_CUDA_TIER": ("cuda_tier", str),
    "SHMCOLL_CUDA_SIM": ("cuda_sim", str),
    "SHMCOLL_CUDA_SIM_DEVICE": ("cuda_sim_device", int),
    "SHMCOLL_CUDA_SIM_P2P": ("cuda_sim_p2p", lambda v: v not in ("0", "false", "no", "")),
    "SHMCOLL_NODE_ID": ("node_id", str),
    "SHMCOLL_EAGER_INIT": ("eager_init", lambda v: v not in ("0", "false", "no", "")),
    "SHMCOLL_HIER_SHARD_MIN_BYTES": ("hier_shard_min_nbytes", int),
    "SHMCOLL_LANE": ("lane", lambda v: v not in ("0", "false", "no", "")),
}


def from_env(environ=None, **overrides):
    """Build a Config from SHMCOLL_* variables (of current_environ() by default), then
    apply keyword overrides."""
    environ = current_environ() if environ is None else environ
    values = {}
    for var, (field, parse) in _ENV.items():
        if var in environ:
            try:
                values[field] = parse(environ[var])
            except ValueError:
                raise ValueError(f"{var}={environ[var]!r} is not a valid {parse.__name__}") from None
    values.update({k: v for k, v in overrides.items() if v is not None})
    cfg = Config(**values)
    if cfg.spin not in ("auto", "spin", "yield"):
        raise ValueError(f"SHMCOLL_SPIN must be auto, spin or yield, got {cfg.spin!r}")
    if cfg.single_copy not in ("auto", "always", "off"):
        raise ValueError(f"SHMCOLL_SINGLE_COPY must be auto, always or off, got "
                         f"{cfg.single_copy!r}")
    if cfg.cuda_tier not in ("auto", "ipc", "host"):
        raise ValueError(f"SHMCOLL_CUDA_TIER must be auto, ipc or host, got {cfg.cuda_tier!r}")
    if cfg.cuda_sim not in ("", "inline", "async"):
        raise ValueError(f"SHMCOLL_CUDA_SIM must be empty, inline or async, got "
                         f"{cfg.cuda_sim!r}")
    if cfg.cuda_nslots < 2 or cfg.cuda_slot_nbytes < 4096 or cfg.cuda_slot_nbytes % 4096 \
            or cfg.cuda_host_slot_nbytes < 4096 or cfg.cuda_host_slot_nbytes % 4096:
        raise ValueError(f"SHMCOLL_CUDA_NSLOTS must be >= 2 and the SHMCOLL_CUDA_*SLOT_BYTES "
                         f"positive multiples of 4096, got {cfg.cuda_nslots}, "
                         f"{cfg.cuda_slot_nbytes} and {cfg.cuda_host_slot_nbytes}")
    if cfg.p2p_cells < 0 or cfg.p2p_cell_nbytes < 64 or cfg.p2p_cell_nbytes % 64:
        raise ValueError(f"SHMCOLL_P2P_CELLS must be >= 0 (0 = auto) and SHMCOLL_P2P_CELL_BYTES "
                         f"a positive multiple of 64, got {cfg.p2p_cells} and "
                         f"{cfg.p2p_cell_nbytes}")
    return cfg


# Process-wide, read at each use (not per group): how long a process waits for another one
# that holds the kernel compile lock (jit.py). Compiling every kernel takes ~10-20 s on a
# quiet 2-core VM; minutes on a loaded one.
COMPILE_TIMEOUT_S = 600.0


def compile_timeout_s(environ=None):
    """SHMCOLL_COMPILE_TIMEOUT_S (seconds, > 0), default COMPILE_TIMEOUT_S."""
    environ = os.environ if environ is None else environ
    raw = environ.get("SHMCOLL_COMPILE_TIMEOUT_S")
    if raw is None:
        return COMPILE_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"SHMCOLL_COMPILE_TIMEOUT_S={raw!r} is not a positive number of "
                         f"seconds")
    return value
