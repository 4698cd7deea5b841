"""Real PyTorch distributed programs, run at 2 ranks on "shm" (processes) and on "threaded"
(rank threads) against gloo (issue 15). tests/test_programs.py drives them.

A program is `fn(rank, world_size, workdir) -> {name: tensor}`: it builds its model inside
`threaded_pg.rng_lock(seed)` (rank threads share torch's RNG; in a process it only seeds),
trains or runs a few steps, and returns what it produced (parameters, outputs, losses),
cloned to plain CPU tensors. `workdir` is a directory every rank of the run shares
(checkpoints). Programs register themselves with @program in the modules below; the
registry keeps their order. `compare` says how a run is held against gloo's: BITWISE, or
(rtol, atol) with the reason the reduction order differs. A program torch itself cannot
run on CPU says why in `torch_fails`: gloo must fail, and "shm"/"threaded" the same way. A
program that needs a newer torch than the oldest the package supports says so in `since`
((major, minor), what it needs); on an older torch it is skipped with that reason. A
program that computes what another one does by another route says so in `same_as`
((program, why)): where gloo fails on it in a run, "shm"/"threaded" are held against
gloo's run of that other program (with a warning naming gloo's failure).
"""

import dataclasses
import importlib

__all__ = ["Program", "program", "programs", "BITWISE", "MODULES"]

BITWISE = "bitwise"
MODULES = ("ddp", "fsdp", "parallel", "functional")


@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    fn: object
    compare: object = BITWISE  # or (rtol, atol, reason)
    slow: bool = False  # -m slow only (a fast variant of the same program runs in CI)
    torch_fails: str = ""  # why torch itself cannot run it on CPU (gloo fails the same way)
    # (reason, keys) for a program that draws from torch's global RNG mid-run, which rank
    # threads share: on threads only `keys` are held against gloo, and the parameters
    # (keys without "loss") must agree across the ranks
    threads_rng: tuple = ()
    since: tuple = ()  # ((major, minor), what needs it): skipped on an older torch
    same_as: tuple = ()  # (program, why): the reference where gloo cannot run this one

    def unsupported(self, torch_version):
        """Why this torch cannot run the program (None when it can)."""
        if self.since and tuple(torch_version[:2]) < tuple(self.since[0]):
            return f"needs torch >= {'.'.join(map(str, self.since[0]))}: {self.since[1]}"
        return None


_REGISTRY = {}


def program(name, compare=BITWISE, slow=False, torch_fails="", threads_rng=(), since=(),
            same_as=()):
    """Register `fn` as program `name` (a decorator)."""
    def register(fn):
        if name in _REGISTRY:
            raise ValueError(f"program {name!r} registered twice")
        _REGISTRY[name] = Program(name, fn, compare, slow, torch_fails, threads_rng, since,
                                  same_as)
        return fn
    return register


def programs():
    """Every registered program, in registration order (importing the program modules)."""
    for module in MODULES:
        importlib.import_module(f"{__name__}.{module}")
    return dict(_REGISTRY)
