"""benchmarks.ddp_step runs end to end: mlp, 2 ranks, shm and gloo, a few steps, verified,
under DDP and under FSDP2.

Spawns three short runs (compute-only, shm, gloo) for DDP and two for FSDP2; ~25 s and
~15 s on a loaded 2-core host, mostly spawning ranks and importing torch. The ranks destroy
their process groups and the parent joins (or kills) them before run_benchmark returns, so
the /dev/shm leak check applies.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import ddp_step  # noqa: E402
from shmcoll.torch_backend.compat import TORCH_VERSION  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch, pytest.mark.timeout(180)]


def test_ddp_step_mlp_shm_vs_gloo():
    rows = ddp_step.run_benchmark(models=["mlp"], world_sizes=[2], backends=["shm", "gloo"],
                                  steps=3, warmup=3, timeout=55)  # 3 runs: < 180 s
    by_backend = {r["backend"]: r for r in rows}
    assert set(by_backend) == {"compute", "shm", "gloo"}, rows
    for name in ("shm", "gloo"):
        r = by_backend[name]
        assert r["model"] == "mlp" and r["world_size"] == 2
        assert r.get("verify") == "ok", r
        assert r["replicas_identical"] is True
        assert r["step_ms"] > 0 and all(t > 0 for t in r["rank_median_ms"])
        assert len(r["rank_median_ms"]) == 2
        assert r["params"] == 1024 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10
        assert r["compute_ms"] == by_backend["compute"]["step_ms"] > 0
        assert r["ratio_vs_gloo"] > 0
    # shm was compared with gloo (2 ranks: a + b is commutative, so even the bits agree)
    assert by_backend["shm"]["ref_backend"] == "gloo"
    assert by_backend["shm"]["vs_ref_max_abs_diff"] <= 1e-5
    assert by_backend["shm"]["init_sha256"] == by_backend["gloo"]["init_sha256"]
    assert "ERROR" not in ddp_step.format_table(rows)


@pytest.mark.skipif(TORCH_VERSION < (2, 6), reason="FSDP2's public fully_shard: torch >= 2.6")
def test_fsdp2_step_mlp_shm_vs_gloo():
    """The FSDP2 rows: every layer sharded over the group, the final parameters gathered
    whole on every rank and held against gloo's (bitwise at 2 ranks: each reduce-scatter
    element is one addition a + b, the all-gathers move bytes)."""
    rows = ddp_step.run_benchmark(models=["mlp"], world_sizes=[2], backends=["shm", "gloo"],
                                  steps=2, warmup=1, timeout=55, compute_only=False,
                                  wrappers=["fsdp2"])
    by_backend = {r["backend"]: r for r in rows}
    assert set(by_backend) == {"shm", "gloo"}, rows
    for r in by_backend.values():
        assert r["wrapper"] == "fsdp2" and r.get("verify") == "ok", r
        assert r["replicas_identical"] is True and r["step_ms"] > 0
    assert by_backend["shm"]["ref_backend"] == "gloo"
    assert by_backend["shm"]["vs_ref_bitwise"] is True
    assert "fsdp2" in ddp_step.format_table(rows)


def test_cross_check_flags_a_mismatch(tmp_path):
    """The parent-side comparison (no processes): a perturbed backend is a mismatch."""
    import torch

    base = torch.linspace(-1, 1, 1000)
    rows = []
    for name, delta in (("gloo", 0.0), ("shm", 0.0), ("bad", 1e-3)):
        p = base.clone()
        p[7] += delta
        f = tmp_path / f"{name}.pt"
        torch.save(p, f)
        rows.append({"backend": name, "verify": "ok", "init_sha256": "x",
                     "_params_file": str(f)})
    ddp_step.cross_check(rows, "gloo")
    assert [r["verify"] for r in rows] == ["ok", "ok", "mismatch"]
    assert rows[1]["vs_ref_bitwise"] is True
    assert "differ from gloo" in rows[2]["problems"][0]
