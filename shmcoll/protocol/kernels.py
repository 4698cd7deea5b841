"""The protocol's steps as compiled code (numba, nogil, cached), and the kernel sets that
load them on first use.

protocol.py states the rules and holds the Arena, which calls these: `post_wake` / `sleep_on`
(rule 2 and both halves of rule 5's sleeper handshake), `_exchange_steps` (copy-in and
rules 1-4, nothing else) and the kernels built on it -- `_exchange_kernel`
(Arena.exchange), `_one_step_kernel` + `_one_step_consume` (Arena.one_step), `_stream_kernel`
+ `_consume` (Arena._stream), `_two_shot_kernel` + `_two_shot_consume`
(Arena.exchange_reduce_two_shot), `_wait_kernel` (Arena.wait_all) -- and the rank threads'
Python turn around each of them (`_gil_enter` / `_gil_leave`). The kernels move bytes and
reduce through a reducer's address (kernels.call_reduce), so each compiles once for every
dtype. The Arena reaches them through compiled.py (on first use, not at import); their
numbers (modes, the one-step kernel's constants, the kernel sets' names) are in
protocol/layout.py.
"""

import numpy as np

from ..native import jit
from ..native.atomics import add_release, cas_acq_rel, copy_bytes, cpu_pause, fence_seq_cst, \
    futex_wait, futex_wake, load_acquire, monotonic_ns, OWNER_CPU_OFFSET, sched_getcpu, \
    sched_yield, store_release, wait_all_ge
from ..native.reducers import call_reduce, view_1d, view_2d
from .layout import (  # noqa: F401  (the steps' numbers; also read here by tests)
    _CFG_FP0,
    _CFG_GIL,
    _CFG_GIL_ME,
    _CFG_POSTED,
    _CFG_RANK,
    _CFG_SEQ,
    _CFG_SINGLE_COPY,
    _CFG_SPIN_NS,
    _CFG_STATE,
    _CFG_VERIFY,
    _CFG_YIELD_NS,
    _EXCHANGE,
    _NO_BYTES,
    _ONE_STEP,
    _PEER_FP0,
    _PEER_PID,
    _PEER_POSTED,
    _PEER_STATE,
    _LANE_ENTRY,
    _SINGLE_COPY,
    _SLEEPERS_DELTA,
    _STREAM,
    _TWO_SHOT,
    CTRL_LINES,
    FP_RING,
    FP_WORDS,
    GIL_LEAVE_NS,
    LINE_NBYTES,
    LINE_WORDS,
    A2A_PLAN_SIZES,
    A2A_PLAN_SLOT,
    A2A_TABLE_WORDS,
    ONE_STEP_ALL_TO_ALL,
    ONE_STEP_BROADCAST,
    ONE_STEP_CLOSE,
    ONE_STEP_GATHER,
    ONE_STEP_NOT_CONSUMED,
    ONE_STEP_REDUCE,
    ONE_STEP_REDUCE_SCATTER,
    STATE_ABORTED,
    STREAM_BROADCAST,
    STREAM_GATHER,
    STREAM_REDUCE,
    STREAM_RING,
)
from ..native.single_copy import CMA
from ..native.single_copy_kernels import fetch, gather_from_peers, reduce_from_peers



def warm_up():
    """Compile (or load from numba's cache) every protocol kernel (warmup.py)."""
    for what, build in _KERNEL_SETS:
        jit.once(what, build)


# The protocol kernels, in sets compiled on first use (jit.once), with exactly the argument
# types Arena passes. They move bytes, so one compilation serves every dtype (a reduction
# is a call through ops.ReduceSpec.fn). An Arena loads the one-step kernel when it is made
# (a group's warm-up does it earlier, right after the rendezvous); the others load when a
# collective first needs them (cold: 0.1-0.4 s each, 2-core VM).

def _dummies():
    """Arguments that make each kernel return at once (no peers, nothing to move). `words`
    spans a control block: a post reads the SLEEPERS word _SLEEPERS_DELTA past POSTED."""
    words = np.zeros(CTRL_LINES * LINE_WORDS, np.int64)
    w = words.ctypes.data
    cfg = np.zeros(_CFG_SINGLE_COPY + 1, np.int64)
    cfg[[_CFG_POSTED, _CFG_STATE, _CFG_SEQ, _CFG_FP0]] = (w + 8, w + 16, w, w + 24)
    return (words, w, np.zeros(0, np.int64), np.array([w], np.int64), cfg,
            np.zeros((_PEER_PID + 1, 0), np.int64), np.zeros(1, np.uint8), (0,) * FP_WORDS)


