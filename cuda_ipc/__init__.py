"""cuda_ipc: CUDA tensors on backend "shm", moved between rank processes through CUDA IPC.

One `dist.init_process_group("shm")` serves CPU and CUDA tensors. A CUDA tensor reaching a
collective of an "shm" process group is handed here (torch_path.DevicePath): the group
gets a device arena (arena.py) on its first device collective -- per-rank device slots
allocated outside torch's caching allocator and opened by the peers through CUDA IPC
handles, or host-staged slots where the GPUs cannot map each other's memory (tiers.py) --
and every collective is enqueued on the caller's current stream, ordered between ranks by
32-bit flag words in shared host memory that the streams write and wait on (device.py),
with the host protocol of shmcoll (numbering, fingerprints, deadlines, liveness) deciding
before anything is enqueued. Several ranks may share one GPU.

Nothing here imports CUDA until a CUDA tensor arrives: a CPU-only install never touches it.
The simulated device (sim.py) runs the same code on CPU tensors for the test suite.

Layers (imports go downwards): torch_path -> work, group -> collectives, reduce -> arena ->
tiers, watchdog, rendezvous -> device; cuda -> cuda_api (real device), sim (simulated device).
"""

import threading

__all__ = ["device_path", "get_device", "DeviceError"]

from .device import DeviceError  # noqa: E402

_devices = {}
_lock = threading.Lock()


def get_device(tensor_device, cfg):
    """The process-wide device object for a tensor's device (torch.device), or for the
    simulator when cfg.cuda_sim is set and the tensor is on the CPU."""
    if tensor_device.type == "cuda":
        import torch
        index = tensor_device.index if tensor_device.index is not None \
            else torch.cuda.current_device()
        key = ("cuda", index)
        with _lock:
            dev = _devices.get(key)
            if dev is None:
                from .cuda import CudaDevice
                dev = _devices[key] = CudaDevice(index)
        return dev
    if cfg.cuda_sim:
        key = ("sim", cfg.cuda_sim, cfg.cuda_sim_device, cfg.cuda_sim_p2p)
        with _lock:
            dev = _devices.get(key)
            if dev is None:
                from .sim import SimDevice
                dev = _devices[key] = SimDevice(cfg.cuda_sim_device,
                                                asynchronous=cfg.cuda_sim == "async",
                                                peer_access=cfg.cuda_sim_p2p)
        return dev
    raise DeviceError(f"cuda_ipc: no device for tensors on {tensor_device}")


def device_path(pg, tensor_device, cfg):
    """The DevicePath of EngineProcessGroup `pg` for tensors on `tensor_device`; the
    arena's control plane comes from `pg._device_rendezvous()` when it is first needed
    (rank processes: rendezvous.ProcessRendezvous; rank threads: ThreadRendezvous)."""
    from .group import DeviceGroup
    from .torch_path import DevicePath

    dev = get_device(tensor_device, cfg)
    return DevicePath(pg, DeviceGroup(pg.group, dev, pg._device_rendezvous, cfg))
