"""The real device: CUDA through ctypes (runtime + driver API) and torch's streams and kernels.

No build step and no extra package: the CUDA runtime torch already loaded (libcudart, found
in this process's mappings) provides device memory, IPC handles, host registration and
peer queries; the driver (libcuda.so.1) provides the stream memory operations. Memory is
allocated with cudaMalloc, outside torch's caching allocator, so expandable segments and
allocator reuse cannot change what a peer has mapped (vLLM #42609). Device memory is
wrapped as torch tensors through __cuda_array_interface__ (no copy, no ownership).

Every runtime call runs with this device current (torch.cuda.device). Errors raise
DeviceError naming the call, the CUDA error and, where one exists, the fix.
"""

import ctypes
import ctypes.util
import threading
import time

import numpy as np
import torch

from .device import Allocation, DeviceError, Mapping

__all__ = ["CudaDevice"]

_IPC_HANDLE_NBYTES = 64
_IPC_LAZY_ENABLE_PEER_ACCESS = 1
_HOST_REGISTER_PORTABLE, _HOST_REGISTER_MAPPED = 1, 2
_CU_STREAM_WAIT_VALUE_GEQ = 0
_CU_STREAM_WRITE_VALUE_DEFAULT = 0  # with a memory fence before the write


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_byte * _IPC_HANDLE_NBYTES)]


