"""Algorithm choice: the one place that decides which algorithm runs, as a pure function.

Each algorithm lives in the module named after its collective and talks only to the Arena
seam (protocol.Arena), so the process engine and the threaded engine run the same code.
"""

from ..protocol import ONE_STEP_BROADCAST, ONE_STEP_GATHER, ONE_STEP_REDUCE, \
    ONE_STEP_REDUCE_SCATTER
from ..native.single_copy import CMA, IN_PROCESS, NONE
from .all_gather import all_gather_direct, all_gather_single_copy
from .all_reduce import STREAM_NBYTES, all_reduce_one_shot, all_reduce_single_copy, \
    all_reduce_two_shot, one_shot_sub_nbytes
from .all_to_all import STREAM_MAX_WORLD, all_to_all_direct, all_to_all_finish, \
    all_to_all_read, rides
from .barrier import barrier_flags
from .broadcast import broadcast_direct, broadcast_single_copy, broadcast_streamed
from .gather import gather_direct
from .reduce import reduce_direct
from .reduce_scatter import reduce_scatter_direct, reduce_scatter_single_copy
from .scatter import scatter_direct

__all__ = ["select", "one_step_mode", "all_to_all_finish", "all_to_all_read", "reads_one_step",
           "rides", "ONE_SHOT_MAX_NBYTES",
           "SINGLE_COPY_MIN",
           "SINGLE_COPY_NOT_ON_SMALL_PAGES", "BROADCAST_STREAMED_MIN_NBYTES",
           "LIST_STAGED_MAX_NBYTES"]

# all_reduce one-shot vs two-shot cut-over, by world size. One-shot reads N*S per rank and
# needs one wait per sub-chunk; two-shot reads ~2*S but needs two waits (both run as one
# compiled call per collective; through dist.* only one-shot takes the compiled lane). At
# N=2 the byte counts are equal, so one-shot always wins. Above, two-shot wins once the N*S
# reads cost more than a wait. Measured on the 2-core VM (every world size from 3 is more
# ranks than cores: each wait hands a core over), idle, numpy buffers, engine level
# (Group.all_reduce), 2026-11-29 with the one-step and streamed kernels, medians of
# 200-2000 calls, two alternated runs, us (one / two-shot): 3 ranks 512K 165-194 /
# 401-425, 1M 326-664 / 750-777; 4 ranks 64K 52-70 / 84-126, 128K 111-173 / 104-165,
# 256K 209-261 / 266-410, 512K 214-215 / 480-505, 1M 516-1204 / 926-977, 2M 1022-1190 /
# 1047-1329; 8 ranks 16K 185-255 / 222-330, 64K 292-357 / 335-356, 256K 504-560 /
# 757-888, 1M 1928-2109 / 2300-2446. Through dist.* (lane on, 4 ranks, 12 rounds each):
# 32K 100 / 188, 64K 128 / 194, 128K 161 / 226, 256K 296 / 280 (medians); 1M about even.
# (The table before this, measured on older kernels, cut over at 16 KiB for 4 ranks and
# 8 KiB from 5.) From 5 ranks the 4-rank limit: a limit never grows with the world size
# (N*S reads), though 8 ranks won at 1M too. Not measured: 3+ ranks with a core each,
# where two-shot's fewer bytes may win sooner.
ONE_SHOT_MAX_NBYTES = {2: 1 << 62, 3: 1 << 20, 4: 512 << 10}
ONE_SHOT_MAX_NBYTES_DEFAULT = 512 << 10
# Rank threads of one process (threaded_pg) take turns on the GIL around every wait, and
# one-shot of one sub-chunk is one compiled call with one wait (Arena.one_step); their
# table is their own (not re-measured with the processes' above). Measured through dist.*
# (benchmarks.threaded_bench, two runs, one-shot vs two-shot, us): 4 ranks 8K 100/113 vs
# 161/199, 32K 111/110 vs 175/206, 64K 147/122 vs 193/212, 256K 335/273 vs 296/309, 1M
# 1049/1013 vs 861/816; 8 ranks 8K 334/257 vs 556/234, 32K 329/244 vs 562/314, 64K
# 401/268 vs 629/282, 256K 943/967 vs 858/730.
ONE_SHOT_MAX_NBYTES_THREADS = {2: 1 << 62, 3: 256 << 10}
ONE_SHOT_MAX_NBYTES_THREADS_DEFAULT = 64 << 10

