"""Helpers the programs share: seeded models, per-rank data, snapshots of results."""

import torch
import torch.nn as nn

import threaded_pg

__all__ = ["build", "mlp", "batches", "params", "snapshot", "SEED"]

SEED = 1234


def build(factory, seed=SEED):
    """factory() with torch seeded: the same parameters on every rank and backend (rank
    threads take turns through rng_lock, each reseeding; a process just seeds)."""
    with threaded_pg.rng_lock(seed):
        return factory()


def mlp(width=16, depth=3, out=4, seed=SEED):
    """A small seeded MLP: depth Linear layers with Tanh between them."""
    def make():
        layers = []
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.Tanh()]
        layers.append(nn.Linear(width, out))
        return nn.Sequential(*layers)
    return build(make, seed)


def batches(rank, steps, batch=8, width=16, out=4, salt=0):
    """`steps` (x, y) pairs of rank `rank`'s own data (a generator of its own: no shared
    RNG state involved)."""
    g = torch.Generator().manual_seed(1000 * (rank + 1) + salt)
    return [(torch.randn(batch, width, generator=g), torch.randn(batch, out, generator=g))
            for _ in range(steps)]


def params(module, prefix=""):
    """{prefix + name: detached clone} of a module's parameters."""
    return {prefix + n: snapshot(p) for n, p in module.named_parameters()}


def snapshot(t):
    """A plain CPU tensor copy of t (a DTensor's local shard, a Parameter's data)."""
    t = t.detach()
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.clone().contiguous()
