"""Acquire/release atomics, a CPU pause, futexes and the spin/yield wait loop, as numba
intrinsics.

Why intrinsics: a numba array load in a spin loop is an ordinary load that LLVM may hoist out
of the loop, and a Python-level store gives no ordering guarantee at all (vLLM #27858/#56251).
These emit `load atomic ... acquire`, `store atomic ... release` and the architecture's spin
hint, so the protocol in protocol.py holds on weakly ordered CPUs too, not just on x86-TSO.

Everything operates on raw int64 addresses (from `ndarray.ctypes.data`) so one compiled
function serves every segment, every rank count and the in-process arena alike.
"""

import ctypes
import platform
import sys
import time

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import jit

__all__ = [
    "load_acquire",
    "store_release",
    "cpu_pause",
    "wait_all_ge",
    "wait_any_ge",
    "add_release",
    "cas_acq_rel",
    "sched_yield",
    "sched_getcpu",
    "monotonic_ns",
    "copy_bytes",
    "fence_seq_cst",
    "futex_wait",
    "futex_wake",
    "HAVE_FUTEX",
    "wake_sleepers",
    "read_acquire",
    "write_release",
    "warm_up",
    "OWNER_CPU_OFFSET",
    "SPIN_CHECK_POLLS",
]

_IS_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
# futex(2) through libc's syscall(): its number on the 64-bit Linux ABIs we know; the wait
# is on the low 32 bits of an int64 word, which sit at the word's address on little-endian
# machines. Elsewhere HAVE_FUTEX is False and callers sleep instead.
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(
    platform.machine().lower(), 0) if sys.platform.startswith("linux") and \
    sys.byteorder == "little" else 0
HAVE_FUTEX = _SYS_FUTEX != 0
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE): the words are in shared memory


def _i64_ptr(builder, addr):
    return builder.inttoptr(addr, ir.IntType(64).as_pointer())


@intrinsic
def load_acquire(typingctx, addr):
    """Atomic 64-bit load with acquire ordering from address `addr`."""
    if not isinstance(addr, types.Integer):
        return None
    sig = types.int64(types.int64)

    def codegen(context, builder, signature, args):
        return builder.load_atomic(_i64_ptr(builder, args[0]), "acquire", 8)

    return sig, codegen


@intrinsic
def store_release(typingctx, addr, value):
    """Atomic 64-bit store of `value` at `addr` with release ordering."""
    if not isinstance(addr, types.Integer) or not isinstance(value, types.Integer):
        return None
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        builder.store_atomic(args[1], _i64_ptr(builder, args[0]), "release", 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def add_release(typingctx, addr, value):
    """Atomic fetch-add (acq_rel) of `value` at `addr`; returns the new value."""
    sig = types.int64(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        old = builder.atomic_rmw("add", _i64_ptr(builder, args[0]), args[1], "acq_rel")
        return builder.add(old, args[1])

    return sig, codegen


@intrinsic
def cas_acq_rel(typingctx, addr, expected, value):
    """Atomic compare-and-swap (acq_rel): if the int64 at `addr` equals `expected`, store
    `value`; returns True when it did."""
    sig = types.boolean(types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        pair = builder.cmpxchg(_i64_ptr(builder, args[0]), args[1], args[2], "acq_rel",
                               "acquire")
        return builder.extract_value(pair, 1)

    return sig, codegen


@intrinsic
def fence_seq_cst(typingctx):
    """A full memory fence (x86 mfence): orders an earlier store before a later load, which
    acquire/release alone never does (the sleeper handshake in protocol.py needs it)."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


def _futex_call(builder, addr, op, val, timeout_ns):
    """syscall(SYS_futex, addr, op, val, timeout or NULL, NULL, 0) -> i64 (libc's
    syscall(), declared as an external symbol so the caller stays cacheable)."""
    i64 = ir.IntType(64)
    fnty = ir.FunctionType(i64, [i64], var_arg=True)
    fn = cgutils.get_or_insert_function(builder.module, fnty, "syscall")
    zero = ir.Constant(i64, 0)
    ts_arg = zero
    if timeout_ns is not None:
        timespec = ir.LiteralStructType([i64, i64])  # {tv_sec, tv_nsec}, relative
        ts = cgutils.alloca_once(builder, timespec)
        billion = ir.Constant(i64, 1_000_000_000)
        builder.store(builder.sdiv(timeout_ns, billion), cgutils.gep_inbounds(builder, ts, 0, 0))
        builder.store(builder.srem(timeout_ns, billion), cgutils.gep_inbounds(builder, ts, 0, 1))
        ts_arg = builder.ptrtoint(ts, i64)
    return builder.call(fn, [ir.Constant(i64, _SYS_FUTEX), addr, ir.Constant(i64, op), val,
                             ts_arg, zero, zero])


@intrinsic
def futex_wait(typingctx, addr, expected, timeout_ns):
    """Sleep until woken at `addr` (futex_wake), at most `timeout_ns`, unless the 32-bit
    word at `addr` no longer equals the low 32 bits of `expected` (checked atomically by
    the kernel). Returns at once, 0, where HAVE_FUTEX is False. Spurious returns happen
    (signals): callers re-check what they wait for."""
    sig = types.int64(types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        if not _SYS_FUTEX:
            return ir.Constant(ir.IntType(64), 0)
        val = builder.and_(args[1], ir.Constant(ir.IntType(64), 0xFFFFFFFF))
        return _futex_call(builder, args[0], _FUTEX_WAIT, val, args[2])

    return sig, codegen


@intrinsic
def futex_wake(typingctx, addr):
    """Wake every thread sleeping in futex_wait on `addr`; returns how many (0 where
    HAVE_FUTEX is False)."""
    sig = types.int64(types.int64)

    def codegen(context, builder, signature, args):
        if not _SYS_FUTEX:
            return ir.Constant(ir.IntType(64), 0)
        return _futex_call(builder, args[0], _FUTEX_WAKE, ir.Constant(ir.IntType(64), 0x7FFFFFFF),
                           None)

    return sig, codegen


@intrinsic
def cpu_pause(typingctx):
    """Spin-wait hint: x86 `pause`, aarch64 `yield`; tells the core we are spinning."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        # An LLVM intrinsic, not inline asm: numba's object-code cache cannot emit asm.
        if _IS_X86:
            fnty = ir.FunctionType(ir.VoidType(), [])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse2.pause")
            builder.call(fn, [])
        else:  # aarch64 `yield` is hint #1
            fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(32)])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.aarch64.hint")
            builder.call(fn, [ir.Constant(ir.IntType(32), 1)])
        return context.get_dummy_value()

    return sig, codegen


def _libc_int32(symbol, doc):
    """An intrinsic calling libc's `int symbol(void)`, declared as an external symbol so
    that the functions calling it stay cacheable."""
    def call(typingctx):
        def codegen(context, builder, signature, args):
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.IntType(32), []), symbol)
            return builder.call(fn, [])

        return types.int32(), codegen

    call.__name__ = call.__qualname__ = symbol
    call.__doc__ = doc
    return intrinsic(call)


