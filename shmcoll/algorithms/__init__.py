"""Algorithm choice: the one place that decides which algorithm runs, as a pure function.

Each algorithm lives in the module named after its collective and talks only to the Arena
seam (protocol.Arena), so the process engine and the threaded engine run the same code.
"""

from .all_gather import all_gather_direct
from .all_reduce import all_reduce_one_shot, all_reduce_two_shot
from .all_to_all import all_to_all_direct
from .barrier import barrier_flags
from .broadcast import broadcast_direct
from .gather import gather_direct
from .reduce import reduce_direct
from .reduce_scatter import reduce_scatter_direct
from .scatter import scatter_direct

__all__ = ["select", "ONE_SHOT_MAX_NBYTES"]

# all_reduce one-shot vs two-shot cut-over, by world size. One-shot reads N*S per rank and
# needs one wait per chunk; two-shot reads ~2*S but needs two waits. At N=2 the byte counts
# are equal, so one-shot always wins; above, two-shot wins once the N*S reads dominate.
# Measured with benchmarks/bench.py on the 2-core dev VM (see README "Algorithm choice").
ONE_SHOT_MAX_NBYTES = {2: 1 << 62, 3: 256 << 10, 4: 128 << 10}
ONE_SHOT_MAX_NBYTES_DEFAULT = 64 << 10

_FIXED = {
    "broadcast": broadcast_direct,
    "reduce": reduce_direct,
    "all_gather": all_gather_direct,
    "reduce_scatter": reduce_scatter_direct,
    "barrier": barrier_flags,
    "gather": gather_direct,
    "scatter": scatter_direct,
    "all_to_all": all_to_all_direct,
}


def select(collective, nbytes, world_size, direct_max_nbytes=-1):
    """The algorithm function for `collective` moving `nbytes` per rank among `world_size`.

    `direct_max_nbytes` >= 0 overrides the all_reduce one-shot threshold (SHMCOLL_DIRECT_MAX_BYTES).
    """
    if collective == "all_reduce":
        limit = direct_max_nbytes
        if limit < 0:
            limit = ONE_SHOT_MAX_NBYTES.get(world_size, ONE_SHOT_MAX_NBYTES_DEFAULT)
        return all_reduce_one_shot if nbytes <= limit else all_reduce_two_shot
    try:
        return _FIXED[collective]
    except KeyError:
        raise NotImplementedError(f"no algorithm for collective {collective!r}") from None
