"""DeferredProcessGroup: what `init_process_group("shm")` and `new_group` return at once,
while the group is made in the background (NCCL's lazy communicators, done early).

Making a group -- the adapter's and engine's imports, node discovery, the segments and
their store rounds -- took ~35 ms of a warm `init_process_group("shm")` against gloo's
~4 ms (docs/notes/2026-11-29-deferred-init.md). The creator now returns this object after
starting that work on a background thread; the work overlaps whatever the program does
before its first collective, and the first call that needs the group waits for it.
Importing this module imports no adapter or engine module: only torch.distributed.

Creations run one at a time, in the order the groups were created (one chain per
process), exactly as when each ran inside its init_process_group / new_group call: ranks
that create several groups meet in each one's rendezvous in the same order.

Ownership. A `_Creation` is written by its thread only (the group or the error, then
`done`); the DeferredProcessGroup reads it once `done` is set and adopts the group: from
then on it forwards everything to it. The group name and description torch sets right
after creation are this object's; the group gets a copy (at adoption, and at every later
set).
Collective methods are installed on the instance at adoption (bound methods of the
group), so that torch's C++ trampolines reach the group's methods with no Python in
between: a call costs what it cost before.

Errors. A creation that fails (a peer that never arrives, /dev/shm too small) fails the
first call that needs the group, and every later one, with a DistBackendError naming the
cause; `SHMCOLL_EAGER_INIT=1` (or torch's `device_id=` in init_process_group, which calls
eager_connect_single_device) waits for the creation inside the call instead, where the
error then surfaces. shutdown (destroy_process_group) waits for an unfinished creation and
closes its group; abort does not wait: the creation's thread closes what it made.

Fork. A fork while a creation runs would leave the child with module and store locks held
by a thread it does not have: a fork waits for the running creations first
(os.register_at_fork), as it would have waited for init_process_group itself.
Interpreter exit waits for them too (at most EXIT_WAIT_S), so that the groups they made
are closed by their finalizers rather than left mapped by a frozen daemon thread.
"""

import atexit
import logging
import os
import threading
import time

import torch.distributed as dist

__all__ = ["DeferredProcessGroup", "EXIT_WAIT_S", "FORWARDED"]

log = logging.getLogger("shmcoll")

# What interpreter exit and a fork wait for the running creations, in all.
EXIT_WAIT_S = 30.0

# A creation starts once torch has set the group up (it names and describes a new group
# last, in _new_process_group_helper), at the latest after this: started at once, its
# thread took the GIL from the rest of init_process_group (benchmarks.init_time, 2 ranks,
# tcp://, 15 alternating rounds: 6.9 ms started at once, 5.2 ms started here; gloo 4.1 ms).
START_WAIT_S = 0.02

# ProcessGroup methods torch's C++ calls through the pybind trampolines, or its Python
# calls on a backend: forwarded to the group once it exists (installed on the instance at
# adoption: see the module docstring).
FORWARDED = (
    "allreduce", "allreduce_coalesced", "_allreduce_sparse", "broadcast", "reduce",
    "allgather", "_allgather_base", "all_gather_single", "allgather_coalesced",
    "allgather_into_tensor_coalesced", "all_gather_single_coalesced", "reduce_scatter",
    "_reduce_scatter_base", "reduce_scatter_single", "reduce_scatter_tensor_coalesced",
    "reduce_scatter_single_coalesced", "alltoall", "alltoall_base", "all_to_all_single",
    "gather", "scatter", "send", "recv", "recv_anysource", "barrier", "monitored_barrier",
    "_start_coalescing", "_end_coalescing", "split_group", "set_timeout",
    "_set_default_timeout", "comm_split_count",
)

# The chain (written by _start and the creation threads under _chain_lock, and by
# _forget_in_child in a forked child, where no other thread exists)
_chain_lock = threading.Lock()
_last_done = None  # the newest creation's `done`
_running = []  # _Creations not done yet (appended by _start, removed by their thread)


