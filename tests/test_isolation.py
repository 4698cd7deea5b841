"""Isolation and security of the shared-memory segments.

Two jobs on one machine never see each other's segments; segments are private (0600, our
uid, unlinked once attached, memory reserved); an attacher refuses anything that is not
exactly the segment it expects; values read from peers' memory (fingerprints, size tables)
are input, checked before use, never trusted as lengths.
"""

import os

import numpy as np
import posix_ipc
import pytest

from _ranks import Job

from shmcoll import protocol
from shmcoll.shm import segments as shm
from shmcoll.algorithms.all_to_all import all_to_all_direct
from shmcoll.errors import CollectiveMismatchError, SegmentError
from shmcoll.engine.group import describe_fingerprint


# ========================================================= two concurrent jobs, live segments

@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_concurrent_jobs_never_see_each_others_segments(tmp_path):
    """Guards: two jobs running at the same time on different stores get different group
    tokens, each rank maps exactly its own group's segments (never the other job's), the
    results are the job's own, and the live segments are private: mode 0600, our uid, not
    reachable by name (unlinked after attach), with all their pages allocated."""
    ws = 2
    jobs = {"a": Job("isolated", ws, tmp_path / "a", args={"base": 1000, "iters": 300}),
            "b": Job("isolated", ws, tmp_path / "b", args={"base": 5_000_000, "iters": 300})}
    try:
        mapped = {k: j.all_ranks("mapped", timeout_s=180) for k, j in jobs.items()}
        tokens = {}
        for k, evs in mapped.items():
            job_tokens = {e["token"] for e in evs.values()}
            assert len(job_tokens) == 1, job_tokens  # one group
            tokens[k] = job_tokens.pop()
            for r, e in evs.items():
                assert e["bad"] == 0, e  # every result was this job's own sum
                paths = set(e["maps"].values())
                assert len(paths) == ws, e  # its own segment and its peer's
                for path in paths:
                    assert tokens[k] in path, (k, r, path)
                # inspect the live mappings through /proc (root or same uid can)
                for rng, path in e["maps"].items():
                    st = os.stat(f"/proc/{e['pid']}/map_files/{rng}")
                    assert st.st_mode & 0o777 == 0o600, (path, oct(st.st_mode))
                    assert st.st_uid == os.geteuid()
                    assert st.st_nlink == 0, path  # unlinked: nobody can open it by name
                    assert st.st_blocks * 512 >= st.st_size, path  # reserved up front
                    assert not os.path.exists(path), path
        assert tokens["a"] != tokens["b"]
        for k, evs in mapped.items():
            other = tokens["b" if k == "a" else "a"]
            for e in evs.values():
                assert not any(other in p for p in e["maps"].values())
        for j in jobs.values():
            for r in range(ws):
                j.send(r)
        for j in jobs.values():
            assert set(j.join(60).values()) == {0}
    finally:
        for j in jobs.values():
            j.__exit__(None, None, None)


# ================================================================ attach refuses bad segments

LAYOUT = protocol.RegionLayout(64 << 10, 2, 2)


def _regions(rank):
    r = shm.ShmRegions.__new__(shm.ShmRegions)
    r.rank, r.world_size, r.layout = rank, 2, LAYOUT
    r.regions, r.pids, r._maps, r._unlinked, r._my_name = [None, None], [0, 0], [], False, None
    return r


def _tamper_header(region, offset, value):
    region[offset:offset + 8].view(np.uint64)[0] = value


