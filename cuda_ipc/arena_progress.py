"""The DeviceArena's progress and failure: what the host reads of its stream's progress
(done, is_done), which peers' words hold the stream at a chunk (short_peers), the error for
a peer that can never release it (peer_failure), the guard inline (simulated) streams wait
with (_guard), and the release values stored after a failure (release_all).

`ProgressMixin` is a part of arena.DeviceArena (it uses the arena's flag-word addresses
_mine, _ready, _done, its _released flag, its host protocol.Arena, rank, nslots, issued and
_peers(); the words and rules are in arena.py's docstring). Its readers are the watchdog
(watchdog.py) and DeviceWork (work.py); of the chunk protocol, claim and collect use
_guard for inline streams.
"""

import time

from shmcoll.errors import CollectiveTimeoutError, GroupAbortedError, PeerLostError
from shmcoll.protocol import STATE_ABORTED, STATE_CLOSED

from .device import at_or_past, read_word, word_add, write_word

__all__ = ["ProgressMixin"]


class ProgressMixin:
    """Progress and failure of arena.DeviceArena (see the module docstring)."""

    def done(self):
        """The last chunk my stream finished (host read of my MINE word)."""
        return read_word(self._mine)

    def is_done(self, g):
        """Whether my stream finished chunk g (True once the arena is closed: close drains
        the stream or fails the group first)."""
        return self._released or at_or_past(self.done(), g)

    def short_peers(self, g):
        """Peers whose words hold my stream at chunk g (READY < g, or DONE < g - nslots)."""
        short = []
        for p in self._peers():
            if not at_or_past(read_word(self._ready[p]), g) or (
                    self.issued > self.nslots and
                    not at_or_past(read_word(self._done[p]), word_add(g, -self.nslots))):
                short.append(p)
        return short

    def peer_failure(self, peers, name, seq):
        """The error for a wait on `peers` that one of them can never satisfy, or None."""
        for p in peers:
            state = self._host.peer_states()[p][3]
            if state == STATE_CLOSED or not self._host.is_peer_alive(p):
                what = "closed the group" if state == STATE_CLOSED else "exited"
                return PeerLostError(
                    f"{name} (cuda): rank {p} {what} while rank {self.rank}'s stream waited "
                    f"for it at seq {seq}; this group is unusable, create a new one", peer=p)
        for p in peers:
            if self._host.peer_states()[p][3] == STATE_ABORTED:
                return GroupAbortedError(
                    f"{name} (cuda): rank {p} aborted the group while rank {self.rank}'s "
                    f"stream waited for it at seq {seq}; this group is unusable, create a new one")
        return None

    def _guard(self, peer, addr, target):
        """For inline streams (sim): raise instead of spinning past the deadline or on a
        lost peer; real streams are watched by the watchdog instead."""
        host = self._host
        name, seq = host._op_name, host._seq
        deadline = time.monotonic() + host._timeout_s

        def guard():
            err = self.peer_failure([peer], name, seq)
            if err is not None:
                raise err
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(
                    f"[Rank {self.rank}] {name} (cuda, seq {seq}): Timed out waiting "
                    f"{int(round(host._timeout_s * 1000))}ms for rank {peer} (its flag is at "
                    f"{read_word(addr)}, the stream needs {target})")
        return guard

    def release_all(self, ready_target, done_target):
        """Store release values into my inbox words, which my stream may wait on (after a
        failure): its waits pass, it drains, and the device stays usable."""
        for p in self._peers():
            write_word(self._ready[p], ready_target)
            write_word(self._done[p], done_target)
