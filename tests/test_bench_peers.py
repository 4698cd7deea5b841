"""The reference peers of benchmarks/bench.py: single-core memcpy, Open MPI via mpi4py and
DeepSpeed's CPU shm all-reduce.

Fast: the memcpy runs happen in this process, the MPI runs start one mpirun of 2 ranks each
(about 4-8 s apiece on a 2-core machine). The MPI tests skip when mpirun or mpi4py is missing,
the DeepSpeed runs when deepspeed is not installed (its op compiles once, ~30 s, then loads
from torch's extension cache).
"""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench, deepspeed_peer  # noqa: E402
from support import devshm  # noqa: E402

MPI_WHY = bench.mpi_unavailable()
needs_mpi = pytest.mark.skipif(MPI_WHY is not None, reason=f"mpi4py peer unavailable: {MPI_WHY}")
needs_deepspeed = pytest.mark.skipif(not deepspeed_peer.installed(),
                                     reason="deepspeed is not installed")


def _run(tmp_path, *argv):
    """bench.main in this process; returns (exit status, rows, error records)."""
    out = tmp_path / "bench.jsonl"
    code = bench.main([*argv, "--out", str(out)])
    records = bench.load_jsonl(out)
    assert records[0]["record"] == "header"
    rows = [r for r in records if r.get("record") == "row"]
    errors = [r for r in records if r.get("record") == "error"]
    return code, rows, errors


# ---------------------------------------------------------------------------------------
# memcpy
# ---------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_memcpy_rows_verified_and_positive(tmp_path):
    code, rows, errors = _run(tmp_path, "--backends", "memcpy", "--world-sizes", "2",
                              "--ops", "all_reduce", "-b", "4K", "-e", "64K", "-f", "16",
                              "-n", "5")
    assert code == bench.EXIT_OK and not errors
    assert [r["nbytes"] for r in rows] == [4096, 65536]
    for r in rows:
        assert set(bench.COLUMNS) <= set(r)
        assert (r["backend"], r["op"], r["world_size"]) == ("memcpy", "memcpy", 1)
        assert r["wrong"] == 0 and r["iters"] == 5
        assert r["time_us"] > 0 and r["algbw_GBps"] > 0
        assert r["busbw_GBps"] == pytest.approx(2 * r["algbw_GBps"])  # read + write
        assert r["busbw_GBps"] == pytest.approx(2 * r["nbytes"] / (r["time_us"] * 1e3))


@pytest.mark.timeout(120)
def test_memcpy_inject_error_is_detected(tmp_path):
    code, rows, _ = _run(tmp_path, "--backends", "memcpy", "--ops", "all_reduce",
                         "-b", "8", "-e", "1K", "-f", "128", "-n", "3", "--inject-error")
    assert code == bench.EXIT_WRONG
    assert len(rows) == 2 and all(r["wrong"] > 0 for r in rows)


@pytest.mark.timeout(120)
def test_rounds_tag_rows_and_the_median_round_is_reported(tmp_path):
    code, rows, errors = _run(tmp_path, "--backends", "memcpy", "--ops", "all_reduce",
                              "-b", "4K", "-e", "64K", "-f", "16", "-n", "3", "--rounds", "3")
    assert code == bench.EXIT_OK and not errors
    assert sorted((r["nbytes"], r["round"]) for r in rows) == \
        [(n, k) for n in (4096, 65536) for k in range(3)]
    merged = bench.merge_rounds(rows)
    assert len(merged) == 2
    for m in merged:
        times = sorted(r["time_us"] for r in rows if r["nbytes"] == m["nbytes"])
        assert m["time_us"] == times[1] and m["rounds"] == 3


