"""/dev/shm: snapshots, segment owners and leak checks, for conftest.py and the tests that
run real rank processes.

A segment's name ends in its owner's pid (`shmcoll-<uid>-<token>-<rank>-<pid>`), so a leak
is attributed by pid. sem.*/psm_* entries (POSIX semaphores, multiprocessing.shared_memory)
carry no pid: other jobs on this machine create them, so tests only report new ones."""

import os
import time

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "shmcoll-"
FOREIGN_PREFIXES = ("sem.", "psm_")  # POSIX semaphores / multiprocessing.shared_memory
# Open MPI 5's shared-memory transport (sm_segment.<host>.<uid>.<job>.<rank>): a process
# that initialises MPI without mpirun (a singleton: `from mpi4py import MPI`, which
# Lightning's environment detection runs when mpi4py is installed) leaves it behind.
OPEN_MPI_PREFIX = "sm_segment."


def listing():
    """Every name in /dev/shm (empty where it cannot be read)."""
    try:
        return set(os.listdir(SHM_DIR))
    except OSError:
        return set()


def owner_pid(name):
    """The pid a segment name ends in, or None."""
    try:
        return int(name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return None


def shm_entries(pids=None):
    """A /dev/shm snapshot: with `pids`, the `shmcoll-*` segments owned by those pids (the
    owner pid is the last field of a name); without, every `shmcoll-*`, `sem.*` and `psm_*`
    entry (POSIX semaphores, multiprocessing.shared_memory)."""
    names = listing()
    if pids is not None:
        owners = {str(p) for p in pids}
        return {n for n in names if n.startswith(SEGMENT_PREFIX) and n.rsplit("-", 1)[-1] in owners}
    return {n for n in names if n.startswith((SEGMENT_PREFIX,) + FOREIGN_PREFIXES)}


def new_foreign_entries(before, settle_s=3.0):
    """sem.*/psm_* entries that appeared since `before` and are still there after
    `settle_s`. Not attributable to a pid (other jobs on this machine create them, e.g.
    multiprocessing's named semaphores), so tests only report them; that *our* processes
    create none is checked through their mappings (`dev_shm_mappings`)."""
    deadline = time.monotonic() + settle_s
    while True:
        new = {n for n in shm_entries() - before if n.startswith(FOREIGN_PREFIXES)}
        if not new or time.monotonic() > deadline:
            return new
        time.sleep(0.2)


def left_behind(before):
    """What a finished job left in /dev/shm since snapshot `before` (`listing()`): Open MPI
    segments, and shmcoll segments whose owner is gone (a live owner's may belong to
    another test's group)."""
    return sorted(n for n in listing() - before
                  if n.startswith(OPEN_MPI_PREFIX) or n.startswith(SEGMENT_PREFIX)
                  and not _alive(owner_pid(n)))


def _alive(pid):
    return pid is not None and os.path.exists(f"/proc/{pid}")


def dev_shm_mappings(pid="self"):
    """Every /dev/shm file mapped by process `pid` ({path: deleted?})."""
    out = {}
    with open(f"/proc/{pid}/maps") as f:
        for ln in f:
            parts = ln.split(None, 5)
            if len(parts) == 6 and parts[5].startswith(SHM_DIR + "/"):
                path = parts[5].rstrip("\n")
                deleted = path.endswith(" (deleted)")
                out[path[:-len(" (deleted)")] if deleted else path] = deleted
    return out


def descendants(root):
    """Live pids whose parent chain reaches `root` (from /proc)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found = set()
    for pid in parent:
        p, hops = pid, 0
        while p in parent and p > 1 and hops < 64:
            if parent[p] == root:
                found.add(pid)
                break
            p, hops = parent[p], hops + 1
    return found


def unlink(name):
    """Remove /dev/shm/`name`, quietly where it is already gone."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except OSError:
        pass


def assert_job_left_nothing(pids, before):
    """No segment of `pids` (a job's ranks) is left; sem./psm_ entries new since `before` are
    reported only (not attributable; the mapping checks show our ranks create none)."""
    leaked = shm_entries(pids)
    assert not leaked, f"segments of this job left in /dev/shm: {sorted(leaked)}"
    foreign = new_foreign_entries(before, settle_s=0.5)
    if foreign:
        print(f"\n[note] new sem./psm_ entries during the test (other jobs?): {sorted(foreign)}")
