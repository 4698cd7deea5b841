"""A simulated GPU for the CPU test suite: the device seam (device.py) over shared memory.

What it models, and why each part is faithful enough to test the protocol:
- Device memory is a POSIX shared-memory segment per allocation; its "IPC handle" is the
  segment's name, and a peer process maps it (at another address, as cudaIpcOpenMemHandle
  does). Opening a handle in the process that exported it fails, as CUDA's does. The name
  is unlinked when the arena seals its allocations (after every peer opened them) or frees
  them, so a crash cannot leak a segment once the group is up.
- A stream is a FIFO of operations. `inline` streams execute each operation when it is
  enqueued (a wait spins on the calling thread, bounded by the caller's guard): this is
  what lets the whole torch.distributed surface run through cuda_ipc on CPU tensors.
  `async` streams hand operations to a worker thread that executes them in order, with
  optional random delays, so the host runs ahead of its "GPU" exactly as with CUDA and the
  tests can see an ordering bug as wrong data instead of luck.
- Flag words are the same host words the real device uses; a stream's write is a release
  store after the stream's earlier operations, a stream's wait polls until the word is
  cyclically at or past its target. A stalled worker is released by the same host stores
  the watchdog uses on a real GPU.

Device identity: every process on this machine that simulates device index i sees the
same "GPU" (uuid sim-<boot id>-<i>), so ranks with equal indices form the same-GPU tier.
"""

import collections
import mmap
import os
import random
import secrets
import threading
import time

import posix_ipc
import torch

from shmcoll.shm.segments import segment_prefix
from shmcoll.errors import SegmentError

from .device import Allocation, DeviceError, Mapping, at_or_past, read_word, write_word

__all__ = ["SimDevice", "SimStream"]

_POLL_S = 20e-6  # a stalled sim stream re-reads its flag this often (a real GPU: ~1 us)
_POLL_MAX_S = 1e-3


def _boot_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "noboot"


class SimStream:
    """One simulated stream: inline (ops run when enqueued) or async (a worker runs them)."""

    def __init__(self, name, asynchronous=False, max_delay_s=0.0, seed=None):
        self.name = name
        self.asynchronous = asynchronous
        self._max_delay_s = max_delay_s
        self._rng = random.Random(seed)
        self._ops = collections.deque()
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self.error = None  # first failure of an async op (sticky, as CUDA errors are)
        self._thread = None
        if asynchronous:
            self._thread = threading.Thread(target=self._loop, name=f"simstream-{name}",
                                            daemon=True)
            self._thread.start()

    def enqueue(self, fn, *args):
        if not self.asynchronous:
            fn(*args)
            return
        with self._cv:
            if self._closed:
                raise DeviceError(f"sim stream {self.name}: closed")
            self._ops.append((fn, args))
            self._cv.notify_all()

    def idle(self):
        with self._cv:
            return not self._ops and not self._busy

    def synchronize(self, timeout_s=60.0):
        """Wait until every enqueued op has run; raise the stream's error if one failed."""
        if self.asynchronous:
            deadline = time.monotonic() + timeout_s
            with self._cv:
                while self._ops or self._busy:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise DeviceError(f"sim stream {self.name}: not idle after "
                                          f"{timeout_s:.1f} s ({len(self._ops)} ops queued)")
                    self._cv.wait(min(left, 0.05))
        if self.error is not None:
            raise DeviceError(f"sim stream {self.name}: an operation failed: {self.error!r}")

    def close(self):
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(5.0)

    def _loop(self):
        while True:
            with self._cv:
                while not self._ops and not self._closed:
                    self._cv.wait()
                if not self._ops:  # closed and drained
                    return
                fn, args = self._ops.popleft()
                self._busy = True
            try:
                if self._max_delay_s:
                    time.sleep(self._rng.random() * self._max_delay_s)
                if self.error is None:
                    fn(*args)
            except BaseException as e:  # sticky, surfaced by synchronize()
                self.error = e
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def spin_until(self, addr, target, guard):
        """Poll the word at `addr` until it is at or past `target` (an op of this stream)."""
        sleep_s = _POLL_S
        while not at_or_past(read_word(addr), target):
            if self._closed and self.asynchronous:
                raise DeviceError(f"sim stream {self.name}: closed while waiting")
            if guard is not None:
                guard()
            time.sleep(sleep_s)
            sleep_s = min(sleep_s * 2, _POLL_MAX_S)