def _warm_one_step():
    words, w, none, srcs, cfg, tab, a, fp = _dummies()
    _one_step_kernel(ONE_STEP_REDUCE, a[:0], _NO_BYTES, cfg, tab, srcs, np.zeros(8, np.int64),
                     1.0, 1.0, 0, 0, -1)
    _one_step_consume(ONE_STEP_BROADCAST, a[:0], _NO_BYTES, srcs, 0, 0, np.zeros(8, np.int64),
                      1.0, 1.0)
    post_wake(w + 8, 0)  # Arena.post


def _warm_exchange():
    words, w, none, srcs, cfg, tab, a, fp = _dummies()
    _wait_kernel(none, 0, 0, 0, w + 16, 0, 0)
    wait_all_ge(none, 0, 0, 0, w + 16)
    sleep_on(w + 8, 0, 0)  # Arena._wait_slow
    _exchange_kernel(a, 0, 0, 0, 0, *fp, w, 0, w + 8, 0, none, none, none, 0, 0, w + 16,
                     True, 0, 0)


def _warm_stream():
    words, w, none, srcs, cfg, tab, a, fp = _dummies()
    _stream_kernel(STREAM_REDUCE, a, 0, 0, 64, 0, 0, 0, *fp, w, 0, w + 8, 0, none, none, none,
                   0, 0, w + 16, True, srcs, 0, -1, 0, 0, 1.0, 1.0, _NO_BYTES, 0, 0)
    _consume(STREAM_REDUCE, a, 0, 0, srcs, 0, 0, -1, 0, 0, 1.0, 1.0, _NO_BYTES, 0, 0)
    _a2a_stream_kernel(none, none, none, none, 64, 0, 0, 0, 0, w, 0, w + 8, 0, none, none,
                       none, 0, 0, w + 16, srcs, 0, 0, 0, _NO_BYTES)
    _a2a_stream_consume(0, none, none, none, 64, srcs, 0, 0)


def _warm_two_shot():
    words, w, none, srcs, cfg, tab, a, fp = _dummies()
    _two_shot_kernel(a[:0], 1, 64, 0, 0, 0, *fp, w, 0, w + 8, 0, none, none, none, 0, 0,
                     w + 16, True, srcs, 0, 0, 0, 1.0, 1.0, 0, 0)
    _two_shot_consume(0, a[:0], 1, 64, srcs, 0, 0, 0, 1.0, 1.0)


def _warm_single_copy():
    words, w, none, srcs, cfg, tab, a, fp = _dummies()
    reduce_from_peers(CMA, none, srcs, 0, a[:0], 0, a, 1, 0, 0, 1.0, 1.0)
    gather_from_peers(CMA, none, 0, none, none, none, none)


_KERNEL_SETS = ((_ONE_STEP, _warm_one_step), (_EXCHANGE, _warm_exchange),
                (_STREAM, _warm_stream), (_TWO_SHOT, _warm_two_shot),
                (_SINGLE_COPY, _warm_single_copy), (_LANE_ENTRY, lambda: one_step_entry()))


def warm_up_one_step():
    """The one-step kernel (small collectives), once per process."""
    jit.once(_ONE_STEP, _warm_one_step)


# Arguments of compiled calls between kernels: numba types a literal int argument as its
# own Literal type and compiles the callee once more for it (0.1-0.2 s each when cold);
# numpy scalars type as plain int64.
_ZERO, _DONE = np.int64(0), np.int64(-1)
_A2A_RODE, _A2A_READ = 1, 2  # what _a2a_table finds


@jit.kernel(nogil=True)
def post_wake(posted_addr, step):
    """Rule 2 and the waker's half of rule 5's sleeper handshake: publish `step` in the
    POSTED word at `posted_addr`, then wake the peers asleep on it, if any (a full fence
    first: acquire/release alone lets the SLEEPERS load pass the store). The CPU I post
    from goes beside it first (its line's next word: wait_all_ge's OWNER_CPU_OFFSET), so a
    peer that will wait for my next post knows whether I share its CPU."""
    store_release(posted_addr + OWNER_CPU_OFFSET, sched_getcpu() + 1)
    store_release(posted_addr, step)
    fence_seq_cst()
    if load_acquire(posted_addr + _SLEEPERS_DELTA) != 0:
        futex_wake(posted_addr)


