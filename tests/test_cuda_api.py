"""cuda_ipc's ctypes layer (cuda_api.py, cuda.CudaDevice) against a fake CUDA library.

tests/fake_cuda.c implements the runtime and driver functions cuda_ipc binds, with the same
C signatures, and models what would go wrong on a GPU (see its header): a driver call on a
thread without a current context, a host address where a device address is due, an IPC
handle opened in its own process or not carried whole, a stream wait that does not wait.
Built with the system C compiler; skipped where there is none.
"""

import contextlib
import ctypes
import mmap
import os
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest
import torch

from cuda_ipc import cuda as cuda_mod
from cuda_ipc import cuda_api
from cuda_ipc.device import Allocation, DeviceError, read_word, write_word

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler to build tests/fake_cuda.c")
    so = str(tmp_path_factory.mktemp("fakecuda") / "libfakecuda.so")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-pthread", "-o", so,
                    os.path.join(HERE, "fake_cuda.c")], check=True, timeout=120)
    return so


@pytest.fixture()
def api(lib):
    a = cuda_api.Api(runtime_path=lib, driver_path=lib)
    fake = ctypes.CDLL(lib)
    fake.fake_set_mode(0)
    before = fake.fake_registrations()
    yield a
    fake.fake_set_mode(0)
    assert _drained(fake), "a fake stream operation is still queued"
    assert fake.fake_registrations() == before, "a host registration leaked"


def _fake(lib, name, ctype=ctypes.c_uint64):
    return ctype.in_dll(ctypes.CDLL(lib), name).value