def test_merge_rounds_median_and_wrong():
    rows = [_row("shm", "all_reduce", 2, 8, t, 0.0) for t in (30.0, 10.0, 20.0, 40.0)]
    rows[3]["wrong"] = 2  # the slowest round was also wrong: the merged row says so
    [m] = bench.merge_rounds(rows)
    assert m["time_us"] == 20.0 and m["rounds"] == 4 and m["wrong"] == 2
    assert bench.merge_rounds(rows[:1]) == [rows[0]]  # one round: the row as it was
    with pytest.raises(SystemExit):
        bench.resolve_args(["--rounds", "0"])


def test_report_preset_budget_and_its_override():
    # --report gives 16 MiB 16 warmup + 64 timed calls (a fresh buffer needs ~10 calls to
    # reach its steady speed); the plain default stays 256M; an explicit value wins.
    report = bench.resolve_args(["--report"])
    assert report.iter_bytes == 1 << 30
    assert bench.plan_iterations(16 << 20, report.iters, report.warmup, report.iter_bytes,
                                 report.min_iters) == (16, 64)
    assert bench.resolve_args([]).iter_bytes == 256 << 20
    assert bench.resolve_args(["--report", "--iter-bytes", "64M"]).iter_bytes == 64 << 20


def _row(backend, op, ws, nbytes, time_us, busbw, wrong=0):
    return {"record": "row", "backend": backend, "op": op, "world_size": ws, "nbytes": nbytes,
            "time_us": time_us, "busbw_GBps": busbw, "wrong": wrong}


def _table_lines(text):
    """{(op, world_size, nbytes): cells after nbytes} of a memcpy_table."""
    return {tuple(l.split()[:3]): l.split()[3:] for l in text.splitlines()[3:]}


def test_memcpy_table_ratio_and_target():
    M16 = 16 << 20
    rows = [
        _row("memcpy", "memcpy", 1, 1 << 20, 50.0, 40.0),
        _row("memcpy", "memcpy", 1, M16, 3000.0, 12.0),
        _row("shm", "all_reduce", 2, M16, 5000.0, 3.0),      # 3/12 = 0.25 >= 1/6
        _row("mpi4py", "all_reduce", 2, M16, 9000.0, 1.2),   # 0.1
        _row("shm", "all_reduce", 2, 1 << 20, 100.0, 4.0),   # below 16M: no verdict
        _row("shm", "broadcast", 2, M16, 5000.0, 1.0),       # other op: no verdict
        _row("shm", "all_reduce", 4, 2 << 20, 100.0, 4.0),   # no memcpy row at 2M: nearest
    ]
    text = bench.memcpy_table(rows)
    assert "busbw / memcpy read+write" in text
    cells = _table_lines(text)
    AR16 = ("all_reduce", "2", str(M16))
    assert cells[AR16] == ["12.000", "0.250", "0.100", "ok"]
    assert cells[("all_reduce", "2", str(1 << 20))] == ["40.000", "0.100", "-"]
    assert cells[("broadcast", "2", str(M16))] == ["12.000", "0.083", "-"]
    assert cells[("all_reduce", "4", str(2 << 20))] == ["40.000", "@1M", "~0.100", "-"]
    rows[2]["busbw_GBps"] = 1.9  # 1.9/12 < 1/6
    assert _table_lines(bench.memcpy_table(rows))[AR16][-1] == "BELOW"
    rows[2]["wrong"] = 3
    assert _table_lines(bench.memcpy_table(rows))[AR16] == ["12.000", "WRONG", "0.100", "WRONG"]
    assert bench.memcpy_table([r for r in rows if r["backend"] != "memcpy"]) == ""


def test_ratio_table_shm_vs_mpi4py_and_pairs():
    rows = [_row("shm", "all_reduce", 2, 1024, 10.0, 2.0),
            _row("mpi4py", "all_reduce", 2, 1024, 20.0, 1.0),
            _row("memcpy", "memcpy", 1, 1024, 1.0, 9.0)]
    text = bench.ratio_table(rows, "shm", "mpi4py")
    assert "shm vs mpi4py" in text
    assert text.splitlines()[-1].split()[-2:] == ["0.500", "2.000"]  # lat, busbw
    assert bench.default_pairs(["memcpy", "shm", "gloo", "mpi4py"]) == [
        ("shm", "gloo"), ("shm", "mpi4py")]
    args = bench.resolve_args(["--backends", "shm,gloo,mpi4py,memcpy",
                               "--compare", "shm,gloo", "--compare", "shm,mpi4py"])
    assert args.pairs == [("shm", "gloo"), ("shm", "mpi4py")]


