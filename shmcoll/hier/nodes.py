"""Which ranks of a group share a host: node discovery when a group is created.

A *node* is a set of ranks that can map each other's POSIX shared memory. Ranks find their
node through the group's store, in two rounds (keys under "shmcoll/nodes/<gen>/"):

  1. every rank creates a probe segment (our usual name prefix, so the stale-segment GC
     knows it) holding a random token, and publishes its hostname, boot id, identity key
     and the probe's name and token ("id/<rank>"):
       key = "id:" + SHMCOLL_NODE_ID when set (any string; equal strings = one node, even
             on one machine: simulated nodes, or setups detection gets wrong), else
             "auto:" + boot id | st_dev:st_ino of /dev/shm | pid namespace inode.
       The hostname is not part of the key: containers on different machines may share a
       name (and containers on one machine sharing /dev/shm may not); the boot id tells
       machines apart, the identity of the /dev/shm mount tells private mounts apart (each
       tmpfs has its own device number), and the pid namespace keeps ranks together only
       where they can see each other's pids (liveness checks use pidfds).
  2. candidate nodes = equal keys; the lowest rank of each is its leader. Every other
     member opens the leader's probe and compares the token (it fails, e.g., across users:
     segments are mode 0600), publishing "ok/<rank>" = 1 / 0. A member that cannot read
     it becomes a node of its own (correct, only slower). Probes are unlinked once every
     rank has answered.

Nodes are numbered by their lowest rank; ranks inside a node are ordered by rank (local
rank 0 is the node's leader). All of this runs once per group, at creation: a group on one
node then runs exactly the single-node engine.
"""

import dataclasses
import functools
import os
import secrets
import socket
import time
from dataclasses import dataclass

import posix_ipc

from ..errors import SegmentError
from ..engine.init_phases import phase
from ..shm.segments import wait_key, segment_prefix

__all__ = ["NodeLayout", "identity", "discover"]

_PROBE_NBYTES = 64


@dataclass(frozen=True)
class NodeLayout:
    """node_of[r]: the node of group rank r; hosts[r]: its hostname (for messages);
    machines[r]: its boot id (nodes simulated on one machine share its cores); token: a
    random hex string every rank of the group read in discovery's first round (rank 0's
    probe token), which a group on one node takes as its segments' group token instead of
    a store round of its own (shm.ShmRegions); "" when there was no round."""

    node_of: tuple
    hosts: tuple = ()
    machines: tuple = ()
    token: str = ""

    @classmethod
    def from_keys(cls, keys, hosts=(), machines=()):
        """Ranks with equal keys share a node; nodes are numbered by their lowest rank."""
        index = {}
        node_of = tuple(index.setdefault(k, len(index)) for k in keys)
        return cls(node_of, tuple(hosts) or ("?",) * len(keys),
                   tuple(machines) or tuple(f"node{n}" for n in node_of))

    @property
    def world_size(self):
        return len(self.node_of)

    @functools.cached_property
    def nodes(self):
        """Members of every node, ascending, in node order."""
        members = [[] for _ in range(max(self.node_of) + 1)]
        for r, n in enumerate(self.node_of):
            members[n].append(r)
        return tuple(tuple(m) for m in members)

    @functools.cached_property
    def num_nodes(self):
        return max(self.node_of) + 1

    @functools.cached_property
    def single_node(self):
        return self.num_nodes == 1

    @functools.cached_property
    def even(self):
        """Every node has the same number of ranks."""
        return len({len(m) for m in self.nodes}) == 1

    @functools.cached_property
    def shards(self):
        """S: the local ranks 0..S-1 exist on every node (the smallest node's size); local
        rank l < S talks to other nodes through channel l."""
        return min(len(m) for m in self.nodes)

    def local_rank(self, rank):
        return self.nodes[self.node_of[rank]].index(rank)

    def rank_of(self, node, local):
        return self.nodes[node][local]

    def channel_members(self, local):
        """Group ranks of channel `local` (local rank `local` of every node), node order."""
        return tuple(m[local] for m in self.nodes)

    def ranks_on_machine(self, rank):
        """How many ranks of the group run on `rank`'s machine (all its nodes)."""
        return sum(m == self.machines[rank] for m in self.machines)

    def describe(self, rank):
        """'rank 3 (node 1, host-b)' for messages."""
        return f"rank {rank} (node {self.node_of[rank]}, {self.hosts[rank]})"

    def describe_node(self, node):
        ranks = ", ".join(map(str, self.nodes[node]))
        return f"node {node} ({self.hosts[self.nodes[node][0]]}: ranks {ranks})"


def boot_id():
    """The running kernel's boot id (one per machine and boot), else the hostname."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "host=" + socket.gethostname()


def identity(cfg):
    """This process's node key (see the module docstring)."""
    if cfg.node_id:
        return "id:" + cfg.node_id
    boot = boot_id()
    try:
        st = os.stat(cfg.shm_dir)
        shm = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        shm = "no-shm"
    try:
        pidns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pidns = "?"
    return f"auto:{boot}|{shm}|{pidns}"


