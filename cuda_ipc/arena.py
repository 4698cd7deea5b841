"""DeviceArena: per-rank device slots, the flag words that order them, and the tier.

Vocabulary as in shmcoll/protocol/__init__.py, on a device: a *slot* is one of a rank's device
buffers (or, in the host tier, one of the data slots of its host region); a *chunk* is the
part of a collective that fits a slot; chunks are numbered g = 1, 2, ... in issue order,
the same on every rank (chunk counts derive from fingerprint-checked arguments), and chunk
g uses slot g % nslots.

Layout of rank r's host region (a shm.ShmRegions segment of layout RegionLayout(slot,
nslots)): the header as everywhere, then the control block, whose 8-byte words here hold
32-bit flags (device.write_value / wait_value):

    word 0              MINE       g once my stream finished chunk g (written by my stream,
                                   read by my host: watchdog, Work.is_completed)
    word 16             CLOSED     1 once I closed my mappings of the peers' memory (host)
    word 32 + p         READY[p]   g once rank p's chunk g is in p's slot (written by p's
                                   stream into my region; waited on by my stream)
    word 32 + W + p     DONE[p]    g once rank p finished reading every slot for chunk g
    data                nslots host slots (host tier only; 64-byte stubs otherwise)

Rules, per chunk g (every rank, every chunk, in order, all on the caller's stream):
1. claim: before writing my slot for chunk g, wait until my DONE[p] >= g - nslots for every
   peer p (they finished reading that slot's previous contents). Skipped for the first
   nslots chunks.
2. write my slot, then publish: READY[me] := g in every peer's region.
3. collect: wait until my READY[p] >= g for every peer p; only then read their slots.
4. after the last read of chunk g: release: DONE[me] := g in every peer's region, and
   MINE := g in mine.
A rank's stream waits only on words of its own region, and only its own host ever stores
into them besides the peers' streams: after a failure the watchdog stores release values
there (never into another rank's memory), so a stalled stream can always be let go.
Every rank publishes and releases every chunk, also when it has nothing to write or read
(a broadcast's non-roots), so the words move in lock step and waits stay `>=` on counters
that only grow (cyclically, see device.py). No wait is ever satisfied by a value from a
previous use of the same slot: a word reaches g only after chunk g's own step.

The host orders the ranks once per collective (shmcoll's Arena: post, wait, fingerprint
check) before any of this is enqueued, so a mismatch is reported before data moves and no
stream ever waits for a chunk that a peer will not issue. Stream waits that a dead or
stuck peer never satisfies are found by the watchdog (watchdog.py), which fails the group
and stores release values into the words, so no stream is left waiting.

Tiers (tiers.py chooses, every rank agrees): same_gpu and p2p read peers' device slots
through CUDA IPC mappings; host keeps the slots in the host regions, registered with the
device, and the kernels read peers' slots across PCIe.

The class's sections: setup; the chunk protocol (rules 1-4); progress and failure (what
the host reads of the words: done, is_done; which peers' words hold the stream at a chunk;
the error for a peer that can never release it; the guard inline (simulated) streams wait
with; the release values stored after a failure; read by the watchdog and DeviceWork);
lifecycle.
"""

import logging
import secrets
import time

import numpy as np

from shmcoll.errors import CollectiveTimeoutError, GroupAbortedError, PeerLostError
from shmcoll.protocol import CTRL_LINES, LINE_NBYTES, STATE_ABORTED, STATE_CLOSED, RegionLayout

from . import tiers
from .device import DeviceError, Mapping, at_or_past, read_word, word_add, write_word
from .watchdog import Watchdog

__all__ = ["DeviceArena", "MAX_WORLD_SIZE"]

log = logging.getLogger("shmcoll.cuda_ipc")

