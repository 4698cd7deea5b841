"""send / recv / recv_anysource for EngineProcessGroup, with ProcessGroupGloo's semantics.

P2P ops never go through the collective Executor: a receive waiting for its message would
hold up every later collective (and a recv queued behind a collective that needs the
sender's progress could deadlock). They are posted to the engine at call time (p2p.py);
the engine's progress thread completes them and P2PWork.wait() blocks on that. So, as with
gloo, isend/irecv return at once, batch_isend_irecv may post receives before sends, and a
send completes once its data is in the mailbox, not when the peer has received it.
`dist.batch_isend_irecv` needs nothing more: for a Python ProcessGroup subclass torch 2.13
takes its non-coalescing path (one isend/irecv call per P2POp).
"""

import threading

import torch
import torch.distributed as dist

from ..errors import CollectiveTimeoutError
from . import checks
from .convert import as_array
from .work import Job, torch_error

__all__ = ["P2PMixin", "P2PWork"]


class P2PWork(dist.Work):
    """torch Work over an engine p2p.Request. Its future exists once get_future() is
    called, and is completed by the group's Executor (complete_later), not by the engine's
    progress thread that finishes the request: a callback that waits there for another
    send or receive would stop the very thread that moves it."""

    def __init__(self, name, request, outputs, on_abort=None, executor=None, copy_in=None):
        super().__init__()
        self._name = name
        self._req = request
        self._outputs = outputs
        self._on_abort = on_abort
        self._executor = executor
        self._copy_in = copy_in  # a staged device receive: copy the host tensor in first
        self._copy_lock = threading.Lock()
        self._error = None
        self._lock = threading.Lock()
        self._job = None  # created by get_future()
        request.add_done_callback(self._settle)

    def _settle(self, request):
        self._copied_in()
        with self._lock:
            job = self._job
            if job is not None:
                self._finish(job)
        if job is not None:
            if self._executor is not None:
                self._executor.complete_later(job)
            else:
                job.complete()

    def _finish(self, job):
        """Holding _lock, the request done: the job's outcome is the request's."""
        job.error = self.exception()
        job.finished = True

    def _copied_in(self):
        """Enqueue a staged receive's copy into its device tensor, once, whichever of the
        completing thread and a waiter comes first (both return only after it is enqueued)."""
        with self._copy_lock:
            if self._copy_in is not None and self._req.error is None:
                self._copy_in()
            self._copy_in = None

    def wait(self, timeout=None):
        timeout_s = None
        if timeout is not None:
            timeout_s = (timeout.total_seconds() if hasattr(timeout, "total_seconds")
                         else float(timeout))
            if timeout_s <= 0:
                timeout_s = None
        try:
            self._req.wait(timeout_s)
        except CollectiveTimeoutError:
            if self._req.is_completed():
                raise self.exception() from None
            ms = int(round(timeout_s * 1000))
            if self._on_abort is not None:
                self._on_abort()
            raise torch_error(RuntimeError(
                f"{self._name}: Timed out waiting {ms}ms for the operation to complete; the "
                f"group was aborted")) from None
        except Exception:
            raise self.exception() from None
        self._copied_in()
        return True

    def get_future(self):
        with self._lock:
            if self._job is None:
                self._job = Job(self._name, None, self._outputs)
                if self._req.is_completed():  # no callbacks yet: settle it right here
                    self._copied_in()
                    self._finish(self._job)
                    self._job.complete()
            return self._job.future

    def is_completed(self):
        return self._req.is_completed()

    def is_success(self):
        return self._req.is_completed() and self._req.error is None

    def exception(self):
        if self._error is None and self._req.error is not None:
            self._error = torch_error(self._req.error)
        return self._error

    def result(self):
        self.wait()
        return self._outputs

    def source_rank(self):
        if self._req.op != "recv":
            raise RuntimeError("sourceRank() may only be called on work objects that "
                               "correspond to a recv or recv-from-any call.")
        return self._req.source

    def _source_rank(self):
        return self.source_rank()

    def synchronize(self):
        self.wait()


class P2PMixin:
    """Point-to-point methods of EngineProcessGroup (uses self.group and self.size())."""

    def send(self, tensors, dstRank, tag=0):
        array, tensors, _ = self._p2p_args("send", tensors, dstRank, tag, "destination")
        return self._p2p_post("send", tensors, self.group.isend, array, dstRank, tag)

    def recv(self, tensors, srcRank, tag=0):
        array, tensors, finish = self._p2p_args("recv", tensors, srcRank, tag, "source")
        return self._p2p_post("recv", tensors, self.group.irecv, array, srcRank, tag, finish)

    def recv_anysource(self, tensors, tag=0):
        array, tensors, finish = self._p2p_args("recvAnysource", tensors, None, tag, "source")
        return self._p2p_post("recvAnysource", tensors, self.group.irecv, array, None, tag,
                              finish)

    def _p2p_args(self, name, tensors, peer, tag, what):
        """(numpy view to send or receive, the tensor list, finish callable or None)."""
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if len(tensors) != 1:
            checks.fail(name, "takes a single tensor")
        checks.tensors(name, tensors)
        checks.dense(name, tensors)
        if not isinstance(tag, int) or tag < 0:
            checks.fail(name, f"Tag must be nonnegative, got {tag}")
        if peer is not None and not 0 <= peer < self.size():
            checks.fail(name, f"invalid {what} rank: {peer} (group size {self.size()})")
        t, finish = tensors[0], None
        if t.is_cuda:  # staged through host memory (cuda_ipc/p2p.py)
            from cuda_ipc.p2p import stage_recv, stage_send
            if name == "send":
                t = stage_send(t)
            else:
                t, finish = stage_recv(t)
        checks.cpu(name, [t])
        return as_array(t, for_reduce=False)[0], tensors, finish

    def _p2p_post(self, name, tensors, start, array, peer, tag, finish=None):
        try:
            request = start(array, peer, tag)
        except RuntimeError as e:  # poisoned, aborted or closed group
            raise torch_error(e) from None
        return P2PWork(name, request, tensors, self.group.abort, self._executor, finish)
