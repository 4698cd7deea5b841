"""The per-group Executor: a group's operations execute one at a time in issue order, and
their futures complete in issue order, on threads no later operation depends on.

Executing. Jobs run under `_running`, one at a time, in submission order. A worker thread
guarantees progress for async operations nobody waits on; a thread that waits for a job
that has not started executes the queue itself up to that job, so a synchronous call pays
no thread hand-off.

Completing (settling a job's future, which runs the future's callbacks there, then its
event) happens outside `_running`, one job after the other in issue order, by one thread at
a time: the completer. DDP's comm hooks run in such callbacks, and PowerSGD's issue
collectives there and wait for them; when callbacks ran on the thread that held the
executor, a nested collective queued behind the very job that waited for it (a hang with
no timeout). So:

- a worker that executed a job, or a thread waiting for its Work, becomes the completer
  when there is none and completes every executed job in order;
- a completer that issues work from inside a callback, or spends COMPLETION_GRACE_S in
  the callbacks of one job, is taken over: the next free worker (or a waiting thread)
  completes the jobs after it, in order, while the first one stays in its callback (so
  futures always complete in issue order; callbacks keep it unless one blocks);
- a worker inside a completion is not free; whenever work is waiting and no worker is
  free, a helper worker starts (it ends after HELPER_IDLE_S without work);
- at stop(), queued jobs fail as aborted and what is left is completed by drainer
  threads, one more each time the last one is stuck, never by the stopping thread.

So a callback that waits for a later job (by its future, a Work, or torch.futures.wait_all)
always has a thread that executes it and one that completes it, and a job that cannot
finish fails by its own collective timeout, which fails its future: every wait ends.
Callbacks of earlier operations may run on a thread waiting for a later one (as they
always did here); a Work's own callbacks have run when its wait() returns (as with gloo).

Waking. The workers sleep on a Doorbell (doorbell.py) where the C extension is built,
with the GIL released: a submission wakes nobody, a worker looks every millisecond and
takes the GIL only for a job still queued a look later (its submitter usually waits for it
first and runs it), and parks when submissions stop; every other wake-up is urgent,
including a job whose future was asked for (expedite: C++ waits cannot run it). Without it
(or with DOORBELL False: a subclass's own scheme) the condition wakes them.
"""

import collections
import threading
import time

from .doorbell import Doorbell
from .executor_workers import WorkerSet
from .work import torch_error

__all__ = ["Executor"]