# Single-copy paths (peers' buffers read where they lie, see single_copy.py), by transport:
# (min bytes per rank -- all_reduce: the buffer; reduce_scatter: the whole input --, min
# world size). They need 2-3 waits with Python between them, where the slot paths run as
# one compiled call, so they win only where the copy they save outweighs that. Measured
# (engine level, the 2-core VM, slots vs single copy in one run, us): CMA all_reduce at 2
# ranks 2 MiB 433 vs 457, 3 MiB 654 vs 551, 4 MiB 816 vs 520, 16 MiB 3850 vs 2562; at 4
# ranks (two-shot) 2 MiB 1142 vs 1306, 3 MiB 1878 vs 1797, 4 MiB 2547 vs 1954; at 8 ranks
# 2 MiB 3101 vs 3323, 4 MiB 8389 vs 7079; reduce_scatter 4 MiB 609 vs 459 (2 ranks), 2241
# vs 1733 (4). CMA broadcast lost at every size (the slot path overlaps the root's copy-in
# with the readers' copy-out; one kernel copy does not) and all_gather was a toss-up, so
# both stay on the slots. Rank threads (IN_PROCESS, through dist.*): all_reduce at 4 ranks
# 1 MiB 665 vs 962, 2 MiB 1840 vs 1595, 4 MiB 3075 vs 2416; at 8 ranks 1 MiB 1499 vs 1623,
# 2 MiB 3774 vs 3349; reduce_scatter from 256 KiB (463 vs 389 at 4). At 2-3 rank threads
# the extra waits' GIL hand-overs cost more than the copy saves.
# all_to_all from 4 ranks reads the peers' blocks from their buffers (all_to_all_read)
# from this size of a rank's whole input, though they would ride with the table: with the
# ranks' buffers, the slots' copies overflow the caches and the second copy of every byte
# costs more than CMA's page pinning. Measured 2026-11-29, 2-core VM, through
# dist.all_to_all_single, torch buffers, medians of 200-300 calls, read / riding, us:
# 4 ranks 1 MiB 477-515 / 213-233, 2 MiB 901 / 670, 4 MiB 1059-1527 / 1846-2370; 8 ranks
# 4 MiB 3824 / 5746; 3 ranks a toss-up (4 MiB 1175-1829 / 1588-1608, 2 MiB 509-779 /
# 443-556), so it stays on the slots there up to a slot.
A2A_READ_MIN_NBYTES = 4 << 20
SINGLE_COPY_MIN = {
    CMA: {"all_reduce": (3 << 20, 2), "reduce_scatter": (2 << 20, 2),
          "all_to_all": (A2A_READ_MIN_NBYTES, 4)},
    IN_PROCESS: {"all_reduce": (2 << 20, 4), "reduce_scatter": (256 << 10, 2)},
}
# The measurements above used numpy arrays, which sit on transparent huge pages from 4 MiB.
# Where user buffers are on 4 KiB pages (torch tensors by default, see pages.py), CMA pins
# 512x more pages, and all_reduce's single copy does not pay at any size: on
# torch-allocated buffers (engine level, CMA / slots time, alternating blocks) 4 ranks
# 4 MiB 1.03, 16 MiB 1.03, 64 MiB 1.16, 8 ranks 16 MiB 1.04, 2 ranks 64 MiB 1.09, 256 MiB
# 1.22; a band at 2 ranks below 16 MiB, where it once won (4 MiB 0.94, 8 MiB 0.83), lost
# once the slot path streamed: 2026-11-29, lab.config_ab, slots / CMA time, 3 MiB 0.71,
# 4 MiB 0.68-0.69, 6 MiB 0.86, 8 MiB 0.67-0.86, 12 MiB 0.93 (4 ranks, always / default:
# 4 MiB 1.40, 16 MiB 1.11). reduce_scatter's single copy still wins there (2 ranks 4 MiB
# 0.91, 16 MiB 0.92; 4 ranks 16 MiB 0.78). On numpy's huge pages all_reduce keeps it:
# slots / CMA 2 ranks 4 MiB 0.86, 16 MiB 1.00, 64 MiB 0.94; 4 ranks 4 MiB 1.12, 16 MiB 1.10.
SINGLE_COPY_NOT_ON_SMALL_PAGES = {CMA: ("all_reduce",)}
_SINGLE_COPY = {"all_reduce": all_reduce_single_copy, "all_gather": all_gather_single_copy,
                "broadcast": broadcast_single_copy, "reduce_scatter": reduce_scatter_single_copy,
                "all_to_all": all_to_all_read}


def reads_one_step(algo, world_size, single_copy, ride):
    """Whether all_to_all_single's equal blocks run as the one-step kernel's read (slot
    bytes 0 in its plan, Group._plan_all_to_all): at 3+ ranks with single copy, where
    select chose all_to_all_read, or where the blocks do not ride (`ride` False:
    all_to_all_direct would read them too, in Python). At 2 ranks a table of reads goes
    on streamed where the general path finishes it (all_to_all_finish), so the kernel
    could not read while a peer on that path streams."""
    return world_size > STREAM_MAX_WORLD and single_copy != NONE and (
        algo is all_to_all_read or not ride)