class SimDevice:
    """The device seam over shared memory and simulated streams (see module docstring).

    `asynchronous`: streams run their operations on a worker thread (engine-level tests);
    else inline (the torch.distributed path on CPU tensors). `peer_access`: whether this
    device can map other sim devices' memory (False makes the group fall back to the
    host-staged tier, as GPUs without P2P do).
    """

    kind = "sim"

    def __init__(self, index=0, asynchronous=False, max_delay_s=0.0, seed=None,
                 peer_access=True):
        self.index = int(index)
        self.uuid = f"sim-{_boot_id()}-{self.index}"
        self.torch_device = torch.device("cpu")
        self.peer_access = peer_access
        self._asynchronous = asynchronous
        self.inline = not asynchronous  # waits spin on the caller's thread (bounded by guards)
        self._max_delay_s = max_delay_s
        self._seed = seed
        self._local = threading.local()
        self._streams = []
        self._default = self.new_stream("default")

    def describe(self):
        streams = "async" if self._asynchronous else "inline"
        return f"simulated device {self.index} ({streams} streams)"

    # -- streams ---------------------------------------------------------------------------

    def new_stream(self, name):
        seed = None if self._seed is None else self._seed + len(self._streams)
        s = SimStream(f"{self.index}:{name}", self._asynchronous, self._max_delay_s, seed)
        self._streams.append(s)
        return s

    def current_stream(self):
        return getattr(self._local, "stream", None) or self._default

    def set_stream(self, stream):
        """Make `stream` this thread's current stream (None: the default); returns the old."""
        old = getattr(self._local, "stream", None)
        self._local.stream = stream
        return old

    def run(self, stream, fn, *args):
        stream.enqueue(fn, *args)

    def write_value(self, stream, addr, value):
        stream.enqueue(write_word, addr, value)

    def wait_value(self, stream, addr, value, guard=None):
        """`guard` bounds an inline wait (it runs on the caller's thread); an asynchronous
        stream waits like a GPU's, until the flag moves or the watchdog releases it."""
        stream.enqueue(stream.spin_until, addr, value,
                       None if stream.asynchronous else guard)

    def synchronize(self, stream, timeout_s=60.0):
        stream.synchronize(timeout_s)

    def stream_idle(self, stream):
        return stream.idle()

    def streams_idle(self, streams, deadline):
        """Wait until every stream in `streams` ran what it was given; False past `deadline`."""
        for s in streams:
            while not s.idle():
                if time.monotonic() > deadline:
                    return False
                time.sleep(_POLL_S)
        return True

    def close(self):
        for s in self._streams:
            s.close()

    # -- memory ----------------------------------------------------------------------------

    def alloc(self, nbytes):
        name = f"/{segment_prefix()}simdev{secrets.token_hex(8)}-{os.getpid()}"
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)
        except OSError as e:
            raise SegmentError(f"sim device: create {name!r}: {e}") from e
        try:
            os.posix_fallocate(shm.fd, 0, max(nbytes, 1))
            mm = mmap.mmap(shm.fd, max(nbytes, 1))
        except BaseException:
            shm.close_fd()
            posix_ipc.unlink_shared_memory(name)
            raise
        shm.close_fd()
        tensor = torch.frombuffer(mm, dtype=torch.uint8)[:nbytes]
        return Allocation(_address(tensor), nbytes, tensor, owner=[mm, name])

    def export(self, allocation):
        mm, name = allocation.owner
        if name is None:
            raise DeviceError("sim device: export of a sealed allocation")
        return f"{name}|{os.getpid()}".encode()

    def seal(self, allocation):
        """Unlink the allocation's name: peers have opened it, nobody else may."""
        name = allocation.owner[1]
        if name is not None:
            allocation.owner[1] = None
            try:
                posix_ipc.unlink_shared_memory(name)
            except posix_ipc.ExistentialError:
                pass

    def open(self, handle, nbytes):
        name, pid = handle.decode().rsplit("|", 1)
        if int(pid) == os.getpid():
            raise DeviceError("sim device: an IPC handle cannot be opened in the process that "
                              "exported it (CUDA's rule; rank threads share pointers instead)")
        if not name.startswith("/" + segment_prefix()):
            raise DeviceError(f"sim device: {name!r} is not a segment of this user")
        try:
            shm = posix_ipc.SharedMemory(name, 0)
        except posix_ipc.ExistentialError:
            raise DeviceError(f"sim device: {name!r} does not exist (the exporter exited or "
                              f"sealed it)") from None
        try:
            if os.fstat(shm.fd).st_size < nbytes:
                raise DeviceError(f"sim device: {name!r} is smaller than {nbytes} bytes")
            mm = mmap.mmap(shm.fd, max(nbytes, 1))
        finally:
            shm.close_fd()
        tensor = torch.frombuffer(mm, dtype=torch.uint8)[:nbytes]
        return Mapping(_address(tensor), nbytes, tensor, owner=mm)

    def close_mapping(self, mapping):
        mm, mapping.owner, mapping.tensor = mapping.owner, None, None
        _unmap(mm)

    def free(self, allocation):
        self.seal(allocation)
        mm, allocation.owner, allocation.tensor = allocation.owner[0], None, None
        _unmap(mm)

    def register_host(self, array):
        return array.ctypes.data  # the simulated device reads host memory where it lies

    def unregister_host(self, array):
        pass

    def host_tensor(self, array, dev_addr):
        return torch.frombuffer(array, dtype=torch.uint8)

    def can_access_peer(self, uuid):
        return self.peer_access and uuid.startswith("sim-")

    def write_bytes(self, tensor, data):
        tensor.copy_(torch.from_numpy(data))

    def read_bytes(self, tensor, timeout_s):
        return bytes(tensor.clone().numpy())

    def mem_get_info(self):
        return (0, 0)


def _address(tensor):
    return tensor.data_ptr()


def _unmap(mm):
    if mm is None:
        return
    try:
        mm.close()
    except BufferError:
        pass  # a tensor view is still alive: the mapping goes with it
