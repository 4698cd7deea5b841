"""Reference peer for benchmarks.bench: the same collectives through Open MPI (mpi4py).

    mpirun --allow-run-as-root --oversubscribe -n N [mpirun args] \\
        python -m benchmarks.mpi_peer <config.json | inline JSON>

You normally don't run this yourself: ``python -m benchmarks.bench --backends mpi4py`` (or
``--backends shm,gloo,mpi4py``) writes the config, launches mpirun with a deadline and kills it
on a hang. Its default mpirun arguments are ``--bind-to none --mca pml ob1 --mca btl self,sm``
(Open MPI 5: the ob1 point-to-point layer over the shared-memory BTL "sm", which replaced
"vader" of 4.x; with CMA single-copy for large messages), see ``--mpirun-args``.

Every rank does exactly what a torch rank (benchmarks/ranks.py) does, with the MPI call in
place of the torch.distributed call:

* the buffers, input patterns, output poisoning and exact verification are those of
  benchmarks/collectives.py (torch tensors; MPI gets their memory through ``.numpy()`` views,
  so ``reset`` / ``corrupt`` / ``check`` act on the very bytes MPI reads and writes);
* iteration planning (``plan_iterations``), warmup, timing and the ``--inject-error`` hook are
  the torch ranks' own ``_bench_one``, with ``MPI_Barrier`` in place of ``dist.barrier``;
* rows are built by ``make_row`` (benchmarks/rows.py), so the columns and busbw factors are
  the same.

Op mapping (all SUM, all blocking): all_reduce -> Allreduce(IN_PLACE) (torch's all_reduce is
in place too), broadcast -> Bcast, all_gather -> Allgather, reduce_scatter ->
Reduce_scatter_block, reduce -> Reduce (IN_PLACE on the root), all_to_all -> Alltoall.
float16 reductions use MPI's FLOAT16_T (an Open MPI extension); bfloat16 can only be moved
(broadcast / all_gather / all_to_all), a bfloat16 reduction is reported as a failed op.

Bookkeeping does not go through MPI data transfers: after each size every rank writes its
medians and wrong count to a file in the run directory, an MPI_Barrier orders the writes
before the reads, and rank 0 reads all files and appends the row to the events file that the
parent follows (the same events as the torch ranks: ready / begin / row / op_error / done /
fatal).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


class _Fatal(Exception):
    pass


def _load_config(arg: str) -> dict:
    text = arg.strip()
    if not text.startswith("{"):
        text = Path(arg).read_text()
    return json.loads(text)


def _env_rank() -> int:
    """This process's rank before MPI is initialised (for reporting a failed import)."""
    for key in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def library_version(MPI) -> str:
    """'Open MPI v5.0.11' (the first field of MPI_Get_library_version, NULs stripped)."""
    text = MPI.Get_library_version().replace("\x00", "").strip()
    return text.splitlines()[0].split(",")[0].strip() if text else "unknown MPI library"


class _MpiBarrier:
    """Stands in for torch.distributed in bench._bench_one (which only calls barrier())."""

    def __init__(self, comm):
        self.comm = comm

    def barrier(self):
        self.comm.Barrier()


