"""The gloo behaviours of SEEDS.md that "shm" must reproduce as a drop-in (E-table, §3):
timeouts and monitored_barrier; destroy, abort and re-init of groups.

How the seeds run (one job per test on every rank of the harness pool, world size 4): see
seed_util.py. The subjects: test_gloo_seeds_{checks,basics,front_end,lifecycle}.py.
"""

import threading
import time
from datetime import timedelta

import pytest

from seed_util import assert_equal, raises, ranks, run_job, WS

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch]


# ============================================================== timeouts and monitoring

def _timeouts_job(rank, world_size, store):
    import torch
    import torch.distributed as c10d
    import torch.distributed as dist

    ws = world_size
    with ranks(rank, world_size, store) as ctx:
        sync = ctx.pg()  # phases stay aligned through a group no test poisons

        # ---- test_allreduce_op_timeout (E-06): only rank 0 calls, 1 ms per-op timeout;
        # then E-26: the next op fails fast, says "aborted", is a DistBackendError (E-27c)
        pg = ctx.pg()
        opts = c10d.AllreduceOptions()
        opts.timeout = timedelta(milliseconds=1)
        if rank == 0:
            t1 = torch.zeros([1], dtype=torch.float32)
            with raises(RuntimeError, "Timed out waiting 1ms"):
                pg.allreduce([t1], opts).wait()
            with raises(dist.DistBackendError, "Timed out waiting 1ms"):
                pg.allreduce([t1], opts).wait()
            t0 = time.monotonic()
            try:
                pg.allreduce([t1]).wait()
            except dist.DistBackendError as e:
                assert "aborted" in str(e), str(e)
                assert isinstance(e, dist.DistError) and isinstance(e, RuntimeError)
            else:
                raise AssertionError("expected the aborted group to refuse work")
            assert time.monotonic() - t0 < 5, "a poisoned group must fail fast"
        sync.barrier().wait()

        # ---- test_allreduce_overall_timeout: set_timeout(1 ms), rank 0 only
        pg = ctx.pg()
        pg.set_timeout(timedelta(milliseconds=1))
        if rank == 0:
            with raises(RuntimeError, "Timed out waiting 1ms"):
                pg.allreduce([torch.zeros([1])]).wait()
        sync.barrier().wait()

        # ---- per-op timeout wins over the group default; opts._timeout read back
        pg = ctx.pg(timeout_s=1.5)
        assert pg.options._timeout == timedelta(seconds=1.5)
        if rank == 0:
            opts = c10d.AllreduceOptions()
            opts.timeout = timedelta(milliseconds=300)
            t0 = time.monotonic()
            with raises(RuntimeError, "Timed out waiting 300ms"):
                pg.allreduce([torch.zeros([1])], opts).wait()
            assert 0.29 <= time.monotonic() - t0 < 5  # returned at the 300 ms timeout, not 1.5 s
        sync.barrier().wait()

        # ---- E-24 (002 _test_barrier_timeout): only the group's local rank 0 calls
        # barrier; it must not raise before timeout - 0.1 s; " (Timed out|closed|timeout) "
        def barrier_timeout(group_id, timeout):
            if dist.get_rank(group_id) == 0:
                expected_time = time.time() + timeout.total_seconds()
                with raises(Exception, " (Timed out|closed|timeout) "):
                    dist.barrier(group_id)
                assert time.time() >= expected_time - 0.1, (time.time(), expected_time)
                assert time.time() < expected_time + 5

        ctx.init(init_method=f"file://{ctx.file('global_init')}")  # destroy + re-init (PG-51)
        t = torch.ones(1)
        dist.all_reduce(t)
        assert_equal(t, torch.tensor([float(ws)]))
        dist.destroy_process_group()
        sync.barrier().wait()
        ctx.init(init_method=f"file://{ctx.file('global_init')}", timeout_s=1.0)
        # (the groups are made first: their rendezvous must not wait on a stuck rank 0)
        group = dist.new_group([1, 2], timeout=timedelta(seconds=2))
        full = dist.new_group(timeout=timedelta(seconds=1))
        barrier_timeout(dist.group.WORLD, timedelta(seconds=1))       # test_barrier_timeout_global
        if rank in (1, 2):
            barrier_timeout(group, timedelta(seconds=2))              # test_barrier_timeout_group
        else:
            barrier_timeout(full, timedelta(seconds=1))        # test_barrier_timeout_full_group
        sync.barrier().wait()
        dist.destroy_process_group()
        # E-25: with TORCH_DISTRIBUTED_DEBUG=DETAIL the message names the missing ranks
        pg = ctx.pg(timeout_s=1.0)
        previous = dist.get_debug_level()
        dist.set_debug_level(dist.DebugLevel.DETAIL)
        try:
            if rank == 0:
                with raises(Exception, r"rank\(s\) 1, 2, 3 failed to pass monitoredBarrier"):
                    dist.barrier(pg)
        finally:
            dist.set_debug_level(previous)
        sync.barrier().wait()

        # ---- test_nccl_propagate_error_reason, CPU: Work.wait(timeout) expiring raises
        # DistBackendError; the group is aborted; the next op says "aborted"
        shared_store = ctx.filestore()
        pg = ctx.pg(store=shared_store, timeout_s=15.0)
        # PG-05: a group of another backend on the same store, no prefix, used alongside
        pg_side = dist.ProcessGroupGloo(shared_store, rank, ws) \
            if dist.is_gloo_available() else ctx.pg()
        pg.barrier().wait(timedelta(seconds=5))
        if rank == 0:
            pg_side.barrier().wait()  # "stuck" until the others are done
        else:
            with raises(dist.DistBackendError, "Timed out waiting 1000ms"):
                pg.allreduce([torch.ones(1)]).wait(timedelta(seconds=1))
            try:
                pg.allreduce([torch.ones(2)]).wait()
            except dist.DistBackendError as e:
                assert "aborted" in str(e), str(e)
            else:
                raise AssertionError("Expected error to be raised!")
            pg_side.barrier().wait()
        sync.barrier().wait()

        # ---- monitored_barrier (gloo semantics; dist.monitored_barrier itself refuses
        # non-gloo backends, so the method is called on the group)
        pg = ctx.pg()
        pg.monitored_barrier(timedelta(seconds=30))
        pg.monitored_barrier(timedelta(seconds=30), wait_all_ranks=True)
        sync.barrier().wait()
        pg = ctx.pg()
        t0 = time.monotonic()
        if rank == 0:
            with raises(RuntimeError, "Rank 1 failed to pass monitoredBarrier in 1000 ms"):
                pg.monitored_barrier(timedelta(seconds=1))
            assert 0.9 <= time.monotonic() - t0 < 5
        elif rank != 1:
            with raises(RuntimeError, "received errors while waiting for send/recv from rank 0"):
                pg.monitored_barrier(timedelta(seconds=1))
        sync.barrier().wait()
        pg = ctx.pg()
        if rank == 0:
            with raises(RuntimeError, "Ranks 1, 2 failed to pass monitoredBarrier in 1000 ms"):
                pg.monitored_barrier(timedelta(seconds=1), wait_all_ranks=True)
        elif rank == 3:
            with raises(dist.DistBackendError, "Please check rank 0 logs for faulty rank"):
                pg.monitored_barrier(timedelta(seconds=1), wait_all_ranks=True)
        sync.barrier().wait()
        # the monitored barrier does not consume a sequence number of the group
        pg = ctx.pg()
        seq = pg._get_sequence_number_for_group()
        pg.monitored_barrier()
        assert pg._get_sequence_number_for_group() == seq
        pg.allreduce([torch.ones(1)]).wait()
    return True


