"""Options and argument shapes shared by EngineProcessGroup's methods: ShmOptions (the
backend's Options), the reduce-op and timeout coercions of torch's call forms, and the
future values ProcessGroupGloo gives."""

import copy
import datetime
import weakref

import torch
import torch.distributed as dist

from .convert import to_seconds

__all__ = ["ShmOptions", "DEFAULT_TIMEOUT_S", "REDUCIBLE", "tensor_list", "nested",
           "gloo_value", "is_op", "set_timeout", "as_op", "allreduce_opts", "coalesced_opts",
           "rs_opts"]

DEFAULT_TIMEOUT_S = 1800.0  # torch's default_pg_timeout for non-NCCL backends

REDUCIBLE = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
             torch.complex128, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
             torch.bool}


def tensor_list(x):
    return [x] if isinstance(x, torch.Tensor) else list(x)


def nested(lists):
    return [list(x) for x in lists]


def gloo_value(output_lists):
    """gloo's returnFutureWithOutput: [] for none, flat for one list, nested for several."""
    if len(output_lists) == 0:
        return []
    if len(output_lists) == 1:
        return list(output_lists[0])
    return [list(x) for x in output_lists]


def is_op(x):
    return isinstance(x, (dist.ReduceOp, dist.ReduceOp.RedOpType))


def set_timeout(opts, timeout):
    if timeout is not None:
        opts.timeout = timeout if isinstance(timeout, datetime.timedelta) else \
            datetime.timedelta(seconds=float(timeout))
    return opts


def as_op(op):
    return op if isinstance(op, dist.ReduceOp) else dist.ReduceOp(op)


def allreduce_opts(opts, op, timeout):
    if isinstance(opts, dist.AllreduceOptions):
        return set_timeout(opts, timeout)
    if is_op(opts):
        op = opts
    new = dist.AllreduceOptions()
    if op is not None:
        new.reduceOp = as_op(op)
    return set_timeout(new, timeout)


def coalesced_opts(op):
    new = dist.AllreduceCoalescedOptions()
    if is_op(op):
        new.reduceOp = as_op(op)
    return new


def rs_opts(op):
    new = dist.ReduceScatterOptions()
    if is_op(op):
        new.reduceOp = as_op(op)
    return new


class ShmOptions:
    """ProcessGroupGloo._Options look-alike: `_timeout` takes seconds (float) or a timedelta
    and reads back as a timedelta; `_threads`, `_devices`, `group_name` are kept (the engine
    needs no thread pool: ops run in order on one executor per group).

    `pg.options` is bound to its group: reading `_timeout` gives the current default timeout,
    assigning it changes the group's default (like `_set_default_timeout`). The binding is a
    weak reference: the group holds its options, and a cycle back to it would keep a group
    nobody references alive, with its shared memory and threads, until the garbage
    collector ran (torch 2.4's destroy_process_group shuts down no group but NCCL's: the
    group's last reference going is what releases it there)."""

    def __init__(self, timeout=None, threads=2, group_name="", devices=None):
        self._pg = None  # weakref.ref to the group these options are bound to (bind())
        self._timeout_s = DEFAULT_TIMEOUT_S if timeout is None else to_seconds(timeout)
        self._threads = threads
        self.group_name = group_name
        self._devices = list(devices or [])
        self.global_ranks_in_group = []
        self.group_desc = ""

    def bind(self, pg):
        """Make these options `pg`'s own (`pg.options`)."""
        self._pg = weakref.ref(pg)

    def _bound(self):
        return None if self._pg is None else self._pg()

    @property
    def _timeout(self):
        pg = self._bound()
        s = pg.group.timeout_s if pg is not None else self._timeout_s
        return datetime.timedelta(seconds=s)

    @_timeout.setter
    def _timeout(self, value):
        pg = self._bound()
        if pg is not None:
            pg._set_default_timeout(value)
        else:
            self._timeout_s = to_seconds(value)

    timeout = _timeout

    @property
    def threads(self):
        return self._threads

    @threads.setter
    def threads(self, value):
        self._threads = value

    @classmethod
    def coerce(cls, options):
        """An unbound ShmOptions from ours, from another backend's options object (gloo's
        _Options, NCCL's Options: `_timeout`, `group_name`, `_threads` are taken) or None."""
        if isinstance(options, cls):
            return options._unbound()
        new = cls()
        if options is not None:
            timeout = getattr(options, "_timeout", None)
            if timeout is not None:
                new._timeout = timeout
            new.group_name = str(getattr(options, "group_name", "") or "")
            new._threads = getattr(options, "_threads", new._threads)
            new.global_ranks_in_group = list(getattr(options, "global_ranks_in_group", []))
        return new

    def _unbound(self):
        new = copy.copy(self)
        new._timeout_s = self._timeout.total_seconds()
        new._pg = None
        new._devices = list(self._devices)
        new.global_ranks_in_group = list(self.global_ranks_in_group)
        return new

    def __deepcopy__(self, memo):
        return self._unbound()

    def __repr__(self):
        return (f"ShmOptions(timeout={self._timeout}, threads={self._threads}, "
                f"group_name={self.group_name!r})")
