"""Sizes on the benchmarks' command lines, and the iteration plan of one size.

parse_size reads '8', '64K', '256M', '1G' (binary units), human writes them back,
size_range is nccl-tests' -b/-e/-f sweep, and plan_iterations caps the bytes that one size
moves (warmup and timed loop).
"""

import argparse

__all__ = ["parse_size", "human", "size_range", "plan_iterations"]

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text) -> int:
    """'8' -> 8, '64K' / '64KB' / '64KiB' -> 65536, '256M' -> 268435456, '1G' ... (binary)."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper().replace("_", "")
    for tail in ("IB", "B"):
        if s.endswith(tail) and len(s) > len(tail):
            s = s[: -len(tail)]
            break
    suffix = s[-1] if s and s[-1] in _SUFFIX else ""
    number = s[: len(s) - len(suffix)]
    try:
        value = float(number) * _SUFFIX[suffix]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 8, 64K, 256M, 1G)")
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"bad size {text!r}")
    return int(value)


def human(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B" if nbytes < 1024 else f"{nbytes / 1024:.1f}K"


def size_range(minbytes: int, maxbytes: int, factor: int) -> list:
    if minbytes > maxbytes:
        raise ValueError(f"-b {minbytes} is larger than -e {maxbytes}")
    if factor < 2:
        raise ValueError("-f must be an integer >= 2")
    sizes, s = [], minbytes
    while s <= maxbytes:
        sizes.append(s)
        s *= factor
    return sizes


def plan_iterations(nbytes: int, iters: int, warmup: int, iter_bytes: int, min_iters: int):
    """(warmup, iters) for one size: at most ~iter_bytes moved in the timed loop (a quarter of
    that in warmup), but never fewer than min_iters timed / 1 warmup iteration."""
    nb = max(1, nbytes)
    n = min(iters, max(min_iters, iter_bytes // nb))
    w = min(warmup, max(1, (iter_bytes // 4) // nb)) if warmup > 0 else 0
    return w, max(1, n)