# ---------------------------------------------------------------------------------------
# mpi4py
# ---------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_mpi_unavailable_is_reported_and_others_go_on(tmp_path):
    code, rows, errors = _run(tmp_path, "--backends", "mpi4py,memcpy", "--world-sizes", "2",
                              "--ops", "all_reduce", "-b", "8", "-e", "8", "-n", "3",
                              "--mpirun", str(tmp_path / "no-such-mpirun"))
    assert code == bench.EXIT_ERROR
    assert [(e["backend"], e["kind"]) for e in errors] == [("mpi4py", "unavailable")]
    assert "not found" in errors[0]["message"]
    assert [r["backend"] for r in rows] == ["memcpy"] and rows[0]["wrong"] == 0


@needs_mpi
@pytest.mark.timeout(120)
def test_mpi4py_rows_verified(tmp_path):
    code, rows, errors = _run(tmp_path, "--backends", "mpi4py", "--world-sizes", "2",
                              "--ops", "all_reduce,broadcast", "-b", "8", "-e", "64K",
                              "-f", "64", "-n", "3")
    assert not errors, json.dumps(errors, indent=1)
    assert code == bench.EXIT_OK
    got = [(r["op"], r["nbytes"]) for r in rows]
    assert got == [(op, nb) for op in ("all_reduce", "broadcast") for nb in (8, 512, 32768)]
    for r in rows:
        assert set(bench.COLUMNS) <= set(r)
        assert r["backend"] == "mpi4py" and r["world_size"] == 2 and r["wrong"] == 0
        assert r["iters"] == 3 and r["time_us"] > 0 and len(r["rank_median_us"]) == 2
        # busbw factor: all_reduce 2(n-1)/n = 1 at n = 2, broadcast 1
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"])
        assert r["algbw_GBps"] == pytest.approx(r["nbytes"] / (r["time_us"] * 1e3))


@needs_mpi
@pytest.mark.timeout(120)
def test_mpi4py_corrupted_result_is_detected(tmp_path):
    """--inject-error damages one output element after every MPI call (through the same
    memory MPI wrote): every row must count it, and the exit status must say WRONG."""
    code, rows, errors = _run(tmp_path, "--backends", "mpi4py", "--world-sizes", "2",
                              "--ops", "all_reduce,reduce,all_gather,reduce_scatter",
                              "-b", "8", "-e", "256", "-f", "32", "-n", "3", "--inject-error")
    assert not errors, json.dumps(errors, indent=1)
    assert code == bench.EXIT_WRONG
    assert [r["op"] for r in rows] == ["all_reduce", "all_reduce", "reduce", "reduce",
                                       "all_gather", "all_gather", "reduce_scatter",
                                       "reduce_scatter"]
    assert all(r["wrong"] > 0 for r in rows)


# ---------------------------------------------------------------------------------------
# DeepSpeed
# ---------------------------------------------------------------------------------------
def _deepspeed_segments():
    return {n for n in devshm.listing() if n.startswith("deepspeed_allreduce_buffer")}


@pytest.mark.timeout(120)
def test_deepspeed_reports_what_its_op_cannot_do_and_others_go_on(tmp_path):
    assert "int32" in deepspeed_peer.unavailable(["all_reduce"], "int32")
    assert "only all_reduce" in deepspeed_peer.unavailable(["broadcast"], "float32")
    code, rows, errors = _run(tmp_path, "--backends", "deepspeed,memcpy", "--world-sizes", "2",
                              "--ops", "all_reduce", "--dtype", "int32", "-b", "8", "-e", "8",
                              "-n", "3")
    assert code == bench.EXIT_ERROR
    assert [(e["backend"], e["kind"]) for e in errors] == [("deepspeed", "unavailable")]
    assert [r["backend"] for r in rows] == ["memcpy"] and rows[0]["wrong"] == 0