class Executor:
    """Runs a group's jobs (work.Job) in submission order and completes them in that order.

    Its threads are a WorkerSet (executor_workers.py), which owns them and their count;
    what a worker does each round is _serve, here. Hooks for subclasses (threaded_pg's rank
    executor): _submitted, _idle_wait, _woken, _thread_init.
    """

    _RETRY_S = 1e-3  # a waiter re-checks its job this often while another thread runs jobs
    _BUSY_RETRY_S = _RETRY_S  # a worker re-checks the queue this often meanwhile
    HELPER_IDLE_S = 1.0  # a helper worker with nothing to do for this long ends
    # A job whose future is complete but whose callbacks have run this long is taken to be
    # blocked, and the jobs after it are completed by another thread (their futures still
    # complete after its future, their callbacks may start before its callbacks return). A
    # callback that issued work is taken over at once (PowerSGD's); this bound is for one
    # that waits for work other threads issued. Callbacks that wait for nothing must not
    # lose their order: DDP's bucket division and copy-back of a 25 MiB bucket took
    # 15-49 ms on this 2-core VM at load average 9 (one thread, pages touched first).
    COMPLETION_GRACE_S = 0.1
    DOORBELL = True  # the workers sleep on a Doorbell where one can be made

    def __init__(self, name, on_abort=None):
        self._cv = threading.Condition()
        self._queue = collections.deque()  # submitted, not executed
        self._completions = collections.deque()  # executed, not completed (issue order)
        self._running = threading.Lock()
        self._completer = None  # the thread completing jobs in order, if any
        self._completing = None  # the job it completes now
        self._completing_since = 0.0  # when it began that job
        self._nested = False  # the completer issued work from inside a callback
        self._stopped = False
        self.inline_busy = False  # a synchronous op is running on a caller's thread
        self._stop_reason = "shut down"
        self._on_abort = on_abort
        self._bell = Doorbell.create() if self.DOORBELL else None
        self._workers = WorkerSet(name, self._cv)
        with self._cv:
            self._workers.start(False, self._thread_init, self._serve)

    @property
    def pending(self):
        return len(self._queue) + (1 if self._running.locked() else 0)

    def owns_current_thread(self):
        """The calling thread is one of this executor's workers."""
        return self._workers.owns(threading.current_thread())

    # -- submitting and executing ----------------------------------------------------------

    def submit(self, job):
        """Queue `job` and wake the worker (it runs it unless a waiter does first)."""
        with self._cv:
            if self._stopped:
                raise torch_error(RuntimeError(
                    f"{job.name}: the process group was {self._stop_reason}; it accepts no new "
                    f"operations (create a new process group)"))
            self._queue.append(job)
            if self._completer is threading.current_thread():
                self._nested = True  # issued from a callback, which may now wait for it
            self._submitted()
            self._ensure_free_worker()
        return job

    def run_inline(self, fn, *args):
        """Run `fn(*args)` on this thread after every queued job (issue order holds); its
        error is raised here, typed as a torch DistBackendError."""
        with self._running:
            if self._stopped:
                raise torch_error(RuntimeError(
                    f"the process group was {self._stop_reason}; it accepts no new operations "
                    f"(create a new process group)"))
            if self._queue:  # this thread's earlier async ops go first (the workers
                self._execute_until(None)  # complete them)
            self.inline_busy = True  # shutdown from another thread must abort, not wait
            try:
                return fn(*args)
            except BaseException as e:
                raise torch_error(e) from None
            finally:
                self.inline_busy = False

    def _execute_until(self, until):
        """Execute queued jobs in order (caller holds _running) until `until` is done (None:
        all); each goes to the completions, for the workers to complete unless the caller
        waits for `until` (it then completes them itself: no wake-up)."""
        while until is None or not until.done:
            with self._cv:
                if not self._queue:
                    return
                job = self._take()
            job.execute()
            with self._cv:
                self._completions.append(job)
                if until is None:
                    self._wake()
                    self._ensure_free_worker()

    def expedite(self):
        """A job's future was asked for: it may be waited for where no thread can run it
        (a torch future's C++ wait), so a worker runs the queue now, not a look later."""
        with self._cv:
            if self._queue:
                self._wake()

    # -- completing ------------------------------------------------------------------------

    def complete_later(self, job):
        """Complete `job`, finished elsewhere (a point-to-point request), like the executed
        jobs: on a thread no operation depends on, after those executed before it."""
        with self._cv:
            if not self._stopped:
                self._completions.append(job)
                self._wake()
                self._ensure_free_worker()
                return
        job.complete()

    def _stuck(self):
        """Holding _cv: the completer is in the callbacks of a complete future, and issued
        work from one of them or has been there for COMPLETION_GRACE_S."""
        job = self._completing
        return self._completer is not None and job is not None and job.in_callbacks and (
            self._nested or time.monotonic() - self._completing_since > self.COMPLETION_GRACE_S)

    def _complete_in_order(self, claimed=False, steal=False):
        """Complete executed jobs in order on this thread while it is the completer: it
        becomes the completer if there is none (or `claimed`: it already is; `steal`: it
        takes over a stuck one), and stops when none are left or it was taken over. A
        completer's callbacks may call this again (Work.wait inside a callback): that
        inner call completes the jobs after, in order, and returns."""
        me = threading.current_thread()
        worker = self._workers.owns(me)
        with self._cv:
            inner = self._completer is me and not claimed
            if not (claimed or inner):
                if self._completer is not None and not (steal and self._stuck()):
                    return
                self._completer = me
            if worker and not inner:
                self._workers.enter_completion()
                self._ensure_free_worker()
        try:
            while True:
                with self._cv:
                    if self._completer is not me:
                        return  # taken over while in a callback
                    if not self._completions:
                        if not inner:
                            self._completer = self._completing = None
                        return
                    job = self._completing = self._completions.popleft()
                    self._completing_since = time.monotonic()
                    self._nested = False
                job.complete()
        finally:
            if worker and not inner:
                with self._cv:
                    self._workers.leave_completion()

    # -- the workers' rounds (the threads themselves: executor_workers.WorkerSet) ----------

    def _ensure_free_worker(self):
        """Holding _cv: work is waiting and every worker is inside a completion: start a
        helper (a worker blocked in a callback must not hold up the queue)."""
        if self._workers.free == 0 and not self._stopped and (self._queue or self._completions):
            self._workers.start(True, self._thread_init, self._serve)

    def _drain(self):
        """What a drainer thread does (stop()): complete the jobs left, taking over a
        stuck completer."""
        self._complete_in_order(steal=True)

    def _serve(self, helper):
        """One round of a worker: complete jobs in order, or execute one job; False when
        the worker should end."""
        idle_since = time.monotonic()
        with self._cv:
            while True:
                if self._completions and (self._completer is None or self._stuck()):
                    self._completer = threading.current_thread()
                    claimed = True
                    break
                if self._stopped:
                    return False
                if self._queue:
                    claimed = False
                    break
                if self._completions:  # wait until the completer is done or stuck
                    timeout = max(self._completing_since + self.COMPLETION_GRACE_S
                                  - time.monotonic(), self._RETRY_S)
                elif helper:
                    timeout = self.HELPER_IDLE_S - (time.monotonic() - idle_since)
                    if timeout <= 0:
                        return False
                else:
                    timeout = None
                self._idle_wait(helper, timeout)
            self._woken()
        if claimed:
            self._complete_in_order(claimed=True)
            return True
        if not self._running.acquire(blocking=False):
            with self._cv:
                self._cv.wait(self._BUSY_RETRY_S)
            return True
        try:
            with self._cv:
                job = self._take() if self._queue else None
            if job is not None:
                job.execute()
                with self._cv:  # before _running goes: a thread that runs the next job
                    self._completions.append(job)  # must find this one ahead of it
        finally:
            self._running.release()
        if job is not None:
            self._complete_in_order()
        return True

    def _take(self):
        """Holding _cv: the next queued job, off the queue."""
        if self._bell is not None:
            self._bell.taken()
        return self._queue.popleft()

    def _wake(self, everyone=False):
        """Holding _cv: wake a worker now (all threads waiting, with `everyone`)."""
        if self._bell is not None:
            self._bell.urgent(everyone)
        if everyone:
            self._cv.notify_all()
        else:
            self._cv.notify()

    # -- hooks for subclasses --------------------------------------------------------------

    def _thread_init(self):
        """First thing every worker thread does; subclasses bind thread state here."""

    def _submitted(self):
        """Called (holding _cv) after a job was queued: the doorbell's worker takes it a
        look later unless someone has (doorbell.py); else wake a worker."""
        if self._bell is not None:
            self._bell.job()
        self._cv.notify()  # a worker waiting on the condition (_serve's busy retry)

    def _idle_wait(self, helper, timeout):
        """Wait (holding _cv) for work, stop, or `timeout` seconds (None: no limit).
        Subclasses may poll instead."""
        if self._bell is None:
            self._cv.wait(timeout)
            return
        seen = self._bell.snapshot()  # rings are made holding _cv: none is missed
        self._cv.release()
        try:
            self._bell.wait(seen, timeout)
        finally:
            self._cv.acquire()

    def _woken(self):
        """Called (holding _cv) once a worker has work or must stop."""

    # -- waiting and stopping --------------------------------------------------------------

    def wait(self, job, timeout_s=None):
        """Block until `job` is complete (its future settled, its callbacks run), executing
        and completing it here where no other thread does; with `timeout_s`, only until
        then: False if the job has not finished by then (a worker runs it: this thread
        would not return at the deadline from inside the collective)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if deadline is not None and not job.done:
            self.expedite()  # a worker runs it now, not a doorbell look later
        while not job.event.is_set():
            if not job.done:
                if deadline is None:
                    if self._running.acquire(blocking=False):
                        try:
                            self._execute_until(job)
                        finally:
                            self._running.release()
                elif time.monotonic() >= deadline:
                    return False
            if job.done:
                self._complete_in_order(steal=True)
                if job.event.is_set():
                    break
                job.event.wait(self._RETRY_S)  # another thread completes it
            else:
                remaining = self._RETRY_S if deadline is None else deadline - time.monotonic()
                job.event.wait(min(max(remaining, 0.0), self._RETRY_S))
        return True

    def stop(self, abort_pending=True, join_timeout_s=10.0, reason="shut down"):
        """Stop the workers; pending jobs are aborted (woken) and failed, every job's future
        is completed. True when no job is executing any more (and none will: the engine's
        memory may then be released).

        `reason` ("shut down", "aborted") words the errors of later submissions."""
        with self._cv:
            if not self._stopped:
                self._stop_reason = reason
            self._stopped = True
            busy = bool(self._queue) or self._running.locked()
            self._wake(everyone=True)
        if busy and abort_pending and self._on_abort is not None:
            self._on_abort()
        idle = self._running.acquire(timeout=join_timeout_s)
        try:
            with self._cv:
                pending, self._queue = list(self._queue), collections.deque()
                if self._bell is not None:
                    self._bell.taken(len(pending))
                for job in pending:
                    job.fail(torch_error(RuntimeError(
                        f"{job.name}: the process group was {self._stop_reason} before "
                        f"this operation ran (pending work aborted)")))
                    self._completions.append(job)
        finally:
            if idle:
                self._running.release()
        deadline = time.monotonic() + join_timeout_s
        while True:  # what is left is completed by a drainer thread, not by this one
            with self._cv:
                left = bool(self._completions)
                if left and (self._completer is None or self._stuck()) and \
                        time.monotonic() - self._workers.drain_started > self.COMPLETION_GRACE_S:
                    self._workers.start_drainer(self._thread_init, self._drain)
            if not left or time.monotonic() > deadline:
                break
            time.sleep(self._RETRY_S)
        self._workers.join(deadline)
        return idle
