"""run_threads(fn, world_size): fn on one thread per rank; first failure wins and wakes the rest.

This is the engine-level runner (numpy only); threaded_pg.spawn adds the torch default group
on top of it. What the caller sees:
- the first rank to raise is re-raised as RankFailedError "rank r: <original traceback>"; the
  error is also an instance of the original exception's class when that class allows it, so
  `pytest.raises(CollectiveMismatchError)` around a run works;
- that failure aborts every group of the run (Rendezvous.abort), so ranks blocked in a
  collective return at once; their errors are listed under "other ranks";
- past `timeout`, SpawnTimeoutError says what every rank is blocked in (collective, seq,
  group, the peers it waits for: flight records + the peers' control words) or, outside
  collectives, its current source line; then the run is aborted the same way;
- a rank still running ABORT_GRACE_S after an abort gets an asynchronous exception; one that
  survives even that (blocked in C, e.g. time.sleep) is reported and left behind as a daemon
  thread: the caller never hangs.

`sys._current_frames()` (CPython, documented "for internal and specialized purposes") and
`ctypes.pythonapi.PyThreadState_SetAsyncExc` serve the last two points only.
"""

import ctypes
import os
import sys
import threading
import time
import traceback

from shmcoll.errors import CollectiveTimeoutError, GroupAbortedError, PeerLostError

from .binding import bind_rank
from .group import Rendezvous

__all__ = ["run_threads", "RankFailedError", "SpawnTimeoutError", "describe_ranks",
           "DEFAULT_TIMEOUT_S", "ABORT_GRACE_S"]

DEFAULT_TIMEOUT_S = 60.0  # below pytest-timeout's 120 s, so our report comes out first
# After an abort, blocked collectives return within milliseconds; this only bounds ranks
# busy in their own code (a sleep, a loop) before they notice.
ABORT_GRACE_S = 5.0
_INTERRUPT_GRACE_S = 2.0


class RankFailedError(RuntimeError):
    """A rank raised: str() is "rank r: <original traceback>" (+ the other ranks' outcome);
    .rank, .exception (the original), .text (its traceback)."""

    def __init__(self, message, rank=None, exception=None, text=""):
        self.args = (message,)  # not super().__init__: a mixed-in class may want other args
        self.message = message
        self.rank = rank
        self.exception = exception
        self.text = text

    def __str__(self):
        return self.message


class SpawnTimeoutError(TimeoutError):
    """The run passed its timeout; the message says what each rank was blocked in.
    .ranks: the ranks that had not finished at the deadline."""

    def __init__(self, message, ranks=()):
        super().__init__(message)
        self.ranks = list(ranks)


class _Interrupted(BaseException):
    """Raised asynchronously in a rank that ignored an abort (a BaseException, so that
    `except Exception` in user code does not swallow it)."""


# Errors a rank raises because another rank failed first (its group closed under a waiting
# peer, the spawn's abort, the interrupt of a straggler).
_KNOCK_ON = (PeerLostError, GroupAbortedError, _Interrupted)


_MIXED = {}  # original exception class -> RankFailedError subclass mixing it in


def _rank_error(rank, exc, text, message):
    """RankFailedError carrying `message`, also of type(exc) when that class allows it."""
    cls = RankFailedError
    original = type(exc)
    if isinstance(exc, Exception) and not isinstance(exc, RankFailedError):
        cls = _MIXED.get(original)
        if cls is None:
            try:
                cls = type(original.__name__, (RankFailedError, original),
                           {"__module__": original.__module__})
            except TypeError:  # e.g. an instance lay-out conflict: keep the plain class
                cls = RankFailedError
            _MIXED[original] = cls
    return cls(message, rank, exc, text)


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class _Failure:
    __slots__ = ("rank", "exception", "text")

    def __init__(self, rank, exception):
        self.rank = rank
        self.exception = exception
        tb = exception.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR):
            tb = tb.tb_next  # start at the rank's own code (runner, spawn, @ranks frames)
        self.text = "".join(traceback.format_exception(type(exception), exception, tb)).rstrip()

    def summary(self):
        last = self.text.splitlines()[-1] if self.text else type(self.exception).__name__
        return f"rank {self.rank}: {last}"


def run_threads(fn, world_size, args=(), kwargs=None, timeout=DEFAULT_TIMEOUT_S, cfg=None):
    """fn(rank, world_size, rendezvous, *args, **kwargs) on `world_size` rank threads; the
    list of return values by rank. Inside, new_threaded_group(rendezvous, rank, world_size)
    builds an engine group; rendezvous.set/get/add is a store shared by the ranks."""
    return _Run(fn, world_size, args, kwargs, timeout, cfg).run()