@needs_deepspeed
@pytest.mark.timeout(240)
def test_deepspeed_rows_verified_other_ops_skipped_no_segment_left(tmp_path, capsys):
    before = _deepspeed_segments()
    code, rows, errors = _run(tmp_path, "--backends", "deepspeed", "--world-sizes", "2",
                              "--ops", "all_reduce,broadcast", "-b", "8", "-e", "64K",
                              "-f", "64", "-n", "3")
    assert not errors, json.dumps(errors, indent=1)
    assert code == bench.EXIT_OK
    assert [(r["op"], r["nbytes"]) for r in rows] == [("all_reduce", nb) for nb in (8, 512, 32768)]
    for r in rows:
        assert r["backend"] == "deepspeed" and r["wrong"] == 0 and r["time_us"] > 0
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"])  # 2(n-1)/n = 1 at n = 2
    assert "has no broadcast: skipped" in capsys.readouterr().out
    assert _deepspeed_segments() == before  # the op never unlinks them; the bench does


@needs_deepspeed
@pytest.mark.timeout(240)
def test_deepspeed_corrupted_result_is_detected(tmp_path):
    """--inject-error damages one output element after every DeepSpeed call: the rows must
    count it (the peer is verified like every other backend)."""
    code, rows, errors = _run(tmp_path, "--backends", "deepspeed", "--world-sizes", "2",
                              "--ops", "all_reduce", "-b", "8", "-e", "256", "-f", "32",
                              "-n", "3", "--inject-error")
    assert not errors, json.dumps(errors, indent=1)
    assert code == bench.EXIT_WRONG
    assert len(rows) == 2 and all(r["wrong"] > 0 for r in rows)


@pytest.mark.timeout(120)
def test_unknown_backend_is_reported_at_init_by_name(tmp_path):
    code, rows, errors = _run(tmp_path, "--backends", "nosuch,memcpy", "--world-sizes", "2",
                              "--ops", "all_reduce", "-b", "8", "-e", "8", "-n", "3")
    assert code == bench.EXIT_ERROR
    assert [(e["backend"], e["kind"]) for e in errors] == [("nosuch", "init failed")]
    assert "did not register a backend named 'nosuch'" in errors[0]["message"]
    assert [r["backend"] for r in rows] == ["memcpy"]