class _Creation:
    """One group being made on its own thread, once torch has set it up (`ready`, an
    event, or None: at once) and the creation before it is done (`before`: its `done`
    event, or None)."""

    def __init__(self, make, before, ready):
        self._make = make
        self._before = before
        self._ready = ready
        self.done = threading.Event()
        self.group = None
        self.error = None
        self._lock = threading.Lock()  # the hand-over between abandon() and the thread's end
        self._abandoned = False  # abandon()'s
        self._finished = False  # the thread's
        self.thread = threading.Thread(target=self._run, daemon=True, name="shmcoll-create")

    def _run(self):
        try:
            if self._ready is not None:
                self._ready.wait(START_WAIT_S)
            if self._before is not None:
                self._before.wait()  # ends: every creation's store waits have deadlines
            self.group = self._make()
        except BaseException as e:  # noqa: BLE001 -- the group's first call raises it
            self.error = e
        finally:
            with self._lock:
                self._finished = True
                abandoned = self._abandoned
            if abandoned and self.group is not None:
                try:
                    self.group.abort()
                except Exception:  # noqa: BLE001 -- nobody waits for this thread to report
                    log.exception("shm: aborting process group made after its abort()")
            with _chain_lock:
                _running.remove(self)
            self.done.set()

    def abandon(self):
        """The group was aborted before it was made: the thread aborts it when it is.
        Returns False when the thread already finished (the caller aborts the group)."""
        with self._lock:
            if self._finished:
                return False
            self._abandoned = True
            return True


def _start(make, ready):
    global _last_done
    with _chain_lock:
        creation = _Creation(make, _last_done, ready)
        _last_done = creation.done
        _running.append(creation)
    creation.thread.start()
    return creation


def _wait_running(budget_s):
    deadline = time.monotonic() + budget_s
    with _chain_lock:
        running = [c for c in _running if c.thread is not threading.current_thread()]
    for creation in running:
        creation.done.wait(max(0.0, deadline - time.monotonic()))


def _forget_in_child():
    """After a fork, in the child: the parent's creation threads do not exist here."""
    global _chain_lock, _last_done
    _chain_lock = threading.Lock()
    _running.clear()
    _last_done = None


atexit.register(_wait_running, EXIT_WAIT_S)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=lambda: _wait_running(EXIT_WAIT_S),
                        after_in_child=_forget_in_child)


def _forward(name):
    def method(self, *args, **kwargs):
        return getattr(self._adopted(name), name)(*args, **kwargs)
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"ProcessGroup.{name}, run by the group once it is made."
    return method