def _loaded_library(name):
    """Path of a shared library already mapped into this process (torch's libcudart)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                if f"/{name}" in path and ".so" in path:
                    return path
    except OSError:
        pass
    return None


class _Api:
    """The runtime and driver functions cuda_ipc uses, with their C signatures."""

    _instance = None
    _lock = threading.Lock()

    @classmethod
    def get(cls):
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self):
        torch.cuda.init()
        path = _loaded_library("libcudart") or ctypes.util.find_library("cudart")
        if path is None:
            raise DeviceError("cuda_ipc: the CUDA runtime library (libcudart) is not loaded "
                              "in this process and was not found")
        rt = ctypes.CDLL(path)
        drv = ctypes.CDLL("libcuda.so.1")
        vp, sz, ui, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int
        self._sig(rt, "cudaGetErrorString", ctypes.c_char_p, [i])
        self._sig(rt, "cudaMalloc", i, [ctypes.POINTER(vp), sz])
        self._sig(rt, "cudaFree", i, [vp])
        self._sig(rt, "cudaMemset", i, [vp, i, sz])
        self._sig(rt, "cudaIpcGetMemHandle", i, [ctypes.POINTER(_IpcMemHandle), vp])
        self._sig(rt, "cudaIpcOpenMemHandle", i, [ctypes.POINTER(vp), _IpcMemHandle, ui])
        self._sig(rt, "cudaIpcCloseMemHandle", i, [vp])
        self._sig(rt, "cudaHostRegister", i, [vp, sz, ui])
        self._sig(rt, "cudaHostUnregister", i, [vp])
        self._sig(rt, "cudaHostGetDevicePointer", i, [ctypes.POINTER(vp), vp, ui])
        self._sig(rt, "cudaDeviceCanAccessPeer", i, [ctypes.POINTER(i), i, i])
        self.rt = rt
        u64, u32 = ctypes.c_uint64, ctypes.c_uint32
        self.write_value = self._first(drv, ("cuStreamWriteValue32_v2", "cuStreamWriteValue32"),
                                       i, [vp, u64, u32, ui])
        self.wait_value = self._first(drv, ("cuStreamWaitValue32_v2", "cuStreamWaitValue32"),
                                      i, [vp, u64, u32, ui])
        self._sig(drv, "cuGetErrorString", i, [i, ctypes.POINTER(ctypes.c_char_p)])
        self.drv = drv

    @staticmethod
    def _sig(lib, name, restype, argtypes):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
        return fn

    def _first(self, lib, names, restype, argtypes):
        for name in names:
            if hasattr(lib, name):
                return self._sig(lib, name, restype, argtypes)
        raise DeviceError(f"cuda_ipc: the CUDA driver lacks {names[0]} (stream memory "
                          f"operations need a CUDA 12 or newer driver)")

    def check(self, what, code):
        if code != 0:
            text = self.rt.cudaGetErrorString(code)
            raise DeviceError(f"cuda_ipc: {what} failed: CUDA error {code} "
                              f"({text.decode() if text else '?'})")

    def check_driver(self, what, code):
        if code != 0:
            text = ctypes.c_char_p()
            self.drv.cuGetErrorString(code, ctypes.byref(text))
            raise DeviceError(f"cuda_ipc: {what} failed: CUDA driver error {code} "
                              f"({text.value.decode() if text.value else '?'})")


class _CudaArray:
    """__cuda_array_interface__ of `nbytes` raw bytes at device address `ptr`."""

    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3, "strides": None}


_registered = {}  # (host address, nbytes) -> [device address, refcount], process-wide
_registered_lock = threading.Lock()


class CudaDevice:
    """The device seam (device.py) on CUDA device `index`."""

    kind = "cuda"
    inline = False  # waits run on the device; the watchdog bounds them

    def __init__(self, index):
        self.index = int(index)
        self.torch_device = torch.device("cuda", self.index)
        self._api = _Api.get()
        props = torch.cuda.get_device_properties(self.index)
        self.uuid = str(props.uuid)
        self._name = props.name

    def describe(self):
        return f"cuda:{self.index} {self._name}"

    def _ctx(self):
        return torch.cuda.device(self.index)

    # -- streams ---------------------------------------------------------------------------

    def current_stream(self):
        return torch.cuda.current_stream(self.torch_device)

    def run(self, stream, fn, *args):
        """fn's torch kernels go to the current stream, which the callers pass as `stream`."""
        fn(*args)

    def write_value(self, stream, dev_addr, value):
        self._memop("cuStreamWriteValue32", self._api.write_value, stream, dev_addr, value,
                    _CU_STREAM_WRITE_VALUE_DEFAULT)

    def wait_value(self, stream, dev_addr, value, guard=None):
        self._memop("cuStreamWaitValue32", self._api.wait_value, stream, dev_addr, value,
                    _CU_STREAM_WAIT_VALUE_GEQ)

    def _memop(self, what, fn, stream, dev_addr, value, flags):
        """A driver stream memory operation, with this device's context current (the
        calling thread's current device may be another one)."""
        args = (ctypes.c_void_p(stream.cuda_stream), dev_addr, value & 0xFFFFFFFF, flags)
        if torch.cuda.current_device() == self.index:
            code = fn(*args)
        else:
            with self._ctx():
                code = fn(*args)
        self._api.check_driver(what, code)

    def synchronize(self, stream, timeout_s=60.0):
        stream.synchronize()

    def stream_idle(self, stream):
        return stream.query()

    def close(self):
        pass

    # -- memory ----------------------------------------------------------------------------

    def _wrap(self, ptr, nbytes):
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=self.torch_device)
        return torch.as_tensor(_CudaArray(ptr, nbytes), device=self.torch_device)

    def alloc(self, nbytes):
        api, ptr = self._api, ctypes.c_void_p()
        with self._ctx():
            api.check(f"cudaMalloc({nbytes})", api.rt.cudaMalloc(ctypes.byref(ptr), nbytes))
            api.check("cudaMemset", api.rt.cudaMemset(ptr, 0, nbytes))
        return Allocation(ptr.value, nbytes, self._wrap(ptr.value, nbytes))

    def export(self, allocation):
        api, handle = self._api, _IpcMemHandle()
        with self._ctx():
            api.check("cudaIpcGetMemHandle", api.rt.cudaIpcGetMemHandle(
                ctypes.byref(handle), ctypes.c_void_p(allocation.ptr)))
        return bytes(handle.reserved)

    def seal(self, allocation):
        pass  # a CUDA IPC handle stays valid until cudaFree; nothing is named in /dev/shm

    def open(self, handle, nbytes):
        if len(handle) != _IPC_HANDLE_NBYTES:
            raise DeviceError(f"cuda_ipc: malformed IPC handle ({len(handle)} bytes)")
        api, h, ptr = self._api, _IpcMemHandle(), ctypes.c_void_p()
        ctypes.memmove(h.reserved, handle, _IPC_HANDLE_NBYTES)
        with self._ctx():
            code = api.rt.cudaIpcOpenMemHandle(ctypes.byref(ptr), h, _IPC_LAZY_ENABLE_PEER_ACCESS)
        if code != 0:
            text = api.rt.cudaGetErrorString(code)
            raise DeviceError(f"cudaIpcOpenMemHandle failed: CUDA error {code} "
                              f"({text.decode() if text else '?'})")
        return Mapping(ptr.value, nbytes, self._wrap(ptr.value, nbytes))

    def close_mapping(self, mapping):
        mapping.tensor = None
        api = self._api
        with self._ctx():
            api.check("cudaIpcCloseMemHandle",
                      api.rt.cudaIpcCloseMemHandle(ctypes.c_void_p(mapping.ptr)))

    def free(self, allocation):
        allocation.tensor = None
        api = self._api
        with self._ctx():
            api.check("cudaFree", api.rt.cudaFree(ctypes.c_void_p(allocation.ptr)))

    def register_host(self, array):
        """Pin and map `array` (page-aligned host memory) for the device; its device address.
        Reference-counted per range, so rank threads sharing regions register them once."""
        key = (array.ctypes.data, array.nbytes)
        api = self._api
        with _registered_lock:
            entry = _registered.get(key)
            if entry is None:
                dev_ptr = ctypes.c_void_p()
                with self._ctx():
                    api.check("cudaHostRegister", api.rt.cudaHostRegister(
                        ctypes.c_void_p(key[0]), key[1],
                        _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED))
                    api.check("cudaHostGetDevicePointer", api.rt.cudaHostGetDevicePointer(
                        ctypes.byref(dev_ptr), ctypes.c_void_p(key[0]), 0))
                entry = _registered[key] = [dev_ptr.value, 0]
            entry[1] += 1
            return entry[0]

    def unregister_host(self, array):
        key = (array.ctypes.data, array.nbytes)
        with _registered_lock:
            entry = _registered.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del _registered[key]
                with self._ctx():
                    self._api.check("cudaHostUnregister",
                                    self._api.rt.cudaHostUnregister(ctypes.c_void_p(key[0])))

    def host_tensor(self, array, dev_addr):
        return self._wrap(dev_addr, array.nbytes)

    def can_access_peer(self, uuid):
        """Whether this device can map memory of the visible device with `uuid`."""
        for other in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(other).uuid) == uuid:
                if other == self.index:
                    return True
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
        out = torch.empty(tensor.numel(), dtype=torch.uint8, pin_memory=True)
        with self._ctx():
            side = torch.cuda.Stream(self.index)
            with torch.cuda.stream(side):
                out.copy_(tensor, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
        deadline = time.monotonic() + timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                raise DeviceError(
                    f"cuda_ipc: reading a peer's memory through CUDA IPC did not finish in "
                    f"{timeout_s:.0f} s (broken peer-to-peer access?); set "
                    f"SHMCOLL_CUDA_TIER=host to stage through host memory")
            time.sleep(1e-3)
        return bytes(out.numpy())

    def mem_get_info(self):
        return torch.cuda.mem_get_info(self.index)
