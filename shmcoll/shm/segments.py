"""POSIX shared-memory segments: naming, create/attach/verify/unlink, liveness and stale-segment GC.

Lifecycle of one group (every rank does the same; keys live under the group's store prefix):

    rank 0   token = 16 random bytes -> store["shmcoll/<gen>/token"]; the others wait for it
             (a torch group on one node skips that wait: its ranks read a fresh random token
             in node discovery's first round, hier/nodes.py, and rank 0 stores that one)
    rank r   create '/shmcoll-<uid>-<token>-<r>-<pid>'  O_CREAT|O_EXCL, mode 0600,
             posix_fallocate(region nbytes)  -> ENOSPC here, never SIGBUS later
             write header (protocol.write_header) -> store["shmcoll/<gen>/seg/<r>"] = name
    rank r   attach every peer: open, fstat (owner uid, no group/other bits, exact size),
             mmap, check magic/version/token/world_size/rank/geometry
    rank r   store["shmcoll/<gen>/attached/<r>"]; wait for every peer's; unlink own name

From then on no name exists: a crash or SIGKILL of any or all ranks cannot leak a segment (the
kernel frees the memory with the last mapping). The only window is between create and unlink;
gc_stale() removes segments of ours whose owner pid (encoded in the name) is dead.

`gen` is a per-rank counter in the store (store.add), so a group re-created on the same store
never reads the previous group's token. The token makes names unguessable; owner uid, mode
and the header token are checked on attach, so another job's or user's segment is refused.
"""

import errno
import mmap
import os
import secrets
import select
import time

import numpy as np
import posix_ipc

from .. import protocol
from ..native import single_copy as single_copy_mod
from ..errors import SegmentError
from ..engine.init_phases import phase

__all__ = ["ShmRegions", "segment_prefix", "gc_stale", "PidLiveness"]

NAME_PREFIX = "shmcoll"  # full name '/shmcoll-<uid>-<32 hex>-<rank>-<pid>' is < 80 chars (NAME_MAX 255)


def segment_prefix():
    """Name prefix of this user's segments (as listed in /dev/shm, without the slash)."""
    return f"{NAME_PREFIX}-{os.geteuid()}-"


def _store_get(store, key):
    value = store.get(key)
    return value.decode() if isinstance(value, bytes) else str(value)


def wait_key(store, key, deadline, timeout_s, who, pid=None):
    """store.get(key), but give up when `pid` (the rank we wait for) exits or the group
    timeout passes, instead of blocking for the store's own timeout.

    Needs store.check([key]) (c10d stores and shmcoll.FileStore have it); without it this is
    a plain blocking get.
    """
    check = getattr(store, "check", None)
    if check is None:
        return _store_get(store, key)
    fd = None
    if pid is not None:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise SegmentError(f"rendezvous: {who} exited before the group was set up") from None
        except OSError:
            fd = None  # no pidfds here: fall back to kill(pid, 0)
    try:
        delay = 1e-4
        while not check([key]):
            gone = select.select([fd], [], [], 0)[0] if fd is not None else \
                (pid is not None and not _pid_exists(pid))
            if gone:
                raise SegmentError(f"rendezvous: {who} exited before the group was set up")
            if time.monotonic() > deadline:
                raise SegmentError(f"rendezvous: timed out after {timeout_s} s waiting for {who} "
                                   f"(store key {key!r})")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
        return _store_get(store, key)
    finally:
        if fd is not None:
            os.close(fd)


def gc_stale(shm_dir="/dev/shm"):
    """Unlink this user's segments whose owner process is gone; returns the names removed."""
    removed = []
    try:
        entries = os.listdir(shm_dir)
    except OSError:
        return removed
    prefix = segment_prefix()
    for entry in entries:
        if not entry.startswith(prefix):
            continue
        try:
            pid = int(entry.rsplit("-", 1)[1])
        except (IndexError, ValueError):
            continue
        if pid == os.getpid() or _pid_exists(pid):
            continue
        try:
            posix_ipc.unlink_shared_memory("/" + entry)
            removed.append(entry)
        except posix_ipc.ExistentialError:
            pass
    return removed


