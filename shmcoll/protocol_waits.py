"""The Arena's slow path: the wait tiers' constants, the Python wait that takes over from
the compiled tiers (rule 5), and every error a collective can end in -- a lost, closed or
aborted peer, the deadline, a fingerprint mismatch (rule 4), a failed single-copy read.

`WaitMixin` is a part of protocol.Arena (it uses the Arena's control-block views, peers,
liveness callback and the current collective's seq, name, fingerprint and deadline); the
Arena's own waits (wait_all, _finish_wait) call into it only once a compiled wait did not
complete cleanly. protocol.py re-exports the constants.
"""

import errno
import time

from . import jit
from .atomics import HAVE_FUTEX, read_acquire, wait_all_ge
from .errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    GroupAbortedError,
    PeerLostError,
    ShmcollError,
)
from .protocol_kernels import _EXCHANGE, _warm_exchange, sleep_on
from .protocol_layout import FP_LINE0, FP_RING, LINE_WORDS, STATE_ABORTED, STATE_CLOSED, \
    STATE_LIVE, W_POSTED, W_SEQ, W_STATE
from .single_copy import errno_text

# Wait tiers (see DESIGN_NOTES §14), all inside the compiled wait (atomics.wait_all_ge):
# SPINS pause-polls (~10 us): brief, because on a VM a long PAUSE loop can trigger
# pause-loop exits that deschedule the vCPU, and on a loaded host a spinning rank steals the
# core its late peer needs; then sched_yield polls for YIELD_NS, so a peer a few hundred us
# late (GC, a page fault, a descheduled core, a peer thread's Python) is seen at once while
# the core still goes to whoever needs it when ranks outnumber cores. The yield tier is
# bounded by time, not by a count: sched_yield takes from under 1 us (idle core) to a whole
# time slice (loaded host). Only then does Python take over (_wait_slow): sleeps with
# backoff, checking deadline, abort and peer liveness in between; each sleep is a futex
# wait that the awaited peer's post (or any STATE change) ends at once (rule 5), from
# FUTEX_SLEEP_MIN_S doubling to FUTEX_SLEEP_MAX_S, or, without futexes, a plain sleep from
# SLEEP_MIN_S to SLEEP_MAX_S followed by SLOW_YIELD_NS of yield-polling. Staying compiled for
# the whole yield tier matters most for rank threads (threaded_pg): a waiting thread back
# in Python takes the GIL from the very peer it waits for (measured: one Python slow wait
# per collective made 2-thread dist.all_reduce ~5x slower).
SPINS = 200
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