@jit.kernel(nogil=True)
def sleep_on(posted_addr, target, timeout_ns):
    """The sleeper's half of rule 5: sleep at most `timeout_ns` unless the POSTED word at
    `posted_addr` (a peer's) reaches `target`; its post wakes us at once."""
    add_release(posted_addr + _SLEEPERS_DELTA, 1)
    fence_seq_cst()
    seen = load_acquire(posted_addr)
    if seen < target:
        futex_wait(posted_addr, seen, timeout_ns)
    add_release(posted_addr + _SLEEPERS_DELTA, -1)


@jit.kernel(nogil=True)
def _exchange_kernel(src, byte_offset, nbytes, dst, fp_addr, f0, f1, f2, f3, f4, f5, f6, f7,
                     seq_addr, seq, posted_addr, step, peer_posted, peer_fp, peer_state,
                     spin_ns, yield_ns, abort_addr, verify, gil_addr, gil_me):
    """Arena.exchange's compiled body: _exchange_steps between _gil_enter / _gil_leave."""
    _gil_enter(gil_addr, gil_me)
    r = _exchange_steps(src, byte_offset, nbytes, dst, fp_addr, f0, f1, f2, f3, f4, f5, f6, f7,
                        seq_addr, seq, posted_addr, step, peer_posted, peer_fp, peer_state,
                        spin_ns, yield_ns, abort_addr, verify)
    _gil_leave(gil_addr, gil_me, r, spin_ns)
    return r


@jit.kernel(nogil=True)
def _one_step_kernel(mode, src, out, cfg, peer_tab, srcs, plan, pre, post, seq, step, root):
    """Arena.one_step's compiled body: _exchange_steps (copy src into my slot of `srcs`
    unless I am a broadcast's non-root, write fingerprint [seq, step - 1, *plan[:6]], post
    `step`, wait, check), then, when that returned -1, _one_step_consume (reducer
    plan[7], op plan[6]), or _a2a_read for an all_to_all whose messages are read where
    they are (plan[A2A_PLAN_SLOT] 0). Returns _exchange_steps' code, or theirs."""
    rank = cfg[_CFG_RANK]
    spin_ns = cfg[_CFG_SPIN_NS]
    _gil_enter(cfg[_CFG_GIL], cfg[_CFG_GIL_ME])
    k = seq % FP_RING
    nbytes = src.nbytes if root < 0 or root == rank else 0
    dst = srcs[rank]
    reads = mode == ONE_STEP_ALL_TO_ALL and plan[A2A_PLAN_SLOT] == 0
    if mode == ONE_STEP_ALL_TO_ALL:  # the table, then my messages to the peers, packed
        world = srcs.shape[0]        # (or, where they are read, their addresses in it)
        dst += _write_a2a_table(dst, world, plan, np.int64(src.ctypes.data), reads)
        if not reads:
            at = src.ctypes.data
            for d in range(world):
                n = plan[A2A_PLAN_SIZES + d]
                if d != rank:
                    copy_bytes(dst, at, n)
                    dst += n
                at += n
        nbytes = 0
    r = _exchange_steps(src, _ZERO, nbytes, dst, cfg[_CFG_FP0] + k * LINE_NBYTES,
                        seq, step - 1, plan[0], plan[1], plan[2], plan[3], plan[4], plan[5],
                        cfg[_CFG_SEQ], seq, cfg[_CFG_POSTED], step, peer_tab[_PEER_POSTED],
                        peer_tab[_PEER_FP0 + k], peer_tab[_PEER_STATE], spin_ns,
                        cfg[_CFG_YIELD_NS], cfg[_CFG_STATE], cfg[_CFG_VERIFY] != 0)
    if r == -1:
        if reads:
            r = _a2a_read(src, out, srcs, rank, plan, cfg[_CFG_SINGLE_COPY],
                          peer_tab[_PEER_PID])
        else:
            r = _one_step_consume(mode, src, out, srcs, rank, root, plan, pre, post)
    _gil_leave(cfg[_CFG_GIL], cfg[_CFG_GIL_ME], r, spin_ns)
    return r