def _pid_exists(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PidLiveness:
    """Peer liveness through pidfds: a pidfd polls readable once the process has exited
    (zombies included, unlike kill(pid, 0)); pid reuse cannot fool it."""

    def __init__(self, pids):
        self._pids = list(pids)
        self._fds = {}
        for r, pid in enumerate(self._pids):
            if pid == os.getpid():
                continue
            try:
                self._fds[r] = os.pidfd_open(pid)
            except OSError:
                self._fds[r] = None  # e.g. another pid namespace: fall back to kill(pid, 0)

    def __call__(self, peer):
        if peer not in self._fds:
            return True
        fd = self._fds[peer]
        if fd is None:
            return _pid_exists(self._pids[peer])
        return not select.select([fd], [], [], 0)[0]

    def close(self):
        for fd in self._fds.values():
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fds = {}


class ShmRegions:
    """The mapped regions of one group: mine (created) and every peer's (attached)."""

    def __init__(self, store, rank, world_size, layout, timeout_s, shm_dir="/dev/shm",
                 single_copy="auto", small_pages=False, token=None):
        self.rank = rank
        self.world_size = world_size
        self.layout = layout
        self.regions = [None] * world_size
        self.pids = [0] * world_size
        self._maps = []
        self._my_name = None
        self._unlinked = False
        # single_copy.CMA when every rank can read every peer's memory (process_vm_readv),
        # else single_copy.NONE; the same on every rank (agreed in the rendezvous).
        self.single_copy = single_copy_mod.NONE
        self._want_single_copy = single_copy != "off"
        # Whether any rank's buffers are likely on 4 KiB pages (pages.py): agreed likewise,
        # since it steers algorithm choice, which must be the same on every rank.
        self.small_pages = bool(small_pages)
        try:
            self._rendezvous(store, timeout_s, shm_dir, token)
        except BaseException:
            self.close()
            raise

    def _rendezvous(self, store, timeout_s, shm_dir, token_hex=None):
        """`token_hex`: the group token, when the ranks already share one (node
        discovery's); else rank 0 makes it and the others wait for it in a store round."""
        deadline = time.monotonic() + timeout_s
        with phase("segments: token"):
            gen = store.add(f"shmcoll/gen/{self.rank}", 1)
            base = f"shmcoll/{gen}"
            if self.rank == 0:  # set when given too: the store names every group's token
                store.set(f"{base}/token", token_hex or secrets.token_hex(16))
            if token_hex is None:
                token_hex = wait_key(store, f"{base}/token", deadline, timeout_s,
                                      "rank 0's group token")
        if len(token_hex) != 32:
            raise SegmentError(f"rendezvous: malformed group token {token_hex!r} in the store")
        with phase("segments: gc_stale"):
            gc_stale(shm_dir)
        token = bytes.fromhex(token_hex)
        self._my_name = f"/{segment_prefix()}{token_hex}-{self.rank}-{os.getpid()}"
        with phase("segments: create"):
            self.regions[self.rank] = self._create(self._my_name, token)
        self.pids[self.rank] = os.getpid()
        store.set(f"{base}/seg/{self.rank}", self._my_name)
        with phase("segments: attach peers"):
            for peer in range(self.world_size):
                if peer != self.rank:
                    name = wait_key(store, f"{base}/seg/{peer}", deadline, timeout_s,
                                     f"rank {peer}'s segment")
                    self.regions[peer], self.pids[peer] = self._attach(name, token, peer)
        # NOTE: order matters: unlink only after every peer has attached, or a slow peer
        # would find no segment; after this point nothing can leak.
        # The value says whether I can read every peer's memory ("2") or not ("1"): the
        # group goes single-copy only if every rank can (ptrace access is not symmetric);
        # an "s" after it: my buffers are likely on small pages.
        with phase("segments: single-copy probe"):
            can = self._want_single_copy and all(
                self._probe(peer) for peer in range(self.world_size) if peer != self.rank)
        store.set(f"{base}/attached/{self.rank}",
                  ("2" if can else "1") + ("s" if self.small_pages else ""))
        with phase("segments: wait attached"):
            for peer in range(self.world_size):
                if peer != self.rank:
                    # A rank killed during init must not leave its peers waiting for the
                    # store's timeout: the wait ends as soon as its pid exits.
                    value = wait_key(store, f"{base}/attached/{peer}", deadline, timeout_s,
                                      f"rank {peer} (pid {self.pids[peer]})",
                                      pid=self.pids[peer])
                    can = can and value.startswith("2")
                    self.small_pages = self.small_pages or value.endswith("s")
        self.single_copy = single_copy_mod.CMA if can else single_copy_mod.NONE
        self.unlink()

    def _probe(self, peer):
        """Whether process_vm_readv can read `peer`'s memory: its header, read through the
        address the peer mapped it at, must equal the header we see in shared memory."""
        region = self.regions[peer]
        addr = protocol.read_header(region)["map_addr"]
        return addr != 0 and single_copy_mod.probe(self.pids[peer], addr,
                                                   region[:protocol.HEADER_PROBE_NBYTES])

    def _create(self, name, token):
        nbytes = self.layout.nbytes
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)
        except posix_ipc.ExistentialError:
            raise SegmentError(f"create {name!r}: already exists (token collision?)") from None
        except OSError as e:
            raise SegmentError(f"create {name!r}: {e}") from e
        try:
            os.fchmod(shm.fd, 0o600)  # shm_open applies the umask; make the mode exact
            try:
                # Reserve the pages now: a full /dev/shm fails here, not with SIGBUS later.
                os.posix_fallocate(shm.fd, 0, nbytes)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    raise SegmentError(
                        f"create {name!r}: cannot reserve {nbytes} bytes in /dev/shm ({e.strerror}); "
                        f"/dev/shm is too small for {self.world_size} ranks x {nbytes} bytes. "
                        f"Remedy: run the container with --shm-size=1g (or --ipc=host), or lower "
                        f"SHMCOLL_SLOT_BYTES (now {self.layout.slot_nbytes})") from None
                raise SegmentError(f"create {name!r}: posix_fallocate failed: {e}") from e
            mm = mmap.mmap(shm.fd, nbytes)
        except BaseException:
            shm.close_fd()
            posix_ipc.unlink_shared_memory(name)
            raise
        shm.close_fd()
        self._maps.append(mm)
        region = np.frombuffer(mm, np.uint8)
        protocol.write_header(region, self.layout, token, self.world_size, self.rank, os.getpid())
        return region

    def _attach(self, name, token, peer):
        if not name.startswith("/" + segment_prefix()):
            raise SegmentError(f"attach {name!r}: not a segment of this user (rank {peer})")
        try:
            shm = posix_ipc.SharedMemory(name, 0)
        except posix_ipc.ExistentialError:
            raise SegmentError(
                f"attach {name!r}: rank {peer}'s segment does not exist (it exited, or a stale "
                f"store from an earlier run?)") from None
        try:
            st = os.fstat(shm.fd)
            if st.st_uid != os.geteuid():
                raise SegmentError(f"attach {name!r}: owned by uid {st.st_uid}, expected {os.geteuid()}")
            if st.st_mode & 0o077:
                raise SegmentError(f"attach {name!r}: mode {st.st_mode & 0o777:o} is open to "
                                   f"group/other (expected 600)")
            if st.st_size != self.layout.nbytes:
                raise SegmentError(f"attach {name!r}: expected {self.layout.nbytes} bytes, found "
                                   f"{st.st_size} (different SHMCOLL_SLOT_BYTES on rank {peer}?)")
            mm = mmap.mmap(shm.fd, self.layout.nbytes)
        finally:
            shm.close_fd()
        self._maps.append(mm)
        region = np.frombuffer(mm, np.uint8)
        self._verify_header(name, region, token, peer)
        pid = protocol.read_header(region)["pid"]
        # The owner pid is used for liveness (pidfd) and stale-segment GC: it must be the
        # pid its name was created with, not whatever the header claims.
        if name.rsplit("-", 1)[-1] != str(pid):
            raise SegmentError(f"attach {name!r}: header pid {pid} does not match the name "
                               f"(stale or foreign segment)")
        return region, pid

    def _verify_header(self, name, region, token, peer):
        h = protocol.read_header(region)
        expected = {"magic": protocol.MAGIC, "version": protocol.LAYOUT_VERSION, "token": token,
                    "world_size": self.world_size, "rank": peer, "nbytes": self.layout.nbytes,
                    "slot_nbytes": self.layout.slot_nbytes, "nslots": self.layout.nslots,
                    "p2p_cells": self.layout.p2p_cells,
                    "p2p_cell_nbytes": self.layout.p2p_cell_nbytes}
        for field, want in expected.items():
            if h[field] != want:
                raise SegmentError(f"attach {name!r}: header {field} is {h[field]!r}, expected "
                                   f"{want!r} (stale or foreign segment)")
        if h["pid"] <= 0:
            raise SegmentError(f"attach {name!r}: header pid {h['pid']} is invalid")

    def unlink(self):
        """Remove my segment's name (the mappings stay valid); idempotent."""
        if self._my_name and not self._unlinked:
            self._unlinked = True
            try:
                posix_ipc.unlink_shared_memory(self._my_name)
            except posix_ipc.ExistentialError:
                pass

    def close(self):
        """Unlink (if still named) and unmap everything; idempotent, safe after a partial init."""
        first = None
        try:
            self.unlink()
        except Exception as e:  # keep going: unmapping matters more
            first = e
        self.regions = [None] * self.world_size
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:
                pass  # a numpy view is still alive; the mapping goes with the last view
            except Exception as e:
                first = first or e
        self._maps = []
        if first is not None:
            raise first
