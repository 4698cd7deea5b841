"""The Arena's slow path: the wait tiers' constants, the Python wait that takes over from
the compiled tiers (rule 5), and every error a collective can end in -- a lost, closed or
aborted peer, the deadline, a fingerprint mismatch (rule 4), a failed single-copy read.

`PeerWatch` holds what it needs, given once by protocol.Arena: this rank's and its peers'
control-block views and word addresses, their pids, the liveness callback and the
fingerprint renderer. It writes no state: a wait returns when every peer arrived or raises;
the fingerprint check returns its verdict (None or the error to raise), and the Arena,
which owns the step clock (protocol/steps.py), undoes the slot rotation on a mismatch. The
collective's name, seq, timeout and deadline come from the Arena's Frame, passed to each
call. protocol.py re-exports the constants.
"""

import errno
import time

from ..native import jit
from . import compiled
from ..errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    GroupAbortedError,
    PeerLostError,
    ShmcollError,
)
from .layout import _EXCHANGE, FP_LINE0, FP_RING, LINE_WORDS, STATE_ABORTED, \
    STATE_CLOSED, STATE_LIVE, W_POSTED, W_SEQ, W_STATE
from ..native.single_copy import errno_text

# Wait tiers (see DESIGN_NOTES §14), all inside the compiled wait (atomics.wait_all_ge):
# pause-polls for SPIN_NS, unless the awaited peer last posted from this CPU (it cannot run
# until I let go of it: atomics.OWNER_CPU_OFFSET), and never when ranks outnumber cores;
# then sched_yield polls for YIELD_NS, so a peer a few hundred us late (GC, a page fault, a
# descheduled core, a peer thread's Python) is seen at once while the core still goes to
# whoever needs it when ranks outnumber cores. Both tiers are bounded by time, not by a
# count: a pause takes 3-50 ns by CPU model, sched_yield from under 1 us (idle core) to a
# whole time slice (loaded host). Only then does Python take over (_wait_slow): sleeps with
# backoff, checking deadline, abort and peer liveness in between; each sleep is a futex
# wait that the awaited peer's post (or any STATE change) ends at once (rule 5), from
# FUTEX_SLEEP_MIN_S doubling to FUTEX_SLEEP_MAX_S, or, without futexes, a plain sleep from
# SLEEP_MIN_S to SLEEP_MAX_S followed by SLOW_YIELD_NS of yield-polling. Staying compiled for
# the whole yield tier matters most for rank threads (threaded_pg): a waiting thread back
# in Python takes the GIL from the very peer it waits for (measured: one Python slow wait
# per collective made 2-thread dist.all_reduce ~5x slower).
# Why spin that long (it was ~10 us, 200 pauses): on a host with other busy processes a
# yield hands the core to one of them, and the rank gets it back at the scheduler's next
# tick or slice end (4 ms ticks on the VM: HZ=250), long after its peer posted. 2 ranks,
# 64 KiB all_reduce, engine level, medians of 1000 calls with 1-2 busy Python loops beside
# them on the 2-core VM: 52-115 us yielding after 10 us; 10-23 us spinning 0.2-0.5 ms; idle,
# no difference (10-37 us either way, the pair's speed state:
# docs/notes/2026-11-29-busy-host-waits.md).
# Spinning without the CPU check paid its whole budget on every wait whenever the
# scheduler put both ranks on one core (p90 0.5-1.2 ms; 2 ms budgets: 2 ms medians).
SPIN_NS = 200_000
YIELD_NS = 2_000_000
SLOW_YIELD_NS = 100_000
SLEEP_MIN_S = 20e-6
SLEEP_MAX_S = 1e-3
# A futex sleep's bound only decides how often a sleeper wakes for nothing, to look at the
# deadline and peer liveness: every wake up costs the CPU that oversubscribed ranks need.
# lab/hier_ab.py, 2 namespaced hosts x 2 ranks on the 2-core VM, all_reduce, time
# over 20 us doubling to 1 ms (20 blocks, two runs): 1 ms to 8 ms: 8 B 0.84-0.92, 512 B
# 0.87-0.97, 4 KiB 0.88-0.89; 1 ms flat 0.88-0.98; 200 us to 4 ms 0.92-0.99.
FUTEX_SLEEP_MIN_S = 1e-3
FUTEX_SLEEP_MAX_S = 8e-3


