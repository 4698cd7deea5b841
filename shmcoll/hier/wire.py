"""The inter-node seam: what a hierarchical group needs from the engine between nodes, and the
first-round frame every hierarchical collective opens its inter-node part with.

A Transport (torch_backend/inter_node.py builds one over gloo; NCCL would plug in the same
way for CUDA buffers) offers, for one group:

    transport.channel(l)   channel of local rank l: local rank l of every node (l < S, the
                           smallest node's size), one member per node, in node order
    transport.world        every rank of the group (point-to-point, all_to_all)
    transport.close(abandon)

and each Channel (`rank`, `size`) starts byte-moving operations on flat uint8 arrays:

    all_gather(out, src, timeout_s)                           out = size * src.nbytes
    exchange(out, src, timeout_s)                             out = the others' blocks
    all_to_all(out, src, out_splits, in_splits, timeout_s)    splits in bytes
    broadcast(buf, root, timeout_s)                           root: a channel rank

returning a Pending: wait(timeout_s) -> done?, wake() (ends a wait early: abort),
result() -> None or raises TransportError(kind = "lost" | "timeout" | "failed"). The
transport never reduces: reductions run in our kernels, in a fixed order, so results do
not depend on the transport's algorithm.

The first round. gloo kills the process (std::terminate) when a message is larger than the
buffer posted for it, so a hierarchical collective never lets message sizes depend on
arguments the ranks have not yet compared. Its first inter-node exchange on a channel is
an all_gather of a fixed FRAME_NBYTES block per member:

    [ header: 8 x int64 = MAGIC, seq, collective, dtype, count, root, op, shape ][ inline ]

so the sizes always agree. Every member compares every header with its own and raises
CollectiveMismatchError naming both sides before anything else moves. Payloads of at most
INLINE_NBYTES travel in the same round (one exchange in all for small collectives); larger
ones follow in a second exchange, sized from the header the members just agreed on.
"""

import numpy as np

from ..errors import ShmcollError

__all__ = ["TransportError", "HEADER_NBYTES", "INLINE_NBYTES", "FRAME_NBYTES", "MAGIC",
           "frame", "check_frames", "header_of"]

MAGIC = 0x53484D48  # "SHMH"; bump with any change of the frame
HEADER_NBYTES = 64
# Payload carried in the first round. gloo all_gather at 2 ranks (loopback, 2-core VM, one
# run, best of 5 x 50 calls): 64 B 118-150 us, 1 KiB 128 us, 4 KiB 235 us, 16 KiB 185 us:
# up to ~1 KiB the frame costs what the header alone costs.
INLINE_NBYTES = 1024
FRAME_NBYTES = HEADER_NBYTES + INLINE_NBYTES


class TransportError(ShmcollError):
    """An inter-node operation failed: kind "lost" (a connection closed: a peer process or
    host is gone), "timeout" (the transport's own deadline), "failed" (anything else)."""

    def __init__(self, message, kind="failed"):
        super().__init__(message)
        self.kind = kind


def frame(seq, fp, payload=None):
    """A first-round block: header for collective `seq` with fingerprint `fp` = (collective
    code, dtype code, count, root, op, shape word), then `payload` (<= INLINE_NBYTES)."""
    block = np.zeros(FRAME_NBYTES, np.uint8)
    words = (MAGIC, seq) + tuple(fp)
    block[:HEADER_NBYTES].view(np.int64)[:] = words + (0,) * (8 - len(words))
    if payload is not None and payload.nbytes:
        block[HEADER_NBYTES:HEADER_NBYTES + payload.nbytes] = payload.reshape(-1).view(np.uint8)
    return block


def check_frames(rows, mine):
    """Index of the first row whose header differs from ours, or -1. `rows`: (members,
    FRAME_NBYTES) uint8; `mine`: our block."""
    headers = rows[:, :HEADER_NBYTES]
    same = (headers == mine[:HEADER_NBYTES]).all(axis=1)
    return -1 if same.all() else int(np.argmin(same))


def header_of(row):
    """(seq, fingerprint tuple) of a first-round row (for messages), or None if the row is
    not a frame at all."""
    words = row[:HEADER_NBYTES].view(np.int64)
    if int(words[0]) != MAGIC:
        return None
    return int(words[1]), tuple(int(w) for w in words[2:])
