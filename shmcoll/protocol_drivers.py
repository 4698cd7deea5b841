"""The Arena's compiled drivers: the collectives and parts of collectives that run as one
compiled call while nobody is late -- one_step (a whole single-step collective), the
streamed one-shot all_reduce and all_gather (_stream), the two-shot all_reduce -- and the
single-copy exchange of user buffers (single_copy.py).

`DriverMixin` is a part of protocol.Arena: each driver calls its kernel
(protocol_kernels.py) with the Arena's addresses and the current collective's
fingerprint, and hands anything but a clean pass to the Arena's own wait (_finish_wait),
which owns the slow tiers and the errors (protocol_waits.py).
"""

import time

import numpy as np

from . import jit
from .errors import ShmcollError
from .protocol_kernels import _NO_BYTES, _SINGLE_COPY, _STREAM, _TWO_SHOT, STREAM_GATHER, \
    STREAM_REDUCE, STREAM_RING, _consume, _one_step_consume, _one_step_kernel, _stream_kernel, \
    _two_shot_consume, _two_shot_kernel, _warm_single_copy, _warm_stream, _warm_two_shot
from .protocol_layout import _BUF_ADDR, _BUF_NBYTES, FP_WORDS
from .single_copy import CMA, PIECE_NBYTES, gather_from_peers, reduce_from_peers


