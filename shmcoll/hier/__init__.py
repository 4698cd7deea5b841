"""Several nodes: shared memory inside each node, a transport (gloo, via the torch backend)
between nodes. No torch here: the transport is passed in (wire.py describes the seam).

    layout = discover(store, rank, world_size, timeout_s, cfg)      # nodes.py
    group = new_hier_group(store, rank, layout, make_transport, ...)  # when not single_node

Layering: nodes.py (who shares a host) -> wire.py (the seam, the first round) -> faults.py
(the failure board, the watchdog) -> reduce.py / move.py (algorithms over `Call`) ->
api.py (argument checks) -> group.py (HierGroup: sequence, frame, fail).
"""

from ..lazy_names import lazy_attributes
from .nodes import NodeLayout, discover, identity

__all__ = ["HierGroup", "NodeLayout", "discover", "identity", "new_hier_group", "PrefixedStore"]

# A group on one node needs only discover (nodes.py): the hierarchical group's modules load
# with the first new_hier_group, so that a one-node group's creation does not import them.
__getattr__, __dir__ = lazy_attributes(__name__, {"HierGroup": "group"})

# The sched_yield tier of the intra-node waits when the machine's ranks outnumber its cores
# (the engine's default: 2 ms). Ranks of a node often wait while their leader is on the
# network, and yield-polling ranks starve that path. 2 namespaced hosts x 2 ranks on the
# 2-core VM, 2-float all_reduce, two runs each (us, shm / gloo in the same run, load ~7):
# 2 ms 3409 / 1596 and 3785 / 1334; 50 us 1175 / 889 and 1531 / 801; 0 2100 / 1353 and
# 1926 / 1288.
INTRA_YIELD_NS_OVERSUBSCRIBED = 50_000


class PrefixedStore:
    """A store whose keys all start with `prefix` (set/get/add/check, and wait/multi_get
    where the wrapped store has them): the engine groups of different nodes rendezvous on
    one store without meeting."""

    def __init__(self, store, prefix):
        self._store = store
        self._prefix = prefix
        if hasattr(store, "wait"):
            self.wait = lambda keys, *a: store.wait([prefix + k for k in keys], *a)
        if hasattr(store, "multi_get"):
            self.multi_get = lambda keys: store.multi_get([prefix + k for k in keys])

    def set(self, key, value):
        return self._store.set(self._prefix + key, value)

    def get(self, key):
        return self._store.get(self._prefix + key)

    def add(self, key, amount):
        return self._store.add(self._prefix + key, amount)

    def check(self, keys):
        return self._store.check([self._prefix + k for k in keys])


def new_hier_group(store, rank, layout, make_transport, timeout_s=1800.0, cfg=None, name="",
                   small_pages=None):
    """The HierGroup of `rank` (every rank of the layout calls it, in the same order).

    make_transport(store, base, layout, rank, timeout_s) -> a wire.py Transport."""
    from .. import config as _config
    from ..engine.group import is_oversubscribed
    from ..shm.factory import new_shm_group
    from .faults import Board
    from .group import HierGroup
    cfg = cfg or _config.from_env()
    gen = store.add(f"shmcoll/hier/gen/{rank}", 1)
    base = f"shmcoll/hier/{gen}"
    node = layout.node_of[rank]
    members = layout.nodes[node]
    intra = new_shm_group(PrefixedStore(store, f"{base}/node{node}/"), members.index(rank),
                          len(members), timeout_s, cfg, name=f"{name}:node{node}",
                          small_pages=small_pages, ranks_here=layout.ranks_on_machine(rank),
                          yield_ns=INTRA_YIELD_NS_OVERSUBSCRIBED
                          if is_oversubscribed(layout.ranks_on_machine(rank)) else None)
    try:
        transport = make_transport(store, base, layout, rank, timeout_s)
    except BaseException:
        intra.close()
        raise
    try:
        # the intra group's kernels loaded while the transport connected: waited for here,
        # so that no transport step of a first collective runs beside the loader
        intra.wait_kernels()
    except BaseException:
        transport.close()
        intra.close()
        raise
    return HierGroup(layout, rank, intra, transport, Board(store, f"{base}/board", layout, rank),
                     timeout_s, name, cfg.hier_shard_min_nbytes)
