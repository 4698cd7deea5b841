"""The Executor's threads (WorkerSet): the first worker, the helpers, the drainers.

A WorkerSet owns its threads and their bookkeeping: the worker threads, how many of them
are free (not inside a completion), and when the last drainer started. It is held by one
executor.Executor and knows it only through the callables each start is given (held by
that thread alone, so no reference cycle outlives the threads): thread_init() (the first
thing every thread does: the Executor's hook for subclasses), serve(helper) -> bool (one
round of a worker: complete the executed jobs in order, or execute the next job; False
when the worker should end) and complete() (what a drainer does: complete the jobs left,
taking over a stuck completer). What a worker does, and the rules these threads follow,
are executor.py's (its module docstring).

Every method but owns() and join() is called holding the Executor's condition `cv`, which
the set itself takes only when a worker ends.
"""

import threading
import time

__all__ = ["WorkerSet"]


class WorkerSet:
    """The threads of one executor.Executor (see the module docstring)."""

    def __init__(self, name, cv):
        self._name = name
        self._cv = cv
        self._threads = []  # worker threads; the first one lives until the executor stops
        self.free = 0  # worker threads not inside a completion
        self.drain_started = float("-inf")  # when start_drainer last started a drainer

    def owns(self, thread):
        """`thread` is one of the worker threads."""
        return thread in self._threads

    def start(self, helper, thread_init, serve):
        """Start a worker: the first one (helper False), or a helper that ends after the
        Executor's HELPER_IDLE_S without work (its serve() says when)."""
        thread = threading.Thread(target=self._loop, args=(helper, thread_init, serve),
                                  daemon=True,
                                  name=f"shmcoll-{self._name}" + ("-helper" if helper else ""))
        self._threads.append(thread)
        self.free += 1
        thread.start()

    def enter_completion(self):
        """A worker begins completing jobs: it is not free until leave_completion()."""
        self.free -= 1

    def leave_completion(self):
        self.free += 1

    def start_drainer(self, thread_init, complete):
        """Start a thread that completes the jobs left at stop() in order, taking over a
        stuck completer. Not the stopping thread itself: a callback that waits for a later
        job (whose abort is queued behind it) blocks whichever thread completes it, so
        every blocked callback gets its own thread, and the next one completes the jobs
        after it, which ends those waits."""
        self.drain_started = time.monotonic()  # one drainer per grace period

        def drain():
            thread_init()
            complete()
        threading.Thread(target=drain, daemon=True, name=f"shmcoll-{self._name}-drain").start()

    def join(self, deadline):
        """Join every worker (but the calling thread) until time.monotonic() `deadline`."""
        for thread in list(self._threads):
            if thread is not threading.current_thread():
                thread.join(max(deadline - time.monotonic(), 0))

    def _loop(self, helper, thread_init, serve):
        thread_init()
        try:
            while serve(helper):
                pass
        finally:
            with self._cv:
                self.free -= 1
                self._threads.remove(threading.current_thread())
