"""The process group behind backend "threaded": EngineProcessGroup over a threaded Group.

Registration, the creator torch calls and the name clash with torch's own threaded PG:
threaded_pg/plugin.py (which imports this module when torch creates the first group).

Private torch symbols touched here (checked against torch 2.13.0): the
`_DistributedBackendOptions` fields store, group_rank, group_size, timeout, group_id,
global_ranks_in_group.

RankThreadExecutor subclasses shmcoll.torch_backend.executor.Executor through its hooks
(_submitted, _idle_wait, _woken, _thread_init; it holds _cv in them);
EngineProcessGroup.executor_class is the hook that installs it.
"""

import time

from shmcoll.torch_backend.process_group import EngineProcessGroup, ShmOptions
from shmcoll.torch_backend.executor import Executor

from . import world
from .binding import bind_rank, current_rank
from .group import new_threaded_group
from .rng import in_rng_section

__all__ = ["new_process_group", "ThreadedProcessGroup", "RankThreadExecutor"]


class RankThreadExecutor(Executor):
    """The Executor for ranks that are threads: submitting does not wake the worker, and
    the worker threads act for the rank that created the group.

    A synchronous call (dist.all_reduce(t)) waits right after submitting and runs its job
    on the rank thread (Executor.wait); waking the worker as well, on every call, costs
    two GIL hand-offs per rank per collective, which is most of a small collective's time
    when all ranks share one GIL. The worker instead looks for jobs nobody runs (async ops
    not waited yet, futures waited from C++) every POLL_S while the group is in use, and
    sleeps until the next submission (which then wakes it) after IDLE_S without one.

    Future callbacks run on the worker threads (Executor), and a callback calls dist.* like
    rank code does (PowerSGD's issue collectives on the default group): so every worker
    thread sees the creating rank's torch world and rank binding (world.follow).
    """

    DOORBELL = False  # this scheme instead of the Executor's doorbell
    POLL_S = 2e-3  # an async op nobody waits on starts at most this late
    IDLE_S = 0.05  # no submission for this long: stop polling

    def __init__(self, name, on_abort=None):
        self._parked = False
        self._last_submit = time.monotonic()
        self._world = world.current()  # the creating rank thread's (None elsewhere)
        self._rank = current_rank()
        super().__init__(name, on_abort)

    def submit(self, job):
        _not_in_rng_section()
        return super().submit(job)

    def run_inline(self, fn, *args):
        _not_in_rng_section()
        return super().run_inline(fn, *args)

    def _submitted(self):
        self._last_submit = time.monotonic()  # (also when parked: the worker polls again)
        if self._parked:
            self._cv.notify()

    _BUSY_RETRY_S = POLL_S

    def _idle_wait(self, helper, timeout):
        if not helper:
            self._parked = timeout is None and time.monotonic() - self._last_submit > self.IDLE_S
            if self._parked:
                self._cv.wait()
                return
        self._cv.wait(self.POLL_S if timeout is None else min(timeout, self.POLL_S))

    def _woken(self):
        self._parked = False

    def _thread_init(self):
        if self._world is not None:
            world.follow(self._world)
        if self._rank is not None:
            bind_rank(*self._rank)


def _not_in_rng_section():
    if in_rng_section():
        binding = current_rank()
        rank = binding[1] if binding else "?"
        raise RuntimeError(
            f"rank {rank}: a collective inside threaded_pg.rng_lock(): the ranks take turns "
            f"through that section, so no peer could join it; leave collectives out of it")


class ThreadedProcessGroup(EngineProcessGroup):
    """EngineProcessGroup over a threaded engine Group (backend "threaded")."""

    BACKEND_NAME = "threaded"  # what name() says (plugin.py: the names it is registered under)
    executor_class = RankThreadExecutor

    def _device_rendezvous(self):
        """Rank threads share device memory by pointer (cuda_ipc.rendezvous.ThreadRendezvous)."""
        from cuda_ipc.rendezvous import ThreadRendezvous

        from .arena import ThreadRegions
        rendezvous, global_rank = _binding()
        return ThreadRendezvous(rendezvous, self.group, global_rank, ThreadRegions)

    def split_group(self, ranks, timeout=None, opts=None, group_name=None, group_desc=None,
                    device_types=None):
        """As EngineProcessGroup.split_group, but the new group's ranks are threads too."""
        ranks = sorted(int(r) for r in ranks)
        count = self._next_split()
        if self.rank() not in ranks:
            return None
        rendezvous, global_rank = _binding()
        parent = self._options.global_ranks_in_group or list(range(self.size()))
        options = opts._unbound() if isinstance(opts, ShmOptions) else ShmOptions(
            timeout=self.group.timeout_s)
        if timeout is not None:
            options._timeout = timeout
        options.group_name = group_name or f"{self._options.group_name or 'pg'}:split:{count - 1}"
        options.global_ranks_in_group = [parent[r] for r in ranks]
        group = new_threaded_group(  # keyed like the shm split: parent, split count, members
            rendezvous, ranks.index(self.rank()), len(ranks),
            name=f"{self.group.name}/split/{count}/{ranks}", global_rank=global_rank,
            timeout_s=options._timeout.total_seconds(), global_ranks=options.global_ranks_in_group)
        pg = ThreadedProcessGroup(group, self.BACKEND_NAME, store=self._store, options=options)
        pg._set_group_name(options.group_name)
        if group_desc:
            pg._set_group_desc(group_desc)
        return pg


def _binding():
    binding = current_rank()
    if binding is None:
        raise RuntimeError(
            "backend 'threaded' (shmcoll) creates groups only on rank threads started by "
            "threaded_pg.spawn(); use backend 'shm' for ranks that are processes")
    return binding


def new_process_group(backend_opts, pg_options=None):
    """What plugin.create_threaded_process_group returns: one engine Group per torch group."""
    rendezvous, global_rank = _binding()
    options = pg_options._unbound() if isinstance(pg_options, ShmOptions) else ShmOptions()
    options.global_ranks_in_group = list(backend_opts.global_ranks_in_group)
    options._timeout = backend_opts.timeout  # init_process_group's timeout wins (as for gloo)
    options.group_name = str(backend_opts.group_id)
    group = new_threaded_group(
        rendezvous, backend_opts.group_rank, backend_opts.group_size, name=options.group_name,
        timeout_s=options._timeout.total_seconds(), global_rank=global_rank,
        global_ranks=options.global_ranks_in_group or range(rendezvous.world_size))
    return ThreadedProcessGroup(group, ThreadedProcessGroup.BACKEND_NAME,
                                store=backend_opts.store, options=options)