class _Run:
    """One run: its rendezvous, threads, results and failures. Subclasses change what a
    rank does (_call/_cleanup) and what wraps it (_enter/_leave, _thread_enter/_thread_leave)."""

    def __init__(self, fn, world_size, args=(), kwargs=None, timeout=DEFAULT_TIMEOUT_S, cfg=None):
        if hasattr(timeout, "total_seconds"):
            timeout = timeout.total_seconds()
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.fn, self.args, self.kwargs = fn, tuple(args), dict(kwargs or {})
        self.world_size = world_size
        self.timeout_s = float(timeout)
        self.rendezvous = Rendezvous(world_size, cfg, self.timeout_s)
        self.results = [None] * world_size
        self.failures = []
        self.report = None  # what the ranks were blocked in, taken before an abort
        self._cv = threading.Condition()
        self._running = 0
        self.threads = [threading.Thread(target=self._rank_main, args=(rank,), daemon=True,
                                         name=f"threaded_pg-rank{rank}")
                        for rank in range(world_size)]

    # -- hooks ---------------------------------------------------------------------------

    def _enter(self):
        """Before the first thread starts (caller's thread)."""

    def _leave(self):
        """After the run, even if threads were left behind (caller's thread)."""

    def _thread_enter(self, rank):
        """Called in the caller's thread just before rank's thread starts."""

    def _thread_leave(self, rank):
        """Last thing the rank's thread does."""

    def _call(self, rank):
        return self.fn(rank, self.world_size, self.rendezvous, *self.args, **self.kwargs)

    def _cleanup(self, rank):
        """In the rank's thread after _call, whatever happened."""

    # -- caller side -----------------------------------------------------------------------

    def run(self):
        self._enter()
        try:
            self._start()
            try:
                timed_out = not self._wait_for_failure_or_end(time.monotonic() + self.timeout_s)
            except BaseException:  # Ctrl-C, pytest-timeout...: unblock the ranks, then leave
                self.rendezvous.abort()
                raise
            stuck = [r for r, t in enumerate(self.threads) if t.is_alive()] if timed_out else []
            if timed_out:
                self.report = describe_ranks(self.rendezvous, self.threads)
                self.rendezvous.abort()
            left = self._stop_stragglers()
        finally:
            self._leave()
        if timed_out:
            raise SpawnTimeoutError(self._timeout_message(left), stuck)
        if self.failures:
            raise self._failure_error(left)
        return self.results

    def _start(self):
        for rank, thread in enumerate(self.threads):
            self._thread_enter(rank)
            try:
                thread.start()
            except BaseException:
                self._thread_leave(rank)
                self.rendezvous.abort()
                raise
            with self._cv:
                self._running += 1

    def _wait_for_failure_or_end(self, deadline):
        """False when the deadline passed with ranks still running and nobody failed."""
        with self._cv:
            while self._running and not self.failures:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cv.wait(remaining)
        return True

    def _stop_stragglers(self):
        """Give ranks ABORT_GRACE_S to unwind, then interrupt them; the ranks still alive."""
        for grace_s, interrupt in ((ABORT_GRACE_S, True), (_INTERRUPT_GRACE_S, False)):
            deadline = time.monotonic() + grace_s
            with self._cv:
                while self._running and time.monotonic() < deadline:
                    self._cv.wait(deadline - time.monotonic())
            alive = [t for t in self.threads if t.is_alive()]
            if not alive or not interrupt:
                break
            if not self.report:
                self.report = describe_ranks(self.rendezvous, self.threads)
            for thread in alive:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                           ctypes.py_object(_Interrupted))
        for thread in self.threads:
            thread.join(0.1 if thread.is_alive() else None)
        return [rank for rank, t in enumerate(self.threads) if t.is_alive()]

    def _failure_error(self, left):
        # The cause first: a rank's own error ranks before what it set off in the others (a
        # peer closed or the spawn aborted), which can be recorded earlier -- a failing rank
        # closes its groups on the way out, before its exception reaches _rank_main.
        failures = sorted(self.failures, key=lambda f: isinstance(f.exception, _KNOCK_ON))
        first = failures[0]
        message = f"rank {first.rank}: {first.text}"
        others = [f.summary() for f in failures[1:]]
        if others:
            message += "\nother ranks:\n  " + "\n  ".join(others)
        if self.report:
            message += "\nranks when it failed:\n" + self.report
        if left:
            message += f"\nranks {left} did not stop after the abort; their threads were left running"
        return _rank_error(first.rank, first.exception, first.text, message)

    def _timeout_message(self, left):
        message = (f"{self.world_size} ranks timed out after {self.timeout_s:g} s; ranks at "
                   f"the deadline:\n{self.report}")
        failed = [f.summary() for f in self.failures]
        if failed:
            message += "\nafter the abort:\n  " + "\n  ".join(failed)
        if left:
            message += f"\nranks {left} did not stop after the abort; their threads were left running"
        return message

    # -- rank side -------------------------------------------------------------------------

    def _rank_main(self, rank):
        bind_rank(self.rendezvous, rank)
        try:
            try:
                self.results[rank] = self._call(rank)
            except BaseException as e:
                self._fail(rank, e)
            finally:
                try:
                    self._cleanup(rank)
                except BaseException as e:
                    if not any(f.rank == rank for f in self.failures):
                        self._fail(rank, e)
        except BaseException as e:  # _Interrupted arriving during cleanup
            self._fail(rank, e)
        finally:
            self.rendezvous.states.mark_finished(rank)
            bind_rank(None, 0)
            self._thread_leave(rank)
            with self._cv:
                self._running -= 1
                self._cv.notify_all()

    def _fail(self, rank, exc):
        failure = _Failure(rank, exc)
        with self._cv:
            if not self.failures and isinstance(exc, CollectiveTimeoutError):
                self.report = describe_ranks(self.rendezvous, self.threads, {rank: exc})
            self.failures.append(failure)
            self._cv.notify_all()
        self.rendezvous.states.mark_failed(rank)
        self.rendezvous.abort()


