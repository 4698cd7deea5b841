"""HierGroup: the engine's Group interface (numpy in, numpy out) over several nodes.

Inside each node an engine Group over shared memory (`intra`); between nodes a Transport
(wire.py: gloo channels, one per local rank). The algorithms (reduce.py, move.py) compose
the two; this module validates, sequences, frames and fails:

- Arguments are checked before anything moves (same errors as the engine's Group); a bad
  call consumes no sequence number.
- Every collective gets a seq, a deadline and a position (seq, step) that the watchdog
  reports once the collective is slow (faults.py), so a timeout can say where each rank is.
- Any failure inside a collective poisons the group on every rank: ranks on other nodes
  may be waiting for this one in an inter-node step, and would otherwise wait for their
  timeout. The failing rank posts the failure on the board, aborts its node's engine group
  and raises a typed error that names the collective, seq, step, rank and node; the others
  raise the same type, naming the rank where it started.
"""

import collections
import time

import numpy as np

from ..errors import (CollectiveMismatchError, CollectiveTimeoutError, GroupAbortedError,
                      PeerLostError, ShmcollError)
from ..engine.group import COLLECTIVES, Group, describe_fingerprint
from . import faults, wire
from .api import Collectives
from .faults import Watchdog
from .reduce import HIER_SHARD_MIN_NBYTES

__all__ = ["HierGroup", "Call"]

_CODE = {name: i + 1 for i, name in enumerate(COLLECTIVES)}
_ERRORS = {cls.__name__: cls for cls in (CollectiveMismatchError, CollectiveTimeoutError,
                                          GroupAbortedError, PeerLostError, ShmcollError)}
TRANSPORT_GRACE_S = 2.0  # the transport's own deadline trails ours: our message wins
# Scratch buffers (receive areas, shards, regrouped inputs) are kept between collectives up
# to this size each: fresh pages cost a fault and the kernel's zeroing on every call.
SCRATCH_KEEP_NBYTES = 64 << 20
FLIGHT_RECORD_LEN = 64


class _Expired(Exception):
    """The collective's deadline passed in a wait of ours."""


class _Remote(Exception):
    """The board says another rank failed: args ("<ErrorType>|<lost rank or empty>",
    message)."""


class Call:
    """One hierarchical collective in flight: seq, fingerprint, deadline, current step."""

    __slots__ = ("g", "name", "seq", "fp", "deadline", "timeout_s", "t0", "step", "report_s")

    def __init__(self, g, name, seq, fp, timeout_s):
        self.g, self.name, self.seq, self.fp = g, name, seq, fp
        self.timeout_s = timeout_s
        self.t0 = time.monotonic()
        self.deadline = self.t0 + timeout_s
        self.report_s = faults.report_after_s(timeout_s)
        self.step = "start"

    def remaining(self):
        r = self.deadline - time.monotonic()
        if r <= 0:
            raise _Expired()
        return r

    def at(self, step):
        self.step = step
        self.g.position = (self.seq, self.name, step, self.t0, self.report_s)

    def intra(self, step, fn, *args, **kw):
        """An engine call on this node's group, inside this collective's deadline."""
        self.at(step)
        return fn(*args, timeout_s=self.remaining(), **kw)

    def move(self, step, start, *args):
        """A transport operation (channel method `start`), awaited abort- and board-aware."""
        self.at(step)
        self.g._await(self, start(*args, self.remaining() + TRANSPORT_GRACE_S))

    def start_frame(self, channel, payload=None):
        """Post the first round on `channel` (see wire.py); finish_frame() checks it."""
        self.at("posting the inter-node first round")
        mine = wire.frame(self.seq, self.fp, payload)
        out = np.empty(channel.size * wire.FRAME_NBYTES, np.uint8)
        pending = channel.all_gather(out, mine, self.remaining() + TRANSPORT_GRACE_S)
        return channel, pending, out, mine

    def finish_frame(self, started, step="inter-node first round"):
        """Wait for a first round; raise CollectiveMismatchError if any header differs;
        -> the members' inline payloads, (members, INLINE_NBYTES) uint8 in node order."""
        channel, pending, out, mine = started
        self.at(step)
        self.g._await(self, pending)
        rows = out.reshape(channel.size, wire.FRAME_NBYTES)
        bad = wire.check_frames(rows, mine)
        if bad >= 0:
            raise self.g._frame_mismatch(self, channel, bad, rows[bad])
        return rows[:, wire.HEADER_NBYTES:]

    def frame_round(self, channel, payload=None, step="inter-node first round"):
        return self.finish_frame(self.start_frame(channel, payload), step)