class DeferredProcessGroup(dist.ProcessGroup):
    """Backend "shm" as torch holds it: the group (ProcessGroupShm or HierProcessGroup) is
    made by `make()` on a background thread; see the module docstring."""

    BACKEND_NAME = "shm"
    supports_splitting = True
    supports_shrinking = False
    supports_time_estimate = False

    def __init__(self, make, rank, size, store, group_name, timeout_s, eager=False):
        super().__init__(rank, size)
        self._store = store
        self._name = group_name  # the creator's name for the group (errors)
        self._timeout_s = timeout_s
        self._eager = eager
        self._group = None  # the adopted group (its only writer: _adopted)
        self._group_name = None  # torch's name and description for the group (see below)
        self._group_desc = None
        self._adopt_lock = threading.Lock()
        self._set_up = threading.Event()  # torch described the group (_set_group_desc)
        self._creation = _start(make, None if eager else self._set_up)
        if eager:
            self._adopted("init_process_group")

    # -- the group -----------------------------------------------------------------------

    def made(self):
        """The group itself (a ProcessGroupShm, or a HierProcessGroup when the ranks span
        nodes), waiting for its creation; raises its error if that failed."""
        return self._adopted("made")

    def _adopted(self, name):
        """The group, once made (waiting for it), or the creation's error as a
        DistBackendError naming `name`, the rank and the group."""
        group = self._group
        if group is not None:
            return group
        creation = self._creation
        self._wait_for(creation, name)
        if creation.error is not None:
            raise dist.DistBackendError(
                f"[Rank {self.rank()}] {name}: creating process group {self._name!r} (backend "
                f"shm) failed: {type(creation.error).__name__}: {creation.error}"
                + ("" if self._eager else
                   ". init_process_group returned before the group was made; "
                   "SHMCOLL_EAGER_INIT=1 makes it wait and raise this there")
            ) from creation.error
        with self._adopt_lock:
            if self._group is None:
                group = creation.group
                if self._group_name is not None:
                    group._set_group_name(self._group_name)
                if self._group_desc is not None:
                    group._set_group_desc(self._group_desc)
                for method in FORWARDED:
                    self.__dict__[method] = getattr(group, method)
                self._group = group
        return self._group

    def _wait_for(self, creation, name):
        """Wait for `creation`; its own store waits are bounded by the group's timeout
        (each one), so this bound only catches a creation that never ends."""
        deadline = time.monotonic() + 4 * self._timeout_s + 60.0
        while not creation.done.wait(1.0):
            if time.monotonic() > deadline or not creation.thread.is_alive() \
                    and not creation.done.is_set():
                raise dist.DistBackendError(
                    f"[Rank {self.rank()}] {name}: process group {self._name!r} (backend shm) "
                    f"was still being created after {4 * self._timeout_s + 60.0:.0f} s")

    @property
    def group(self):
        """The group's engine group (an engine Group, or a HierGroup), once made. Nothing
        else of the group is reachable through this object but the ProcessGroup methods
        (made() returns the group itself): no __getattr__, which torch.compile's Dynamo
        traces into for every attribute a class lacks (torch 2.4 failed on `__bool__`)."""
        return self._adopted("group").group

    # -- what torch asks right after creation: answered without waiting ----------------

    def getBackendName(self):
        return self.BACKEND_NAME

    def name(self):
        return self.BACKEND_NAME

    def _get_backend_name(self):
        return self.BACKEND_NAME

    def _get_backend(self, device=None):
        return self

    def get_group_store(self):
        return self._store

    def _set_sequence_number_for_group(self):
        pass  # sequence numbers start at 0 on every rank by construction

    def _get_sequence_number_for_group(self):
        group = self._group
        return 0 if group is None and not self._creation.done.is_set() else \
            self._adopted("_get_sequence_number_for_group")._get_sequence_number_for_group()

    # The name and description are this object's (its setters are their only writers, and
    # the getters read them without a lock: torch.compile traces `group_name`, and Dynamo
    # cannot trace a lock); the group gets a copy at adoption and every later set.
    def _set_group_name(self, name):
        with self._adopt_lock:
            self._group_name = name
            if self._group is not None:
                self._group._set_group_name(name)

    @property
    def group_name(self):
        name = self._group_name
        if name is None:
            raise RuntimeError("ProcessGroup name not set")
        return name

    def _set_group_desc(self, desc):
        with self._adopt_lock:
            self._group_desc = desc
            if self._group is not None:
                self._group._set_group_desc(desc)
        self._set_up.set()  # torch's last step with a new group: the creation starts

    @property
    def group_desc(self):
        desc = self._group_desc
        return "undefined" if desc is None else desc

    @property
    def options(self):
        return self._adopted("options").options

    def eager_connect_single_device(self, device=None):
        """torch's eager init (init_process_group(device_id=...)): wait for the group."""
        self._adopted("eager_connect_single_device")

    def perform_nocolor_split(self, device=None):
        pass

    def supports_tensor_alloc(self, device=None):
        return False

    # -- lifecycle -----------------------------------------------------------------------

    def shutdown(self):
        """destroy_process_group: wait for the creation, then shut the group down (a
        creation that failed has nothing to release)."""
        creation = self._creation
        self._wait_for(creation, "shutdown")
        if creation.error is None:
            self._adopted("shutdown").shutdown()

    def _shutdown(self, reason="shut down"):
        self.shutdown()

    def abort(self):
        """Never waits: a creation still running closes its group itself when done."""
        creation = self._creation
        if creation.abandon():
            return
        creation.done.wait()  # finished: only its last steps are left
        if creation.error is None:
            self._adopted("abort").abort()


for _name in FORWARDED:
    setattr(DeferredProcessGroup, _name, _forward(_name))
del _name