@jit.kernel(nogil=True)
def _a2a_read(src, out, srcs, rank, plan, single_copy, peer_pids):
    """ONE_STEP_ALL_TO_ALL's work after the wait where my messages stay in `src` and the
    table carries their addresses (plan[A2A_PLAN_SLOT] 0): when every rank's table agrees
    and every rank's messages are to be read, rank j's message to me is read from its
    buffer (single copy: CMA, or a plain copy between rank threads), peers in turn from
    the one after me (N - 1 readers do not all start on the same rank), my own copied from
    `src`; ONE_STEP_CLOSE then, for the closing step. ONE_STEP_NOT_CONSUMED where the
    tables say otherwise or a read failed: the general path (all_to_all_finish) does it
    all again from the same table, and raises a failed read's error (the same read)."""
    world = srcs.shape[0]
    if single_copy == 0 or _a2a_table(srcs, world, 0, 0) != _A2A_READ:
        return ONE_STEP_NOT_CONSUMED
    sizes = A2A_PLAN_SIZES + world  # my receive sizes, in rank order
    mine = np.int64(src.ctypes.data)
    at = np.int64(out.ctypes.data)
    for j in range(rank):
        mine += plan[A2A_PLAN_SIZES + j]
        at += plan[sizes + j]
    if mine != at:  # in place (equal pieces): my piece is already there
        copy_bytes(at, mine, plan[sizes + rank])
    for k in range(1, world):
        j = (rank + k) % world
        n = plan[sizes + j]
        if n == 0:
            continue
        at = np.int64(out.ctypes.data)
        for q in range(j):
            at += plan[sizes + q]
        remote = load_acquire(srcs[j] + 8 * (2 * world + rank))
        if fetch(single_copy, peer_pids[j if j < rank else j - 1], at, remote, n) != 0:
            return ONE_STEP_NOT_CONSUMED
    return ONE_STEP_CLOSE


@jit.kernel(nogil=True)
def _write_a2a_table(slot, world, plan, at, reads):
    """ONE_STEP_ALL_TO_ALL's table in my slot at `slot`: my send and receive sizes from
    `plan`, then no addresses (my messages ride) or, where they are read (`reads`), my
    messages' addresses, packed in rank order from `at`; returns where the messages to the
    peers go (algorithms/all_to_all.py's layout)."""
    for w in range(2 * world):
        store_release(slot + 8 * w, plan[A2A_PLAN_SIZES + w])
    for w in range(world):
        store_release(slot + 8 * (2 * world + w), at if reads else _ZERO)
        at += plan[A2A_PLAN_SIZES + w]
    return _a2a_head(world)


@jit.kernel(nogil=True)
def _a2a_head(world):
    """layout.a2a_head_nbytes, compiled: where the messages start after the table."""
    return (A2A_TABLE_WORDS * world * 8 + LINE_NBYTES - 1) // LINE_NBYTES * LINE_NBYTES


@jit.kernel(nogil=True)
def _a2a_table(srcs, world, head, slot_nbytes):
    """What every rank's table in its slot says: _A2A_RODE when they agree with each
    other (a's send to b is b's receive from a), no size is negative and every rank's
    messages rode with it (they fit a slot of `slot_nbytes` and the table has no
    addresses: the same test as algorithms.all_to_all_finish); _A2A_READ when they agree
    and every rank's messages to its peers are to be read (an address for each non-empty
    one); else 0 (a mismatch, or a mix: the general path's)."""
    rode = True
    read = True
    for a in range(world):
        total = 0
        for b in range(world):
            n = load_acquire(srcs[a] + 8 * b)
            if n < 0 or n != load_acquire(srcs[b] + 8 * (world + a)):
                return 0
            addr = load_acquire(srcs[a] + 8 * (2 * world + b))
            if addr != 0 or n > slot_nbytes:
                rode = False
            if b != a:
                total += n
                if n > 0 and addr == 0:
                    read = False
        if head + total > slot_nbytes:
            rode = False
    return _A2A_RODE if rode else _A2A_READ if read else 0


