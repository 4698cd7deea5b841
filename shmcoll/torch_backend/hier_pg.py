"""The concrete "shm" process groups, and the choice between one node and several.

new_process_group(store, rank, size, options) -- what the backend creator and split_group
call -- discovers the nodes (hier/nodes.py): one node gives a ProcessGroupShm (an
EngineProcessGroup over an engine Group; also built directly, gloo-style:
ProcessGroupShm(store, rank, size, opts | timeout=)); several give a HierProcessGroup: the same EngineProcessGroup (gloo-worded checks,
Work, futures, coalescing, object collectives) over a hier.HierGroup instead of an engine
Group. Point-to-point goes over the group's world channel (a gloo group of every rank),
for every pair: one transport per pair keeps per-tag order, and a receive from any source
must match senders on every node.
"""

import datetime
import logging
import threading
import time
import weakref

import torch
import torch.distributed as dist

from .. import config as _config
from ..errors import GroupAbortedError
from ..hier import discover, new_hier_group
from ..engine.init_phases import phase
from . import checks
from .process_group import EngineProcessGroup, ShmOptions
from .work import torch_error

__all__ = ["ProcessGroupShm", "HierProcessGroup", "new_process_group"]

log = logging.getLogger("shmcoll")


def new_process_group(store, rank, size, options=None, timeout=None, group_name=None):
    """ProcessGroupShm when every rank is on one node, else HierProcessGroup."""
    options = ShmOptions.coerce(options)
    if timeout is not None:
        options._timeout = timeout
    if group_name:
        options.group_name = str(group_name)
    timeout_s = options._timeout.total_seconds()
    with phase("node discovery"):
        layout = discover(store, rank, size, timeout_s, _config.from_env())
    if layout.single_node:
        with phase("ProcessGroupShm"):
            return ProcessGroupShm(store, rank, size, options, token=layout.token or None)
    return HierProcessGroup(store, rank, size, layout, options)


class ProcessGroupShm(EngineProcessGroup):
    """gloo-style direct construction: ProcessGroupShm(store, rank, size, options | timeout).

    `options` is a ProcessGroupShm.Options (`_timeout` in seconds or a timedelta,
    `group_name`); `timeout=` wins over options._timeout. Works with `group=pg` in dist.*
    without being registered, like c10d.ProcessGroupGloo. `token`: the group token its
    ranks already share (new_process_group: node discovery's), which saves the segments'
    token round (shm.ShmRegions)."""

    def __init__(self, store, rank, size, options=None, timeout=None, group_name=None,
                 token=None):
        from ..native.pages import torch_buffers_small_pages
        from ..shm.factory import new_shm_group

        if isinstance(options, datetime.timedelta):
            options, timeout = None, options
        options = ShmOptions.coerce(options)
        if timeout is not None:
            options._timeout = timeout
        if group_name:
            options.group_name = str(group_name)
        # torch's tensors, unlike numpy's large arrays, sit on 4 KiB pages unless torch was
        # told otherwise (pages.py): that bounds where reading peers' buffers pays
        group = new_shm_group(store, rank, size, timeout_s=options._timeout.total_seconds(),
                              name=options.group_name, small_pages=torch_buffers_small_pages(),
                              token=token)
        with phase("adapter"):
            super().__init__(group, "shm", store=store, options=options)

    def _new_split_group(self, store, rank, size, options):
        return new_process_group(store, rank, size, options)