class HierGroup(Collectives):
    """Collectives among `layout.world_size` ranks on `layout.num_nodes` nodes."""

    def __init__(self, layout, rank, intra, transport, board, timeout_s=1800.0, name="",
                 shard_min_nbytes=None):
        self.rank = rank
        self.world_size = layout.world_size
        self.layout = layout
        self.node = layout.node_of[rank]
        self.local = layout.local_rank(rank)
        self.intra = intra
        self.transport = transport
        self.channel = transport.channel(self.local) if self.local < layout.shards else None
        self.board = board
        self.timeout_s = float(timeout_s)
        self.name = name
        self.shard_min_nbytes = HIER_SHARD_MIN_NBYTES if shard_min_nbytes in (None, -1) \
            else shard_min_nbytes
        self.position = None  # (seq, collective, step, t_start, report_after_s) or None
        self._reported = None
        self._next_watch = 0.0
        self._seq = 0
        self._poison = None
        self._closed = False
        self._aborted = False
        self._pending = None
        self._kernels = None  # Group's kernel gate: new_hier_group waited for intra's
        self.flight_record = collections.deque(maxlen=FLIGHT_RECORD_LEN)
        self._scratch = {}
        Watchdog.register(self)

    # -- state ---------------------------------------------------------------------------

    # the engine Group's: collectives issued; the poisoning error; closed / poisoned checks
    # and the kernel gate (open: see _kernels)
    seq, poisoned, _usable = Group.seq, Group.poisoned, Group._usable
    wait_kernels = Group.wait_kernels

    def scratch(self, slot, nbytes, dtype=np.uint8):
        """A buffer of `nbytes` for `slot` of the running collective (slots used together
        differ); reused by later collectives up to SCRATCH_KEEP_NBYTES."""
        buf = self._scratch.get(slot)
        if buf is None or buf.nbytes < nbytes:
            buf = np.empty(max(nbytes, 64), np.uint8)
            if nbytes <= SCRATCH_KEEP_NBYTES:
                self._scratch[slot] = buf
        return buf[:nbytes].view(dtype)

    def is_peer_alive(self, peer):
        """Whether rank `peer` still runs, as far as this rank can tell (monitored_barrier
        asks): a rank of this node by its process, one of another node unless the board
        has it as lost."""
        if self.layout.node_of[peer] == self.node:
            return self.intra.is_peer_alive(self.layout.local_rank(peer))
        return not self.board.is_lost(peer)

    def who(self, rank=None):
        return self.layout.describe(self.rank if rank is None else rank)

    # -- framing -------------------------------------------------------------------------

    def run(self, name, fp, algo, *args, timeout_s=None, nbytes=0):
        """Sequence and run one collective (`algo(call, *args)`); fail it as a group."""
        self._usable(name)
        self._seq += 1
        call = Call(self, name, self._seq, (_CODE[name],) + tuple(fp),
                    self.timeout_s if timeout_s is None else float(timeout_s))
        entry = {"seq": call.seq, "op": name, "nbytes": nbytes, "state": "started",
                 "t_start": time.time(), "t_end": None}
        self.flight_record.append(entry)
        try:
            algo(call, *args)
        except BaseException as e:
            entry["state"], entry["t_end"] = "failed", time.time()
            error = self._failed(call, e)
            if error is e:
                raise
            raise error from e
        finally:
            self.position = None
        entry["state"], entry["t_end"] = "completed", time.time()

    def _await(self, call, pending):
        """Wait for a transport operation: its completion, our deadline, an abort, or a
        failure posted on the board by another rank, whichever comes first."""
        self._pending = pending
        try:
            slice_s = 0.005
            next_poll = time.monotonic() + faults.POLL_S
            while not (pending.wait(slice_s) and pending.done()):
                now = time.monotonic()
                if self._aborted:
                    raise GroupAbortedError(f"group {self.name!r} was aborted on rank "
                                            f"{self.rank}")
                if now >= call.deadline:
                    raise _Expired()
                if now >= next_poll:
                    failure = self.board.failure(wait_s=0.2)
                    if failure is not None:
                        raise _Remote(*failure)
                    next_poll = now + faults.POLL_S
                slice_s = min(slice_s * 2, faults.POLL_S, max(call.deadline - now, 1e-3))
            pending.result()
        finally:
            self._pending = None

    def watch(self, now):
        """Watchdog hook, for a collective that has run a while: wake this rank if another
        rank failed (a rank blocked in a shared-memory wait does not look at the board
        itself), and publish where this rank is once the collective is slow."""
        pos = self.position
        if pos is None:
            return
        seq, name, step, t0, report_s = pos
        if now - t0 >= faults.WATCH_AFTER_S and now >= self._next_watch:
            self._next_watch = now + faults.WATCH_EVERY_S
            if self.board.failure() is not None and self.position is pos:
                self.intra.abort()  # the engine wait raises; _failed reads the board
        if now - t0 < report_s or self._reported == (seq, step):
            return
        self._reported = (seq, step)
        self.board.where(seq, f"seq {seq} {name}: {step} (for {now - t0:.1f} s)")

    # -- failures ------------------------------------------------------------------------

    def _frame_mismatch(self, call, channel, member, row):
        other = self.layout.channel_members(self.local if channel is self.channel else 0)
        theirs = wire.header_of(row)
        mine = f"{self.who()} called {describe_fingerprint(call.fp)} at seq {call.seq}"
        if theirs is None:
            what = "sent something that is not a collective header"
        else:
            what = f"called {describe_fingerprint(theirs[1])} at seq {theirs[0]}"
        return CollectiveMismatchError(
            f"[Rank {self.rank}] {call.name} (seq {call.seq}): ranks on different nodes "
            f"called different collectives: {mine}, {self.who(other[member])} {what}")

    def _failed(self, call, e):
        """Poison the group on every rank; -> the error this rank raises."""
        prefix = f"[Rank {self.rank}] {call.name} (seq {call.seq})"
        where = f"in {call.step} on {self.who()}"
        remote = None
        if isinstance(e, _Remote):
            remote = e.args
        elif isinstance(e, GroupAbortedError) and not self._aborted:
            # our node's engine group was aborted by a local peer: the board says why
            remote = self.board.failure(wait_s=1.0) or ("GroupAbortedError|", str(e))
        if remote is not None:
            error = self._from_board(prefix, where, *remote)
            unnamed_loss = remote[0] == "PeerLostError|"
        else:
            error, peer = self._own_error(call, e, prefix, where)
            if error is None:  # not an Exception (KeyboardInterrupt...): still fail the group
                error, peer = ShmcollError(f"{prefix}: interrupted {where}"), None
            unnamed_loss = isinstance(e, wire.TransportError) and e.kind == "lost"
            if peer is not None:
                self.board.post_lost(peer, str(error))
            self.board.post(f"{type(error).__name__}|{'' if peer is None else peer}",
                            str(error))
        self._poison = self._poison or error
        self.board.ack(f"seq {call.seq} {call.name}: failed {where}")
        try:
            self.intra.abort()  # wake this node's ranks blocked in shared-memory waits
        except Exception:
            pass
        if unnamed_loss:
            error = self._poison = self._name_lost(prefix, where, e if remote is None else
                                                   remote[1])
        return error if isinstance(e, Exception) else e

    def _own_error(self, call, e, prefix, where):
        """(error, lost peer or None) for a failure that started on this rank."""
        if isinstance(e, CollectiveMismatchError):
            if str(e).startswith(prefix):
                return e, None
            return CollectiveMismatchError(
                f"{prefix}: ranks of {self.layout.describe_node(self.node)} disagree {where} "
                f"(the node's engine, local ranks: {e})"), None
        if isinstance(e, PeerLostError):
            peer = None if e.peer is None else self.layout.rank_of(self.node, e.peer)
            who = "a local peer" if peer is None else self.who(peer)
            return PeerLostError(f"{prefix}: {who} was lost {where} (the node's engine, "
                                 f"local ranks: {e})", peer=peer), peer
        if isinstance(e, (_Expired, CollectiveTimeoutError)) or \
                (isinstance(e, wire.TransportError) and e.kind == "timeout"):
            ms = int(round(call.timeout_s * 1000))
            detail = f" (the node's engine, local ranks: {e})" if \
                isinstance(e, CollectiveTimeoutError) else f" ({e})" if str(e) else ""
            self.board.where(call.seq, f"seq {call.seq} {call.name}: timed out {where}")
            return CollectiveTimeoutError(
                f"{prefix}: Timed out waiting {ms}ms {where}{detail}. Where each rank was: "
                f"{self.board.where_text(call.seq)}"), None
        if isinstance(e, wire.TransportError) and e.kind == "lost":
            return PeerLostError(f"{prefix}: lost a connection to another node {where} "
                                 f"({e})"), None
        if isinstance(e, wire.TransportError):
            return ShmcollError(f"{prefix}: inter-node step failed {where}: {e}"), None
        if isinstance(e, GroupAbortedError):
            return GroupAbortedError(f"{prefix}: the group was aborted on {self.who()} "
                                     f"{where}"), None
        if isinstance(e, Exception):
            return ShmcollError(f"{prefix}: failed {where}: {type(e).__name__}: {e}"), None
        return None, None

    def _from_board(self, prefix, where, kind, text):
        type_name, _, peer = kind.partition("|")
        cls = _ERRORS.get(type_name, ShmcollError)
        message = f"{prefix}: stopped {where} because the group failed on another rank: {text}"
        if cls is PeerLostError:
            return PeerLostError(message, peer=int(peer) if peer else None)
        return cls(message)

    def _name_lost(self, prefix, where, detail):
        """A connection between nodes closed: name the lost ranks. A rank on their node may
        have named one exactly (pidfd); otherwise the ranks that did not ack within
        CENSUS_S are the lost ones (a killed rank never does)."""
        missing = self.board.census(faults.CENSUS_S)
        exact = self.board.lost()
        if exact:
            peer, text = exact[0]
            return PeerLostError(f"{prefix}: stopped {where}: {text}", peer=peer)
        if not missing:
            return PeerLostError(f"{prefix}: {detail}; every rank answered afterwards")
        nodes = sorted({self.layout.node_of[r] for r in missing})
        gone = [self.layout.describe_node(n) for n in nodes
                if set(self.layout.nodes[n]) <= set(missing)]
        ranks = ", ".join(self.who(r) for r in missing)
        whole = f"; whole node lost: {', '.join(gone)}" if gone else ""
        return PeerLostError(f"{prefix}: lost {ranks} (no answer within {faults.CENSUS_S} s "
                             f"after a connection closed {where}){whole}; first report: "
                             f"{detail}", peer=missing[0])

    # -- lifecycle -----------------------------------------------------------------------

    def abort(self):
        """Wake a collective blocked in this group (any thread) and fail the group on every
        rank; later calls raise."""
        self._aborted = True
        pending = self._pending
        if pending is not None:
            pending.wake()
        try:
            self.intra.abort()
        except Exception:
            pass
        if self._poison is None:
            self._poison = GroupAbortedError(f"group {self.name!r} was aborted on "
                                             f"{self.who()}")
            self.board.post("GroupAbortedError|", str(self._poison))

    def close(self):
        """Release the node's engine group and the transport; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.position = None
        Watchdog.unregister(self)
        try:
            self.intra.close()
        finally:
            self.transport.close(abandon=self._poison is not None)
