"""The CUDA runtime and driver functions cuda_ipc calls, through ctypes, and the init probe.

No build step and no extra package: the runtime torch already loaded (libcudart, found in
this process's mappings) provides device memory, IPC handles, host registration and peer
queries; the driver (libcuda.so.1) provides the stream memory operations and contexts.
Every C signature is declared here (argtypes/restype), so ctypes converts and checks each
argument: device addresses are 64-bit (CUdeviceptr), flag values 32-bit (cuuint32_t), the
64-byte cudaIpcMemHandle_t is passed by value as the C API takes it.

Contexts. The runtime binds the device's primary context to a thread lazily, at its first
runtime call there; the driver does not. A driver call on a thread that never made a
runtime call (a threaded_pg rank thread that only waits, an autograd thread calling
Work.wait(), the caller of a fresh Python thread) has no current context and fails with
CUDA_ERROR_INVALID_CONTEXT; on a thread whose current device is another GPU, the stream
handle belongs to a different context. `Api.in_context` therefore makes the device's
primary context current around each driver call (push / pop) unless it already is.

`probe_stream_memops` runs once per process and device (cuda.CudaDevice): a stream writes
a word of host memory registered like cuda_ipc's flag words, and waits on one the host
then stores, so a driver, container or platform where this does not work fails at init
with a DeviceError naming the fix, never later as a hang or as a wait that does not wait.
"""

import ctypes
import ctypes.util
import mmap
import threading
import time

import numpy as np

from .device import DeviceError, read_word, write_word

__all__ = ["Api", "IpcMemHandle", "IPC_HANDLE_NBYTES", "probe_stream_memops", "poll",
           "HOST_REGISTER_FLAGS", "ATTR_CAN_MAP_HOST_MEMORY", "ATTR_UNIFIED_ADDRESSING",
           "ATTR_HOST_REGISTER_SUPPORTED"]

IPC_HANDLE_NBYTES = 64  # CUDA_IPC_HANDLE_SIZE
IPC_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
HOST_REGISTER_PORTABLE, HOST_REGISTER_MAPPED = 1, 2  # cudaHostRegisterPortable / Mapped
HOST_REGISTER_FLAGS = HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED
STREAM_WAIT_VALUE_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ: (int32_t)(*addr - value) >= 0
STREAM_WRITE_VALUE_DEFAULT = 0  # CU_STREAM_WRITE_VALUE_DEFAULT: memory barrier, then write
# cudaDeviceAttr (= CUdevice_attribute for these)
ATTR_CAN_MAP_HOST_MEMORY = 19
ATTR_UNIFIED_ADDRESSING = 41
ATTR_HOST_REGISTER_SUPPORTED = 99

# CUDA errors that get a fix in the message (runtime and driver share these numbers)
_ERR_INVALID_VALUE = 1
_ERR_INVALID_CONTEXT = 201  # cudaErrorDeviceUninitialized / CUDA_ERROR_INVALID_CONTEXT
_ERR_OPERATING_SYSTEM = 304
_ERR_INVALID_HANDLE = 400
_ERR_HOST_MEMORY_ALREADY_REGISTERED = 712
_ERR_NOT_SUPPORTED = 801

_CONTAINER_FIX = ("the ranks must run in one container or PID namespace that may use CUDA "
                  "IPC (docker --ipc=host --pid=host); meanwhile SHMCOLL_CUDA_TIER=host stages "
                  "through host memory")


class IpcMemHandle(ctypes.Structure):
    """cudaIpcMemHandle_t: 64 opaque bytes."""
    _fields_ = [("reserved", ctypes.c_byte * IPC_HANDLE_NBYTES)]