_W_MINE, _W_CLOSED, _W_INBOX = 0, 16, 32  # word indices in the control block (see above)
MAX_WORLD_SIZE = (CTRL_LINES * LINE_NBYTES // 8 - _W_INBOX) // 2  # READY and DONE per peer
PROBE_NBYTES = 32  # token (16 B) + rank (8 B) + pad, written at the start of slot 0
_STUB_SLOT_NBYTES = 64  # host regions of the IPC tiers carry flags only
_SHARED = "shared"  # Mapping.owner of a peer thread's allocation (nothing to close)
_kept = []  # host regions a busy stream may still read (never unmapped)


class DeviceArena:
    """The device half of one group: slots, flags, tier, watchdog (see module docstring).

    `host`: the group's shmcoll protocol.Arena (liveness, peer STATE, abort). `group`: its
    shmcoll Group (poisoned by the watchdog on a failure). Built by every rank of the group
    at the same collective (DeviceGroup makes the first CUDA collective a fingerprinted
    setup step), so the rendezvous cannot meet a rank that is doing something else.
    """

    def __init__(self, group, dev, rendezvous, slot_nbytes, nslots, host_slot_nbytes,
                 tier="auto"):
        self.group = group
        self.dev = dev
        self.rank = group.rank
        self.world_size = group.world_size
        self.nslots = int(nslots)
        self._inline = dev.inline  # waits run on this thread: they need guards (sim)
        self._host = group._arena
        self._rv = rendezvous
        self._alloc = None
        self._mappings = []
        self._regions = None
        self._registered = []
        self._closed = False
        self._released = False
        self._waiters = {}  # other streams that wait on my MINE word (Work.wait)
        self.issued = 0  # chunks issued so far (unbounded); chunk id g = issued & WORD_MASK
        self.watchdog = None
        try:
            self._setup(slot_nbytes, host_slot_nbytes, tier)
        except BaseException:
            self.close()
            raise

    # -- setup -----------------------------------------------------------------------------

    def _setup(self, slot_nbytes, host_slot_nbytes, forced):
        rv, dev = self._rv, self.dev
        if self.world_size > MAX_WORLD_SIZE:
            raise DeviceError(f"cuda_ipc: device groups have at most {MAX_WORLD_SIZE} ranks "
                              f"(this one has {self.world_size})")
        infos = [tiers.DeviceInfo.parse(s) for s in rv.all_gather(
            "device", tiers.DeviceInfo.of(dev).render())]
        want_ipc = tiers.wants_ipc(infos, self.rank, dev, forced)
        if rv.in_process:  # rank threads: the peers' allocations themselves, no IPC
            if want_ipc:
                self._alloc = dev.alloc(self.nslots * slot_nbytes)
            allocs = rv.share("slots", self._alloc)
            ok = want_ipc and all(a is not None for a in allocs)
            self._mappings = [None if p == self.rank or a is None else
                              Mapping(a.ptr, a.nbytes, a.tensor, owner=_SHARED)
                              for p, a in enumerate(allocs)]
        else:
            token = secrets.token_hex(16)
            handle = ""
            if want_ipc:
                self._alloc = dev.alloc(self.nslots * slot_nbytes)
                self._write_probe(token)
                handle = f"{token}:{dev.export(self._alloc).hex()}"
            handles = rv.all_gather("handle", handle)
            ok = want_ipc and all(handles) and self._open_peers(handles, slot_nbytes)
        votes = rv.all_gather("probe", "1" if ok else "0")
        self.tier = tiers.choose(infos, [v == "1" for v in votes], forced)
        if self.tier == tiers.HOST:
            for m in self._mappings:
                if m is not None and m.owner is not _SHARED:
                    dev.close_mapping(m)
            self._mappings = []
            if self._alloc is not None:
                dev.free(self._alloc)
                self._alloc = None
        elif self._alloc is not None:
            dev.seal(self._alloc)  # every peer opened it (they voted after opening)
        self.slot_nbytes = host_slot_nbytes if self.tier == tiers.HOST else slot_nbytes
        layout = RegionLayout(self.slot_nbytes if self.tier == tiers.HOST
                              else _STUB_SLOT_NBYTES, self.nslots, self.world_size)
        self._regions = rv.host_regions(layout)
        self._map_host(layout)
        self.watchdog = Watchdog(self)
        log.debug("cuda_ipc group %r rank %d: tier %s (%s), %d slots of %d bytes",
                  self.group.name, self.rank, self.tier, dev.describe(), self.nslots,
                  self.slot_nbytes)

    def _write_probe(self, token):
        pattern = np.zeros(PROBE_NBYTES, np.uint8)
        pattern[:16] = np.frombuffer(bytes.fromhex(token), np.uint8)
        pattern[16:24] = np.frombuffer(np.int64(self.rank).tobytes(), np.uint8)
        self.dev.write_bytes(self._alloc.tensor[:PROBE_NBYTES], pattern)

    def _open_peers(self, handles, slot_nbytes):
        """Open every peer's slots and check its probe pattern; False if any fails."""
        nbytes = self.nslots * slot_nbytes
        self._mappings = [None] * self.world_size
        for peer, text in enumerate(handles):
            if peer == self.rank:
                continue
            token, hexhandle = text.split(":", 1)
            try:
                m = self.dev.open(bytes.fromhex(hexhandle), nbytes)
            except DeviceError as e:
                log.info("cuda_ipc: rank %d cannot open rank %d's memory (%s); the group "
                         "stages through host memory", self.rank, peer, e)
                return False
            self._mappings[peer] = m
            seen = self.dev.read_bytes(m.tensor[:PROBE_NBYTES], self._rv_timeout())
            want = bytes.fromhex(token) + np.int64(peer).tobytes()
            if seen[:24] != want:
                log.info("cuda_ipc: rank %d read a wrong probe from rank %d's memory; the "
                         "group stages through host memory", self.rank, peer)
                return False
        return True

    def _rv_timeout(self):
        return max(1.0, self.group.timeout_s)

    def _map_host(self, layout):
        """Register every rank's host region with the device; word and slot addresses."""
        regions = self._regions.regions
        span = layout.nbytes if self.tier == tiers.HOST else layout.data_offset
        bases = []
        for region in regions:
            view = region[:span]
            bases.append(self.dev.register_host(view))
            self._registered.append(view)
        ctrl, world, me = layout.ctrl_offset, self.world_size, self.rank

        def host(r, word):
            return regions[r].ctypes.data + ctrl + word * 8

        def dev(r, word):
            return bases[r] + ctrl + word * 8
        self._mine, self._mine_dev = host(me, _W_MINE), dev(me, _W_MINE)
        self._closed_words = [host(r, _W_CLOSED) for r in range(world)]
        # my inbox (host addresses, for the watchdog; device addresses, for my waits)
        self._ready = [host(me, _W_INBOX + p) for p in range(world)]
        self._done = [host(me, _W_INBOX + world + p) for p in range(world)]
        self._ready_dev = [dev(me, _W_INBOX + p) for p in range(world)]
        self._done_dev = [dev(me, _W_INBOX + world + p) for p in range(world)]
        # my words in the peers' inboxes (device addresses, for my stream's writes)
        self._ready_out = [dev(p, _W_INBOX + me) for p in self._peers()]
        self._done_out = [dev(p, _W_INBOX + world + me) for p in self._peers()]
        if self.tier == tiers.HOST:
            self._slot_bufs = [self.dev.host_tensor(view, base)[layout.data_offset:]
                               for view, base in zip(self._registered, bases)]
        else:
            self._slot_bufs = [self._alloc.tensor if p == self.rank else self._mappings[p].tensor
                               for p in range(self.world_size)]

    # -- chunk protocol --------------------------------------------------------------------

    def next_chunk(self):
        """Issue the next chunk id (the same sequence on every rank)."""
        self.issued += 1
        return self.issued & 0xFFFFFFFF

    def slot(self, g, rank):
        """Rank `rank`'s slot for chunk g (uint8 tensor of slot_nbytes)."""
        i = g % self.nslots
        return self._slot_bufs[rank][i * self.slot_nbytes:(i + 1) * self.slot_nbytes]

    def claim(self, stream, g):
        """Rule 1: my stream waits until every peer finished reading this slot's last use."""
        if self.issued > self.nslots:
            prev = word_add(g, -self.nslots)
            for p in self._peers():
                self.dev.wait_value(stream, self._done_dev[p], prev,
                                    self._guard(p, self._done[p], prev) if self._inline
                                    else None)

    def publish(self, stream, g):
        """Rule 2: READY[me] := g in every peer's inbox."""
        for addr in self._ready_out:
            self.dev.write_value(stream, addr, g)

    def collect(self, stream, g):
        """Rule 3: my stream waits until every peer's chunk g is in its slot."""
        for p in self._peers():
            self.dev.wait_value(stream, self._ready_dev[p], g,
                                self._guard(p, self._ready[p], g) if self._inline else None)

    def release(self, stream, g):
        """Rule 4: DONE[me] := g in every peer's inbox, then MINE := g."""
        for addr in self._done_out:
            self.dev.write_value(stream, addr, g)
        self.dev.write_value(stream, self._mine_dev, g)

    def stream_wait_done(self, stream, g):
        """Make `stream` (another stream of this rank) wait until mine finished chunk g.
        Nothing to do once the arena is closed (it drained; the word is unmapped). The
        stream is remembered: close() lets it execute the wait before unmapping the word."""
        if self._released or self._closed:
            return
        self._waiters[getattr(stream, "cuda_stream", id(stream))] = stream
        self.dev.wait_value(stream, self._mine_dev, g, None)

    def part_nbytes(self):
        """Bytes of one of world_size equal parts of a slot (16-byte aligned, so a part
        viewed as any dtype stays aligned)."""
        return (self.slot_nbytes // self.world_size) // 16 * 16

    def _peers(self):
        return (p for p in range(self.world_size) if p != self.rank)

    # -- progress and failure (read by the watchdog and DeviceWork) ------------------------

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
        frame = self._host.frame  # the host collective in progress
        name, seq = frame.name, frame.seq
        deadline = time.monotonic() + frame.timeout_s

        def guard():
            err = self.peer_failure([peer], name, seq)
            if err is not None:
                raise err
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(
                    f"[Rank {self.rank}] {name} (cuda, seq {seq}): Timed out waiting "
                    f"{int(round(frame.timeout_s * 1000))}ms for rank {peer} (its flag is at "
                    f"{read_word(addr)}, the stream needs {target})")
        return guard

    def release_all(self, ready_target, done_target):
        """Store release values into my inbox words, which my stream may wait on (after a
        failure): its waits pass, it drains, and the device stays usable."""
        for p in self._peers():
            write_word(self._ready[p], ready_target)
            write_word(self._done[p], done_target)

    # -- lifecycle -------------------------------------------------------------------------

    def abort(self):
        """Fail outstanding device work (group.abort): the stream is released, not waited for."""
        if self.watchdog is not None:
            self.watchdog.abort(GroupAbortedError(
                f"cuda_ipc group {self.group.name!r} was aborted on rank {self.rank}"))

    def close(self, timeout_s=10.0):
        """Drain, unmap peers, wait until the peers unmapped mine, free; idempotent.

        NOTE: order matters: freeing memory a peer still has mapped is undefined behaviour
        in CUDA, so my allocation is freed only after every live peer said CLOSED."""
        if self._closed:
            return
        self._closed = True
        first = None
        deadline = time.monotonic() + timeout_s
        if self.watchdog is not None:
            exited, first = self.watchdog.stop(deadline)
            if not exited:  # it still reads the flag words: leave every mapping in place
                log.error("cuda_ipc group %r rank %d: the watchdog did not stop; its memory "
                          "stays mapped until the process exits", self.group.name, self.rank)
                return
        for m in self._mappings:
            if m is not None and m.owner is not _SHARED:
                try:
                    self.dev.close_mapping(m)
                except Exception as e:
                    first = first or e
        self._mappings = []
        if self._regions is not None:
            write_word(self._closed_words[self.rank], 1)
            for p in self._peers():
                while not read_word(self._closed_words[p]) and self._host.is_peer_alive(p) \
                        and time.monotonic() < deadline:
                    time.sleep(1e-3)
        if self._alloc is not None:
            try:
                self.dev.free(self._alloc)
            except Exception as e:
                first = first or e
            self._alloc = None
        # NOTE: order matters: a stream that Work.wait() made wait on my MINE word reads it
        # when it gets there; unmapping the word first would be a device page fault.
        if self._waiters and not self.dev.streams_idle(list(self._waiters.values()),
                                                       max(deadline, time.monotonic() + 1.0)):
            log.error("cuda_ipc group %r rank %d: a stream that waits on this group's flags "
                      "is still busy; its flag words stay mapped until the process exits",
                      self.group.name, self.rank)
            _kept.append((self._regions, self._registered))
            self._registered, self._regions = [], None
        self._waiters = {}
        for view in self._registered:
            try:
                self.dev.unregister_host(view)
            except Exception as e:
                first = first or e
        self._registered = []
        self._slot_bufs = []
        if self._regions is not None:
            try:
                self._regions.close()
            except Exception as e:
                first = first or e
            self._regions = None
        # Break the reference cycles (watchdog <-> arena <-> group) now, so the host
        # regions are unmapped at once rather than whenever the cyclic GC runs.
        if self.watchdog is not None:
            self.watchdog.detach()
        self._host = None
        self._released = True  # the words are unmapped: is_done must not read them
        if first is not None and not isinstance(first, (PeerLostError, GroupAbortedError,
                                                        CollectiveTimeoutError)):
            raise first
