"""The point-to-point engine's numbers, numba-free: read by the engine (p2p/__init__.py),
which a group's creation imports, and by its cell kernels (cells.py), which only the
warm-up and the first p2p call load."""

import numpy as np

ANY_SOURCE = -1  # a receive from any rank
_NEVER = np.iinfo(np.int64).max  # a wait target no counter reaches
# The kernel sets of the mailboxes (jit.once keys)
_CELL_KERNELS = "shmcoll's point-to-point kernels"
_PROGRESS_WAIT = "shmcoll's point-to-point progress wait"