def _loaded_library(name):
    """Path of a shared library already mapped into this process (torch's libcudart)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                base = path.rsplit("/", 1)[-1]
                if base.startswith(name + ".so") or base.startswith(name + "-"):
                    return path
    except OSError:
        pass
    return None


class Api:
    """The runtime and driver functions cuda_ipc uses, with their C signatures.

    `Api.get()` is the process-wide instance over torch's runtime; tests build one over
    other libraries with `Api(runtime_path, driver_path)`."""

    _instance = None
    _lock = threading.Lock()

    @classmethod
    def get(cls):
        with cls._lock:
            if cls._instance is None:
                import torch
                torch.cuda.init()  # the runtime torch links is loaded and initialised
                cls._instance = cls()
            return cls._instance

    def __init__(self, runtime_path=None, driver_path="libcuda.so.1"):
        path = runtime_path or _loaded_library("libcudart") or ctypes.util.find_library("cudart")
        if path is None:
            raise DeviceError("cuda_ipc: the CUDA runtime library (libcudart) is not loaded "
                              "in this process and was not found")
        self.runtime_path = path
        rt = ctypes.CDLL(path)
        try:
            drv = ctypes.CDLL(driver_path)
        except OSError as e:
            raise DeviceError(f"cuda_ipc: the CUDA driver library {driver_path} cannot be "
                              f"loaded ({e})") from e
        vp, sz, ui, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int
        pvp, pi = ctypes.POINTER(vp), ctypes.POINTER(i)
        sig = self._sig
        sig(rt, "cudaGetErrorString", ctypes.c_char_p, [i])
        sig(rt, "cudaMalloc", i, [pvp, sz])
        sig(rt, "cudaFree", i, [vp])
        sig(rt, "cudaMemset", i, [vp, i, sz])
        sig(rt, "cudaDeviceSynchronize", i, [])
        sig(rt, "cudaIpcGetMemHandle", i, [ctypes.POINTER(IpcMemHandle), vp])
        sig(rt, "cudaIpcOpenMemHandle", i, [pvp, IpcMemHandle, ui])  # handle by value
        sig(rt, "cudaIpcCloseMemHandle", i, [vp])
        sig(rt, "cudaHostRegister", i, [vp, sz, ui])
        sig(rt, "cudaHostUnregister", i, [vp])
        sig(rt, "cudaHostGetDevicePointer", i, [pvp, vp, ui])
        sig(rt, "cudaDeviceCanAccessPeer", i, [pi, i, i])
        sig(rt, "cudaDeviceGetAttribute", i, [pi, i, i])
        sig(rt, "cudaRuntimeGetVersion", i, [pi])
        sig(rt, "cudaDriverGetVersion", i, [pi])
        self.rt = rt
        # driver: CUstream and CUcontext are pointers, CUdeviceptr is unsigned long long,
        # CUdevice is int; the _v2 names are what cuda.h binds the plain names to
        u64, u32 = ctypes.c_uint64, ctypes.c_uint32
        self.write_value = self._first(drv, ("cuStreamWriteValue32_v2", "cuStreamWriteValue32"),
                                       i, [vp, u64, u32, ui])
        self.wait_value = self._first(drv, ("cuStreamWaitValue32_v2", "cuStreamWaitValue32"),
                                      i, [vp, u64, u32, ui])
        self._ctx_push = self._first(drv, ("cuCtxPushCurrent_v2", "cuCtxPushCurrent"), i, [vp])
        self._ctx_pop = self._first(drv, ("cuCtxPopCurrent_v2", "cuCtxPopCurrent"), i, [pvp])
        sig(drv, "cuGetErrorString", i, [i, ctypes.POINTER(ctypes.c_char_p)])
        sig(drv, "cuDeviceGet", i, [pi, i])
        sig(drv, "cuDevicePrimaryCtxRetain", i, [pvp, i])
        sig(drv, "cuCtxGetCurrent", i, [pvp])
        self.drv = drv
        self.memops_v2 = self.write_value.__name__.endswith("_v2")

    @staticmethod
    def _sig(lib, name, restype, argtypes):
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise DeviceError(f"cuda_ipc: {name} is missing from {lib._name}") from None
        fn.restype, fn.argtypes = restype, argtypes
        return fn

    def _first(self, lib, names, restype, argtypes):
        for name in names:
            if hasattr(lib, name):
                return self._sig(lib, name, restype, argtypes)
        raise DeviceError(f"cuda_ipc: the CUDA driver lacks {names[0]} (stream memory "
                          f"operations and context calls need a CUDA 12 or newer driver)")

    # -- errors ------------------------------------------------------------------------

    def error_text(self, code, driver=False):
        if driver:
            text = ctypes.c_char_p()
            self.drv.cuGetErrorString(code, ctypes.byref(text))
            text = text.value
        else:
            text = self.rt.cudaGetErrorString(code)
        return text.decode(errors="replace") if text else "?"

    def check(self, what, code, fix=""):
        """Raise DeviceError for a runtime error code (with `fix` when given)."""
        if code != 0:
            raise DeviceError(f"cuda_ipc: {what} failed: CUDA error {code} "
                              f"({self.error_text(code)})" + (f"; {fix}" if fix else ""))

    def check_driver(self, what, code, fix=""):
        if code != 0:
            if not fix and code == _ERR_NOT_SUPPORTED:
                fix = ("stream memory operations are not supported by this driver or "
                       "platform (they need CUDA 12+; older drivers: NVreg_EnableStreamMemOPs=1)")
            raise DeviceError(f"cuda_ipc: {what} failed: CUDA driver error {code} "
                              f"({self.error_text(code, driver=True)})"
                              + (f"; {fix}" if fix else ""))

    # -- queries --------------------------------------------------------------------------

    def attribute(self, attr, device):
        value = ctypes.c_int()
        self.check(f"cudaDeviceGetAttribute({attr}, {device})",
                   self.rt.cudaDeviceGetAttribute(ctypes.byref(value), attr, device))
        return value.value

    def versions(self):
        """(runtime version, driver version) as CUDA encodes them (13000 = 13.0)."""
        rt, drv = ctypes.c_int(), ctypes.c_int()
        self.check("cudaRuntimeGetVersion", self.rt.cudaRuntimeGetVersion(ctypes.byref(rt)))
        self.check("cudaDriverGetVersion", self.rt.cudaDriverGetVersion(ctypes.byref(drv)))
        return rt.value, drv.value

    # -- contexts -------------------------------------------------------------------------

    def primary_context(self, index):
        """Device `index`'s primary context (the one the runtime and torch use), retained
        for the life of the process."""
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self.check_driver(f"cuDeviceGet({index})", self.drv.cuDeviceGet(ctypes.byref(dev), index))
        self.check_driver("cuDevicePrimaryCtxRetain",
                          self.drv.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev.value))
        return ctx.value

    def current_context(self):
        ctx = ctypes.c_void_p()
        self.check_driver("cuCtxGetCurrent", self.drv.cuCtxGetCurrent(ctypes.byref(ctx)))
        return ctx.value

    def in_context(self, ctx, what, fn, *args):
        """fn(*args), a driver call, with context `ctx` current on this thread; raises
        DeviceError naming `what` when it fails. The thread's context is left as it was."""
        if self.current_context() == ctx:
            self.check_driver(what, fn(*args))
            return
        self.check_driver("cuCtxPushCurrent", self._ctx_push(ctx))
        try:
            code = fn(*args)
        finally:
            popped = ctypes.c_void_p()
            self._ctx_pop(ctypes.byref(popped))
        self.check_driver(what, code)

    # -- calls with a fix in the message -----------------------------------------------------

    def ipc_open(self, handle_bytes, exported_here=False):
        """cudaIpcOpenMemHandle of a peer's 64-byte handle; the device address."""
        if len(handle_bytes) != IPC_HANDLE_NBYTES:
            raise DeviceError(f"cuda_ipc: malformed IPC handle ({len(handle_bytes)} bytes, "
                              f"expected {IPC_HANDLE_NBYTES})")
        if exported_here:
            raise DeviceError("cuda_ipc: cudaIpcOpenMemHandle of a handle this process "
                              "exported: CUDA IPC cannot be opened in the exporting process "
                              "(rank threads of one process share device pointers instead)")
        h, ptr = IpcMemHandle(), ctypes.c_void_p()
        ctypes.memmove(h.reserved, handle_bytes, IPC_HANDLE_NBYTES)
        code = self.rt.cudaIpcOpenMemHandle(ctypes.byref(ptr), h, IPC_LAZY_ENABLE_PEER_ACCESS)
        if code == _ERR_INVALID_CONTEXT:
            fix = ("the handle may come from this same process (not allowed) or " + _CONTAINER_FIX)
        elif code in (_ERR_INVALID_VALUE, _ERR_OPERATING_SYSTEM, _ERR_INVALID_HANDLE,
                      _ERR_NOT_SUPPORTED):
            fix = _CONTAINER_FIX
        else:
            fix = "SHMCOLL_CUDA_TIER=host stages through host memory"
        self.check("cudaIpcOpenMemHandle", code, fix)
        return ptr.value

    def host_register(self, addr, nbytes, device):
        """cudaHostRegister(Portable | Mapped) of host memory; its device address."""
        code = self.rt.cudaHostRegister(ctypes.c_void_p(addr), nbytes, HOST_REGISTER_FLAGS)
        if code != 0:
            if code == _ERR_HOST_MEMORY_ALREADY_REGISTERED:
                fix = "a range overlapping it is registered already (a cuda_ipc bug: report it)"
            else:
                fix = self._register_fix(device)
            self.check(f"cudaHostRegister({nbytes} bytes of shared memory)", code, fix)
        dev_ptr = ctypes.c_void_p()
        code = self.rt.cudaHostGetDevicePointer(ctypes.byref(dev_ptr), ctypes.c_void_p(addr), 0)
        if code != 0:
            self.rt.cudaHostUnregister(ctypes.c_void_p(addr))
            self.check("cudaHostGetDevicePointer", code, self._register_fix(device))
        return dev_ptr.value

    def _register_fix(self, device):
        try:
            facts = (f"device attributes: HostRegisterSupported="
                     f"{self.attribute(ATTR_HOST_REGISTER_SUPPORTED, device)}, CanMapHostMemory="
                     f"{self.attribute(ATTR_CAN_MAP_HOST_MEMORY, device)}")
        except DeviceError:
            facts = "device attributes unreadable"
        return (f"cuda_ipc keeps its flag words in /dev/shm and needs the GPU to map them "
                f"({facts}); sandboxes that virtualise the GPU driver (gVisor) or a /dev/shm "
                f"that is not tmpfs can refuse this: run the ranks in a container with the "
                f"host's driver and --ipc=host")


