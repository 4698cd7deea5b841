"""Work objects and the per-group executor: async ops run in issue order, on a worker thread
or on the thread that waits for them (so a synchronous call pays no thread hand-off)."""

import collections
import threading
import time

import torch
import torch.distributed as dist

__all__ = ["Job", "Executor", "ShmWork", "CompletedWork", "torch_error"]

_ERROR_TYPES = {}


def torch_error(e):
    """Re-type an engine error so it is also a torch DistBackendError (and keeps its class)."""
    if isinstance(e, dist.DistBackendError) or not isinstance(e, RuntimeError):
        return e
    cls = type(e)
    if issubclass(dist.DistBackendError, cls):  # RuntimeError itself: no mixin needed
        new = dist.DistBackendError(*e.args)
        new.__cause__ = e.__cause__
        new.__traceback__ = e.__traceback__
        return new
    mixed = _ERROR_TYPES.get(cls)
    if mixed is None:
        mixed = type(cls.__name__, (cls, dist.DistBackendError), {"__module__": cls.__module__})
        _ERROR_TYPES[cls] = mixed
    # OSError-based errors (CollectiveTimeoutError is a TimeoutError, SegmentError an
    # OSError) need OSError's __new__: mixed.__new__ resolves to RuntimeError's, which
    # refuses them ("RuntimeError.__new__(...) is not safe") and turned a timeout into a
    # TypeError.
    new = (OSError.__new__ if issubclass(mixed, OSError) else mixed.__new__)(mixed)
    new.__dict__.update(getattr(e, "__dict__", {}))
    new.args = e.args
    new.__cause__ = e.__cause__
    new.__traceback__ = e.__traceback__
    return new


class Job:
    """One queued operation: `fn()` runs it; `outputs` become the future's value."""

    __slots__ = ("name", "fn", "outputs", "event", "error", "future", "source_rank",
                 "finished")

    def __init__(self, name, fn, outputs):
        self.name = name
        self.fn = fn
        self.outputs = outputs
        self.event = threading.Event()
        self.error = None
        self.future = torch.futures.Future()
        self.source_rank = -1
        self.finished = False

    @property
    def done(self):
        """The operation has finished (outputs written, or failed). Its future and `event`
        follow right after (see run)."""
        return self.finished

    def run(self):
        try:
            result = self.fn()
            if isinstance(result, int):
                self.source_rank = result
        except BaseException as e:  # surfaced through wait()/the future, never lost
            self.fail(torch_error(e))
            return
        # NOTE: order matters: `finished` first (shutdown then knows nothing is pending),
        # the future next, the event last: wait() returns on the event, so
        # `work.wait(); work.get_future().value()` never sees an incomplete future (gloo
        # also completes the future before wait() returns).
        self.finished = True
        self.future.set_result(self.outputs)
        self.event.set()

    def fail(self, error):
        self.error = error
        self.finished = True
        self.future.set_exception(error)
        self.event.set()


