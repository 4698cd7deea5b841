"""Point-to-point mailboxes in compiled code: the cell header words, the cell kernels that
write, peek at and take cells (rules 1-3 of p2p.py's docstring, which draws the cell), and
the kernel sets that load them and the progress thread's wait on first use (jit.once).

The engine (p2p.py) and its progress thread (p2p/progress.py) reach these through
compiled.p2p_cells (they import no numba); the engine's constants (ANY_SOURCE, the wait
target _NEVER, the kernel sets' names) are in p2p/layout.py.
"""

import numpy as np

from ..native import atomics, jit
from ..native.atomics import copy_bytes, load_acquire, store_release, wait_any_ge
from ..protocol.layout import LINE_NBYTES
from .layout import _CELL_KERNELS, _PROGRESS_WAIT

_H_SEQ, _H_MSG, _H_TAG, _H_TOTAL, _H_OFFSET, _H_NBYTES = range(6)
_HDR = LINE_NBYTES  # a cell's header line; the payload follows


def _warm_progress_wait():
    word = np.zeros(1, np.int64)
    addrs = np.array([word.ctypes.data], np.int64)
    wait_any_ge(addrs, np.zeros(1, np.int64), 0, 0, word.ctypes.data)


def ensure_progress_wait():
    """Compile (or load) what the progress thread needs from its start: the atomics and its
    idle wait, once per process, under the job's compile lock (jit.py). A group's warm-up
    (warmup.py) loads them too, so that the thread never loads beside a collective."""
    atomics.warm_up()
    jit.once(_PROGRESS_WAIT, _warm_progress_wait)


def ensure_kernels():
    """Compile (or load from numba's cache) the cell kernels below, once per process, under
    the job's compile lock (jit.py). A group's progress thread runs from its creation, but
    these wait for the first message this process posts or receives: most jobs send none,
    and compiling them (~0.7 s cold) would delay the first collectives."""
    ensure_progress_wait()
    jit.once(_CELL_KERNELS, _warm_kernels)


def _warm_kernels():
    ring = np.zeros(_HDR + 64, np.uint8)
    word = np.zeros(1, np.int64)
    addr, waddr = ring.ctypes.data, word.ctypes.data
    none = np.zeros(0, np.uint8)
    # Arguments that do no work: no cell to write, none ready, none left to take.
    _push_cells(ring, addr, 1, ring.size, 0, 0, waddr, none, 1, 0, 0)
    _peek_cell(ring, addr, 1, ring.size, 0)
    _take_cells(ring, addr, 1, ring.size, 0, waddr, none, False, 0, 0, 0, 1)


# -- cell kernels (rules 1-3): per-cell work in compiled code, GIL released ------------------
# `ring` is one pair's K cells (uint8, K * stride bytes), `ring_addr` its address.

@jit.kernel(nogil=True)
def _push_cells(ring, ring_addr, K, stride, sent, room, consumed_addr, data, j, msg, tag):
    """Write cells j, j+1, ... of message `msg` (= data) as pair cells sent+1, ... while
    the ring has room. Returns (sent, room, j) after."""
    words = ring.view(np.int64)
    C = stride - _HDR
    total = data.shape[0]
    ncells = max(1, (total + C - 1) // C)
    while j < ncells:
        n = sent + 1
        if n - K > room:
            room = load_acquire(consumed_addr)
            if n - K > room:
                break  # rule 1: cell n - K not consumed yet
        p = ((n - 1) % K) * stride
        off = j * C
        nb = min(C, total - off)
        copy_bytes(ring_addr + p + _HDR, data.ctypes.data + off, nb)
        w = p // 8
        words[w + _H_MSG] = msg
        words[w + _H_TAG] = tag
        words[w + _H_TOTAL] = total
        words[w + _H_OFFSET] = off
        words[w + _H_NBYTES] = nb
        store_release(ring_addr + p, n)  # rule 2: the sequence word goes last
        sent = n
        j += 1
    return sent, room, j


@jit.kernel(nogil=True)
def _peek_cell(ring, ring_addr, K, stride, taken):
    """(ready, msg, tag, total, offset, nbytes) of pair cell taken+1, without consuming it."""
    p = (taken % K) * stride
    if load_acquire(ring_addr + p) < taken + 1:
        return False, 0, 0, 0, 0, 0
    w = p // 8
    words = ring.view(np.int64)
    return (True, words[w + _H_MSG], words[w + _H_TAG], words[w + _H_TOTAL],
            words[w + _H_OFFSET], words[w + _H_NBYTES])


@jit.kernel(nogil=True)
def _take_cells(ring, ring_addr, K, stride, taken, consumed_addr, buf, copy, msg, tag, total, j):
    """Consume cells j, j+1, ... of message (msg, tag, total) while present, copying them
    into buf if `copy`. Returns (taken, j, corrupt) after; stops at a bad header."""
    words = ring.view(np.int64)
    C = stride - _HDR
    ncells = max(1, (total + C - 1) // C)
    while j < ncells:
        n = taken + 1
        p = ((n - 1) % K) * stride
        if load_acquire(ring_addr + p) < n:
            break
        w = p // 8
        off = j * C
        nb = min(C, total - off)
        if (words[w + _H_MSG] != msg or words[w + _H_TAG] != tag or
                words[w + _H_TOTAL] != total or words[w + _H_OFFSET] != off or
                words[w + _H_NBYTES] != nb):
            return taken, j, True
        if copy:
            copy_bytes(buf.ctypes.data + off, ring_addr + p + _HDR, nb)
        store_release(consumed_addr, n)  # rule 3: after the copy, frees the cell
        taken = n
        j += 1
    return taken, j, False
