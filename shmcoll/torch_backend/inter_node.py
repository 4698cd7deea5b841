"""The transport between nodes (hier/wire.py's seam) over torch.distributed process groups.

Per group: channel l = a process group of local rank l of every node (l < S, the smallest
node's size; so the local ranks of a node talk to other nodes in parallel), and the world
channel = every rank (point-to-point and all_to_all). Each is created directly on a
PrefixStore of the group's store (`dist.ProcessGroupGloo(PrefixStore(...), rank, size,
timeout)`), not through dist.new_group: they are parts of our group, not groups of torch's
world. gloo picks its network interface as for any gloo group (GLOO_SOCKET_IFNAME, else
the address the hostname resolves to).

Backend per device (`backend_for`): gloo for CPU buffers; for CUDA buffers NCCL where
torch has it, else gloo. UNTESTED: no GPU here, and "shm" does not take CUDA tensors yet
(cuda_ipc/ will); the NCCL branch only builds ProcessGroupNCCL channels the same way, and
the channels accept torch tensors of any device as well as numpy arrays.

gloo facts this module works around (torch 2.13, measured here):
- abort()/shutdown() do not wake an operation blocked on a live peer, and destroying a
  gloo group joins its threads, so a blocked operation holds the destructor until the
  peer exits or the operation's timeout (11.5 s in a test where the peer stayed 12 s).
  Waits are therefore ours (Pending polls), and a failed group's gloo groups are never
  destroyed (close(abandon=True) keeps them until the process exits): a peer closing its
  connection while one is being destroyed made gloo throw out of the destructor and
  terminate the process.
- a message larger than the buffer posted for it terminates the process: see the first
  round in hier/wire.py.
"""

import ctypes
import datetime
import os
import time

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

from ..hier.wire import TransportError

__all__ = ["GlooTransport", "Channel", "Pending", "backend_for", "make_transport"]

_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
         "Connection refused", "Socket closed", "closed by peer")


def backend_for(device_type):
    """The torch backend that carries buffers of `device_type` between nodes."""
    if device_type == "cuda" and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def _new_pg(backend, store, rank, size, timeout_s):
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":  # UNTESTED (see the module docstring)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if not x.flags.writeable:  # torch.from_numpy warns on read-only arrays
        x = x.copy()
    return torch.from_numpy(x)


class Pending:
    """One transport operation in flight (hier/wire.py): wait(timeout_s) -> bool, done(),
    wake(), result() (raises TransportError). Completion is polled like the engine's waits:
    is_completed() with sched_yield for YIELD_S from the start, then sleeps of 50 us
    doubling to 1 ms. (A Python callback on the Work's future would run on a gloo thread,
    possibly while the interpreter exits; a thread blocked in Work.wait() cannot be woken.)
    Measured, 2 ranks, 16 B all_gather: 73-74 us polled vs 77-79 us in Work.wait()."""

    __slots__ = ("_work", "_keep", "_woken", "_t0", "_pause", "what")
    YIELD_S = 2e-3

    def __init__(self, work, keep, what):
        self._work = work
        self._keep = keep  # the tensors stay alive while the operation may touch them
        self._woken = False
        self._t0 = time.monotonic()
        self._pause = 5e-5
        self.what = what

    def wait(self, timeout_s):
        end = time.monotonic() + timeout_s
        while not (self._woken or self._work.is_completed()):
            now = time.monotonic()
            if now >= end:
                return False
            if now - self._t0 < self.YIELD_S:
                os.sched_yield()
            else:
                time.sleep(min(self._pause, end - now))
                self._pause = min(self._pause * 2, 1e-3)
        return True

    def done(self):
        return self._work.is_completed()

    def wake(self):
        self._woken = True

    def result(self):
        try:
            self._work.wait()
        except Exception as e:
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            kind = "lost" if any(s in text for s in _LOST) else \
                "timeout" if "imed out" in text else "failed"
            raise TransportError(f"{self.what}: {text}", kind) from None


class Channel:
    """Byte-moving operations over one process group (rank = this rank's index in it)."""

    def __init__(self, pg, rank, size, name):
        self.pg = pg
        self.rank = rank
        self.size = size
        self.name = name

    def all_gather(self, out, src, timeout_s):
        opts = _c10d.AllgatherOptions()
        opts.timeout = datetime.timedelta(seconds=timeout_s)
        t_out, t_src = _tensor(out), _tensor(src)
        return Pending(self.pg._allgather_base(t_out, t_src, opts), (t_out, t_src),
                       f"{self.name} all_gather")

    def all_to_all(self, out, src, out_splits, in_splits, timeout_s):
        opts = dist.AllToAllOptions()
        opts.timeout = datetime.timedelta(seconds=timeout_s)
        t_out, t_src = _tensor(out), _tensor(src)
        return Pending(self.pg.alltoall_base(t_out, t_src, list(out_splits), list(in_splits),
                                             opts), (t_out, t_src), f"{self.name} all_to_all")

    def broadcast(self, buf, root, timeout_s):
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.timeout = datetime.timedelta(seconds=timeout_s)
        t = _tensor(buf)
        return Pending(self.pg.broadcast([t], opts), (t,), f"{self.name} broadcast")


class GlooTransport:
    """The channels of one hierarchical group (hier/wire.py's Transport)."""

    def __init__(self, store, base, layout, rank, timeout_s, backend="gloo"):
        self._channel = None
        self._local = layout.local_rank(rank)
        node = layout.node_of[rank]
        world = None
        try:
            if self._local < layout.shards:
                pg = _new_pg(backend, dist.PrefixStore(f"{base}/channel{self._local}/", store),
                             node, layout.num_nodes, timeout_s)
                self._channel = Channel(pg, node, layout.num_nodes, f"channel {self._local}")
            world = _new_pg(backend, dist.PrefixStore(f"{base}/world/", store), rank,
                            layout.world_size, timeout_s)
        except BaseException:
            self._channel = None
            raise
        self.world = Channel(world, rank, layout.world_size, "world channel")

    def channel(self, local):
        if local != self._local or self._channel is None:
            raise ValueError(f"channel {local}: this rank (local rank {self._local}) is not "
                             f"in it")
        return self._channel

    def close(self, abandon=False):
        """Drop the process groups. abandon (after a failure: an operation may still be
        blocked in one): keep them alive until the process exits instead. Destroying a
        gloo group waits for its blocked operations, and when a peer's connection closes
        during that wait gloo throws out of its destructor and terminates the process
        (seen here when a peer exited while a failed group was being dropped)."""
        pgs = [c.pg for c in (self._channel, self.world) if c is not None]
        self._channel = self.world = None
        if abandon:
            for pg in pgs:
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))  # never destroyed


def make_transport(store, base, layout, rank, timeout_s):
    """hier.new_hier_group's transport factory for CPU tensors."""
    return GlooTransport(store, base, layout, rank, timeout_s, backend_for("cpu"))