sched_yield = _libc_int32("sched_yield", "libc sched_yield(): give up the CPU.")
sched_getcpu = _libc_int32(
    "sched_getcpu", "libc sched_getcpu(): the CPU this thread runs on now (glibc reads it "
    "from rseq or the vDSO: a few ns), -1 where it cannot tell.")


@intrinsic
def monotonic_ns(typingctx):
    """clock_gettime(CLOCK_MONOTONIC) in nanoseconds (a vDSO call, ~20-50 ns): lets the
    compiled waits bound their yield tier by time rather than by a count of sched_yield
    calls, whose cost ranges from under 1 us (idle core) to a whole time slice (loaded)."""
    sig = types.int64()

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        timespec = ir.LiteralStructType([i64, i64])  # {tv_sec, tv_nsec}: Linux LP64 layout
        ts = cgutils.alloca_once(builder, timespec)
        fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32), timespec.as_pointer()])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "clock_gettime")
        builder.call(fn, [ir.Constant(ir.IntType(32), time.CLOCK_MONOTONIC), ts])
        sec = builder.load(cgutils.gep_inbounds(builder, ts, 0, 0))
        nsec = builder.load(cgutils.gep_inbounds(builder, ts, 0, 1))
        return builder.add(builder.mul(sec, ir.Constant(i64, 1_000_000_000)), nsec)

    return sig, codegen