class Executor:
    """Runs a group's jobs one at a time in submission order.

    A worker thread guarantees progress for async ops nobody waits on; a thread that waits
    for a job that has not started runs the queue itself up to that job (no hand-off
    latency for synchronous calls). `_running` makes sure only one thread runs jobs.
    """

    _RETRY_S = 1e-3  # a waiter re-checks its job this often while another thread runs jobs
    _BUSY_RETRY_S = _RETRY_S  # the worker re-checks the queue this often meanwhile

    def __init__(self, name, on_abort=None):
        self._cv = threading.Condition()
        self._queue = collections.deque()
        self._running = threading.Lock()
        self._stopped = False
        self.inline_busy = False  # a synchronous op is running on a caller's thread
        self._stop_reason = "shut down"
        self._on_abort = on_abort
        self._thread = threading.Thread(target=self._loop, name=f"shmcoll-{name}", daemon=True)
        self._thread.start()

    @property
    def pending(self):
        return len(self._queue) + (1 if self._running.locked() else 0)

    def submit(self, job):
        """Queue `job` and wake the worker (it runs it unless a waiter does first)."""
        with self._cv:
            if self._stopped:
                raise torch_error(RuntimeError(
                    f"{job.name}: the process group was {self._stop_reason}; it accepts no new "
                    f"operations (create a new process group)"))
            self._queue.append(job)
            self._cv.notify()
        return job

    def run_inline(self, fn, *args):
        """Run `fn(*args)` on this thread after every queued job (issue order holds); its
        error is raised here, typed as a torch DistBackendError."""
        with self._running:
            if self._stopped:
                raise torch_error(RuntimeError(
                    f"the process group was {self._stop_reason}; it accepts no new operations "
                    f"(create a new process group)"))
            if self._queue:  # this thread's earlier async ops go first
                self._run_until(None)
            self.inline_busy = True  # shutdown from another thread must abort, not wait
            try:
                return fn(*args)
            except BaseException as e:
                raise torch_error(e) from None
            finally:
                self.inline_busy = False

    def _pop(self):
        with self._cv:
            return self._queue.popleft() if self._queue else None

    def _run_until(self, until):
        """Run queued jobs in order (caller holds _running) until `until` is done."""
        while until is None or not until.done:
            job = self._pop()
            if job is None:
                return
            job.run()

    def _loop(self):
        while True:
            with self._cv:
                while not self._queue and not self._stopped:
                    self._idle_wait()
                self._woken()
                if self._stopped:
                    return
            if self._running.acquire(blocking=False):
                try:
                    self._run_until(None)
                finally:
                    self._running.release()
            else:
                with self._cv:
                    self._cv.wait(self._BUSY_RETRY_S)

    def _idle_wait(self):
        """Wait (holding _cv) for a submission or stop; subclasses may poll instead."""
        self._cv.wait()

    def _woken(self):
        """Called (holding _cv) once the worker has work or must stop."""

    def wait(self, job, timeout_s=None):
        """Block until `job` is done (running it here if nobody else is); True if done."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not job.done:
            if self._running.acquire(blocking=False):
                try:
                    if deadline is None:
                        self._run_until(job)
                        continue
                finally:
                    self._running.release()
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            job.event.wait(self._RETRY_S if remaining is None else min(remaining, self._RETRY_S))
        return True

    def stop(self, abort_pending=True, join_timeout_s=10.0, reason="shut down"):
        """Stop the worker; pending jobs are aborted (woken) and failed. True if joined.

        `reason` ("shut down", "aborted") words the errors of later submissions."""
        with self._cv:
            if not self._stopped:
                self._stop_reason = reason
            self._stopped = True
            busy = bool(self._queue) or self._running.locked()
            self._cv.notify_all()
        if busy and abort_pending and self._on_abort is not None:
            self._on_abort()
        self._thread.join(join_timeout_s)
        with self._running:
            while True:
                job = self._pop()
                if job is None:
                    break
                job.fail(torch_error(RuntimeError(
                    f"{job.name}: the process group was {self._stop_reason} before this "
                    f"operation ran (pending work aborted)")))
        return not self._thread.is_alive()


class ShmWork(dist.Work):
    """torch Work over a Job: wait(), get_future(), is_completed(), exception(), result()."""

    def __init__(self, executor, job):
        super().__init__()
        self._executor = executor
        self._job = job

    def wait(self, timeout=None):
        timeout_s = None
        if timeout is not None:
            timeout_s = timeout.total_seconds() if hasattr(timeout, "total_seconds") \
                else float(timeout)
            if timeout_s <= 0:
                timeout_s = None
        if not self._executor.wait(self._job, timeout_s):
            ms = int(round(timeout_s * 1000))
            err = torch_error(RuntimeError(f"[{self._job.name}] Timed out waiting {ms}ms for "
                                           f"the operation to complete in Work.wait(); the "
                                           f"process group was aborted"))
            if self._executor._on_abort is not None:
                self._executor._on_abort()
            raise err
        self._job.event.wait()  # set right after the future completes (Job.run)
        if self._job.error is not None:
            raise self._job.error
        return True

    def get_future(self):
        return self._job.future

    def is_completed(self):
        return self._job.event.is_set()

    def is_success(self):
        return self._job.event.is_set() and self._job.error is None

    def exception(self):
        return self._job.error

    def result(self):
        self.wait()
        return self._job.outputs

    def source_rank(self):
        return self._job.source_rank

    def _source_rank(self):
        return self._job.source_rank

    def synchronize(self):
        self.wait()


class CompletedWork(ShmWork):
    """The Work of a synchronous op, returned after the op ran (and raised, if it failed):
    wait() has nothing left to do."""

    def wait(self, timeout=None):
        return True