class PeerWatch:
    """The slow wait and the errors of protocol.Arena (see the module docstring)."""

    def __init__(self, rank, ctrl, peer_posted, posted_addrs, state_addrs, seq_addrs, pids,
                 is_alive, describe):
        self.rank = rank
        self._ctrl = ctrl
        self._mine = ctrl[rank]
        self._peers = [p for p in range(len(ctrl)) if p != rank]
        self._peer_posted = peer_posted  # int64 addresses of the peers' POSTED words
        self._posted_addrs = posted_addrs
        self._state_addrs = state_addrs
        self._seq_addrs = seq_addrs
        self._state_addr = state_addrs[rank]
        self._pids = pids
        self._is_alive = is_alive
        self._describe = describe

    def wait(self, target, r, frame):
        """The compiled tiers ran out (or saw my abort word) waiting for every peer to post
        `target`: sleep with backoff, checking abort, peer liveness and the deadline before
        every sleep; return once every peer posted it, else raise."""
        atomics, pk = compiled.atomics, compiled.protocol_kernels
        jit.once(_EXCHANGE, pk._warm_exchange)  # wait_all_ge, called from Python below
        futex = atomics.HAVE_FUTEX and r >= 0
        sleep_s, sleep_max = (FUTEX_SLEEP_MIN_S, FUTEX_SLEEP_MAX_S) if futex else \
            (SLEEP_MIN_S, SLEEP_MAX_S)
        while True:
            if r == -2 or self._mine[W_STATE * LINE_WORDS] != STATE_LIVE:
                raise GroupAbortedError(
                    f"{frame.name}: rank {self.rank} aborted while waiting at seq {frame.seq}")
            self._check_peers(target, frame)
            left = frame.deadline - time.monotonic()
            if left < 0:
                raise self._timeout_error(target, frame)
            if futex:
                # asleep until the first missing peer posts (rule 5), then one look: no
                # yield-polling after it, which only burns the cores an oversubscribed
                # machine's other ranks need (2 namespaced hosts x 2 ranks, 8 B all_reduce,
                # A/B in one run: 0.80-0.96x the time of 100 us of yield-polling per sleep)
                pk.sleep_on(self._peer_posted[r], target, int(min(sleep_s, left + 1e-4) * 1e9))
                yield_ns = 0
            else:
                time.sleep(sleep_s)
                yield_ns = SLOW_YIELD_NS
            sleep_s = min(sleep_s * 2, sleep_max)
            r = atomics.wait_all_ge(self._peer_posted, target, 0, yield_ns, self._state_addr)
            if r == -1:
                return

    def _check_peers(self, target, frame):
        """Raise if a peer we still wait for can never arrive.

        Every missing peer is checked, not only the first: with 3+ ranks the first missing
        peer may be alive and itself waiting for the dead one. A lost (dead or closed) peer
        wins over an aborted one, so every survivor names the rank that was lost, not the
        survivor that noticed it first and aborted.
        """
        missing = [p for p in self._peers if self._ctrl[p][W_POSTED * LINE_WORDS] < target]
        if not missing:
            return
        aborted = None
        for peer in missing:
            state = int(self._ctrl[peer][W_STATE * LINE_WORDS])
            if (state == STATE_CLOSED or not self._is_alive(peer)) and self._still_short(
                    peer, target):
                raise self.lost_error(peer, state, frame)
            if state == STATE_ABORTED and aborted is None:
                aborted = peer
        if aborted is not None:
            # The aborting peer may have noticed a loss we have not waited on yet.
            for peer in self._peers:
                state = int(self._ctrl[peer][W_STATE * LINE_WORDS])
                if state == STATE_CLOSED or not self._is_alive(peer):
                    raise self.lost_error(peer, state, frame)
            raise GroupAbortedError(
                f"{frame.name}: rank {aborted} aborted the group while rank {self.rank} "
                f"waited for it at seq {frame.seq}; this group is unusable, create a new one")

    def _still_short(self, peer, target):
        """Re-read the peer's POSTED after seeing it closed or dead: it may have posted
        `target` (then finished and closed) between our first read and the state read. A
        closing peer stores STATE after its last post, and a dead one posts no more, so this
        second read is final."""
        return compiled.atomics.read_acquire(self._posted_addrs[peer]) < target

    def lost_error(self, peer, state, frame):
        what = "closed the group" if state == STATE_CLOSED else "exited"
        pid = self._pids[peer] if peer < len(self._pids) else None
        return PeerLostError(
            f"{frame.name}: rank {peer} (pid {pid}) {what} while rank {self.rank} waited "
            f"for it at seq {frame.seq} (peer last seq "
            f"{int(self._ctrl[peer][W_SEQ * LINE_WORDS])}); this group is unusable, create a "
            f"new one", peer=peer)

    def _timeout_error(self, target, frame):
        missing = [p for p in self._peers if self._ctrl[p][W_POSTED * LINE_WORDS] < target]
        seqs = ", ".join(f"rank {p} at seq {int(self._ctrl[p][W_SEQ * LINE_WORDS])}"
                         for p in missing)
        ms = int(round(frame.timeout_s * 1000))
        return CollectiveTimeoutError(
            f"[Rank {self.rank}] {frame.name} (seq {frame.seq}): Timed out waiting {ms}ms "
            f"for ranks {missing} to arrive ({seqs})")

    def fingerprint_verdict(self, frame):
        """Rule 4, once every peer posted the collective's first step: None when every
        peer's fingerprint for `frame` matches mine and no peer aborted at or before it;
        else the error to raise (a CollectiveMismatchError, after which the group stays
        usable once the caller undid the collective's slot rotation; or the lost or
        aborted peer's error)."""
        mine = frame.fp
        line = (FP_LINE0 + frame.seq % FP_RING) * LINE_WORDS
        end = line + len(mine)
        for p in self._peers:
            theirs = self._ctrl[p][line:end].tolist()  # a copy: checked and rendered alike
            if theirs != mine:
                ours, other = self._describe(tuple(mine[2:])), self._describe(tuple(theirs[2:]))
                if theirs[0] != mine[0]:
                    other += f" at seq {theirs[0]} (ranks are out of step)"
                elif ours == other:
                    other += " with a different shape or split sizes"
                return CollectiveMismatchError(
                    f"seq {frame.seq}: rank {self.rank} called {ours} but rank {p} called "
                    f"{other}")
        # A peer that aborted (timeout, lost peer, abort()) at this collective or an
        # earlier one: do not complete it here with the data it left behind, so that every
        # rank fails at the same collective (a late rank woken by SIGCONT included). One
        # whose SEQ is past mine finished mine (it could not begin the next before), so
        # its abort belongs to a later collective: STATE is read first, and abort_at stores
        # SEQ before STATE. CLOSED is not checked: a peer may finish the last collective
        # and close at once.
        read_acquire = compiled.atomics.read_acquire
        for p in self._peers:
            if (read_acquire(self._state_addrs[p]) == STATE_ABORTED
                    and read_acquire(self._seq_addrs[p]) <= frame.seq):
                for q in self._peers:  # name the lost rank the aborting peer noticed
                    if not self._is_alive(q):
                        return self.lost_error(q, int(self._ctrl[q][W_STATE * LINE_WORDS]),
                                               frame)
                return GroupAbortedError(
                    f"{frame.name}: rank {p} aborted the group before rank {self.rank} "
                    f"reached seq {frame.seq}; this group is unusable, create a new one")
        return None

    def read_error(self, peer, err, frame):
        """The error of a failed single-copy read from `peer` (-errno `err`)."""
        state = int(self._ctrl[peer][W_STATE * LINE_WORDS])
        if -err == errno.ESRCH or not self._is_alive(peer) or state == STATE_CLOSED:
            return self.lost_error(peer, state, frame)
        return ShmcollError(
            f"{frame.name} (seq {frame.seq}): rank {self.rank} could not read rank "
            f"{peer}'s buffer (pid {self._pids[peer]}): process_vm_readv failed with "
            f"{errno_text(err)}")