def discover(store, rank, world_size, timeout_s, cfg):
    """The NodeLayout of a group (every rank calls it, in the same group order)."""
    if world_size == 1:
        return NodeLayout((0,), (socket.gethostname(),), (boot_id(),))
    deadline = _deadline(timeout_s)
    gen = store.add(_gen_key(rank), 1)
    base = f"shmcoll/nodes/{gen}"
    reused = functools.partial(_reused_store, store, rank, gen)
    with phase("discovery: probe segment"):
        probe, token = _create_probe()  # read by the members if this rank leads its node
    try:
        with phase("discovery: ids"):
            store.set(f"{base}/id/{rank}", "\n".join(
                (socket.gethostname(), boot_id(), identity(cfg), probe, token.hex())))
            values = _get_all(store, [f"{base}/id/{r}" for r in range(world_size)], deadline,
                              timeout_s, reused)
        hosts, machines, keys, probes, tokens = zip(*(v.split("\n") for v in values))
        layout = dataclasses.replace(NodeLayout.from_keys(keys, hosts, machines),
                                     token=tokens[0])
        leader = layout.nodes[layout.node_of[rank]][0]
        if leader != rank:
            _unlink(probe)  # only leaders' probes are read
        ok = leader == rank or _read_probe(probes[leader]) == bytes.fromhex(tokens[leader])
        with phase("discovery: oks"):
            store.set(f"{base}/ok/{rank}", "1" if ok else "0")
            oks = _get_all(store, [f"{base}/ok/{r}" for r in range(world_size)], deadline,
                           timeout_s, reused)
    finally:
        _unlink(probe)  # every member has answered (or this rank gives up)
    if all(v == "1" for v in oks):
        return layout
    # A member that could not read its leader's probe is a node of its own.
    keys = [k if v == "1" else f"{k}|unshared:{r}" for r, (k, v) in enumerate(zip(keys, oks))]
    return dataclasses.replace(NodeLayout.from_keys(keys, hosts, machines), token=tokens[0])


def _create_probe():
    token = secrets.token_bytes(16)
    name = f"/{segment_prefix()}probe{token.hex()}-{os.getpid()}"
    try:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=_PROBE_NBYTES)
    except (posix_ipc.Error, OSError) as e:
        raise SegmentError(f"node discovery: cannot create the probe segment {name!r}: "
                           f"{e}") from None
    try:
        os.pwrite(shm.fd, token, 0)
    except OSError as e:
        shm.close_fd()
        _unlink(name)
        raise SegmentError(f"node discovery: cannot write the probe segment: {e}") from None
    shm.close_fd()
    return name, token


def _read_probe(name):
    """The token in a peer's probe segment, or b"" if this rank cannot open it."""
    if not name.startswith("/" + segment_prefix()):
        return b""
    try:
        shm = posix_ipc.SharedMemory(name, 0)
    except (posix_ipc.Error, OSError):
        return b""
    try:
        return os.pread(shm.fd, 16, 0)
    except OSError:
        return b""
    finally:
        shm.close_fd()


def _unlink(name):
    try:
        posix_ipc.unlink_shared_memory(name)
    except (posix_ipc.Error, OSError):
        pass


def _deadline(timeout_s):
    return time.monotonic() + timeout_s


def _gen_key(rank):
    """Rank `rank`'s count of the groups it began to discover on this store."""
    return f"shmcoll/nodes/gen/{rank}"


# How often a discovery that waits looks at the peers' generation counters (_reused_store).
_REUSED_CHECK_S = 0.5


def _reused_store(store, rank, gen, missing):
    """Why the ranks in `missing` cannot come, when the store says so; else None.

    Each rank counts the discoveries it began on the store (gen), so all ranks of one group
    agree on the keys' generation -- as long as every rank that began one took part in it.
    A rank that died before it began its group's discovery while its peers had begun
    theirs (a crash at start-up) leaves the counters apart for good: in the next set of
    processes on the same store (a torchrun restart: the agent keeps one store for every
    attempt) the ranks wait under different generations, attempt after attempt. A rank we
    wait for whose counter is past ours shows it (a rank that finished our generation and
    went on has written every key of it), and so does one two or more behind (one behind
    is a rank that has not arrived yet)."""
    gens = {r: store.add(_gen_key(r), 0) for r in missing}
    if all(gen - 1 <= g <= gen for g in gens.values()):
        return None
    where = ", ".join(f"rank {r} at {g}" for r, g in sorted(gens.items()))
    return (f"rank {rank} is at rendezvous generation {gen} of this store, {where}: the "
            f"store holds an unfinished group set-up of processes that are gone (a rank died "
            f"before it created the group while its peers were creating theirs), and the "
            f"ranks will not meet in it. torchrun keeps one store for every attempt of an "
            f"elastic job: give each attempt its own, "
            f"PrefixStore(f\"attempt{{os.environ['TORCHELASTIC_RESTART_COUNT']}}\", store) "
            f"(docs/RECIPES.md)")


def _get_all(store, keys, deadline, timeout_s, reused=None):
    """Values of `keys` (str), waiting until `deadline`: store.check polled with backoff from
    100 us (c10d FileStore.wait sleeps 10 ms between its own checks), then one multi_get
    where the store has it (c10d stores), else one get per key. keys[r] is rank r's:
    `reused(missing ranks)` (discover's _reused_store) is asked every _REUSED_CHECK_S of
    waiting and at the deadline; a reason it gives ends the wait."""
    check = getattr(store, "check", None)
    if check is None:
        return [wait_key(store, k, deadline, timeout_s, f"store key {k!r}") for k in keys]
    delay = 1e-4
    next_look = time.monotonic() + _REUSED_CHECK_S
    while not check(keys):
        now = time.monotonic()
        if now > deadline or (reused is not None and now > next_look):
            missing = [r for r, k in enumerate(keys) if not check([k])]
            why = reused(missing) if reused is not None else None
            if now > deadline:
                raise SegmentError(f"node discovery: timed out after {timeout_s} s waiting "
                                   f"for store keys {[keys[r] for r in missing]}"
                                   + (f"; {why}" if why else ""))
            if why:
                raise SegmentError(f"node discovery: {why}")
            next_look = now + _REUSED_CHECK_S
        time.sleep(delay)
        delay = min(delay * 2, 0.01)
    multi_get = getattr(store, "multi_get", None)
    values = multi_get(keys) if multi_get is not None else [store.get(k) for k in keys]
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]
