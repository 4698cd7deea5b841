"""Single-copy transport: a rank reads a peer's user buffer where it lies, with no copy-in.

The slot path (protocol.Arena) moves every byte twice: the owner copies it into its slot,
a peer copies it out. For large messages that first copy is a full extra pass over memory,
and it is what kept us behind Open MPI at 1-16 MiB (Open MPI's shared-memory transport
reads peers' buffers through CMA: 148 us for a 1 MiB all_reduce at 2 ranks here, 202 us
with CMA disabled, ours 233 us through the slots).

A peer's buffer is read:
* IN_PROCESS (rank threads, threaded_pg): straight from its address, which is valid in
  this process; a reduction reads every rank's buffer in place, with no copy at all.
* CMA (rank processes): `process_vm_readv(2)`, the kernel copies from the peer's address
  space into ours in one pass (Cross Memory Attach, Linux >= 3.2). It needs ptrace access
  to the peer: same user, and Yama's ptrace_scope 0 (or 1 where the reader is an
  ancestor), no seccomp rule against it. `probe` tries it on every peer at init and the
  ranks agree (shm.ShmRegions); where any pair cannot, the group keeps the slot path.

Addresses are exchanged through the control block (Arena.exchange_buffer) and are only
ever used inside the kernel's copy from the peer's address space (CMA) or, for threads,
from buffers of this very process; a bad address from a corrupt peer makes CMA fail with
EFAULT, it never reads our own memory out of bounds.

Everything is compiled (`nogil=True`): one call per collective phase, whatever the size,
the syscall declared by name in the LLVM module like atomics.monotonic_ns (cacheable,
unlike a ctypes function pointer, which pins an address into the cached code).
"""

import ctypes
import errno as _errno
import os

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import jit
from .atomics import copy_bytes
from .kernels import call_reduce

__all__ = ["NONE", "IN_PROCESS", "CMA", "PIECE_NBYTES", "peer_read", "probe", "fetch",
           "reduce_from_peers", "gather_from_peers", "errno_text"]

NONE, IN_PROCESS, CMA = 0, 1, 2

# A reduction through CMA copies each peer's part of my chunk into a scratch piece, then
# reduces the pieces in rank order: pieces small enough that the scratch stays in L2 while
# it is reduced (256 KiB x (N - 1)).
PIECE_NBYTES = 256 << 10

_EFAULT = _errno.EFAULT


@intrinsic
def peer_read(typingctx, pid, local, remote, nbytes):
    """process_vm_readv(pid, [local, nbytes], [remote, nbytes]): bytes read, or -errno."""
    sig = types.int64(types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        i64, i32 = ir.IntType(64), ir.IntType(32)
        iovec = ir.LiteralStructType([i64, i64])  # {iov_base, iov_len}: Linux LP64 layout
        liov = cgutils.alloca_once(builder, iovec)
        riov = cgutils.alloca_once(builder, iovec)
        builder.store(args[1], cgutils.gep_inbounds(builder, liov, 0, 0))
        builder.store(args[3], cgutils.gep_inbounds(builder, liov, 0, 1))
        builder.store(args[2], cgutils.gep_inbounds(builder, riov, 0, 0))
        builder.store(args[3], cgutils.gep_inbounds(builder, riov, 0, 1))
        fnty = ir.FunctionType(i64, [i32, iovec.as_pointer(), i64, iovec.as_pointer(), i64,
                                     i64])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "process_vm_readv")
        one = ir.Constant(i64, 1)
        got = builder.call(fn, [builder.trunc(args[0], i32), liov, one, riov, one,
                                ir.Constant(i64, 0)])
        errfn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(i32.as_pointer(), []), "__errno_location")
        err = builder.sext(builder.load(builder.call(errfn, [])), i64)
        failed = builder.icmp_signed("<", got, ir.Constant(i64, 0))
        return builder.select(failed, builder.neg(err), got)

    return sig, codegen


@jit.kernel(nogil=True)
def fetch(mode, pid, local, remote, nbytes):
    """Copy `nbytes` from `remote` (an address in the peer's address space) to `local`:
    0, or -errno (CMA). CMA may copy less than asked (a fault part-way): go on from there."""
    if mode == IN_PROCESS:
        copy_bytes(local, remote, nbytes)
        return 0
    done = 0
    while done < nbytes:
        got = peer_read(pid, local + done, remote + done, nbytes - done)
        if got < 0:
            return got
        if got == 0:
            return -_EFAULT
        done += got
    return 0



@jit.kernel(nogil=True)
def reduce_from_peers(mode, pids, addrs, rank, out, offset, scratch, piece, fn, op, pre,
                      post):
    """out[i] = the reduction (reducer `fn`, kernels.py), in rank order, of the bytes at
    addrs[p] + offset + i of every rank p (an address in p's own address space; addrs[rank]
    is mine, and may be `out` itself: element-wise, so in place is fine), in pieces of
    `piece` bytes (whole elements; `out` is bytes too). IN_PROCESS reads peers in place;
    CMA fetches their pieces into `scratch` ((N - 1) * piece bytes) first. Returns (-1, 0),
    or (peer, -errno)."""
    world = addrs.shape[0]
    srcs = np.empty(world, np.int64)
    s = 0
    while s < out.size:
        e = min(out.size, s + piece)
        at = offset + s
        k = 0
        for p in range(world):
            if p == rank or mode == IN_PROCESS:
                srcs[p] = addrs[p] + at
            else:
                dst = scratch.ctypes.data + k * piece
                r = fetch(mode, pids[p], dst, addrs[p] + at, e - s)
                if r < 0:
                    return p, r
                srcs[p] = dst
                k += 1
        call_reduce(fn, out.ctypes.data + s, srcs.ctypes.data, world, 0, -1, e - s, op, pre,
                    post)
        s = e
    return -1, 0


@jit.kernel(nogil=True)
def gather_from_peers(mode, pids, rank, peers, remote, local, nbytes):
    """For each k: copy nbytes[k] from `remote[k]` in rank peers[k]'s address space to
    `local[k]`, starting with the entry after my rank's turn (ranks start on different
    peers, so N - 1 readers do not all hit rank 0's buffer first). (-1, 0) or
    (peer, -errno)."""
    count = peers.shape[0]
    first = 0
    while first < count and peers[first] <= rank:
        first += 1
    for j in range(count):
        k = (first + j) % count
        r = fetch(mode, pids[peers[k]], local[k], remote[k], nbytes[k])
        if r < 0:
            return peers[k], r
    return -1, 0


def errno_text(neg_errno):
    code = -int(neg_errno)
    return f"{_errno.errorcode.get(code, code)} ({os.strerror(code)})"


def probe(pid, remote, expected):
    """True when process_vm_readv from `pid` at `remote` returns exactly the bytes
    `expected` (a uint8 array: what that address holds, as we see it through shared
    memory). Called from Python through ctypes: nothing is compiled for a probe."""
    got = np.zeros(expected.size, np.uint8)
    n = _py_readv(pid, got.ctypes.data, remote, expected.size)
    return n == expected.size and bool((got == expected).all())


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _py_readv(pid, local, remote, nbytes):
    try:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):  # not Linux, or a libc without the wrapper
        return -1
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                   ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    liov, riov = _Iovec(local, nbytes), _Iovec(remote, nbytes)
    return fn(pid, ctypes.byref(liov), 1, ctypes.byref(riov), 1, 0)