def _drained(fake, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while fake.fake_pending():
        if time.monotonic() > deadline:
            return False
        time.sleep(1e-3)
    return True


def _on_fresh_thread(fn):
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            out["error"] = e
    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    if "error" in out:
        raise out["error"]
    return out.get("value")


@contextlib.contextmanager
def _registered_page(api):
    buf = mmap.mmap(-1, mmap.PAGESIZE)
    view = np.frombuffer(buf, np.uint8)
    host = view.ctypes.data
    dev = api.host_register(host, mmap.PAGESIZE, 0)
    try:
        yield host, dev
    finally:
        api.check("cudaHostUnregister", api.rt.cudaHostUnregister(ctypes.c_void_p(host)))
        del view
        buf.close()


def test_flag_writes_carry_64_bit_addresses_and_32_bit_values(api, lib):
    """The device address (above 2^44 in the fake) and a value with the top bit set reach
    the driver unchanged, and the stream's write lands in the host word."""
    ctx = api.primary_context(0)
    with _registered_page(api) as (host, dev):
        assert dev != host and dev > 1 << 44
        api.in_context(ctx, "cuStreamWriteValue32", api.write_value, ctypes.c_void_p(0),
                       dev + 8, 0xFFFFFFFE, cuda_api.STREAM_WRITE_VALUE_DEFAULT)
        assert _fake(lib, "fake_last_addr") == dev + 8
        assert _fake(lib, "fake_last_value", ctypes.c_uint32) == 0xFFFFFFFE
        assert _drained(ctypes.CDLL(lib)) and read_word(host + 8) == 0xFFFFFFFE
        assert _fake(lib, "fake_last_register_flags", ctypes.c_uint) == \
            cuda_api.HOST_REGISTER_FLAGS


def test_driver_calls_on_a_thread_without_context_get_the_device_context(api, lib):
    """A thread that never made a runtime call has no current context: the raw driver call
    fails there (CUDA_ERROR_INVALID_CONTEXT), in_context succeeds with the device's primary
    context current during the call and leaves the thread as it was."""
    ctx = api.primary_context(0)
    with _registered_page(api) as (host, dev):
        raw = _on_fresh_thread(lambda: api.write_value(ctypes.c_void_p(0), dev, 1, 0))
        assert raw == 201

        def with_context():
            assert api.current_context() is None
            api.in_context(ctx, "cuStreamWriteValue32", api.write_value, ctypes.c_void_p(0),
                           dev, 2, 0)
            return api.current_context()
        assert _on_fresh_thread(with_context) is None
        assert _fake(lib, "fake_last_ctx") == ctx
        assert _drained(ctypes.CDLL(lib)) and read_word(host) == 2


def test_device_write_value_works_from_any_thread(api, lib):
    """CudaDevice.write_value / wait_value (the arena's calls) from a fresh thread."""
    dev = _device(api)
    with _registered_page(api) as (host, daddr):
        stream = type("S", (), {"cuda_stream": 0})()
        _on_fresh_thread(lambda: dev.write_value(stream, daddr, 5))
        _on_fresh_thread(lambda: dev.wait_value(stream, daddr, 5))
        assert _drained(ctypes.CDLL(lib)) and read_word(host) == 5


def test_a_host_address_is_not_a_device_address(api):
    ctx = api.primary_context(0)
    with _registered_page(api) as (host, dev):
        with pytest.raises(DeviceError, match="cuStreamWaitValue32 failed: CUDA driver error 1"):
            api.in_context(ctx, "cuStreamWaitValue32", api.wait_value, ctypes.c_void_p(0),
                           host, 1, cuda_api.STREAM_WAIT_VALUE_GEQ)


def test_ipc_handle_is_passed_whole_by_value(api, lib):
    """The 64-byte handle reaches cudaIpcOpenMemHandle intact (by value), with the lazy
    peer-access flag; a handle of this process fails with the reason; a truncated or
    corrupted one with the container fix."""
    ptr = ctypes.c_void_p()
    api.check("cudaMalloc", api.rt.cudaMalloc(ctypes.byref(ptr), 256))
    handle = cuda_api.IpcMemHandle()
    api.check("cudaIpcGetMemHandle", api.rt.cudaIpcGetMemHandle(ctypes.byref(handle), ptr))
    mine = bytes(handle.reserved)
    with pytest.raises(DeviceError, match="201.*this same process"):
        api.ipc_open(mine)
    with pytest.raises(DeviceError, match="exporting process"):
        api.ipc_open(mine, exported_here=True)
    other = bytearray(mine)
    other[8:16] = (os.getpid() + 1).to_bytes(8, "little")  # as if another process made it
    assert api.ipc_open(bytes(other)) == ptr.value
    assert _fake(lib, "fake_last_open_flags", ctypes.c_uint) == 1
    other[63] ^= 0xFF
    with pytest.raises(DeviceError, match="400.*--pid=host"):
        api.ipc_open(bytes(other))
    with pytest.raises(DeviceError, match="malformed"):
        api.ipc_open(mine[:32])
    api.check("cudaFree", api.rt.cudaFree(ptr))


def test_device_refuses_to_open_its_own_export(api, monkeypatch):
    dev = _device(api)
    ptr = ctypes.c_void_p()
    api.check("cudaMalloc", api.rt.cudaMalloc(ctypes.byref(ptr), 64))
    monkeypatch.setattr(cuda_mod, "_live", {"allocations": 1, "mappings": 0})
    alloc = Allocation(ptr.value, 64, None)
    handle = dev.export(alloc)
    with pytest.raises(DeviceError, match="exporting process"):
        dev.open(handle, 64)
    dev.free(alloc)
    assert handle not in cuda_mod._exported
    assert cuda_mod.outstanding()["allocations"] == 0 and cuda_mod.outstanding()["mappings"] == 0


def test_overlapping_registration_names_the_bug(api):
    with _registered_page(api) as (host, _):
        with pytest.raises(DeviceError, match="712.*overlapping"):
            api.host_register(host, 64, 0)


def test_probe_passes_where_stream_memory_operations_work(api):
    cuda_api.probe_stream_memops(api, api.primary_context(0), 0, 0, timeout_s=5.0)


def test_probe_refuses_a_wait_that_does_not_wait(api, lib):
    ctypes.CDLL(lib).fake_set_mode(1)
    with pytest.raises(DeviceError, match="did not hold the stream"):
        cuda_api.probe_stream_memops(api, api.primary_context(0), 0, 0, timeout_s=5.0)


def test_probe_gives_up_on_writes_that_never_arrive(api, lib):
    """No hang: a platform where the stream's writes never reach the host fails within the
    probe's timeout (plus its 2 s drain wait), and the buffer it cannot trust stays mapped."""
    ctypes.CDLL(lib).fake_set_mode(2)
    kept = len(cuda_api._probe_kept)
    t0 = time.monotonic()
    with pytest.raises(DeviceError, match="did not arrive"):
        cuda_api.probe_stream_memops(api, api.primary_context(0), 0, 0, timeout_s=0.3)
    assert time.monotonic() - t0 < 5.0
    assert len(cuda_api._probe_kept) == kept + 1
    ctypes.CDLL(lib).fake_set_mode(0)
    buf, view = cuda_api._probe_kept.pop()  # the fake's queue is empty: safe to release
    api.check("cudaHostUnregister", api.rt.cudaHostUnregister(
        ctypes.c_void_p(view.ctypes.data)))


def test_wrap_refuses_memory_torch_places_on_another_device(api, monkeypatch):
    """torch.as_tensor puts a tensor on the device that owns the memory and would copy it
    to ours: a peer's slots on another GPU would silently become a snapshot."""
    dev = _device(api)
    src = torch.arange(8, dtype=torch.uint8)
    monkeypatch.setattr(cuda_mod.torch, "as_tensor", lambda obj, device=None: src.clone())
    with pytest.raises(DeviceError, match="not of cpu"):
        dev._wrap(src.data_ptr(), 8, "a peer's memory")


def _device(api):
    """A CudaDevice over the fake library, without torch.cuda (this is a CPU build)."""
    dev = object.__new__(cuda_mod.CudaDevice)
    dev.index, dev._api, dev._name, dev.uuid = 0, api, "fake", "fake-uuid"
    dev._context = api.primary_context(0)
    dev.torch_device = torch.device("cpu")
    dev._ctx = contextlib.nullcontext
    return dev


def test_flag_words_round_trip_through_the_protocol_helpers(api):
    """write_word / read_word (8-byte slots, the low 32 bits) see what a stream wrote."""
    ctx = api.primary_context(0)
    with _registered_page(api) as (host, dev):
        write_word(host + 16, 3)
        api.in_context(ctx, "w", api.wait_value, ctypes.c_void_p(0), dev + 16, 3, 0)
        api.in_context(ctx, "w", api.write_value, ctypes.c_void_p(0), dev + 24, 4, 0)
        deadline = time.monotonic() + 5
        while read_word(host + 24) != 4 and time.monotonic() < deadline:
            time.sleep(1e-3)
        assert read_word(host + 24) == 4