_PROBE_WORDS = (0, 16, 32)  # A, B, C: 8-byte word indices, on separate 128-byte lines
_probe_kept = []  # probe buffers a stream may still touch (never unmapped)


def probe_stream_memops(api, ctx, stream, device, timeout_s=10.0, settle_s=0.01):
    """Check, on `stream` (a CUstream handle of device `device`, context `ctx`), what the
    flag protocol needs of shared host memory registered with the GPU: a stream's write
    reaches the host, and a stream's wait holds the stream until the host stores the value.
    Raises DeviceError naming what failed and the fix; never leaves the stream waiting."""
    buf = mmap.mmap(-1, mmap.PAGESIZE)  # MAP_SHARED anonymous: shmem, like /dev/shm
    words = np.frombuffer(buf, np.uint8)
    host = words.ctypes.data
    dev = api.host_register(host, mmap.PAGESIZE, device)
    a, b, c = (host + 8 * w for w in _PROBE_WORDS)
    da, db, dc = (dev + 8 * w for w in _PROBE_WORDS)
    last = None  # (host address, value) of the stream's last enqueued write

    def enqueue_write(host_addr, dev_addr, value):
        nonlocal last
        api.in_context(ctx, "cuStreamWriteValue32", api.write_value, stream, dev_addr, value,
                       STREAM_WRITE_VALUE_DEFAULT)
        last = (host_addr, value)
    try:
        enqueue_write(c, dc, 7)
        if not poll(lambda: read_word(c) == 7, timeout_s):
            raise DeviceError(
                f"cuda_ipc: a stream's cuStreamWriteValue32 into registered shared host memory "
                f"did not arrive within {timeout_s:.0f} s (the word reads {read_word(c)}); the "
                f"flag protocol cannot work on this platform")
        api.in_context(ctx, "cuStreamWaitValue32", api.wait_value, stream, da, 5,
                       STREAM_WAIT_VALUE_GEQ)
        enqueue_write(b, db, 9)
        time.sleep(settle_s)
        if read_word(b) == 9:
            raise DeviceError(
                "cuda_ipc: cuStreamWaitValue32(GEQ 5) on a word holding 0 did not hold the "
                "stream: waits would not order the ranks (a driver or platform bug); "
                "collectives on CUDA tensors are unsafe here")
        write_word(a, 5)
        if not poll(lambda: read_word(b) == 9, timeout_s):
            raise DeviceError(
                f"cuda_ipc: a stream waiting with cuStreamWaitValue32 on registered shared "
                f"host memory did not see the host's store within {timeout_s:.0f} s; the flag "
                f"protocol cannot work on this platform")
    finally:
        write_word(a, 5)  # whatever failed, nothing stays waiting on this word
        drained = last is None or poll(lambda: read_word(last[0]) == last[1],
                                        min(timeout_s, 2.0))
        code = 0
        if drained:
            code = api.rt.cudaHostUnregister(ctypes.c_void_p(host))
            del words
            buf.close()
        else:  # the stream may still touch it: keep it registered and mapped
            _probe_kept.append((buf, words))
    api.check("cudaHostUnregister", code)


def poll(cond, timeout_s):
    """Wait until cond() holds, at most `timeout_s`, sleeping 10 us doubling to 1 ms
    between checks; False if it never held."""
    deadline = time.monotonic() + timeout_s
    sleep_s = 1e-5
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(sleep_s)
        sleep_s = min(sleep_s * 2, 1e-3)
    return True
