"""DeviceWork: the torch Work of a collective on device tensors (NCCL's semantics).

The collective's device work is enqueued on the caller's current stream when the call
returns. `wait()` makes the *current* stream wait for it (nothing to do when that is the
stream it was enqueued on) and never blocks the host; `is_completed()` asks whether the
device has finished it (the rank's MINE word); `synchronize()` blocks the host until then,
bounded by the collective's timeout. The future is a device-aware torch Future completed
at once, as ProcessGroupNCCL's is: its value is usable by work ordered after the
collective on a stream, `then()` callbacks run right away on the calling thread (so a
callback that issues and waits on another collective -- the PowerSGD hook -- cannot wait
for a thread that waits for it), and a consumer on another stream is ordered by the
future's own events. A failure found later by the watchdog is raised by `wait()`,
`synchronize()`, `exception()` and every later call on the group.
"""

import time

import torch

from shmcoll.torch_backend.compat import Work
from shmcoll.torch_backend.work import torch_error

__all__ = ["DeviceWork"]


class DeviceWork(Work):
    """See the module docstring. `last`: the last chunk id enqueued (None: nothing was)."""

    def __init__(self, dgroup, last, outputs, stream, timeout_s, holder=None):
        super().__init__(holder)
        self._dgroup = dgroup
        self._last = last
        self._outputs = outputs
        self._stream = stream
        self._timeout_s = timeout_s
        self._future = None

    def _error(self):
        arena = self._dgroup.arena
        if arena is None or arena.watchdog is None:
            return None
        err = arena.watchdog.error
        if err is None or (self._last is not None and self._finished()):
            return None
        return err

    def _finished(self):
        return self._last is None or self._dgroup.arena.is_done(self._last)

    def _wait(self, timeout):
        err = self._error()
        if err is not None:
            raise torch_error(err)
        dev = self._dgroup.dev
        current = dev.current_stream()
        if self._last is not None and current != self._stream:
            self._dgroup.arena.stream_wait_done(current, self._last)
        return True

    def synchronize(self):
        """Block the host until the device finished this collective (or it failed)."""
        deadline = time.monotonic() + self._timeout_s
        sleep_s = 20e-6
        while not self._finished():
            err = self._error()
            if err is not None:
                raise torch_error(err)
            if time.monotonic() > deadline:
                raise torch_error(RuntimeError(
                    f"Work.synchronize: the device did not finish the collective within "
                    f"{self._timeout_s:.1f} s (is the stream blocked by earlier work?)"))
            time.sleep(sleep_s)
            sleep_s = min(sleep_s * 2, 1e-3)
        err = self._error()
        if err is not None:
            raise torch_error(err)

    def is_completed(self):
        return self._finished() or self._error() is not None

    def is_success(self):
        return self._finished() and self._error() is None

    def exception(self):
        err = self._error()
        return None if err is None else torch_error(err)

    def result(self):
        self.wait()
        return self._outputs

    def _get_future(self):
        if self._future is None:
            dev = self._dgroup.dev
            if dev.kind == "cuda":
                fut = torch.futures.Future(devices=[dev.torch_device])
                with torch.cuda.stream(self._stream):  # its events follow the collective
                    fut.set_result(self._outputs)
            else:
                fut = torch.futures.Future()
                fut.set_result(self._outputs)
            self._future = fut
        return self._future

    def source_rank(self):
        return -1

    def _source_rank(self):
        return -1
