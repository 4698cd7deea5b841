"""The Executor's worker threads: the first worker and the helpers (_start_worker,
_ensure_free_worker), a worker's life and each of its rounds (_loop, _serve: complete the
executed jobs in order, or execute the next one), and the drainer threads that stop() starts
for the jobs left (_start_drainer).

`WorkerMixin` is a part of executor.Executor (it uses the Executor's queue, completions,
locks and completer state, its timing constants, _complete_in_order and its hooks for
subclasses: _thread_init, _idle_wait, _woken). It holds every thread the Executor starts;
executor.py keeps submitting, executing, completing, waiting and stopping, and its module
docstring the rules these threads follow.
"""

import threading
import time

__all__ = ["WorkerMixin"]


class WorkerMixin:
    """The worker threads of executor.Executor (see the module docstring)."""

    def _start_worker(self, helper):
        """Start a worker (holding _cv)."""
        thread = threading.Thread(target=self._loop, args=(helper,), daemon=True,
                                  name=f"shmcoll-{self._name}" + ("-helper" if helper else ""))
        self._threads.append(thread)
        self._free += 1
        thread.start()

    def _ensure_free_worker(self):
        """Holding _cv: work is waiting and every worker is inside a completion: start a
        helper (a worker blocked in a callback must not hold up the queue)."""
        if self._free == 0 and not self._stopped and (self._queue or self._completions):
            self._start_worker(helper=True)

    def _loop(self, helper):
        self._thread_init()
        try:
            while self._serve(helper):
                pass
        finally:
            with self._cv:
                self._free -= 1
                self._threads.remove(threading.current_thread())

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
                job = self._queue.popleft() if self._queue else None
            if job is not None:
                job.execute()
                with self._cv:  # before _running goes: a thread that runs the next job
                    self._completions.append(job)  # must find this one ahead of it
        finally:
            self._running.release()
        if job is not None:
            self._complete_in_order()
        return True

    def _start_drainer(self):
        """Start a thread (holding _cv) that completes the jobs left at stop() in order,
        taking over a stuck completer. Not the stopping thread itself: a callback that
        waits for a later job (whose abort is queued behind it) blocks whichever thread
        completes it, so every blocked callback gets its own thread, and the next one
        completes the jobs after it, which ends those waits."""
        self._drain_started = time.monotonic()  # one drainer per grace period

        def drain():
            self._thread_init()
            self._complete_in_order(steal=True)
        threading.Thread(target=drain, daemon=True, name=f"shmcoll-{self._name}-drain").start()
