"""Work objects over the jobs of a group's Executor (executor.py), and DistBackendError typing."""

import threading

import torch
import torch.distributed as dist

from .compat import Work

__all__ = ["Job", "ShmWork", "CompletedWork", "torch_error"]

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
        # __reduce__: pickle finds `cls` by name, not this class made here (an error
        # crossing processes, or torch looking for tensors in a value by pickling it)
        mixed = type(cls.__name__, (cls, dist.DistBackendError), {
            "__module__": cls.__module__,
            "__reduce__": lambda self: (_rebuild, (cls, self.args, dict(self.__dict__)))})
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


def _rebuild(cls, args, state):
    """Unpickle a re-typed error: rebuild it as `cls`, then re-type it again."""
    e = (OSError.__new__ if issubclass(cls, OSError) else cls.__new__)(cls)
    e.args = args
    e.__dict__.update(state)
    return torch_error(e)


class Job:
    """One queued operation: `fn()` runs it; `outputs` become the future's value.

    Two halves, run by the Executor at different places: execute() runs the operation
    (holding the executor's running lock: one at a time, in issue order), complete() then
    settles the future and the event (never holding that lock, and in issue order: the
    future's callbacks run there, and they may issue and wait for further operations).

    The future is made when first asked for (`future`: Work.get_future, DDP's C++, a
    callback), complete already if the job is: most async ops are only waited for, and
    two torch futures and a `then` cost more than the rest of an async op's Python
    (docs/notes/2026-11-29-async-ops.md)."""

    __slots__ = ("name", "fn", "outputs", "event", "error", "_future", "_settled", "_lock",
                 "_completed", "source_rank", "finished")

    def __init__(self, name, fn, outputs):
        self.name = name
        self.fn = fn
        self.outputs = outputs
        self.event = threading.Event()
        self.error = None
        self._future = self._settled = None
        self._lock = threading.Lock()  # _future, _settled and _completed
        self._completed = False
        self.source_rank = -1
        self.finished = False

    @property
    def future(self):
        """The future users and torch's C++ (DDP's Reducer) see: a `then` of a private one,
        so a failure raised in that callback puts it in torch's error state.
        Future.set_exception(e) would not: it sets `e` as the *value*, with an unwrap
        function only Python's wait() applies; DDP's C++ took the exception object for
        its tensors (a segfault; before, only torch's failure to pickle our errors turned
        it into an error)."""
        with self._lock:
            if self._future is None:
                settled = torch.futures.Future()
                self._future = settled.then(self._result)
                if self._completed:  # no callbacks of anyone's yet: settle it here
                    settled.set_result(None)
                else:
                    self._settled = settled
            return self._future

    @property
    def in_callbacks(self):
        """Its future is complete and complete() has not returned: the future's callbacks
        are running (the Executor's completer is then maybe stuck in one)."""
        future = self._future
        return future is not None and future.done() and not self.event.is_set()

    @property
    def done(self):
        """The operation has finished (outputs written, or failed). Its future and `event`
        follow when complete() runs."""
        return self.finished

    def execute(self):
        try:
            result = self.fn()
            if isinstance(result, int):
                self.source_rank = result
        except BaseException as e:  # surfaced through wait()/the future, never lost
            self.error = torch_error(e)
        self.fn = None  # drop the closure: the arrays and temporaries it held
        self.finished = True  # (shutdown then knows nothing is pending)

    def complete(self):
        """Settle the future, if one was asked for (running its callbacks here), then the
        event: wait() returns on the event, so `work.wait(); work.get_future().value()`
        never sees an incomplete future, and, as with gloo, wait() returns after the
        callbacks ran."""
        with self._lock:
            self._completed = True
            settled, self._settled = self._settled, None
        if settled is not None:
            settled.set_result(None)
        self.event.set()

    def _result(self, _):
        if self.error is not None:
            raise self.error
        return self.outputs

    def fail(self, error):
        """Mark a job that never ran as failed (complete() then settles it)."""
        self.fn = None
        self.error = error
        self.finished = True


class ShmWork(Work):
    """torch Work over a Job: wait(), get_future(), is_completed(), exception(), result()."""

    def __init__(self, executor, job, holder=None):
        super().__init__(holder)
        self._executor = executor
        self._job = job

    def _wait(self, timeout):
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
        self._job.event.wait()  # set right after the future completes (Job.complete)
        if self._job.error is not None:
            raise self._job.error
        return True

    def _get_future(self):
        future = self._job.future
        if not self._job.done:  # waited for through it, maybe from C++ (DDP's Reducer,
            self._executor.expedite()  # torch.futures.wait_all), which cannot run it
        return future

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
