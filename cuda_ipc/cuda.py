"""The real device: CUDA through ctypes (cuda_api.py) and torch's streams and kernels.

Memory is allocated with cudaMalloc, outside torch's caching allocator, so expandable
segments and allocator reuse cannot change what a peer has mapped (vLLM #42609). Device
memory is wrapped as torch tensors through __cuda_array_interface__ (no copy, no
ownership; without a "stream" key, so torch synchronizes nothing on import).

Every runtime call runs with this device current (torch.cuda.device); every driver call
(the stream memory operations) with this device's primary context current on the calling
thread (cuda_api.Api.in_context), whichever thread it is. Errors raise DeviceError naming
the call, the CUDA error and, where one exists, the fix. The first CudaDevice of a device
in a process probes the stream memory operations on registered shared memory
(cuda_api.probe_stream_memops; SHMCOLL_CUDA_PROBE=0 skips it).
"""

import ctypes
import os
import threading
import time

import numpy as np
import torch

from .cuda_api import STREAM_WAIT_VALUE_GEQ, \
    STREAM_WRITE_VALUE_DEFAULT, Api, IpcMemHandle, poll, probe_stream_memops
from .device import Allocation, DeviceError, Mapping

__all__ = ["CudaDevice", "outstanding"]


class _CudaArray:
    """__cuda_array_interface__ of `nbytes` raw bytes at device address `ptr`."""

    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3, "strides": None}


# Process-wide state (rank threads of one process share it):
_registered = {}  # (host address, nbytes) -> [device address, refcount]
_exported = {}  # IPC handle bytes -> device address, for allocations this process exported
_live = {"allocations": 0, "mappings": 0}
_probed = {}  # device index -> None (probe passed) or the DeviceError it raised
_lock = threading.Lock()


def outstanding():
    """What this process holds through cuda_ipc right now (the leak test's ledger):
    {"allocations", "mappings", "registrations"}."""
    with _lock:
        return dict(_live, registrations=len(_registered))