class DriverMixin:
    """protocol.Arena's compiled drivers (see the module docstring)."""

    def exchange_reduce(self, i, buf, start, n, spec, sub_nbytes):
        """buf[start:start + n] = the reduction (ops.ReduceSpec `spec`) of every rank's
        buf[start:start + n], in rank order, through my slot i (claimed): the one-shot
        all_reduce as one compiled call when nobody is late (see _stream)."""
        size = buf.itemsize
        self._stream(i, STREAM_REDUCE, buf.view(np.uint8), size, start * size, n * size,
                     sub_nbytes, spec, _NO_BYTES)

    def one_step(self, seq, op_name, mode, plan, pre, post, src, out, root, timeout_s):
        """Collective `seq` when it is a single step through one slot, as one compiled call
        -- begin, claim, copy-in, post, wait, fingerprint check, consume -- instead of the
        ~6-8 us of Python between begin(), next_slot(), claim() and the exchange. Same
        slot, step, fingerprint and stores as the general path of the same collective, so
        a peer that takes that path (a strided array, say) matches it. The modes (see
        algorithms.one_step_mode for when each applies):

        ONE_STEP_REDUCE: all_reduce_one_shot of one sub-chunk; `src` (the bytes of a 1-D
            contiguous array) becomes the reduction in rank order of every rank's `src`.
        ONE_STEP_BROADCAST: broadcast_direct of one chunk; the root (rank `root`) copies
            `src` in, every other rank copies the root's slot out into its `src`.
        ONE_STEP_GATHER: all_gather_direct into one array, of one sub-chunk; rank j's `src`
            lands at out[j * src.nbytes:] (uint8 arrays).
        ONE_STEP_REDUCE_SCATTER: reduce_scatter_direct of one input array (world_size equal
            blocks) that fits a slot; `out` (the bytes of my output, one block) becomes the
            reduction in rank order of block[rank] of every rank's `src` (bytes too).

        `plan`: int64 [collective code, dtype code, count, root, op, shape word, kernel op,
        reducer] (fingerprint words 2-7, then the reduction: ops.ReduceSpec's op and fn);
        pre/post as in ops.ReduceSpec. `src` and `out` are uint8 arrays.
        Anything but a clean pass (a late peer, a mismatch, an abort) is finished by the same
        Python as the general path (_finish_wait), which owns the slow tiers and errors.
        """
        if out is None:  # all_reduce, broadcast: typed like the gathers' for one compilation
            out = _NO_BYTES
        self._seq = seq
        self._op_name = op_name
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._fp_pending = False  # the kernel checks this collective's fingerprints itself
        i = self._next_slot
        publishes = root < 0 or root == self.rank  # broadcast: only the root fills a slot
        if publishes and self._known_min < self._free_at[i]:  # rare: a peer may still read it
            self.wait_all(self._free_at[i])
        step = self._step + 1
        srcs = self._slot_addrs[i]
        r = _one_step_kernel(mode, src, out, self._cfg, self._peer_tab, srcs, plan, pre, post,
                             seq, step, root)
        self._next_slot = i + 1 if i + 1 < self.nslots else 0
        if publishes:
            self._free_at[i] = step + 1
        self._step = step
        if r == -1:
            self._known_min = step
            return
        # The kernel posted (with the fingerprint) but did not finish: the general path's
        # state for this collective, as begin() would have left it, then its slow wait.
        self._fp_list = [seq, step - 1, *plan[:FP_WORDS - 2].tolist()]
        self._fp_unwritten = False
        self._fp_pending = True
        self._begin_step = step - 1
        self._slot_at_begin = i
        self._finish_wait(step, r, True)
        _one_step_consume(mode, src, out, srcs, self.rank, root, plan[7], plan[6], pre, post)

    def exchange_gather(self, i, inp, out, sub_nbytes):
        """out[j * inp.size: (j + 1) * inp.size] = rank j's `inp`, for every rank j (uint8
        arrays; all_gather into one buffer), through my slot i (claimed), streamed like
        exchange_reduce: my own bytes are copied from `inp` (still in cache from the
        copy-in), each peer's from its sub-slot."""
        self._stream(i, STREAM_GATHER, inp, 1, 0, inp.size, sub_nbytes, None, out)

    def exchange_reduce_two_shot(self, i, buf, spec):
        """buf = the reduction (ops.ReduceSpec `spec`) of every rank's buf, in rank order,
        as reduce-scatter + all-gather through my slot i (claimed): per sub-chunk two steps
        -- copy in and post; wait; reduce my slice of every rank's sub-slot into buf and my
        sub-slot; post; wait; copy every peer's reduced slice out of its sub-slot -- all in
        one compiled call unless a peer is late (Python then finishes that wait, does the
        step's work and resumes the kernel after it).

        The sub-chunks take turns in STREAM_RING sub-slots, as in _stream: I copy sub-chunk
        k into sub-slot k % 2 only after every peer posted the second step of k - 1, which
        it does after gathering k - 2 (the last read of that sub-slot). The reduce writes
        only my own slice of my sub-slot, which no peer reads until the next step. The
        sub-chunks fill whole sub-slots: nothing overlaps across them, so smaller ones
        would only add waits."""
        jit.once(_TWO_SHOT, _warm_two_shot)
        nbytes, size = buf.nbytes, buf.itemsize
        sub = self.sub_nbytes(size, self.slot_nbytes)
        nphase = 2 * max(1, -(-nbytes // sub))
        step0 = self._step
        self._free_at[i] = step0 + nphase + 1
        srcs, dst = self._slot_addrs[i], self._slot_addr_mine[i]
        buf = buf.view(np.uint8)  # kernels move bytes; the reducer knows the dtype
        fn, op, pre, post = spec.fn, spec.op, spec.pre, spec.post
        p = 0
        while True:
            fp, fp_addr, peer_fp = self._fp_args()
            done, r = _two_shot_kernel(
                buf, size, sub, p, dst, fp_addr, fp[0], fp[1], fp[2], fp[3], fp[4], fp[5],
                fp[6], fp[7], self._seq_addr, self._seq, self._posted_addr, step0,
                self._peer_posted, peer_fp, self._peer_state, self._spins, self._yield_ns,
                self._state_addr, self._verify, srcs, self.rank, fn, op, pre, post,
                self._gil_addr, self._gil_me)
            self._fp_unwritten = False
            if self._settle(step0, nphase, done, r, fp_addr):
                return
            _two_shot_consume(done, buf, size, sub, srcs, self.rank, fn, op, pre, post)
            p = done + 1
            if p >= nphase:
                self._step = step0 + nphase
                return

    def _stream(self, i, mode, src, itemsize, byte_offset, nbytes, sub_nbytes, spec, out):
        """One collective's data through slot i in sub-chunks, one step each: copy the
        sub-chunk in, post, wait for every peer, then consume every rank's copy of it
        (mode STREAM_REDUCE: reduce into src with ops.ReduceSpec `spec`; STREAM_GATHER:
        copy into out), `src` and `out` being bytes of `itemsize`-byte elements, all in one
        compiled call unless a peer is late (Python then finishes that wait, consumes the
        sub-chunk and resumes the kernel after it).

        Each peer reads a sub-chunk from the writer's cache right after it was written
        rather than from memory, and the sub-chunks take turns in a ring of STREAM_RING
        sub-slots at the start of slot i, so the slot memory stays in cache too: only the
        user buffers stream through memory, and nbytes may exceed the slot. A ring of 2
        needs no extra waits: I copy sub-chunk k into sub-slot k % 2 only after seeing
        every peer post sub-chunk k - 1, and a peer posts k - 1 only after it consumed
        k - 2, the last read of that sub-slot.
        """
        jit.once(_STREAM, _warm_stream)
        sub = self.sub_nbytes(itemsize, sub_nbytes)
        nsub = max(1, -(-nbytes // sub))
        step0 = self._step
        self._free_at[i] = step0 + nsub + 1
        srcs, dst = self._slot_addrs[i], self._slot_addr_mine[i]
        fn, op, pre, post = (0, 0, 1.0, 1.0) if spec is None else \
            (spec.fn, spec.op, spec.pre, spec.post)
        k = 0
        while True:
            fp, fp_addr, peer_fp = self._fp_args()
            done, r = _stream_kernel(
                mode, src, byte_offset, nbytes, sub, k, dst, fp_addr,
                fp[0], fp[1], fp[2], fp[3], fp[4], fp[5], fp[6], fp[7],
                self._seq_addr, self._seq, self._posted_addr, step0, self._peer_posted, peer_fp,
                self._peer_state, self._spins, self._yield_ns, self._state_addr, self._verify, srcs,
                self.rank, fn, op, pre, post, out, self._gil_addr, self._gil_me)
            self._fp_unwritten = False
            if self._settle(step0, nsub, done, r, fp_addr):
                return
            _consume(mode, src, byte_offset + done * sub, min(sub, nbytes - done * sub),
                     srcs, done % STREAM_RING * sub, self.rank, fn, op, pre, post, out,
                     done * sub, nbytes)
            k = done + 1
            if k >= nsub:
                self._step = step0 + nsub
                return

    def sub_nbytes(self, itemsize, want):
        """Sub-chunk size for the STREAM_RING sub-slots of a slot: at most `want` bytes and
        a sub-slot, whole elements, at least one."""
        sub = max(itemsize, min(want, self.slot_nbytes // STREAM_RING))
        return sub - sub % itemsize

    def _settle(self, step0, nsteps, done, r, fp_addr):
        """After a multi-step kernel (_stream, exchange_reduce_two_shot) returned (done, r):
        True when all `nsteps` steps were exchanged and consumed (r == -1). Else step
        `done` is posted but not every peer has posted it: finish that wait in Python
        (slow tiers, errors) and return False; the caller then does that step's work and
        resumes the kernel after it. The kernel wrote and checked the fingerprint at step 0."""
        if r == -1:
            self._step = self._known_min = step0 + nsteps
            if fp_addr:
                self._fp_pending = False
            return True
        self._step = step0 + done + 1
        self._finish_wait(self._step, r, fp_addr != 0 and done == 0)
        if fp_addr and done > 0:
            self._fp_pending = False
        return False

    # -- single copy (see single_copy.py) ------------------------------------------------

    def exchange_buffer(self, arr):
        """Publish the address of my 1-D array `arr` (its bytes stay where they are), post
        and wait for every peer (exchange()); return every rank's buffer address, each in
        its owner's address space (int64 array, mine included). Peers' buffers are only
        read through reduce_peers / gather_peers, between this wait and my next post."""
        self._mine[_BUF_ADDR] = arr.ctypes.data
        self._mine[_BUF_NBYTES] = arr.nbytes
        self.exchange()
        addrs = np.empty(self.world_size, np.int64)
        for p, c in enumerate(self._ctrl):
            if p != self.rank and c[_BUF_NBYTES] != arr.nbytes:
                raise ShmcollError(
                    f"{self._op_name} (seq {self._seq}): rank {p} published a buffer of "
                    f"{int(c[_BUF_NBYTES])} bytes, rank {self.rank} one of {arr.nbytes} (a "
                    f"corrupt control block?)")
            addrs[p] = c[_BUF_ADDR]
        return addrs

    def reduce_peers(self, addrs, out, offset, spec):
        """out[i] = the reduction (ops.ReduceSpec) in rank order of every rank's element
        at addrs[p] + offset + i * itemsize (addrs from exchange_buffer; mine may be `out`
        itself)."""
        jit.once(_SINGLE_COPY, _warm_single_copy)
        piece = max(1, PIECE_NBYTES // out.itemsize) * out.itemsize
        scratch = self._scratch_for(piece)
        peer, err = reduce_from_peers(self.single_copy, self._pid_arr, addrs, self.rank,
                                      out.view(np.uint8), offset, scratch, piece, spec.fn,
                                      spec.op, spec.pre, spec.post)
        if peer >= 0:
            raise self._read_error(peer, err)

    def gather_peers(self, peers, remote, local, nbytes):
        """Copy nbytes[k] bytes at remote[k] in rank peers[k]'s address space to local[k]
        (int64 arrays; the ranges were published with exchange_buffer)."""
        jit.once(_SINGLE_COPY, _warm_single_copy)
        peer, err = gather_from_peers(self.single_copy, self._pid_arr, self.rank, peers,
                                      remote, local, nbytes)
        if peer >= 0:
            raise self._read_error(peer, err)

    def _scratch_for(self, piece_nbytes):
        need = piece_nbytes * max(1, self.world_size - 1) if self.single_copy == CMA else 64
        if self._scratch is None or self._scratch.nbytes < need:
            raw = np.empty(need + 4096, np.uint8)
            start = -raw.ctypes.data % 4096
            self._scratch = raw[start:start + need]
        return self._scratch
