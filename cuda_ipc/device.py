"""The device seam: what cuda_ipc asks of a GPU, and the stream-ordered flag words.

Everything the collectives do to a device goes through one object with this surface, so
the same protocol and algorithms run on a real GPU (cuda.CudaDevice: CUDA IPC handles,
stream memory operations, torch kernels on the caller's stream) and on the simulated
device of the CPU test suite (sim.SimDevice: shared-memory "device memory", streams as
queues executed inline or by a worker thread, the same torch ops on CPU tensors):

    memory      alloc(nbytes) -> Allocation      free(allocation)
                export(allocation) -> bytes       open(handle, nbytes) -> Mapping
                close(mapping)                    seal(allocation): no peer opens it any more
                register_host(array) -> device address of a host array (flag words,
                host-tier slots); unregister_host(array); host_tensor(array, dev_addr)
    streams     current_stream()                  run(stream, fn, *args): fn's torch ops
                execute in stream order           synchronize(stream, timeout_s)
    flags       write_value(stream, dev_addr, v): a stream-ordered 32-bit store after
                everything enqueued before it (with a system-wide memory fence);
                wait_value(stream, dev_addr, v): the stream stalls until the word is
                cyclically >= v. Both are CUDA stream memory operations
                (cuStreamWriteValue32 / cuStreamWaitValue32, GEQ) on the real device.
    identity    kind ("cuda" | "sim"), index, uuid, torch_device, describe()

Why flag words and not IPC events (what torch.multiprocessing uses): a stream waiting on
an event that a killed peer recorded but never reached waits forever, and nothing on the
host can release it. A flag lives in host shared memory: the watchdog of a surviving rank
stores a release value into it, the stalled stream moves on, and the GPU stays usable.
The cost is one 4-byte PCIe read per poll of the stalled stream (NCCL's proxy flags do
the same).

Words are 32 bits (the memory operations every CUDA 12+ device supports) and compared
cyclically, as cuStreamWaitValue32's GEQ does: `a` is at or past `b` when
(a - b) mod 2^32 < 2^31. Counters may therefore wrap; at most 2^31 steps may be in flight.
"""

from shmcoll.native.atomics import read_acquire, write_release
from shmcoll.errors import ShmcollError

__all__ = ["DeviceError", "Allocation", "Mapping", "WORD_MASK", "at_or_past", "word_add",
           "read_word", "write_word"]

WORD_MASK = 0xFFFFFFFF
_HALF = 1 << 31


class DeviceError(ShmcollError):
    """A device call failed (CUDA error, unsupported setup); the message says which and why."""


class Allocation:
    """Device memory this process owns: `ptr` (device address), `nbytes`, `tensor` (uint8 view)."""

    __slots__ = ("ptr", "nbytes", "tensor", "owner")

    def __init__(self, ptr, nbytes, tensor, owner=None):
        self.ptr, self.nbytes, self.tensor, self.owner = ptr, nbytes, tensor, owner


class Mapping:
    """A peer's device memory opened in this process (same fields as Allocation)."""

    __slots__ = ("ptr", "nbytes", "tensor", "owner")

    def __init__(self, ptr, nbytes, tensor, owner=None):
        self.ptr, self.nbytes, self.tensor, self.owner = ptr, nbytes, tensor, owner


def at_or_past(value, target):
    """Cyclic `value >= target` on 32-bit words (the GEQ of cuStreamWaitValue32)."""
    return ((value - target) & WORD_MASK) < _HALF


def word_add(value, n):
    return (value + n) & WORD_MASK


def read_word(addr):
    """The 32-bit flag at host address `addr` (acquire load of its 8-byte slot)."""
    return read_acquire(addr) & WORD_MASK


def write_word(addr, value):
    """Store a 32-bit flag from the host (release store of its 8-byte slot)."""
    write_release(addr, value & WORD_MASK)