class CudaDevice:
    """The device seam (device.py) on CUDA device `index`."""

    kind = "cuda"
    inline = False  # waits run on the device; the watchdog bounds them

    def __init__(self, index):
        self.index = int(index)
        self.torch_device = torch.device("cuda", self.index)
        self._api = Api.get()
        props = torch.cuda.get_device_properties(self.index)
        self.uuid = str(props.uuid)
        self._name = props.name
        self._context = self._api.primary_context(self.index)
        self._probe()

    def describe(self):
        return f"cuda:{self.index} {self._name}"

    def _ctx(self):
        return torch.cuda.device(self.index)

    def _probe(self):
        """Once per process and device: the stream memory operations work on registered
        shared memory (cuda_api.probe_stream_memops), or every CudaDevice raises why."""
        with _lock:
            if self.index in _probed:
                err = _probed[self.index]
            else:
                err = None
                if os.environ.get("SHMCOLL_CUDA_PROBE", "1") != "0":
                    try:
                        with self._ctx():
                            stream = torch.cuda.Stream(self.index)
                            probe_stream_memops(self._api, self._context, stream.cuda_stream,
                                                self.index)
                    except DeviceError as e:
                        err = e
                _probed[self.index] = err
        if err is not None:
            raise DeviceError(f"{err} (cuda:{self.index}, probed at the first use of this "
                              f"device by cuda_ipc)")

    # -- streams ---------------------------------------------------------------------------

    def current_stream(self):
        return torch.cuda.current_stream(self.torch_device)

    def run(self, stream, fn, *args):
        """fn's torch kernels go to the current stream, which the callers pass as `stream`."""
        fn(*args)

    def write_value(self, stream, dev_addr, value):
        self._api.in_context(self._context, "cuStreamWriteValue32", self._api.write_value,
                             ctypes.c_void_p(stream.cuda_stream), dev_addr, value & 0xFFFFFFFF,
                             STREAM_WRITE_VALUE_DEFAULT)

    def wait_value(self, stream, dev_addr, value, guard=None):
        self._api.in_context(self._context, "cuStreamWaitValue32", self._api.wait_value,
                             ctypes.c_void_p(stream.cuda_stream), dev_addr, value & 0xFFFFFFFF,
                             STREAM_WAIT_VALUE_GEQ)

    def synchronize(self, stream, timeout_s=60.0):
        """Block until `stream` is idle, at most `timeout_s` (then DeviceError)."""
        if not self.streams_idle([stream], time.monotonic() + timeout_s):
            raise DeviceError(f"cuda_ipc: stream {stream} of {self.describe()} did not finish "
                              f"its work within {timeout_s:.1f} s")

    def stream_idle(self, stream):
        return stream.query()

    def streams_idle(self, streams, deadline):
        """Wait until every stream in `streams` finished what was enqueued so far, until
        `deadline` (time.monotonic()); False if one did not."""
        events = []
        with self._ctx():
            for s in streams:
                ev = torch.cuda.Event()
                ev.record(s)
                events.append(ev)
        return poll(lambda: all(ev.query() for ev in events), deadline - time.monotonic())

    def close(self):
        pass

    # -- memory ----------------------------------------------------------------------------

    def _wrap(self, ptr, nbytes, what):
        """A uint8 tensor over `nbytes` at device address `ptr`, on this device. torch puts
        a tensor on the device that owns the memory (cudaPointerGetAttributes) and would
        copy it to this one: refused, since the protocol needs the memory itself."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=self.torch_device)
        with self._ctx():
            t = torch.as_tensor(_CudaArray(ptr, nbytes), device=self.torch_device)
        if t.data_ptr() != ptr or t.device != self.torch_device:
            raise DeviceError(
                f"cuda_ipc: {what} at 0x{ptr:x} is memory of {t.device}, not of "
                f"{self.torch_device}: torch cannot view it in place on this device (ranks on "
                f"different GPUs stage through host memory: SHMCOLL_CUDA_TIER=host)")
        return t

    def _runtime(self, what, fn, *args, fix=""):
        with self._ctx():
            self._api.check(what, fn(*args), fix)

    def alloc(self, nbytes):
        api, ptr = self._api, ctypes.c_void_p()
        self._runtime(f"cudaMalloc({nbytes})", api.rt.cudaMalloc, ctypes.byref(ptr), nbytes)
        try:
            self._runtime("cudaMemset", api.rt.cudaMemset, ptr, 0, nbytes)
            # cudaMemset runs on the legacy stream, which torch's streams do not wait for
            self._runtime("cudaDeviceSynchronize", api.rt.cudaDeviceSynchronize)
            tensor = self._wrap(ptr.value, nbytes, "a cudaMalloc allocation")
        except BaseException:
            api.rt.cudaFree(ptr)
            raise
        with _lock:
            _live["allocations"] += 1
        return Allocation(ptr.value, nbytes, tensor)

    def export(self, allocation):
        api, handle = self._api, IpcMemHandle()
        self._runtime("cudaIpcGetMemHandle", api.rt.cudaIpcGetMemHandle, ctypes.byref(handle),
                      ctypes.c_void_p(allocation.ptr))
        data = bytes(handle.reserved)
        with _lock:
            _exported[data] = allocation.ptr
        return data

    def seal(self, allocation):
        pass  # a CUDA IPC handle stays valid until cudaFree; nothing is named in /dev/shm

    def open(self, handle, nbytes):
        with _lock:
            mine = bytes(handle) in _exported
        with self._ctx():
            ptr = self._api.ipc_open(bytes(handle), exported_here=mine)
        try:
            tensor = self._wrap(ptr, nbytes, "a peer's memory opened through CUDA IPC")
        except BaseException:
            self._runtime("cudaIpcCloseMemHandle", self._api.rt.cudaIpcCloseMemHandle,
                          ctypes.c_void_p(ptr))
            raise
        with _lock:
            _live["mappings"] += 1
        return Mapping(ptr, nbytes, tensor)

    def close_mapping(self, mapping):
        mapping.tensor = None
        self._runtime("cudaIpcCloseMemHandle", self._api.rt.cudaIpcCloseMemHandle,
                      ctypes.c_void_p(mapping.ptr))
        with _lock:
            _live["mappings"] -= 1

    def free(self, allocation):
        allocation.tensor = None
        with _lock:
            for h in [h for h, p in _exported.items() if p == allocation.ptr]:
                del _exported[h]
        self._runtime("cudaFree", self._api.rt.cudaFree, ctypes.c_void_p(allocation.ptr))
        with _lock:
            _live["allocations"] -= 1

    def register_host(self, array):
        """Pin and map `array` (page-aligned host memory) for the device; its device address.
        Reference-counted per range, so rank threads sharing regions register them once."""
        key = (array.ctypes.data, array.nbytes)
        with _lock:
            entry = _registered.get(key)
            if entry is None:
                with self._ctx():
                    dev_ptr = self._api.host_register(key[0], key[1], self.index)
                entry = _registered[key] = [dev_ptr, 0]
            entry[1] += 1
            return entry[0]

    def unregister_host(self, array):
        key = (array.ctypes.data, array.nbytes)
        with _lock:
            entry = _registered.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del _registered[key]
                self._runtime("cudaHostUnregister", self._api.rt.cudaHostUnregister,
                              ctypes.c_void_p(key[0]))

    def host_tensor(self, array, dev_addr):
        return self._wrap(dev_addr, array.nbytes, "registered host memory")

    def can_access_peer(self, uuid):
        """Whether this device can map memory of the visible device with `uuid`."""
        for other in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(other).uuid) == uuid:
                if other == self.index:
                    return True  # cudaDeviceCanAccessPeer(d, d) says no: same GPU needs no P2P
                can = ctypes.c_int()
                self._api.check("cudaDeviceCanAccessPeer", self._api.rt.cudaDeviceCanAccessPeer(
                    ctypes.byref(can), self.index, other))
                return bool(can.value)
        return False  # not visible in this process (CUDA_VISIBLE_DEVICES): stage through host

    def write_bytes(self, tensor, data):
        """Synchronous host -> device copy of numpy uint8 `data` into `tensor` (setup only)."""
        with self._ctx():
            tensor.copy_(torch.from_numpy(np.ascontiguousarray(data)))
            torch.cuda.synchronize(self.index)

    def read_bytes(self, tensor, timeout_s):
        """Device -> host copy of `tensor` (setup probes), bounded by `timeout_s`: reading a
        peer's memory over a broken P2P link can hang (vLLM #2728), so it runs on a side
        stream and the host gives up instead of waiting forever."""
        out = torch.empty(tensor.numel(), dtype=torch.uint8, device="cpu", pin_memory=True)
        with self._ctx():
            side = torch.cuda.Stream(self.index)
            with torch.cuda.stream(side):
                out.copy_(tensor, non_blocking=True)
        if not self.streams_idle([side], time.monotonic() + timeout_s):
            raise DeviceError(
                f"cuda_ipc: reading a peer's memory through CUDA IPC did not finish in "
                f"{timeout_s:.0f} s (broken peer-to-peer access?); set "
                f"SHMCOLL_CUDA_TIER=host to stage through host memory")
        return bytes(out.numpy())

    def mem_get_info(self):
        return torch.cuda.mem_get_info(self.index)