@intrinsic
def copy_bytes(typingctx, dst, src, nbytes):
    """memcpy(dst, src, nbytes) on raw addresses (llvm.memcpy; numba's own slice copy
    is a byte loop ~10x slower). The ranges must not overlap."""
    sig = types.void(types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        dst_p = builder.inttoptr(args[0], i8p)
        src_p = builder.inttoptr(args[1], i8p)
        cgutils.raw_memcpy(builder, dst_p, src_p, args[2], 1)
        return context.get_dummy_value()

    return sig, codegen


# wait_all_ge's contract with the words it waits on: the int64 OWNER_CPU_OFFSET bytes past
# each holds 1 + the CPU its owner last ran on when it wrote the word (0: unknown; the
# protocol's post writes both, kernels.post_wake). A waiter that finds the rank it waits for
# last seen on its own CPU does not spin: that rank cannot run until the waiter lets go of
# the CPU (two ranks the scheduler put on one core; a loaded host).
OWNER_CPU_OFFSET = 8
# pause-polls between two looks at the clock (and at the owner's CPU) in the spin tier:
# ~2 us of pauses on the 2-core VM's AMD EPYC (27 ns each), fewer cycles than a clock read
# costs in proportion
SPIN_CHECK_POLLS = 64


@jit.kernel(nogil=True)
def wait_all_ge(addrs, target, spin_ns, yield_ns, abort_addr):
    """Wait until every word at `addrs` is >= target, or give up.

    Tier 1: pause-polls for up to `spin_ns` nanoseconds, unless the rank that owns the word
    awaited was last seen on this CPU (OWNER_CPU_OFFSET); tier 2: polls each followed by
    sched_yield (the right thing when ranks outnumber cores) for up to `yield_ns`
    nanoseconds. Returns -1 when all words reached `target`, -2 when the abort word at
    `abort_addr` became non-zero, else the index of the first word still below `target`
    (the caller then checks its deadline and peer liveness and calls again, possibly
    sleeping in between). spin_ns = yield_ns = 0: one pass, no waiting.
    """
    n = addrs.shape[0]
    k = 0
    tier = 0  # 0: nothing awaited yet, 1: spinning, 2: yielding
    polls = 0
    until = 0
    me = 0
    while k < n:
        if load_acquire(addrs[k]) >= target:
            k += 1
            continue
        if load_acquire(abort_addr) != 0:
            return -2
        if tier == 1:
            polls += 1
            if polls % SPIN_CHECK_POLLS != 0:
                cpu_pause()
                continue
            now = monotonic_ns()
            if now < until and (me == 0 or load_acquire(addrs[k] + OWNER_CPU_OFFSET) != me):
                cpu_pause()
                continue
            tier = 2
            until = now + yield_ns
        elif tier == 0:
            now = monotonic_ns()
            me = sched_getcpu() + 1  # 0: this thread's CPU is unknown, never a match
            if spin_ns > 0 and (me == 0 or load_acquire(addrs[k] + OWNER_CPU_OFFSET) != me):
                tier = 1
                until = now + spin_ns
                cpu_pause()
                continue
            tier = 2
            until = now + yield_ns
        if monotonic_ns() >= until:
            return k
        sched_yield()
    return -1


@jit.kernel(nogil=True)
def wait_any_ge(addrs, targets, spin_ns, yield_ns, abort_addr):
    """Wait until some word `addrs[k]` is >= `targets[k]`, or give up.

    The p2p progress wait (p2p.py): one word per thing that could make progress. Tiers
    as wait_all_ge's by time (`spin_ns` of pause-polls, then sched_yield polls for up to
    `yield_ns` ns; no owner CPUs: these words are mailbox cells); one full pass always
    runs, so spin_ns = yield_ns = 0 is a non-blocking check. Returns the first such k, -2
    when the word at `abort_addr` became non-zero, else -1.
    """
    n = addrs.shape[0]
    polls = 0
    start = monotonic_ns()
    spin_until = start + spin_ns
    until = spin_until + yield_ns
    while True:
        for k in range(n):
            if load_acquire(addrs[k]) >= targets[k]:
                return k
        if load_acquire(abort_addr) != 0:
            return -2
        polls += 1
        if spin_ns > 0 and polls % SPIN_CHECK_POLLS != 0:
            cpu_pause()
            continue
        now = monotonic_ns()
        if now >= until:
            return -1
        if now < spin_until:
            cpu_pause()
        else:
            sched_yield()


@jit.kernel(nogil=True)
def read_acquire(addr):
    """Python-callable acquire load of the int64 at `addr`."""
    return load_acquire(addr)


@jit.kernel(nogil=True)
def write_release(addr, value):
    """Python-callable release store of `value` into the int64 at `addr`."""
    store_release(addr, value)


_syscall = None


def wake_sleepers(addr):
    """Python-callable futex_wake at `addr` (through ctypes: nothing to compile), for rare
    events such as an abort; a no-op where HAVE_FUTEX is False."""
    global _syscall
    if not HAVE_FUTEX:
        return 0
    if _syscall is None:
        fn = ctypes.CDLL(None, use_errno=True).syscall
        fn.restype = ctypes.c_long
        fn.argtypes = (ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
        _syscall = fn
    return _syscall(_SYS_FUTEX, addr, _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


def _warm_up():
    word = np.zeros(1, np.int64)
    write_release(word.ctypes.data, 0)
    read_acquire(word.ctypes.data)


def warm_up():
    """Compile (or load) the Python-callable atomics, once per process, under the job's
    compile lock: whatever builds on them calls this before its first use."""
    jit.once("shmcoll's atomics", _warm_up)
