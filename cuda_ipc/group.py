"""DeviceGroup: collectives on device tensors for one shmcoll Group.

A device collective is a collective of the Group like any other: it takes the next seq,
its fingerprint (collective code + DEVICE_CODE, dtype, count, root, op, shape) is
compared before any data moves, it appears in the flight record, and a failure poisons
the group. So device and host collectives interleave on one group in issue order, and a
rank that calls a host all_reduce where its peer calls a device one gets a
CollectiveMismatchError, not a hang. The first device collective of a group is preceded
by a setup step, itself fingerprinted ("device setup"), that builds the DeviceArena on
every rank at the same point.

Arguments are flat, contiguous tensors on the group's device (torch_path.py makes them
so): typed for reductions, uint8 views for collectives that only move bytes. Every
method enqueues on `stream` and returns the last chunk id it enqueued (None when none),
which is what a Work waits for.
"""

import torch

from shmcoll.native.ops import DTYPES, reduce_spec

from . import collectives as algos
from .arena import DeviceArena
from .reduce import reduce_into

__all__ = ["DeviceGroup"]


class DeviceGroup:
    """Device collectives over `group` (a shmcoll Group), on device `dev`.

    `rendezvous()` returns the control-plane object of the arena (rendezvous.py), built
    only when the first device collective arrives. `cfg`: the group's shmcoll Config.
    """

    def __init__(self, group, dev, rendezvous, cfg):
        self.group = group
        self.dev = dev
        self.rank = group.rank
        self.world_size = group.world_size
        self._rendezvous = rendezvous
        self._cfg = cfg
        self.arena = None

    # -- setup ----------------------------------------------------------------------------

    def _ensure_arena(self, timeout_s):
        if self.arena is not None or self.world_size == 1:
            return
        self.group.run_collective("device setup", (0, 0, 0, 0, 0), self._setup,
                                  timeout_s=timeout_s)

    def _setup(self, host):
        host.exchange()  # every rank is at this same setup step, with the same arguments
        cfg = self._cfg
        self.arena = DeviceArena(self.group, self.dev, self._rendezvous(), cfg.cuda_slot_nbytes,
                                 cfg.cuda_nslots, cfg.cuda_host_slot_nbytes, cfg.cuda_tier)
        self.group.attach_device(self.arena.close, self.arena.abort)

    @property
    def tier(self):
        return None if self.arena is None else self.arena.tier

    # -- running ----------------------------------------------------------------------------

    def _run(self, name, fp, algo, stream, timeout_s, local, *args):
        """Run device collective `name` (or its world-size-1 form `local`) on `stream`
        (None: the device's current stream); returns the last chunk enqueued."""
        if stream is None:
            stream = self.dev.current_stream()
        if self.world_size == 1:
            self.group.run_collective("device " + name, fp, lambda host: local(stream, *args),
                                      timeout_s=timeout_s)
            return None
        t_s = self.group.timeout_s if timeout_s is None else float(timeout_s)
        self._ensure_arena(t_s)
        arena = self.arena
        seq = self.group.seq + 1

        def enqueue(host):
            return algo(host, arena, stream, *args)
        first, last = self.group.run_collective("device " + name, fp, enqueue, timeout_s=t_s,
                                                nbytes=_nbytes(args))
        if last is not None:
            arena.watchdog.watch(first, last, seq, name, t_s)
        return last

    def _spec(self, name, dtype, op, premul, world_size=None):
        try:
            return reduce_spec(op, DTYPES[dtype], world_size or self.world_size, name, premul)
        except KeyError:
            raise TypeError(f"{name}: dtype {dtype} is not supported") from None

    # -- collectives ------------------------------------------------------------------------

    def all_reduce(self, flat, dtype, op, premul=1.0, stream=None, timeout_s=None, shape=0):
        spec = self._spec("all_reduce", dtype, op, premul)
        return self._run("all_reduce", (DTYPES[dtype].code, flat.numel(), 0, int(op), shape),
                         algos.all_reduce_one_shot, stream, timeout_s, self._local_reduce,
                         flat, spec)

    def reduce(self, flat, root, dtype, op, premul=1.0, stream=None, timeout_s=None, shape=0):
        self._root("reduce", root)
        spec = self._spec("reduce", dtype, op, premul)
        return self._run("reduce", (DTYPES[dtype].code, flat.numel(), root, int(op), shape),
                         algos.reduce_direct, stream, timeout_s,
                         lambda s, f, r, sp: self._local_reduce(s, f, sp), flat, root, spec)

    def broadcast(self, buf, root, code=0, stream=None, timeout_s=None, shape=0):
        self._root("broadcast", root)
        return self._run("broadcast", (code, buf.numel(), root, 0, shape),
                         algos.broadcast_direct, stream, timeout_s, _nothing, buf, root)

    def all_gather(self, outs, src, code=0, stream=None, timeout_s=None, shape=0):
        """outs[r] (world_size byte tensors of src's size) receives rank r's `src`."""
        _check_parts("all_gather", outs, src.numel(), self.world_size)
        return self._run("all_gather", (code, src.numel(), 0, 0, shape), algos.all_gather_direct,
                         stream, timeout_s, lambda s, a, o: self.dev.run(s, _copy, o[0], a),
                         src, outs)

    def gather(self, src, outs, root, code=0, stream=None, timeout_s=None, shape=0):
        self._root("gather", root)
        if self.rank == root:
            _check_parts("gather", outs, src.numel(), self.world_size)
        return self._run("gather", (code, src.numel(), root, 0, shape), algos.gather_direct,
                         stream, timeout_s,
                         lambda s, a, o, r: self.dev.run(s, _copy, o[0], a), src, outs, root)

    def reduce_scatter(self, out, blocks, dtype, op, premul=1.0, stream=None, timeout_s=None,
                       shape=0):
        """out = reduction over ranks of their blocks[rank]; blocks is [world_size, out.numel()]."""
        spec = self._spec("reduce_scatter", dtype, op, premul)
        if tuple(blocks.shape) != (self.world_size, out.numel()):
            raise ValueError(f"reduce_scatter: input has shape {tuple(blocks.shape)}, expected "
                             f"({self.world_size}, {out.numel()})")
        return self._run("reduce_scatter", (DTYPES[dtype].code, blocks.numel(), 0, int(op),
                                            shape),
                         algos.reduce_scatter_direct, stream, timeout_s,
                         lambda s, b, o, sp: self._local_reduce(s, o, sp, src=b[0]),
                         blocks, out, spec)

    def scatter(self, out, pieces, root, code=0, stream=None, timeout_s=None, shape=0):
        """Rank r's `out` (bytes) receives the root's pieces[r]; pieces is [world, nbytes]."""
        self._root("scatter", root)
        if self.rank == root and tuple(pieces.shape) != (self.world_size, out.numel()):
            raise ValueError(f"scatter: input has shape {tuple(pieces.shape)}, expected "
                             f"({self.world_size}, {out.numel()})")
        return self._run("scatter", (code, out.numel(), root, 0, shape), algos.scatter_direct,
                         stream, timeout_s,
                         lambda s, p, o, r: self.dev.run(s, _copy, o, p[0]), pieces, out, root)

    def all_to_all(self, outs, ins, code=0, stream=None, timeout_s=None):
        """outs[j] receives rank j's ins[rank] (byte tensors; sizes may differ per pair)."""
        if len(outs) != self.world_size or len(ins) != self.world_size:
            raise ValueError(f"all_to_all: expected {self.world_size} inputs and outputs, got "
                             f"{len(ins)} and {len(outs)}")
        sends = [t.numel() for t in ins]
        recvs = [t.numel() for t in outs]
        return self._run("all_to_all", (code, 0, 0, 0, 0), _all_to_all, stream, timeout_s,
                         lambda s, o, i, sd, rv: self.dev.run(s, _copy, o[0], i[0]),
                         outs, ins, sends, recvs)

    # -- helpers ------------------------------------------------------------------------------

    def _root(self, name, root):
        if not 0 <= root < self.world_size:
            raise ValueError(f"{name}: invalid root rank {root} (world size {self.world_size})")

    def _local_fold(self, stream, out, srcs, dtype, op):
        """out = the reduction (op) of a rank's own tensors `srcs` (gloo's list semantics)."""
        self.dev.run(stream, reduce_into, out, srcs, self._spec("allreduce", dtype, op, 1.0,
                                                                 world_size=1))

    def _local_reduce(self, stream, flat, spec, src=None):
        """The reduction of a single rank: only the scaling (AVG, PREMUL_SUM) changes data."""
        if src is not None:
            self.dev.run(stream, _copy, flat, src)
        if flat.numel() and (spec.pre != 1.0 or spec.post != 1.0):
            self.dev.run(stream, reduce_into, flat, [flat], spec)


def _all_to_all(host, d, stream, outs, ins, sends, recvs):
    from shmcoll.algorithms.all_to_all import exchange_split_table
    longest = exchange_split_table(host, sends, recvs)
    return algos.all_to_all_direct(host, d, stream, ins, outs, longest)


def _check_parts(name, outs, count, world_size):
    if len(outs) != world_size:
        raise ValueError(f"{name}: expected {world_size} outputs, got {len(outs)}")
    for o in outs:
        if o.numel() != count:
            raise ValueError(f"{name}: output has {o.numel()} bytes, input {count}")


def _copy(dst, src):
    dst.copy_(src)


def _nothing(stream, *args):
    pass


def _nbytes(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.numel() * a.element_size()
    return 0
