"""Which transport a group of device ranks uses: a pure choice over what every rank saw.

    same_gpu  every rank on one device: peers' slots are opened through CUDA IPC (which
              needs no peer-to-peer support on one device) and read at device speed
    p2p       different devices that map each other's memory (NVLink / PCIe P2P): the same
              IPC path, reads cross the link
    host      anything else (no P2P, IPC refused, SHMCOLL_CUDA_TIER=host): slots live in
              the ranks' host regions, registered with the device; kernels read them over PCIe

Every rank reports its device (DeviceInfo); a rank tries IPC only when every peer is on
its own device or one it can access (wants_ipc); it then opens every peer's slots and
reads back a probe pattern, because a P2P capability bit can be wrong (vLLM #2728). The
votes of all ranks decide (choose): IPC only if every rank succeeded, so the choice is
the same everywhere.
"""

import json

from .device import DeviceError

__all__ = ["SAME_GPU", "P2P", "HOST", "TIERS", "DeviceInfo", "wants_ipc", "choose"]

SAME_GPU, P2P, HOST = "same_gpu", "p2p", "host"
TIERS = (SAME_GPU, P2P, HOST)


class DeviceInfo:
    """What one rank tells the others about its device."""

    __slots__ = ("kind", "uuid", "index", "name")

    def __init__(self, kind, uuid, index, name):
        self.kind, self.uuid, self.index, self.name = kind, uuid, int(index), name

    @classmethod
    def of(cls, dev):
        return cls(dev.kind, dev.uuid, dev.index, dev.describe())

    def render(self):
        return json.dumps([self.kind, self.uuid, self.index, self.name])

    @classmethod
    def parse(cls, text):
        kind, uuid, index, name = json.loads(text)
        return cls(kind, uuid, index, name)

    def __repr__(self):
        return f"DeviceInfo{tuple(json.loads(self.render()))!r}"


def wants_ipc(infos, rank, dev, forced="auto"):
    """Whether rank `rank` (on `dev`) should try to map its peers' device memory."""
    kinds = {i.kind for i in infos}
    if len(kinds) > 1:
        raise DeviceError(
            "cuda_ipc: the ranks use different device kinds ("
            + ", ".join(f"rank {r}: {i.kind}" for r, i in enumerate(infos))
            + "); every rank of a group must pass CUDA tensors (or every rank the simulator)")
    if forced == HOST:
        return False
    mine = infos[rank].uuid
    return all(i.uuid == mine or dev.can_access_peer(i.uuid)
               for r, i in enumerate(infos) if r != rank)


def choose(infos, votes, forced="auto"):
    """The tier, from every rank's DeviceInfo and IPC probe vote (True: it mapped and read
    every peer's slots). `forced`: SHMCOLL_CUDA_TIER ("auto", "ipc" or "host")."""
    if forced not in ("auto", "ipc", HOST):
        raise ValueError(f"SHMCOLL_CUDA_TIER must be auto, ipc or host, got {forced!r}")
    if forced != HOST and all(votes):
        return SAME_GPU if len({i.uuid for i in infos}) == 1 else P2P
    if forced == "ipc":
        failed = [r for r, v in enumerate(votes) if not v]
        raise DeviceError(
            f"cuda_ipc: SHMCOLL_CUDA_TIER=ipc, but ranks {failed} could not map their peers' "
            f"device memory through CUDA IPC (different GPUs without P2P, or IPC not permitted "
            f"in this container: it needs a shared PID namespace, e.g. docker --ipc=host "
            f"--pid=host). Remedy: unset SHMCOLL_CUDA_TIER (the group then stages through "
            f"host memory) or fix the setup")
    return HOST