def test_git_commit_reads_main_checkouts_and_linked_worktrees(tmp_path):
    """The run header's commit, read from .git without a git process: a plain checkout,
    and a linked worktree whose branch ref lives in the main repository (commondir)."""
    import subprocess

    from benchmarks.header import git_commit

    def git(*args, cwd=tmp_path / "repo"):
        return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                              text=True, env={**os.environ, "GIT_AUTHOR_NAME": "t",
                                              "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                                              "GIT_COMMITTER_EMAIL": "t@t"}).stdout.strip()
    (tmp_path / "repo").mkdir()
    git("init", "-q")
    (tmp_path / "repo" / "f").write_text("x")
    git("add", "f")
    git("commit", "-qm", "one")
    head = git("rev-parse", "HEAD")
    assert git_commit(tmp_path / "repo") == head
    git("worktree", "add", "-q", "-b", "side", str(tmp_path / "wt"))
    (tmp_path / "wt" / "g").write_text("y")
    git("add", "g", cwd=tmp_path / "wt")
    git("commit", "-qm", "two", cwd=tmp_path / "wt")
    assert git_commit(tmp_path / "wt") == git("rev-parse", "HEAD", cwd=tmp_path / "wt") != head


def test_nccl_on_a_shared_gpu_is_skipped_with_its_reason_before_nccl_2_30(tmp_path, capsys,
                                                                          monkeypatch):
    """NCCL < 2.30 refuses two ranks on one GPU: the benchmark skips that column, records
    why, and still exits 0 when everything else passed (scripts/gpu_check.sh relies on it)."""
    from benchmarks import device, ranks, rows
    why = device.nccl_unavailable("cuda", 2, nccl_version=(2, 28, 9), gpus=1)
    assert "NCCL 2.28.9 refuses" in why and "2 ranks on 1 GPU" in why
    assert device.nccl_unavailable("cuda", 2, nccl_version=(2, 30, 0), gpus=1) is None
    assert device.nccl_unavailable("cuda", 2, nccl_version=(2, 28, 9), gpus=2) is None
    assert device.nccl_unavailable("cpu", 4, nccl_version=(2, 28, 9), gpus=1) is None
    out = tmp_path / "r.jsonl"
    with open(out, "w") as f:
        rep = rows.Reporter(f)
        args = bench.resolve_args(["--device", "cuda", "--backends", "nccl", "--sizes", "8"])
        original = device.nccl_unavailable
        monkeypatch.setattr(device, "nccl_unavailable",
                            lambda dev, ws: original(dev, ws, (2, 28, 9), 1))
        ranks.run_config("nccl", 2, args, rep)  # no rank is started
    assert rep.errors == [] and rep.rows == []
    assert [k["backend"] for k in rep.skips] == ["nccl"]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert recs == [{"record": "skip", "backend": "nccl", "world_size": 2,
                     "reason": why}]
    assert bench.main(["--load", str(out)]) == 0
    assert "skipped: NCCL 2.28.9 refuses" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------
# --fresh-inputs
# ---------------------------------------------------------------------------------------
def test_fresh_inputs_reset_rewrites_the_input_and_poisons_the_output():
    """What --fresh-inputs makes of a non-in-place op's buffers (benchmarks.ranks): reset()
    writes the input back from its copy and still poisons the output."""
    import torch

    from benchmarks import collectives
    buf = collectives.get("all_gather").build(8, 0, 2, torch.float32, 0)
    buf.pristine = buf.inp.clone()
    want = buf.inp.clone()
    buf.inp.fill_(-5.0)
    buf.out.fill_(7.0)
    buf.reset()
    assert torch.equal(buf.inp, want)
    assert torch.isnan(buf.out).all()  # float32's poison


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["shm", pytest.param("mpi4py", marks=needs_mpi)])
def test_fresh_inputs_rows_verified(tmp_path, backend):
    code, rows, errors = _run(tmp_path, "--backends", backend, "--world-sizes", "2",
                              "--ops", "all_gather,reduce_scatter,all_to_all", "-b", "64",
                              "-e", "64K", "-f", "1024", "-n", "3", "--fresh-inputs")
    assert not errors, json.dumps(errors, indent=1)
    assert code == bench.EXIT_OK
    assert [(r["op"], r["nbytes"]) for r in rows] == [
        (op, nb) for op in ("all_gather", "reduce_scatter", "all_to_all") for nb in (64, 65536)]
    assert all(r["wrong"] == 0 for r in rows)
    header = bench.load_jsonl(tmp_path / "bench.jsonl")[0]
    assert header["settings"]["fresh_inputs"] is True


def test_settle_stops_when_any_rank_says_so():
    """benchmarks.ranks.settle: barriers in batches until the flag of some rank (here a
    stand-in for the side channel: the third batch's) says the time is spent; every rank
    calls the same number of barriers."""
    from benchmarks.ranks import SETTLE_BATCH, settle
    calls, asked = [], []

    def any_rank(flag):
        asked.append(flag)
        return len(asked) == 3

    n = settle(lambda: calls.append(1), any_rank, seconds=3600.0)
    assert n == len(calls) == 1 + 3 * SETTLE_BATCH
    assert asked == [False, False, False]  # this rank's own clock had not run out
    assert settle(lambda: None, lambda flag: flag, seconds=0.0) == 1 + SETTLE_BATCH
