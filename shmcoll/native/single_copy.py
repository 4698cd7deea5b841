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

This module is what a group's creation needs (the modes, `probe`, through ctypes) and
imports no numba; the transport's kernels are in single_copy_kernels.py: everything there
is compiled (`nogil=True`), one call per collective phase, whatever the size, the syscall
declared by name in the LLVM module like atomics.monotonic_ns (cacheable, unlike a ctypes
function pointer, which pins an address into the cached code).
"""
import ctypes
import errno as _errno
import os

import numpy as np

__all__ = ["NONE", "IN_PROCESS", "CMA", "PIECE_NBYTES", "probe", "errno_text"]

NONE, IN_PROCESS, CMA = 0, 1, 2

# A reduction through CMA copies each peer's part of my chunk into a scratch piece, then
# reduces the pieces in rank order: pieces small enough that the scratch stays in L2 while
# it is reduced (256 KiB x (N - 1)).
PIECE_NBYTES = 256 << 10


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