@jit.kernel(nogil=True)
def _one_step_consume(mode, src, out, srcs, rank, root, plan, pre, post):
    """The work after Arena.one_step's wait, per mode (every rank's copy is in its slot
    of `srcs`, at offset 0; plan[7] is the reducer, plan[6] its op; ONE_STEP_ALL_TO_ALL
    reads its sizes from the plan too). The same work as _consume's for one sub-chunk,
    written out: calling _consume would compile it into the one-step kernel (~0.15 s more
    for a cold first collective). Returns -1, or ONE_STEP_NOT_CONSUMED where it left the
    work to Python (ONE_STEP_ALL_TO_ALL: the group's tables disagree, or some rank's
    messages did not ride with its table)."""
    nbytes = src.nbytes
    if mode == ONE_STEP_ALL_TO_ALL:  # rank j's message to me (packed after its table,
        world = srcs.shape[0]          # its own skipped) to my out, in rank order
        head = _a2a_head(world)
        if plan[A2A_PLAN_SLOT] == 0 or \
                _a2a_table(srcs, world, head, plan[A2A_PLAN_SLOT]) != _A2A_RODE:
            return ONE_STEP_NOT_CONSUMED
        at = out.ctypes.data
        for j in range(world):
            n = plan[A2A_PLAN_SIZES + world + j]
            if j == rank:
                mine = src.ctypes.data
                for d in range(rank):
                    mine += plan[A2A_PLAN_SIZES + d]
                if mine != at:  # in place (equal pieces): my piece is already there
                    copy_bytes(at, mine, n)
            else:
                theirs = srcs[j] + head
                for k in range(rank):
                    if k != j:
                        theirs += load_acquire(srcs[j] + 8 * k)
                copy_bytes(at, theirs, n)
            at += n
    elif mode == ONE_STEP_REDUCE:
        if nbytes > 0:  # my own contribution from src: see _consume
            call_reduce(plan[7], src.ctypes.data, srcs.ctypes.data, srcs.shape[0], 0, rank,
                        nbytes, plan[6], pre, post)
    elif mode == ONE_STEP_GATHER:  # rank j's copy to out[j * nbytes:]; mine from src,
        for j in range(srcs.shape[0]):  # unless src is that block (in place: FSDP2's)
            at = out.ctypes.data + j * nbytes
            if j != rank:
                copy_bytes(at, srcs[j], nbytes)
            elif at != src.ctypes.data:
                copy_bytes(at, src.ctypes.data, nbytes)
    elif mode == ONE_STEP_REDUCE_SCATTER:  # block `rank` of every rank's slot
        if out.nbytes > 0:
            call_reduce(plan[7], out.ctypes.data, srcs.ctypes.data, srcs.shape[0],
                        rank * out.nbytes, -1, out.nbytes, plan[6], pre, post)
    elif rank != root:
        copy_bytes(src.ctypes.data, srcs[root], nbytes)
    return -1


@jit.kernel(nogil=True)
def _wait_kernel(peer_posted, target, spin_ns, yield_ns, abort_addr, gil_addr, gil_me):
    """Arena.wait_all's compiled wait: atomics.wait_all_ge between _gil_enter / _gil_leave
    (rank threads then take the Python turn on the way out, as after an exchange)."""
    _gil_enter(gil_addr, gil_me)
    r = wait_all_ge(peer_posted, target, spin_ns, yield_ns, abort_addr)
    _gil_leave(gil_addr, gil_me, r, spin_ns)
    return r


@jit.kernel(nogil=True)
def _gil_enter(turn_addr, me):
    """Rank threads (threaded_pg) only: entering compiled code, so give up the Python turn
    if this thread holds it (see _gil_leave)."""
    if turn_addr != 0 and load_acquire(turn_addr) == me:
        store_release(turn_addr, 0)


@jit.kernel(nogil=True)
def _gil_leave(turn_addr, me, r, spin_ns):
    """Rank threads only, before returning to Python (which takes the GIL back).

    Ranks that are threads of one process run their Python one at a time under the GIL.
    When a wait completes, typically every rank's does at once, and all of them reach for
    the GIL together: one gets it, the others sleep in CPython's GIL wait and need a futex
    wake-up when it is released (tens of us on a VM whose idle vCPU halted), per rank per
    collective. So the rank threads of a spawn also share a "Python turn" word (0 free,
    else the holder's id): a rank whose wait completed first takes the turn here, spinning
    without the GIL while a peer holds it; the holder gives it up when it next enters
    compiled code (_gil_enter), right after releasing the GIL, so the next rank takes an
    uncontended GIL. Only a heuristic, never a lock: after GIL_LEAVE_NS (a holder blocked
    elsewhere, or busy in long Python) the rank goes on without the turn, and a rank whose
    wait did not complete (r != -1: the Python slow path follows) does not take it.
    """
    if turn_addr == 0 or r != -1:
        return
    until = monotonic_ns() + GIL_LEAVE_NS
    polls = 0
    while True:
        v = load_acquire(turn_addr)
        if v == me or (v == 0 and cas_acq_rel(turn_addr, 0, me)):
            return
        polls += 1
        if (spin_ns == 0 or polls % 64 == 0) and monotonic_ns() >= until:
            return
        if spin_ns:
            cpu_pause()
        else:
            sched_yield()