# broadcast: below this size broadcast_direct (up to a slot, 4 MiB by default, one
# compiled call, Arena.one_step: the root's copy-in, then the others' copy-out; above, a
# slot per chunk, chunk c + 1's copy-in overlapping chunk c's copy-out), from it on
# broadcast_streamed (the copies overlap sub-chunk by sub-chunk, but each call takes the
# general path's Python and a hand-over per sub-chunk, which costs whenever a rank is
# descheduled). Measured at 2 ranks, engine level, alternating blocks in one run (torch
# buffers; the root's rewritten before every call in all but the first two runs),
# 2026-11-28 on the shared 2-core VM at load 1-6, streamed (512 KiB sub-chunks) / direct
# time, run by run: 1 MiB 0.89 1.06 1.38 0.90 1.74; 4 MiB 1.17 1.24 0.78 0.86 0.89 0.89
# 1.25 1.17 (lab.ab_engine: 0.97 0.85 1.52) -- a toss-up, so up to 8 MiB it stays
# direct; 8 MiB 0.87 0.93 0.98; 12 MiB 0.86; 16 MiB 0.63 1.21 0.85 1.03 0.94 0.73 1.17
# (lab.ab_engine: 0.95 0.89 0.93); 64 MiB 0.95. At 256 KiB it lost 2x in every run.
# Rank threads (not measured) keep broadcast_direct.
BROADCAST_STREAMED_MIN_NBYTES = 8 << 20

# The list forms, up to this many bytes per rank (all_gather's input, reduce_scatter's
# output, all_to_all's input): all_gather into a list (dist.all_gather) runs the one-array
# path into a reused staging array, then copies out; reduce_scatter from a list of equal
# inputs copies them into it, then runs the one-array path; all_to_all's pieces, where
# they ride, go through it into the one-array form (Group.all_gather, .reduce_scatter,
# .all_to_all). Above, the list steps of the direct algorithms (a chunk per slot, a Python
# copy per output; all_to_all's pieces ride from where they lie). all_to_all's list form,
# 2 ranks, engine level, torch buffers (lab.ab_engine, 2026-11-29, the 2-core VM), staged
# up to 256 KiB / staged at every size, time: 64 KiB 0.90, 256 KiB 0.99, 512 KiB 0.77,
# 1 MiB 0.63, 2 MiB 0.47, 4 MiB 0.34.
LIST_STAGED_MAX_NBYTES = 256 << 10

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


def select(collective, nbytes, world_size, direct_max_nbytes=-1, single_copy=NONE,
           single_copy_always=False, threads=False, small_pages=False):
    """The algorithm function for `collective` moving `nbytes` per rank among `world_size`
    (rank threads of one process when `threads`, else processes).

    `direct_max_nbytes` >= 0 overrides the all_reduce one-shot threshold (SHMCOLL_DIRECT_MAX_BYTES).
    `single_copy`: the group's single_copy transport (the same on every rank: agreed at init);
    `single_copy_always` (SHMCOLL_SINGLE_COPY=always) takes its path at every size, for
    tests and measurements. `small_pages`: the ranks' buffers are likely on 4 KiB pages
    (pages.py; agreed at init), where CMA does not pay for all_reduce.
    """
    if single_copy != NONE and collective in _SINGLE_COPY:
        if single_copy_always:
            return _SINGLE_COPY[collective]
        least = SINGLE_COPY_MIN[single_copy].get(collective)
        if least is not None and nbytes >= least[0] and world_size >= least[1] and not (
                small_pages and collective in SINGLE_COPY_NOT_ON_SMALL_PAGES.get(single_copy,
                                                                                 ())):
            return _SINGLE_COPY[collective]
    if collective == "all_reduce":
        limit = direct_max_nbytes
        if limit < 0:
            limit = ONE_SHOT_MAX_NBYTES_THREADS.get(
                world_size, ONE_SHOT_MAX_NBYTES_THREADS_DEFAULT) if threads else \
                ONE_SHOT_MAX_NBYTES.get(world_size, ONE_SHOT_MAX_NBYTES_DEFAULT)
        return all_reduce_one_shot if nbytes <= limit else all_reduce_two_shot
    if collective == "broadcast" and not threads and nbytes >= BROADCAST_STREAMED_MIN_NBYTES:
        return broadcast_streamed
    try:
        return _FIXED[collective]
    except KeyError:
        raise NotImplementedError(f"no algorithm for collective {collective!r}") from None


# The streamed algorithms' one-step mode and their sub-chunk size for a message of nbytes.
_STREAMED = {all_reduce_one_shot: (ONE_STEP_REDUCE, one_shot_sub_nbytes),
             all_gather_direct: (ONE_STEP_GATHER, one_shot_sub_nbytes)}


def one_step_mode(algo, arena, nbytes, itemsize):
    """The Arena.one_step mode that runs `algo` (as `select` chose it for `nbytes` per rank
    in elements of `itemsize` bytes) as one compiled call with its framing -- it is then a
    single step through one slot --, else None (the general path runs it). The streamed
    algorithms (one-shot all_reduce, all_gather into one array) are one step when the
    message is one sub-chunk; the chunked ones when it fits a slot."""
    streamed = _STREAMED.get(algo)  # all_gather: the one-output-array form (Group's call)
    if streamed is not None:
        mode, sub_nbytes = streamed
        return mode if nbytes <= arena.sub_nbytes(itemsize, sub_nbytes(nbytes)) else None
    if algo is broadcast_direct:  # count 0 takes no slot there (no chunk): general path
        return ONE_STEP_BROADCAST if 0 < nbytes <= arena.slot_nbytes else None
    if algo is reduce_scatter_direct:  # the one-input-array form only; nbytes: the input
        return ONE_STEP_REDUCE_SCATTER if 0 < nbytes <= arena.slot_nbytes else None
    return None