class HierProcessGroup(EngineProcessGroup):
    """torch ProcessGroup "shm" whose ranks span nodes (see the module docstring)."""

    def __init__(self, store, rank, size, layout, options):
        from ..native.pages import torch_buffers_small_pages
        from .inter_node import make_transport  # gloo channels: only a group on several nodes

        group = new_hier_group(store, rank, layout, make_transport,
                               timeout_s=options._timeout.total_seconds(),
                               name=options.group_name, small_pages=torch_buffers_small_pages())
        super().__init__(group, "shm", store=store, options=options)
        self.layout = layout
        if rank == 0:
            log.info("shm group %r spans %d nodes (ranks per node: %s): shared memory inside "
                     "each, gloo between them", options.group_name, layout.num_nodes,
                     ", ".join(str(len(m)) for m in layout.nodes))
        self._world = group.transport.world
        self._p2p = weakref.WeakSet()  # unfinished p2p works (close abandons if any)

    # -- point-to-point over the world channel -------------------------------------------

    def _new_split_group(self, store, rank, size, options):
        return new_process_group(store, rank, size, options)

    def send(self, tensors, dstRank, tag=0):
        t = self._p2p_tensor("send", tensors, dstRank, tag, "destination")
        src = t if t.is_contiguous() else t.contiguous()
        return self._track(_P2PWork("send", self._world.pg.send([src], dstRank, tag), [t],
                                    self.group))

    def recv(self, tensors, srcRank, tag=0):
        t = self._p2p_tensor("recv", tensors, srcRank, tag, "source")
        buf = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)
        work = self._world.pg.recv([buf], srcRank, tag)
        return self._track(_P2PWork("recv", work, [t], self.group, buf))

    def recv_anysource(self, tensors, tag=0):
        t = self._p2p_tensor("recvAnysource", tensors, None, tag, "source")
        buf = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)
        work = self._world.pg.recv_anysource([buf], tag)
        return self._track(_P2PWork("recvAnysource", work, [t], self.group, buf))

    def _device_path(self, tensors):
        """CUDA tensors (cuda_ipc) are served inside one node only, for now."""
        raise checks.ArgumentError(
            f"ProcessGroupShm: this group spans {self.layout.num_nodes} nodes, and CUDA tensors "
            f"are supported within one node only (cuda_ipc); use NCCL for multi-node CUDA jobs")

    def _p2p_tensor(self, name, tensors, peer, tag, what):
        if any(isinstance(t, torch.Tensor) and t.is_cuda for t in
               ([tensors] if isinstance(tensors, torch.Tensor) else tensors)):
            self._device_path(tensors)
        _, tensors, _ = self._p2p_args(name, tensors, peer, tag, what)
        poison = self.group.poisoned
        if poison is not None or self._closed:
            raise torch_error(GroupAbortedError(
                f"[Rank {self.rank()}] {name}: the process group was aborted or shut down; "
                f"first failure: {poison}"))
        return tensors[0]

    def _track(self, work):
        self._p2p.add(work)
        return work

    def _shutdown(self, reason):
        # a receive nobody will match would hold the world channel's destructor
        if any(not w.is_completed() for w in list(self._p2p)):
            self.group.abort()
        super()._shutdown(reason)


class _P2PWork(dist.Work):
    """A gloo send/recv Work whose wait() honours our group's abort and copies a receive
    into a strided tensor once it completes (gloo needs contiguous buffers).

    gloo's p2p Works have no future, report is_completed() only after a wait(), and a
    wait(timeout) that expires closes the connection to the peer (measured, torch 2.13).
    So one helper thread per operation, started by the first wait() or get_future(),
    waits on it (bounded by the group's timeout, which gloo applies) and settles an Event
    and a future; our wait() waits on the Event, checking for an abort."""

    def __init__(self, name, work, outputs, group, buf=None):
        super().__init__()
        self._name = name
        self._work = work
        self._outputs = outputs
        self._group = group
        self._buf = buf
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._error = None
        self._settled = self._future = None

    def _start(self):
        with self._lock:
            if self._future is None:
                # a `then` of a private future, so a failure puts it in torch's error
                # state (Future.set_exception would make the error its value: work.Job)
                self._settled = torch.futures.Future()
                self._future = self._settled.then(self._value)
                threading.Thread(target=self._settle, daemon=True,
                                 name=f"shmcoll-{self._name}-wait").start()
            return self._future

    def _settle(self):
        try:
            self._work.wait()
            if self._buf is not None and self._buf is not self._outputs[0]:
                with torch.no_grad():
                    self._outputs[0].copy_(self._buf)
        except Exception as e:
            self._error = torch_error(RuntimeError(f"{self._name}: {e}"))
        self._event.set()
        self._settled.set_result(None)

    def _value(self, _settled):
        if self._error is not None:
            raise self._error
        return self._outputs

    def wait(self, timeout=None):
        self._start()
        limit, ms = None, 0
        if timeout is not None:
            seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) \
                else float(timeout)
            if seconds > 0:
                limit, ms = time.monotonic() + seconds, int(seconds * 1000)
        while not self._event.wait(0.05):
            if self._group.poisoned is not None:
                raise torch_error(GroupAbortedError(
                    f"{self._name}: the process group was aborted: {self._group.poisoned}"))
            if limit is not None and time.monotonic() > limit:
                raise torch_error(RuntimeError(
                    f"{self._name}: Timed out waiting {ms}ms for the operation to complete"))
        if self._error is not None:
            raise self._error
        return True

    def get_future(self):
        return self._start()

    def is_completed(self):
        return self._event.is_set()

    def is_success(self):
        return self._event.is_set() and self._error is None

    def exception(self):
        return self._error

    def result(self):
        self.wait()
        return self._outputs

    def source_rank(self):
        return self._work._source_rank()

    def _source_rank(self):
        return self.source_rank()

    def synchronize(self):
        self.wait()