BAD = {
    # name: (how to spoil the segment, what the error says)
    "wrong_owner": ("chown", "owned by uid"),
    "group_readable": ("chmod640", "open to group/other"),
    "world_readable": ("chmod604", "open to group/other"),
    "too_big": ("truncate+", "expected"),
    "too_small": ("truncate-", "expected"),
    "wrong_magic": ("magic", "header magic"),
    "wrong_version": ("version", "header version"),
    "wrong_token": ("token", "header token"),
    "wrong_world_size": ("world", "header world_size"),
    "wrong_rank": ("rank", "header rank"),
    "wrong_slot_size": ("slot", "header slot_nbytes"),
    "pid_not_its_name": ("pid", "does not match the name"),
    "not_our_prefix": ("name", "not a segment of this user"),
    "missing": ("unlink", "does not exist"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_attach_rejects_bad_segments(case):
    """Guards: attaching a peer's segment checks owner uid, mode, exact size, magic,
    version, token, world size, rank, geometry and owner pid before first use, so a stale,
    foreign, squatted or tampered segment is refused with SegmentError (never mapped and
    used). Each case spoils exactly one property of an otherwise valid segment."""
    how, says = BAD[case]
    token = os.urandom(16)
    owner = _regions(1)
    pid = os.getpid() if how != "pid" else 1
    name = f"/{shm.segment_prefix()}{token.hex()}-1-{pid}"
    if how == "name":
        name = f"/shmcoll-{os.geteuid() + 1}-{token.hex()}-1-{pid}"
    owner._my_name = name
    path = "/dev/shm" + name
    attacher = _regions(0)
    try:
        region = owner._create(name, token)
        if how == "chown":
            os.chown(path, os.geteuid() + 12345, -1)
        elif how.startswith("chmod"):
            os.chmod(path, int(how[5:], 8))
        elif how == "truncate+":
            os.truncate(path, LAYOUT.nbytes + 4096)
        elif how == "truncate-":
            os.truncate(path, LAYOUT.nbytes - 4096)
        elif how == "magic":
            _tamper_header(region, 0, 0xDEADBEEF)
        elif how == "version":
            _tamper_header(region, 8, protocol.LAYOUT_VERSION + 1)
        elif how == "token":
            region[16:32] = np.frombuffer(os.urandom(16), np.uint8)
        elif how == "world":
            _tamper_header(region, 32, 3)
        elif how == "rank":
            _tamper_header(region, 40, 0)
        elif how == "slot":
            _tamper_header(region, 64, LAYOUT.slot_nbytes * 2)
        elif how == "unlink":
            owner.unlink()
        with pytest.raises(SegmentError, match=says):
            attacher._attach(name, token, 1)
    finally:
        attacher.close()
        owner.close()
    assert not os.path.exists(path)


def test_attach_accepts_the_valid_segment():
    """The control case for the test above: the untouched segment attaches."""
    token = os.urandom(16)
    owner, attacher = _regions(1), _regions(0)
    owner._my_name = f"/{shm.segment_prefix()}{token.hex()}-1-{os.getpid()}"
    try:
        owner._create(owner._my_name, token)
        region, pid = attacher._attach(owner._my_name, token, 1)
        assert pid == os.getpid() and region.nbytes == LAYOUT.nbytes
    finally:
        attacher.close()
        owner.close()


def test_create_refuses_an_existing_name():
    """Guards: O_EXCL: a name that already exists (squatted, or a stale segment) is never
    reused -- its contents could be anyone's."""
    token = os.urandom(16)
    name = f"/{shm.segment_prefix()}{token.hex()}-0-{os.getpid()}"
    squatter = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=LAYOUT.nbytes)
    squatter.close_fd()
    r = _regions(0)
    try:
        with pytest.raises(SegmentError, match="already exists"):
            r._create(name, token)
    finally:
        r.close()
        posix_ipc.unlink_shared_memory(name)


# ====================================================== values read from peers are input

class _FakeArena:
    """Rank 0 of 2 whose peer's slot holds whatever the test wrote there."""

    def __init__(self, peer_table, slot_nbytes=4096):
        self.rank, self.world_size, self.slot_nbytes = 0, 2, slot_nbytes
        self._slots = [np.zeros(slot_nbytes, np.uint8) for _ in range(2)]
        self._peer = np.zeros(slot_nbytes, np.uint8)
        self._peer[:len(peer_table) * 8] = np.array(peer_table, np.int64).view(np.uint8)
        self.posts = 0

    def next_slot(self):
        return 0

    def claim(self, i):
        return self._slots[i]

    def post(self, i=None):
        self.posts += 1

    def wait_all(self, target=None):
        pass

    def slot(self, i, rank):
        return self._slots[i] if rank == 0 else self._peer


@pytest.mark.parametrize("peer_table,says", [
    # the peer's row: [sends to 0, sends to 1, receives from 0, receives from 1]; rank 0
    # sends 4 bytes to itself and 8 to rank 1, and expects 8 from rank 1
    ([5, 6, 8, 6], "rank 1 sends 5 bytes to rank 0, which expects 8"),
    ([8, 6, 3, 6], "rank 0 sends 8 bytes to rank 1, which expects 3"),
    ([8, -8, 8, -8], "corrupt size table"),
    ([8, 1 << 60, 8, 1 << 60], "corrupt size table"),
])
def test_all_to_all_size_table_is_checked_before_use(peer_table, says):
    """Guards: all_to_all's size table lives in peers' memory. A peer's entries that
    disagree with ours, negative sizes, or absurd ones (which would set every rank's chunk
    count) raise ValueError before any output byte is written."""
    ins = [np.full(4, 1, np.uint8), np.full(8, 2, np.uint8)]
    outs = [np.full(4, 0xEE, np.uint8), np.full(8, 0xEE, np.uint8)]
    arena = _FakeArena(peer_table)
    with pytest.raises(ValueError, match=says):
        all_to_all_direct(arena, ins, outs)
    assert all((o == 0xEE).all() for o in outs)
    assert arena.posts == 1  # only the size exchange was posted


def test_garbage_fingerprint_from_a_peer_is_a_clean_mismatch():
    """Guards: a peer's fingerprint words are compared and rendered, never used as
    indices: garbage codes (unknown collective, dtype, op; negative count) give a readable
    CollectiveMismatchError, not an IndexError/KeyError, and nothing is read from slots."""
    layout = protocol.RegionLayout(4096, 2, 2)
    regions = [np.zeros(layout.nbytes, np.uint8) for _ in range(2)]
    for r, reg in enumerate(regions):
        protocol.write_header(reg, layout, b"t" * 16, 2, r, os.getpid())
    me = protocol.Arena(regions, 0, layout, lambda p: True, describe_fingerprint)
    seq = 1
    me.begin(seq, "all_reduce", (2, 3, 16, 0, 0, 7), 5.0)
    peer = regions[1][layout.ctrl_offset:layout.data_offset].view(np.int64)
    line = (protocol.FP_LINE0 + seq % protocol.FP_RING) * protocol.LINE_WORDS
    peer[line:line + 8] = [seq, 0, 999, -5, -1, 77, 12345, -9]
    peer[protocol.W_POSTED * protocol.LINE_WORDS] = 1  # "posted"
    me.post()
    with pytest.raises(CollectiveMismatchError) as info:
        me.wait_all()
    msg = str(info.value)
    assert "collective#999" in msg and "count=-1" in msg and "all_reduce(" in msg, msg
    # the renderer copes with anything a peer may write
    for fp in [(0,) * 6, (-1, 2**62, -(2**62), 5, 2**40, 3), (3, 12, 0, 2**63 - 1, 8, 0)]:
        assert isinstance(describe_fingerprint(fp), str)


def test_group_names_its_ranks_pids_and_refuses_once_closed():
    """Group.pids: each rank's process id by rank (what cuda_ipc's rendezvous watches),
    read from the ranks' region headers; world size 1: this process; closed: an error."""
    import threaded_pg
    from shmcoll.errors import ShmcollError

    def fn(rank, ws, rendezvous):
        group = threaded_pg.new_threaded_group(rendezvous, rank, ws)
        pids = group.pids
        group.close()
        with pytest.raises(ShmcollError, match="pids: the group was closed"):
            group.pids
        return pids

    assert threaded_pg.run_threads(fn, 3) == [[os.getpid()] * 3] * 3
    assert threaded_pg.run_threads(fn, 1) == [[os.getpid()]]