# -- diagnostics -------------------------------------------------------------------------


def describe_ranks(rendezvous, threads, raised=None):
    """One line per rank: the collective it is blocked in (seq, group, the peers it waits
    for) or, outside collectives, where its thread is and its last collective. `raised`:
    {rank: exception} of ranks that just failed (their own line says so)."""
    records = rendezvous.records()
    frames = sys._current_frames()
    now = time.time()
    failed = rendezvous.states.failed_ranks()
    raised = raised or {}
    lines = []
    for rank, thread in enumerate(threads):
        mine = [rec for rec in records if rec.global_rank == rank]
        busy = [(rec, e) for rec in mine for e in list(rec.group.flight_record)
                if e["state"] == "started"]
        if rank in raised:
            exc = raised[rank]
            lines.append(f"  rank {rank}: raised {type(exc).__name__}{_last(mine)}")
        elif busy:
            lines += [f"  rank {rank}: " + _describe_collective(rec, entry, now)
                      for rec, entry in busy]
        elif not thread.is_alive():
            lines.append(f"  rank {rank}: {'failed' if rank in failed else 'finished'}")
        else:
            lines.append(f"  rank {rank}: not in a collective, at "
                         + _where(frames.get(thread.ident)) + _last(mine))
    return "\n".join(lines)


def _last(records):
    """"; last collective: <op> seq N (<state>) on group G" over the rank's groups."""
    entries = [(e["t_start"], rec.name, e) for rec in records
               for e in list(rec.group.flight_record)[-1:]]
    if not entries:
        return ""
    _, name, e = max(entries, key=lambda x: x[0])
    return f"; last collective: {e['op']} seq {e['seq']} ({e['state']}) on group {name!r}"


def _describe_collective(record, entry, now):
    text = (f"in {entry['op']} (seq {entry['seq']}, {entry['nbytes']} bytes) on group "
            f"{record.name!r} (ranks {record.global_ranks}) for {now - entry['t_start']:.1f} s")
    if record.arena is None:
        return text
    states = record.arena.peer_states()
    me = record.group.rank
    _, my_posted, my_seq, _ = states[me]
    behind = [f"rank {record.global_ranks[p]} at seq {seq}" for p, posted, seq, _ in states
              if p != me and (seq < my_seq or posted < my_posted)]
    if behind:
        text += "; waiting for " + ", ".join(behind)
    return text


def _where(frame):
    if frame is None:
        return "an unknown place"
    summary = traceback.extract_stack(frame)[-1]
    line = f" `{summary.line}`" if summary.line else ""
    return f"{summary.filename}:{summary.lineno} in {summary.name}{line}"
