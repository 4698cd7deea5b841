"""Point-to-point on backend "shm" at torch level: dist.send, dist.recv, dist.isend/irecv,
dist.batch_isend_irecv and the ProcessGroup's send/recv/recv_anysource over real rank
processes (harness pool): tags, any-source, batches, dtypes bitwise, argument checks, wait
timeouts. Engine level: test_p2p.py. Each test says what it guards.
"""

import time

import pytest

import harness

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


# ============================================================================= torch level

def _torch_send_recv(rank, ws):
    import torch
    import torch.distributed as dist
    # gloo test_send_recv_with_tag: ranks take turns sending to every peer
    for src in range(ws):
        if rank == src:
            for dst in range(ws):
                if dst != rank:
                    dist.send(torch.full((src + 1,) * 3, float(rank)), dst, tag=rank)
        else:
            t = torch.full((src + 1,) * 3, -1.0)
            assert dist.recv(t, src, tag=src) == src
            assert t.eq(src).all()
    # any source (test_send_recv_any_source): alternate recv and irecv
    recv_ranks = {}
    for r in range(ws):
        if r == rank:
            for i in range(2 * (ws - 1)):
                t = torch.full((10, 10, 10), -1.0)
                if i % 2 == 0:
                    sender = dist.recv(t)
                else:
                    w = dist.irecv(t)
                    w.wait()
                    sender = w._source_rank()
                    assert w.source_rank() == sender
                assert t.eq(sender).all()
                recv_ranks[sender] = recv_ranks.get(sender, 0) + 1
        else:
            dist.send(torch.full((10, 10, 10), float(rank)), r)
            dist.send(torch.full((10, 10, 10), float(rank)), r)
        dist.barrier()  # the next receiver's any-source recv must not see later phases
    assert recv_ranks == {p: 2 for p in range(ws) if p != rank}, recv_ranks
    # isend / irecv (test_isend, test_irecv)
    if rank == 0:
        works = [dist.isend(torch.full((dst,) * 3, 10.0), dst) for dst in range(1, ws)]
        for w in works:
            w.wait()
            assert w.is_completed()
        outs = [torch.zeros((src,) * 3) for src in range(1, ws)]
        works = [dist.irecv(outs[src - 1], src) for src in range(1, ws)]
        for w in works:
            w.wait()
            assert w.is_completed()
        for src in range(1, ws):
            assert outs[src - 1].eq(src).all()
    else:
        t = torch.zeros((rank,) * 3)
        dist.recv(t, 0)
        assert t.eq(10).all()
        dist.send(torch.full((rank,) * 3, float(rank)), 0)
    dist.barrier()
    return True


@pytest.mark.torch
def test_torch_send_recv_tags_any_source_isend_irecv():
    """Guards (SEEDS OP-20..22): dist.send/recv with tags, dist.recv without src returns
    the sender, irecv's _source_rank()/source_rank(), isend/irecv is_completed()."""
    assert harness.run_torch_ranks(_torch_send_recv, 3, timeout_s=240) == [True] * 3


def _torch_batch(rank, ws):
    import torch
    import torch.distributed as dist

    def exchange(pairs, tagged=False, n=5000):
        """Every (src, dst) pair in `pairs`; receives listed before sends."""
        recvs, ops = {}, []
        for src, dst in pairs:
            if dst == rank:
                recvs[src] = torch.full((n,), -1.0)
                ops.append(dist.P2POp(dist.irecv, recvs[src], src, tag=src if tagged else 0))
        for src, dst in pairs:
            if src == rank:
                ops.append(dist.P2POp(dist.isend, torch.full((n,), float(rank * 100 + dst)),
                                      dst, tag=rank if tagged else 0))
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        for src, t in recvs.items():
            assert t.eq(src * 100 + rank).all(), (pairs, src)

    others = [(s, d) for s in range(ws) for d in range(ws) if s != d]
    exchange(others)  # (a) gloo: all pairs, recv first
    exchange(others, tagged=True)  # (b) gloo tags
    exchange(others + [(r, r) for r in range(ws)])  # (c) including self
    exchange([(r, (r + 1) % ws) for r in range(ws)])  # (d) ring
    exchange([(0, 0)])  # (e) rank 0 alone, to itself
    exchange([(1, 2), (2, 1)])  # (f) only ranks 1 and 2
    exchange(others, n=100000)  # multi-cell messages in every direction at once
    sub = dist.new_group([1, 2])  # a subgroup: peers are global ranks, its own mailboxes
    if rank in (1, 2):
        peer = 3 - rank
        out = torch.zeros(7)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.irecv, out, peer, sub),
                                       dist.P2POp(dist.isend, torch.full((7,), rank * 1.0),
                                                  peer, sub)])
        for w in reqs:
            w.wait()
        assert out.eq(peer).all()
        if rank == 1:
            dist.send(torch.full((3,), 5.0), 2, group=sub)
        else:
            assert dist.recv(out[:3], group=sub) == 1 and out[:3].eq(5).all()
    dist.barrier()
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t.eq(ws).all()
    return True