class MpiOp:
    """A collectives.Collective whose ``run`` is the matching mpi4py call.

    ``build`` builds the torch buffers of collectives.py and binds the MPI call to byte views
    of their memory once, so the timed call is one closure call plus the mpi4py call.
    """

    def __init__(self, spec, comm, MPI):
        self.spec, self.comm, self.MPI = spec, comm, MPI
        self.name = spec.name
        self.splits = spec.splits

    def busbw_factor(self, world_size):
        return self.spec.busbw_factor(world_size)

    def count_for(self, nbytes, itemsize, world_size):
        return self.spec.count_for(nbytes, itemsize, world_size)

    def nbytes_for(self, count, itemsize):
        return self.spec.nbytes_for(count, itemsize)

    def check(self, buf):
        return self.spec.check(buf)

    def run(self, buf):
        buf.mpi_call()

    def mpi_type(self, dtype, reduces: bool):
        import torch

        MPI = self.MPI
        table = {
            torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE,
            torch.float16: getattr(MPI, "FLOAT16_T", MPI.DATATYPE_NULL),
            torch.bfloat16: getattr(MPI, "BFLOAT16_T", MPI.DATATYPE_NULL),
            torch.int8: MPI.INT8_T, torch.uint8: MPI.UINT8_T, torch.int16: MPI.INT16_T,
            torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T,
        }
        t = table.get(dtype, MPI.DATATYPE_NULL)
        if t == MPI.DATATYPE_NULL:
            if reduces:
                raise NotImplementedError(
                    f"this MPI library has no datatype to reduce {dtype} "
                    f"({library_version(MPI)})")
            # data movement only: any type of the same size moves the same bytes
            size = torch.empty(0, dtype=dtype).element_size()
            t = {1: MPI.UINT8_T, 2: MPI.UINT16_T, 4: MPI.UINT32_T, 8: MPI.UINT64_T}[size]
        return t

    def build(self, count, rank, world_size, dtype, seed, root=0):
        import torch

        MPI, comm, name = self.MPI, self.comm, self.name
        buf = self.spec.build(count, rank, world_size, dtype, seed, root=root)
        T = self.mpi_type(dtype, reduces=name in ("all_reduce", "reduce", "reduce_scatter"))

        def spec_of(t):  # [bytes of the tensor's memory, MPI datatype]
            assert t.is_contiguous()
            return [t.view(-1).view(torch.uint8).numpy(), T]

        out, inp = spec_of(buf.out), spec_of(buf.inp)
        SUM = MPI.SUM
        if name == "all_reduce":
            buf.mpi_call = lambda: comm.Allreduce(MPI.IN_PLACE, out, op=SUM)
        elif name == "reduce":
            if rank == root:
                buf.mpi_call = lambda: comm.Reduce(MPI.IN_PLACE, out, op=SUM, root=root)
            else:
                buf.mpi_call = lambda: comm.Reduce(out, None, op=SUM, root=root)
        elif name == "broadcast":
            buf.mpi_call = lambda: comm.Bcast(out, root=root)
        elif name == "all_gather":
            buf.mpi_call = lambda: comm.Allgather(inp, out)
        elif name == "reduce_scatter":
            buf.mpi_call = lambda: comm.Reduce_scatter_block(inp, out, op=SUM)
        elif name == "all_to_all":
            buf.mpi_call = lambda: comm.Alltoall(inp, out)
        else:
            raise NotImplementedError(f"op {name!r} has no MPI mapping")
        return buf


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: mpirun -n N python -m benchmarks.mpi_peer <config.json | JSON>",
              file=sys.stderr)
        return 2
    cfg = _load_config(argv[0])
    rundir = Path(cfg["rundir"])
    rank = _env_rank()
    (rundir / f"pid.rank{rank}").write_text(str(os.getpid()))
    events = None

    def emit(**ev):
        if events is not None:
            events.write(json.dumps(ev) + "\n")
            events.flush()

    try:
        import torch

        from benchmarks import bench, collectives
        from benchmarks.ranks import settle

        torch.set_num_threads(cfg["threads"])
        try:
            import mpi4py

            # No thread of ours calls MPI but the main one; asking for less than
            # MPI_THREAD_MULTIPLE (mpi4py's default) spares Open MPI its locking.
            mpi4py.rc.thread_level = "funneled"
            from mpi4py import MPI
        except BaseException as e:  # noqa: BLE001
            raise _Fatal(f"MPI init failed: import mpi4py / MPI_Init_thread: "
                         f"{type(e).__name__}: {e}") from e
        comm = MPI.COMM_WORLD
        rank, n = comm.Get_rank(), comm.Get_size()
        if n != cfg["world_size"]:
            raise _Fatal(f"MPI init failed: MPI world size {n} != requested "
                         f"{cfg['world_size']} (not started by mpirun -n?)")
        if rank == 0:
            events = open(rundir / "events.jsonl", "a")
        comm.Barrier()
        emit(event="ready", import_error=None,
             library=library_version(MPI),
             mpi4py=mpi4py.__version__)
        barrier = _MpiBarrier(comm)
        settle(comm.Barrier, lambda flag: bool(comm.allreduce(1 if flag else 0, op=MPI.MAX)))
        dtype = collectives.DTYPES[cfg["dtype"]]
        itemsize = torch.empty(0, dtype=dtype).element_size()

        for op_idx, op_name in enumerate(cfg["ops"]):
            spec = MpiOp(collectives.get(op_name), comm, MPI)
            for size_idx, req in enumerate(cfg["sizes"]):
                count = spec.count_for(req, itemsize, n)
                nbytes = spec.nbytes_for(count, itemsize)
                warm, iters = bench.plan_iterations(nbytes, cfg["iters"], cfg["warmup"],
                                                    cfg["iter_bytes"], cfg["min_iters"])
                seed = cfg["seed"] * 1_000_003 + op_idx * 7_919 + size_idx
                emit(event="begin", op=spec.name, nbytes=nbytes)
                res = bench._bench_one(spec, barrier, rank, n, count, dtype, seed, warm,
                                       iters, cfg)
                tag = f"res.{op_idx}.{size_idx}"
                tmp = rundir / f"{tag}.rank{rank}.tmp"
                tmp.write_text(json.dumps(res))
                tmp.replace(rundir / f"{tag}.rank{rank}.json")
                comm.Barrier()  # every rank's file is complete before anyone reads
                allres = [json.loads((rundir / f"{tag}.rank{r}.json").read_text())
                          for r in range(n)]
                bad_ranks = [r for r in range(n) if allres[r]["error"] is not None]
                if bad_ranks:
                    if rank == 0:
                        emit(event="op_error", op=spec.name, nbytes=nbytes, ranks=bad_ranks,
                             message=bench._summarize({r: allres[r]["error"]
                                                       for r in bad_ranks}))
                    break  # skip the larger sizes of this op, go on with the next op
                if rank == 0:
                    emit(event="row", row=bench.make_row(
                        cfg["backend"], spec, n, nbytes, count, cfg["dtype"], iters, warm,
                        [x["median_ns"] for x in allres], [x["min_ns"] for x in allres],
                        sum(int(x["wrong"]) for x in allres)))
        comm.Barrier()
        emit(event="done")
        if events is not None:
            events.close()
        return 0
    except BaseException as e:  # noqa: BLE001
        text = str(e) if isinstance(e, _Fatal) else traceback.format_exc()
        try:
            (rundir / f"fatal.rank{rank}.txt").write_text(text)
            if events is None and rank == 0:
                events = open(rundir / "events.jsonl", "a")
            emit(event="fatal", rank=rank, message=text)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # mpirun then terminates the other ranks


if __name__ == "__main__":
    sys.exit(main())
