"""The transport between nodes (hier/wire.py's seam) over torch.distributed process groups.

Per group: channel l = a process group of local rank l of every node (l < S, the smallest
node's size; so the local ranks of a node talk to other nodes in parallel), and the world
channel = every rank (point-to-point and all_to_all). Each is created directly on a
PrefixStore of the group's store (`dist.ProcessGroupGloo(PrefixStore(...), rank, size,
timeout)`), not through dist.new_group: they are parts of our group, not groups of torch's
world. gloo picks its network interface as for any gloo group (GLOO_SOCKET_IFNAME, else
the address the hostname resolves to).

Backend per device (`backend_for`): gloo for CPU buffers; for CUDA buffers NCCL where
torch has it, else gloo. UNTESTED: no GPU here, and a group that spans nodes refuses CUDA
tensors for now (cuda_ipc/ serves one node; hier_pg.py); the NCCL branch only builds
ProcessGroupNCCL channels the same way, and the channels accept torch tensors of any
device as well as numpy arrays.

gloo facts this module works around (torch 2.13, measured here):
- abort()/shutdown() do not wake an operation blocked on a live peer, and destroying a
  gloo group joins its threads, so a blocked operation holds the destructor until the
  peer exits or the operation's timeout (11.5 s in a test where the peer stayed 12 s).
  Waits are therefore ours (Pending: Work.wait in slices, checks between them), and a
  failed group's gloo groups are never destroyed (close(abandon=True) keeps them until
  the process exits): a peer closing its connection while one was being destroyed made
  gloo throw out of the destructor and terminate the process.
- a message larger than the buffer posted for it terminates the process: see the first
  round in hier/wire.py.
"""

import ctypes
import datetime

import numpy as np
import torch
import torch.distributed as dist

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
    wake(), result() (raises TransportError).

    wait() blocks in Work.wait(timeout) (the GIL released; on a collective Work an expired
    timeout only raises "Operation timed out!", the operation goes on: checked here, with
    correct data after 29 expired waits). The caller waits in slices of at most 50 ms,
    checking for an abort and other ranks' failures between them. Not a Python callback on
    the Work's future: it would run on a gloo thread, possibly while the interpreter exits.
    Not polling is_completed() with sched_yield either: between namespaced hosts (veth) a
    16 B all_gather took 1478 us polled that way against 373 us blocked in Work.wait()
    (2 ranks, 2-core VM; over loopback both ~75 us): the spinning ranks starve the
    kernel's packet processing."""

    __slots__ = ("_work", "_keep", "_woken", "_finish", "what")

    def __init__(self, work, keep, what, finish=None):
        self._work = work
        self._keep = keep  # the tensors stay alive while the operation may touch them
        self._woken = False
        self._finish = finish  # runs once the operation succeeded (result())
        self.what = what

    def wait(self, timeout_s):
        if self._woken:
            return True
        try:
            self._work.wait(datetime.timedelta(seconds=timeout_s))
            return True
        except RuntimeError:  # expired, or the operation failed (result() says which)
            return self._woken or self._work.is_completed()

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
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


class Channel:
    """Byte-moving operations over one process group (rank = this rank's index in it)."""

    def __init__(self, pg, rank, size, name):
        self.pg = pg
        self.rank = rank
        self.size = size
        self.name = name

    def exchange(self, out, src, timeout_s, finish=None):
        """Every member sends its src (n bytes) to every other one: out ((size - 1) * n)
        <- the others' blocks in member order, ours left out. An all_to_all: gloo's own
        all_gather took up to 2.2x as long for the same bytes (2 namespaced hosts, median
        us, allgather vs alltoall: 1 KiB 252 vs 190, 64 KiB 334 vs 237, 1 MiB 1707 vs
        1106, 8 MiB 29.1 vs 12.3 ms)."""
        n, me, members = src.nbytes, self.rank, self.size
        splits = [0 if m == me else n for m in range(members)]
        send = src if members == 2 else np.tile(src, members - 1)
        return self.all_to_all(out, send, splits, splits, timeout_s, finish, "exchange")

    def all_gather(self, out, src, timeout_s):
        """out[m * n:(m + 1) * n] <- member m's src: exchange(), our block slotted in."""
        n, me, members = src.nbytes, self.rank, self.size
        if members == 2:  # the other member's block lands in place
            out[me * n:(me + 1) * n] = src
            return self.exchange(out[(1 - me) * n:(2 - me) * n], src, timeout_s)

        def finish():
            out[(me + 1) * n:] = out[me * n:(members - 1) * n]
            out[me * n:(me + 1) * n] = src
        return self.exchange(out[:(members - 1) * n], src, timeout_s, finish)

    def all_to_all(self, out, src, out_splits, in_splits, timeout_s, finish=None,
                   what="all_to_all"):
        opts = dist.AllToAllOptions()
        opts.timeout = datetime.timedelta(seconds=timeout_s)
        t_out, t_src = _tensor(out), _tensor(src)
        return Pending(self.pg.alltoall_base(t_out, t_src, list(out_splits), list(in_splits),
                                             opts), (t_out, t_src), f"{self.name} {what}",
                       finish)

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
