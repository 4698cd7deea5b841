"""Every SHMCOLL_* environment variable: name, default, parser and meaning; read once per group."""

import os
from dataclasses import dataclass

__all__ = ["Config", "from_env"]

MIB = 1 << 20


@dataclass(frozen=True)
class Config:
    """Per-group tunables. Defaults are chosen for a small host; see benchmarks/ for evidence."""

    slot_nbytes: int = 4 * MIB  # chunk size: 2 x 4 MiB per rank stays inside a 64 MB /dev/shm at 8 ranks
    nslots: int = 2  # double buffering: copy-in of chunk c+1 overlaps peers reading chunk c
    direct_max_nbytes: int = -1  # all_reduce one-shot threshold; -1 = the table in algorithms.select
    spin: str = "auto"  # "auto" | "spin" | "yield": spin tier on/off (auto: off when ranks > cores)
    shm_dir: str = "/dev/shm"  # where POSIX segments live (for the capacity check and stale-segment GC)


_ENV = {
    "SHMCOLL_SLOT_BYTES": ("slot_nbytes", int),
    "SHMCOLL_NSLOTS": ("nslots", int),
    "SHMCOLL_DIRECT_MAX_BYTES": ("direct_max_nbytes", int),
    "SHMCOLL_SPIN": ("spin", str),
    "SHMCOLL_SHM_DIR": ("shm_dir", str),
}


def from_env(environ=None, **overrides):
    """Build a Config from SHMCOLL_* variables, then apply keyword overrides."""
    environ = os.environ if environ is None else environ
    values = {}
    for var, (field, parse) in _ENV.items():
        if var in environ:
            try:
                values[field] = parse(environ[var])
            except ValueError:
                raise ValueError(f"{var}={environ[var]!r} is not a valid {parse.__name__}") from None
    values.update({k: v for k, v in overrides.items() if v is not None})
    cfg = Config(**values)
    if cfg.spin not in ("auto", "spin", "yield"):
        raise ValueError(f"SHMCOLL_SPIN must be auto, spin or yield, got {cfg.spin!r}")
    return cfg
