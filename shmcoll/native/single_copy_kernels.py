"""The single-copy transport's kernels (single_copy.py: the modes and what they read):
`peer_read` (process_vm_readv as a numba intrinsic), `fetch`, and `reduce_from_peers` /
`gather_from_peers`, one compiled call per collective phase (`nogil=True`), the syscall
declared by name in the LLVM module like atomics.monotonic_ns (cacheable, unlike a ctypes
function pointer, which pins an address into the cached code)."""

import errno as _errno

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import jit
from .atomics import copy_bytes
from .reducers import call_reduce
from .single_copy import IN_PROCESS

__all__ = ["peer_read", "fetch", "reduce_from_peers", "gather_from_peers"]

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
