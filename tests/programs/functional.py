"""Functional collectives (torch.distributed._functional_collectives), eagerly and under
torch.compile: "aot_eager" in CI (Dynamo traces the collectives into the graph, AOTAutograd
runs it), "inductor" with -m slow (it generates and compiles C++, so it needs a C++
compiler; cold cache, gloo + shm processes + threads: 19 s on the 2-core VM).

Bitwise against gloo: every reduction is one addition a + b at 2 ranks, and the compiled
graph is the same code for both backends.
"""

import types

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from . import program
from .common import build, snapshot


def _collectives(x, group):
    """A few functional collectives and the legacy in-place one Dynamo rewrites into them."""
    s = funcol.all_reduce(x * 2, "sum", group)
    g = funcol.all_gather_tensor(x + 1, 0, group)
    r = funcol.reduce_scatter_tensor(g * 3, "sum", 0, group)
    a = funcol.all_to_all_single(g, None, None, group)
    y = torch.tanh(s) + r.sum()
    dist.all_reduce(y, group=group)  # in place: traced as a functional all_reduce
    return s, g, r, a, y


def _inputs(rank):
    x = build(lambda: torch.randn(4, 3))
    return x + rank


@program("functional_collectives_eager")
def eager(rank, world_size, workdir):
    out = _collectives(_inputs(rank), dist.group.WORLD)
    return {k: snapshot(v) for k, v in zip("sgray", out)}  # waits for the async ones


def _fresh(fn):
    """fn with a code object of its own: Dynamo caches compiled code per code object, so
    every run compiles afresh (torch._dynamo.reset() would also do it, but would pull the
    caches from under another rank thread compiling at the same time)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)


def _compiled(backend):
    def run(rank, world_size, workdir):
        fn = torch.compile(_fresh(_collectives), backend=backend, fullgraph=True)
        return dict(zip("sgray", fn(_inputs(rank), dist.group.WORLD)))
    return run


program("functional_collectives_compile_aot_eager")(_compiled("aot_eager"))
program("functional_collectives_compile_inductor", slow=True)(_compiled("inductor"))