@jit.kernel(nogil=True)
def _exchange_steps(src, byte_offset, nbytes, dst, fp_addr, f0, f1, f2, f3, f4, f5, f6, f7,
                    seq_addr, seq, posted_addr, step, peer_posted, peer_fp, peer_state,
                    spin_ns, yield_ns, abort_addr, verify):
    """Copy-in and rules 1-4, nothing else.

    Returns -1 when every peer posted `step` (and, with fp_addr != 0 and `verify`, every
    fingerprint matched and no peer is ABORTED); -3 on a fingerprint mismatch, -4 on an
    aborted peer; else wait_all_ge's code (a peer still missing after the fast tiers, or -2:
    aborted).
    """
    if nbytes > 0:
        copy_bytes(dst, src.ctypes.data + byte_offset, nbytes)
    if fp_addr != 0:  # rule 1: plain stores, published by the release store below
        store_release(fp_addr, f0)
        store_release(fp_addr + 8, f1)
        store_release(fp_addr + 16, f2)
        store_release(fp_addr + 24, f3)
        store_release(fp_addr + 32, f4)
        store_release(fp_addr + 40, f5)
        store_release(fp_addr + 48, f6)
        store_release(fp_addr + 56, f7)
        store_release(seq_addr, seq)
    post_wake(posted_addr, step)  # rule 2
    r = wait_all_ge(peer_posted, step, spin_ns, yield_ns, abort_addr)  # rule 3
    if r != -1 or fp_addr == 0 or not verify:
        return r
    for k in range(peer_fp.shape[0]):  # rule 4
        a = peer_fp[k]
        if (load_acquire(a) != f0 or load_acquire(a + 8) != f1
                or load_acquire(a + 16) != f2 or load_acquire(a + 24) != f3
                or load_acquire(a + 32) != f4 or load_acquire(a + 40) != f5
                or load_acquire(a + 48) != f6 or load_acquire(a + 56) != f7):
            return -3
    for k in range(peer_state.shape[0]):
        if load_acquire(peer_state[k]) == STATE_ABORTED:
            return -4
    return -1