@pytest.mark.torch
def test_torch_batch_isend_irecv_patterns():
    """Guards (SEEDS OP-23, §4.6): batch_isend_irecv with receives before sends for every
    pair (untagged and tagged), including self, ring, rank 0 alone to itself, a subset of
    ranks, large messages in every direction, and p2p on a subgroup (global peer ranks,
    any-source recv returning the global rank); collectives still work afterwards."""
    assert harness.run_torch_ranks(_torch_batch, 4, timeout_s=240) == [True] * 4


def _torch_dtypes_and_checks(rank, ws):
    import torch
    import torch.distributed as dist
    peer = 1 - rank
    g = torch.Generator().manual_seed(1234)
    bits = torch.randint(-2 ** 15, 2 ** 15, (4099,), dtype=torch.int16, generator=g)
    cases = [
        bits.view(torch.bfloat16),  # every bit pattern, NaNs included
        bits.view(torch.float16),
        torch.randint(0, 2, (1000,), generator=g).bool(),
        torch.randn(333, dtype=torch.complex64, generator=g),
        torch.randn(77, dtype=torch.complex128, generator=g),
        torch.randint(-2 ** 62, 2 ** 62, (5, 7), dtype=torch.int64, generator=g),
        torch.empty(0, dtype=torch.float32),
        torch.randn(10, 10, dtype=torch.float64, generator=g)[:, 3],  # strided
    ]
    for i, t in enumerate(cases):
        out = torch.zeros_like(t)
        if rank == 0:
            dist.send(t, peer, tag=i)
            dist.recv(out, peer, tag=i)
        else:
            dist.recv(out, peer, tag=i)
            dist.send(t, peer, tag=i)
        if t.is_complex():
            same = torch.equal(torch.view_as_real(out), torch.view_as_real(t))
        elif t.dtype in (torch.bfloat16, torch.float16):
            same = torch.equal(out.view(torch.int16), t.view(torch.int16))
        else:
            same = torch.equal(out, t)
        assert same, (i, t.dtype)
    pg = dist.group.WORLD
    # ProcessGroup-level calls with complex tensors (no view_as_real by dist)
    c = torch.randn(9, dtype=torch.complex64, generator=g)
    out = torch.zeros_like(c)
    w1 = pg.send([c], peer, 11)
    w2 = pg.recv([out], peer, 11)
    w1.wait()
    w2.wait()
    assert torch.equal(out, c) and w2._source_rank() == peer
    fut = pg.recv_anysource([out], 12).get_future()
    pg.send([c], peer, 12).wait()
    assert fut.wait()[0] is out
    # argument checks (gloo wording), raised on the calling rank, group stays usable
    t = torch.zeros(3)
    for call, pattern in [
        (lambda: pg.send([t], ws, 0), "invalid destination rank"),
        (lambda: pg.recv([t], -1, 0), "invalid source rank"),
        (lambda: pg.send([t, t], peer, 0), "takes a single tensor"),
        (lambda: pg.recv([], peer, 0), "takes a single tensor"),
        (lambda: pg.send([t], peer, -1), "Tag must be nonnegative"),
        (lambda: pg.recv_anysource([t.to_sparse()], 0), "dense"),
    ]:
        try:
            call()
            raise AssertionError(f"no error for {pattern}")
        except RuntimeError as e:
            assert pattern in str(e), (pattern, str(e))
    try:
        dist.send(t, rank)
        raise AssertionError("send to self allowed")
    except ValueError as e:
        assert "Invalid destination rank" in str(e)
    try:  # a send Work has no source rank
        pg.send([t], peer, 13).source_rank()
        raise AssertionError("source_rank on a send")
    except RuntimeError as e:
        assert "sourceRank()" in str(e)
    pg.recv([t], peer, 13).wait()
    dist.barrier()
    return True


def _torch_wait_timeout(rank, ws):
    import datetime

    import torch
    import torch.distributed as dist
    pg = dist.group.WORLD
    t = torch.zeros(4)
    if rank == 0:
        w = pg.recv([t], 1, 99)  # nobody sends this
        try:
            w.wait(datetime.timedelta(seconds=0.5))
            raise AssertionError("wait(timeout) did not time out")
        except RuntimeError as e:
            assert "Timed out waiting 500ms" in str(e) and isinstance(e, dist.DistBackendError)
        deadline = time.monotonic() + 10
        while not w.is_completed() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.is_completed() and not w.is_success() and w.exception() is not None
    try:  # the group is aborted: rank 0 locally, rank 1 through the abort word
        dist.barrier()
        raise AssertionError("barrier after abort")
    except RuntimeError as e:
        assert "abort" in str(e) or "rank 0 " in str(e), e
    return True


@pytest.mark.torch
def test_torch_work_wait_timeout_aborts_group():
    """Guards: P2PWork.wait(timeout) raises a DistBackendError with "Timed out" and aborts
    the group like a collective Work (the pending recv fails; the peer fails fast)."""
    assert harness.run_torch_ranks(_torch_wait_timeout, 2, timeout_s=120) == [True] * 2


@pytest.mark.torch
def test_torch_dtypes_bitwise_and_argument_checks():
    """Guards: bfloat16 (all bit patterns, NaNs), float16, bool, complex64/128, int64,
    0 elements and strided tensors arrive bitwise; pg.send/recv/recv_anysource futures and
    source ranks; gloo-worded argument errors leave the group usable."""
    assert harness.run_torch_ranks(_torch_dtypes_and_checks, 2, timeout_s=240) == [True] * 2