@pytest.mark.timeout(300)
def test_timeouts():
    """test_allreduce_op_timeout / test_allreduce_overall_timeout (E-06), per-op vs default
    timeout, 002 test_barrier_timeout_{global,group,full_group} (E-24) incl. the re-init of
    the default group, E-25 under DETAIL, 003 test_nccl_propagate_error_reason on CPU (E-26,
    E-27c), monitored_barrier success, failure and wait_all_ranks."""
    assert run_job(_timeouts_job) == [True] * WS


# ================================================================= destroy / abort / re-init

def _lifecycle_job(rank, world_size, store):
    import gc

    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from shmcoll.torch_backend.compat import DESTROY_SHUTS_DOWN

    ws = world_size
    with ranks(rank, world_size, store) as ctx:
        sync = ctx.pg()
        filestore = ctx.filestore("lifecycle")

        # ---- 003 test_abort_in_destroy_pg / test_close_pg: after destroy the old group
        # object refuses work with DistBackendError (E-27b), dist.* with ValueError (F-20)
        pg = ctx.init(store=filestore)
        t = torch.rand(10, 10)
        pg.allreduce(t).wait()
        new_pg1 = c10d.new_group([0, 1])
        new_pg2 = c10d.new_group([0, 1])  # PG-54: never runs a collective
        if rank in (0, 1):
            new_pg1.allreduce(torch.ones(3)).wait()
        dist.destroy_process_group()  # one call: default group and both subgroups
        if DESTROY_SHUTS_DOWN:
            with raises(dist.DistBackendError, "shut down"):
                pg.allreduce([t])
            if rank in (0, 1):
                with raises(dist.DistBackendError, "shut down"):
                    new_pg1.allreduce([t])
                with raises(dist.DistBackendError, "shut down"):
                    new_pg2.barrier()
        else:
            # torch 2.4's destroy shuts no group down but NCCL's: the old objects keep
            # working (as gloo's do) until they are shut down or dropped
            ones = torch.ones(3)
            pg.allreduce([ones]).wait()
            assert_equal(ones, torch.full((3,), float(ws)))
            if rank in (0, 1):
                ones = torch.ones(3)
                new_pg1.allreduce([ones]).wait()
                assert_equal(ones, torch.full((3,), 2.0))
                new_pg2.barrier().wait()
            for group in (pg, new_pg1, new_pg2) if rank in (0, 1) else (pg,):
                group.shutdown()
                with raises(dist.DistBackendError, "shut down"):
                    group.allreduce([ones])
        with raises(ValueError, ""):
            dist.all_reduce(t)

        # ---- 003 test_restart_pg: re-init on PrefixStore("2nd", store) in the same processes
        ctx.init(store=c10d.PrefixStore("2nd", filestore))
        t1 = torch.full((5, 5), float(rank))
        dist.all_reduce(t1)
        assert_equal(t1, torch.full((5, 5), ws * (ws - 1) / 2))
        dist.destroy_process_group()
        with raises(ValueError, ""):
            dist.all_reduce(t1)
        # ... and with a new file:// rendezvous
        ctx.init(init_method=f"file://{ctx.file('third_init')}")
        t1 = torch.ones(4)
        dist.all_reduce(t1)
        assert_equal(t1, torch.full((4,), float(ws)))

        # ---- 003 test_abort_pg on CPU: another thread aborts the group while the main
        # thread is blocked in a collective that only rank 0 entered
        if rank == 0:
            default = c10d._get_default_group()

            def abortpg():
                time.sleep(0.5)
                default._get_backend(torch.device("cpu")).abort()

            thread = threading.Thread(target=abortpg)
            thread.start()
            t0 = time.monotonic()
            with raises(dist.DistBackendError, "abort"):
                dist.all_reduce(t1)  # stuck until the abort wakes it (group timeout 60 s)
            assert time.monotonic() - t0 < 10, time.monotonic() - t0
            thread.join()
            with raises(dist.DistBackendError, "aborted"):
                default.allreduce([t1]).wait()
        sync.barrier().wait()
        dist.destroy_process_group()

        # ---- PG-53: del a group without shutting it down first
        pg = ctx.pg(barrier=False)
        ctx._pgs.remove(pg)
        pg.allreduce([torch.ones(1)]).wait()
        threads = threading.active_count()
        del pg
        gc.collect()
        assert threading.active_count() < threads, "the group's threads must be gone"
        sync.barrier().wait()

        # ---- abort on one rank: its peers blocked in a collective fail instead of hanging
        pg = ctx.pg(timeout_s=30.0)
        if rank == 1:
            time.sleep(0.3)
            pg.abort()
            with raises(dist.DistBackendError, "aborted"):
                pg.allreduce([torch.ones(1)])
        else:
            t0 = time.monotonic()
            with raises(dist.DistBackendError, "abort|closed"):
                pg.allreduce([torch.ones(1)]).wait()
            assert time.monotonic() - t0 < 10
        sync.barrier().wait()

        # ---- an async op nobody waits for is aborted by shutdown (no hang at destroy)
        pg = ctx.pg()
        if rank == 0:
            work = pg.allreduce([torch.ones(1)])  # the others never join
            time.sleep(0.2)
            pg.shutdown()
            with raises(dist.DistBackendError, ""):
                work.wait()
        sync.barrier().wait()
    return True


@pytest.mark.timeout(300)
def test_lifecycle():
    """003 test_abort_in_destroy_pg / test_close_pg / test_restart_pg / test_abort_pg /
    test_abort_in_destroy_multi_pgs / test_destruct_before_terminate_pg on CPU: destroy and
    re-init (PrefixStore, new file://), a destroyed group refusing work (E-27b), abort from
    another thread waking a blocked collective, shutdown with work in flight."""
    assert run_job(_lifecycle_job) == [True] * WS