@jit.kernel(nogil=True)
def _stream_kernel(mode, src, byte_offset, nbytes, sub, k0, dst, fp_addr, f0, f1, f2, f3, f4,
                   f5, f6, f7, seq_addr, seq, posted_addr, step0, peer_posted, peer_fp,
                   peer_state, spin_ns, yield_ns, abort_addr, verify, srcs, rank, root, fn, op,
                   pre, post, out, gil_addr, gil_me):
    """Arena._stream's body from sub-chunk k0 on: for each sub-chunk k, the
    _exchange_kernel steps (posting step0 + k + 1; the fingerprint with sub-chunk 0; a
    broadcast's non-roots copy nothing in), then _consume. Returns (k, code): (count, -1)
    when all are done, else the sub-chunk whose wait did not complete cleanly (posted,
    not consumed) and the wait code."""
    nsub = max(1, (nbytes + sub - 1) // sub)
    _gil_enter(gil_addr, gil_me)
    for k in range(k0, nsub):
        off = k * sub
        ring = k % STREAM_RING * sub  # the sub-slot (see Arena._stream)
        m = min(sub, nbytes - off)
        r = _exchange_steps(src, byte_offset + off,
                            0 if mode == STREAM_BROADCAST and rank != root else m,
                            dst + ring, fp_addr if k == 0 else 0,
                            f0, f1, f2, f3, f4, f5, f6, f7, seq_addr, seq, posted_addr,
                            step0 + k + 1, peer_posted, peer_fp, peer_state, spin_ns, yield_ns,
                            abort_addr, verify)
        if r != -1:
            _gil_leave(gil_addr, gil_me, r, spin_ns)
            return k, r
        _consume(mode, src, byte_offset + off, m, srcs, ring, rank, root, fn, op, pre, post, out,
                 off, nbytes)
    _gil_leave(gil_addr, gil_me, _DONE, spin_ns)
    return nsub, -1


@jit.kernel(nogil=True)
def _a2a_stream_kernel(ins, sends, outs, recvs, sub, nsub, k0, dst, ring0, seq_addr, seq,
                       posted_addr, step0, peer_posted, peer_fp, peer_state, spin_ns, yield_ns,
                       abort_addr, srcs, rank, gil_addr, gil_me, nothing):
    """Arena.exchange_all_to_all's body from step k0 on: for each step k, bytes
    [k * sub, (k + 1) * sub) of my piece to every peer d (at address ins[d], sends[d] bytes
    long) into sub-slot d of ring slot k % STREAM_RING (ring0 bytes into my slot at `dst`),
    post step0 + k + 1, wait (no fingerprint: the table step checked it), then
    _a2a_stream_consume. Returns (k, code) like _stream_kernel."""
    world = srcs.shape[0]
    _gil_enter(gil_addr, gil_me)
    for k in range(k0, nsub):
        off = k * sub
        ring = dst + ring0 + k % STREAM_RING * world * sub
        for d in range(world):
            m = min(sub, sends[d] - off)
            if d != rank and m > 0:
                copy_bytes(ring + d * sub, ins[d] + off, m)
        r = _exchange_steps(nothing, _ZERO, _ZERO, ring, _ZERO, _ZERO, _ZERO, _ZERO, _ZERO,
                            _ZERO, _ZERO, _ZERO, _ZERO, seq_addr, seq, posted_addr,
                            step0 + k + 1, peer_posted, peer_fp, peer_state, spin_ns, yield_ns,
                            abort_addr, False)
        if r != -1:
            _gil_leave(gil_addr, gil_me, r, spin_ns)
            return k, r
        _a2a_stream_consume(k, ins, outs, recvs, sub, srcs, ring0, rank)
    _gil_leave(gil_addr, gil_me, _DONE, spin_ns)
    return nsub, -1


@jit.kernel(nogil=True)
def _a2a_stream_consume(k, ins, outs, recvs, sub, srcs, ring0, rank):
    """Step k's work after its wait: bytes [k * sub, (k + 1) * sub) of every rank j's piece
    to me, from sub-slot `rank` of its ring slot k % STREAM_RING into outs[j] (recvs[j]
    bytes long), mine straight from ins[rank] (nothing where it is already there: in
    place)."""
    world = srcs.shape[0]
    off = k * sub
    at = ring0 + k % STREAM_RING * world * sub + rank * sub
    for j in range(world):
        m = min(sub, recvs[j] - off)
        if m <= 0:
            continue
        if j != rank:
            copy_bytes(outs[j] + off, srcs[j] + at, m)
        elif outs[j] != ins[j]:
            copy_bytes(outs[j] + off, ins[j] + off, m)


@jit.kernel(nogil=True)
def _two_shot_kernel(buf, size, sub, p0, dst, fp_addr, f0, f1, f2, f3, f4, f5, f6, f7,
                     seq_addr, seq, posted_addr, step0, peer_posted, peer_fp, peer_state,
                     spin_ns, yield_ns, abort_addr, verify, srcs, rank, fn, op, pre, post,
                     gil_addr, gil_me):
    """Arena.exchange_reduce_two_shot's body from step p0 on: step 2k copies sub-chunk k
    into its sub-slot (with the fingerprint at step 0), step 2k + 1 only posts; each step
    waits for every peer, then _two_shot_consume. Returns (count, -1) when all are done,
    else the step whose wait did not complete cleanly (posted, not consumed) and the code."""
    nbytes = buf.nbytes
    nphase = 2 * max(1, (nbytes + sub - 1) // sub)
    _gil_enter(gil_addr, gil_me)
    for p in range(p0, nphase):
        k = p // 2
        off = k * sub
        m = min(sub, nbytes - off) if p % 2 == 0 else 0
        r = _exchange_steps(buf, off, m, dst + k % STREAM_RING * sub, fp_addr if p == 0 else 0,
                            f0, f1, f2, f3, f4, f5, f6, f7, seq_addr, seq, posted_addr,
                            step0 + p + 1, peer_posted, peer_fp, peer_state, spin_ns, yield_ns,
                            abort_addr, verify)
        if r != -1:
            _gil_leave(gil_addr, gil_me, r, spin_ns)
            return p, r
        _two_shot_consume(p, buf, size, sub, srcs, rank, fn, op, pre, post)
    _gil_leave(gil_addr, gil_me, _DONE, spin_ns)
    return nphase, -1


@jit.kernel(nogil=True)
def _two_shot_consume(p, buf, size, sub, srcs, rank, fn, op, pre, post):
    """The work after step p's wait (`buf`: bytes of `size`-byte elements). Even step
    (sub-chunk k = p // 2 in every sub-slot): reduce my slice of it, in rank order, into
    buf -- my own contribution read from buf, still in cache from the copy-in -- and
    publish the result in my sub-slot. Odd step: copy every peer's reduced slice from its
    sub-slot into buf."""
    k = p // 2
    off = k * sub
    ring = k % STREAM_RING * sub
    n = min(sub, buf.nbytes - off) // size
    base = off // size
    world = srcs.shape[0]
    if p % 2 == 0:
        lo, hi = n * rank // world, n * (rank + 1) // world
        if hi > lo:
            out = buf.ctypes.data + (base + lo) * size
            call_reduce(fn, out, srcs.ctypes.data, world, ring + lo * size, rank,
                        (hi - lo) * size, op, pre, post)
            copy_bytes(srcs[rank] + ring + lo * size, out, (hi - lo) * size)
        return
    for j in range(world):
        lo, hi = n * j // world, n * (j + 1) // world
        if j != rank and hi > lo:
            copy_bytes(buf.ctypes.data + (base + lo) * size, srcs[j] + ring + lo * size,
                       (hi - lo) * size)


@jit.kernel(nogil=True)
def _consume(mode, src, byte_offset, nbytes, srcs, ring, rank, root, fn, op, pre, post, out,
             out_offset, stride):
    """Use every rank's copy of one sub-chunk (at srcs[j] + ring: their sub-slots, mine
    included). STREAM_REDUCE: src[chunk] = the reduction (reducer `fn`) of every rank's
    copy, in rank order, reading my own contribution from src itself rather than from my
    sub-slot: the same bytes (I copied them there), but still in cache from the copy-in,
    so only the peers' sub-slots cost a cross-core transfer (one read less per byte from
    memory for large messages). STREAM_GATHER: rank j's copy goes to
    out[j * stride + out_offset:][:nbytes]; mine straight from src, for the same reason, or
    not at all where src is that block of out (in place: FSDP2's all_gather).
    STREAM_BROADCAST: a non-root copies the root's sub-slot into src[chunk]."""
    if mode == STREAM_BROADCAST:
        if rank != root:
            copy_bytes(src.ctypes.data + byte_offset, srcs[root] + ring, nbytes)
        return
    if mode == STREAM_REDUCE:
        if nbytes > 0:
            call_reduce(fn, src.ctypes.data + byte_offset, srcs.ctypes.data, srcs.shape[0],
                        ring, rank, nbytes, op, pre, post)
        return
    base = out.ctypes.data + out_offset
    for j in range(srcs.shape[0]):
        if j != rank:
            copy_bytes(base + j * stride, srcs[j] + ring, nbytes)
        elif base + j * stride != src.ctypes.data + byte_offset:  # else in place
            copy_bytes(base + j * stride, src.ctypes.data + byte_offset, nbytes)


# ------------------------------------------- the one-step kernel as a C function (lanes)

def _one_step_entry(mode, src, src_n, out, out_n, cfg, cfg_n, tab, tab_rows, tab_cols, srcs,
                    world, plan, plan_n, pre, post, seq, step, root):
    """_one_step_kernel of arrays rebuilt from their addresses and sizes (reducers.view_1d:
    no numba.carray, whose helper's environment would import numba.np.arrayobj at load)."""
    return _one_step_kernel(mode, view_1d(src, np.uint8, src_n), view_1d(out, np.uint8, out_n),
                            view_1d(cfg, np.int64, cfg_n),
                            view_2d(tab, np.int64, tab_rows, tab_cols),
                            view_1d(srcs, np.int64, world), view_1d(plan, np.int64, plan_n),
                            pre, post, seq, step, root)


_entry = []  # the compiled entry, once made


def one_step_entry():
    """The address of `_one_step_kernel` as a C function of addresses and sizes,
    int64(mode, src, src_n, out, out_n, cfg, cfg_n, tab, tab_rows, tab_cols, srcs, world,
    plan, plan_n, pre, post, seq, step, root) (every argument an int64 but pre and post,
    doubles; src and out: the addresses of uint8 arrays, cfg, tab, srcs and plan of int64
    ones, tab tab_rows x tab_cols, srcs world long): what torch_backend/_lane.c calls,
    without numba's dispatcher (~1 us a call with the arrays typed). Compiled, or loaded
    from the kernel caches, once per process, under the compile lock."""
    if not _entry:
        with jit.compiling(_LANE_ENTRY):
            if not _entry:
                _entry.append(jit.cfunc(_entry_signature(), _one_step_entry))
    return _entry[0].address


def _entry_signature():
    from numba import types
    i64, f64 = types.int64, types.float64
    return i64(*[i64] * 14, f64, f64, i64, i64, i64)
