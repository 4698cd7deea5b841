"""Reference peer for benchmarks.bench: DeepSpeed's CPU shared-memory all-reduce.

    python -m benchmarks.bench --backends shm,deepspeed --ops all_reduce

DeepSpeed ships a C++ shared-memory all-reduce for CPU ranks on one machine
(csrc/cpu/comm/shm.cpp, op "deepspeed_shm_comm", compiled on first use with
torch.utils.cpp_extension): what `deepspeed.comm.inference_all_reduce` runs when every rank
is local. Its ranks are the torch ranks of benchmarks/ranks.py with a gloo process group
(for barriers and the bookkeeping side group); only the timed call differs: `torch.ops.
deepspeed.inference_all_reduce_(tensor)`, in place, SUM, float32 / float16 / bfloat16 (other
dtypes and collectives are not in that op, and are skipped with a message). Buffers,
verification and timing are the torch ranks' own, so its rows compare with the others
directly.

The op names its segments /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>
from MASTER_ADDR / MASTER_PORT and never unlinks them: every run gets its own name (a token
in MASTER_PORT, which the op uses for nothing else), and the parent removes the segments
after the ranks exit (`cleanup`), so a run leaves nothing behind.
"""

from __future__ import annotations

import importlib.util
import os

NAME = "deepspeed"
OPS = ("all_reduce",)
DTYPES = ("float32", "float16", "bfloat16")
_SEGMENT_PREFIX = "deepspeed_allreduce_buffer"
_ADDR = "127.0.0.1"


def installed():
    return importlib.util.find_spec("deepspeed") is not None


def unavailable(ops, dtype):
    """Why this peer cannot run the sweep, or None. Compiles the op here, in the parent, when
    its build is not cached yet (~30 s once), so that ranks only load it."""
    if dtype not in DTYPES:
        return f"DeepSpeed's shm all-reduce takes {', '.join(DTYPES)}, not {dtype}"
    if not any(op in OPS for op in ops):
        return f"DeepSpeed's shm op has only {', '.join(OPS)}"
    if not installed():
        return "deepspeed is not installed (pip install -e '.[deepspeed]')"
    try:
        _load()
    except Exception as e:  # noqa: BLE001 - reported as the reason
        return f"building DeepSpeed's shm all-reduce failed: {type(e).__name__}: {e}"
    return None


def _load():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no accelerator probing on a CPU host
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    return ShareMemCommBuilder().load(verbose=False)


def attach(rank, world_size, token):
    """In a rank, after the process groups exist: map every rank's workspace (the op waits
    until all ranks have created theirs) and return the all_reduce call for the rank's
    timing loop."""
    import torch

    os.environ.update(LOCAL_SIZE=str(world_size), MASTER_ADDR=_ADDR, MASTER_PORT=str(token))
    _load().initialize(world_size, rank)
    call = torch.ops.deepspeed.inference_all_reduce_
    return lambda buf: call(buf.out)


def segments(token, world_size):
    """The /dev/shm names the ranks of run `token` create."""
    return [f"{_SEGMENT_PREFIX}_{os.getuid()}_{_ADDR}_{token}_{r}" for r in range(world_size)]


def cleanup(token, world_size):
    """Remove run `token`'s segments (the op never unlinks them)."""
    for name in segments(token, world_size):
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except FileNotFoundError:
            pass