class WaitMixin:
    """protocol.Arena's slow waits and failures (see the module docstring)."""

    def _wait_slow(self, target, r):
        """The compiled tiers ran out (or saw my abort word): sleep with backoff, checking
        abort, peer liveness and the deadline before every sleep."""
        jit.once(_EXCHANGE, _warm_exchange)  # wait_all_ge, called from Python below
        futex = HAVE_FUTEX and r >= 0
        sleep_s, sleep_max = (FUTEX_SLEEP_MIN_S, FUTEX_SLEEP_MAX_S) if futex else \
            (SLEEP_MIN_S, SLEEP_MAX_S)
        while True:
            if r == -2 or self._mine[W_STATE * LINE_WORDS] != STATE_LIVE:
                raise GroupAbortedError(
                    f"{self._op_name}: rank {self.rank} aborted while waiting at seq {self._seq}")
            self._check_peers(target)
            left = self._deadline - time.monotonic()
            if left < 0:
                raise self._timeout_error(target)
            if futex:
                # asleep until the first missing peer posts (rule 5), then one look: no
                # yield-polling after it, which only burns the cores an oversubscribed
                # machine's other ranks need (2 namespaced hosts x 2 ranks, 8 B all_reduce,
                # A/B in one run: 0.80-0.96x the time of 100 us of yield-polling per sleep)
                sleep_on(self._peer_posted[r], target, int(min(sleep_s, left + 1e-4) * 1e9))
                yield_ns = 0
            else:
                time.sleep(sleep_s)
                yield_ns = SLOW_YIELD_NS
            sleep_s = min(sleep_s * 2, sleep_max)
            r = wait_all_ge(self._peer_posted, target, 0, yield_ns, self._state_addr)
            if r == -1:
                return

    def _check_peers(self, target):
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
                raise self._lost_error(peer, state)
            if state == STATE_ABORTED and aborted is None:
                aborted = peer
        if aborted is not None:
            # The aborting peer may have noticed a loss we have not waited on yet.
            for peer in self._peers:
                state = int(self._ctrl[peer][W_STATE * LINE_WORDS])
                if state == STATE_CLOSED or not self._is_alive(peer):
                    raise self._lost_error(peer, state)
            raise GroupAbortedError(
                f"{self._op_name}: rank {aborted} aborted the group while rank {self.rank} "
                f"waited for it at seq {self._seq}; this group is unusable, create a new one")

    def _still_short(self, peer, target):
        """Re-read the peer's POSTED after seeing it closed or dead: it may have posted
        `target` (then finished and closed) between our first read and the state read. A
        closing peer stores STATE after its last post, and a dead one posts no more, so this
        second read is final."""
        return read_acquire(self._posted_addrs[peer]) < target

    def _lost_error(self, peer, state):
        what = "closed the group" if state == STATE_CLOSED else "exited"
        pid = self._pids[peer] if peer < len(self._pids) else None
        return PeerLostError(
            f"{self._op_name}: rank {peer} (pid {pid}) {what} while rank {self.rank} waited "
            f"for it at seq {self._seq} (peer last seq "
            f"{int(self._ctrl[peer][W_SEQ * LINE_WORDS])}); this group is unusable, create a "
            f"new one", peer=peer)

    def _timeout_error(self, target):
        missing = [p for p in self._peers if self._ctrl[p][W_POSTED * LINE_WORDS] < target]
        seqs = ", ".join(f"rank {p} at seq {int(self._ctrl[p][W_SEQ * LINE_WORDS])}"
                         for p in missing)
        ms = int(round(self._timeout_s * 1000))
        return CollectiveTimeoutError(
            f"[Rank {self.rank}] {self._op_name} (seq {self._seq}): Timed out waiting {ms}ms "
            f"for ranks {missing} to arrive ({seqs})")

    def _check_fingerprints(self):
        self._fp_pending = False
        if not self._verify:
            return
        mine = self._fp_list
        line = (FP_LINE0 + self._seq % FP_RING) * LINE_WORDS
        end = line + len(mine)
        for p in self._peers:
            theirs = self._ctrl[p][line:end].tolist()  # a copy: checked and rendered alike
            if theirs != mine:
                # Undo this collective's slot rotation: no data moved, the group stays usable.
                # Slots published by this collective were read by nobody (every peer raises
                # at this same wait), and every peer has posted >= _known_min, so they are
                # free again now; keeping their "free at step + 1" would make the next
                # collective's claim() wait for a post that comes only after that claim.
                self._next_slot = self._slot_at_begin
                self._free_at = [min(f, self._known_min) for f in self._free_at]
                ours, other = self._describe(tuple(mine[2:])), self._describe(tuple(theirs[2:]))
                if theirs[0] != mine[0]:
                    other += f" at seq {theirs[0]} (ranks are out of step)"
                elif ours == other:
                    other += " with a different shape or split sizes"
                raise CollectiveMismatchError(
                    f"seq {self._seq}: rank {self.rank} called {ours} but rank {p} called {other}")
        # A peer that aborted (timeout, lost peer, abort()) at this collective or an
        # earlier one: do not complete it here with the data it left behind, so that every
        # rank fails at the same collective (a late rank woken by SIGCONT included). One
        # whose SEQ is past mine finished mine (it could not begin the next before), so
        # its abort belongs to a later collective: STATE is read first, and abort_at stores
        # SEQ before STATE. CLOSED is not checked: a peer may finish the last collective
        # and close at once.
        for p in self._peers:
            if (read_acquire(self._state_addrs[p]) == STATE_ABORTED
                    and read_acquire(self._seq_addrs[p]) <= self._seq):
                for q in self._peers:  # name the lost rank the aborting peer noticed
                    if not self._is_alive(q):
                        raise self._lost_error(q, int(self._ctrl[q][W_STATE * LINE_WORDS]))
                raise GroupAbortedError(
                    f"{self._op_name}: rank {p} aborted the group before rank {self.rank} "
                    f"reached seq {self._seq}; this group is unusable, create a new one")

    def _read_error(self, peer, err):
        """The error of a failed single-copy read from `peer` (-errno `err`)."""
        state = int(self._ctrl[peer][W_STATE * LINE_WORDS])
        if -err == errno.ESRCH or not self._is_alive(peer) or state == STATE_CLOSED:
            return self._lost_error(peer, state)
        return ShmcollError(
            f"{self._op_name} (seq {self._seq}): rank {self.rank} could not read rank "
            f"{peer}'s buffer (pid {self._pids[peer]}): process_vm_readv failed with "
            f"{errno_text(err)}")
