"""Whether user buffers are likely on 4 KiB pages, which decides where reading a peer's
buffer with process_vm_readv (single_copy.CMA) pays: the kernel pins every page it
reads, ~65 K pins for 256 MiB on 4 KiB pages against 128 on 2 MiB transparent huge pages.

Nothing cheap tells the page size of an arbitrary buffer, but the allocators' policies do:
torch's CPU allocator asks for huge pages only with THP_MEM_ALLOC_ENABLE=1 (allocations
from 2 MiB, madvise), numpy madvises its arrays from 4 MiB, and the kernel's transparent
huge page mode ("always" / "madvise" / "never") says whether either is honoured. The
answer only tunes algorithm choice (algorithms.select): a wrong guess costs speed, never
correctness, and the ranks agree on one answer at init (shm.ShmRegions).
"""

from .. import config

__all__ = ["thp_mode", "torch_buffers_small_pages", "numpy_buffers_small_pages"]

_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path=_THP_ENABLED):
    """The kernel's transparent huge page mode: "always", "madvise" or "never" (the
    bracketed word of `path`); "never" where it cannot be read (no THP support)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return "never"
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return "never"


def torch_buffers_small_pages(mode=None, environ=None):
    """True unless torch's CPU tensors get huge pages: THP "always", or "madvise" with
    torch's THP_MEM_ALLOC_ENABLE=1 (in config.current_environ() by default)."""
    mode = thp_mode() if mode is None else mode
    environ = config.current_environ() if environ is None else environ
    if mode == "always":
        return False
    return not (mode == "madvise" and environ.get("THP_MEM_ALLOC_ENABLE", "0").strip().lower()
                in ("1", "true", "on", "yes"))


def numpy_buffers_small_pages(mode=None):
    """True unless numpy's large arrays get huge pages (THP "always" or "madvise")."""
    mode = thp_mode() if mode is None else mode
    return mode not in ("always", "madvise")
