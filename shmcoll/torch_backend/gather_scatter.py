"""gather and scatter of EngineProcessGroup (a mixin): the rooted collectives whose
arguments differ between the root and the other ranks (only the root passes a list of
world_size tensors), with gloo's checks, both call forms and future values.

`GatherScatterMixin` is a part of process_group.EngineProcessGroup, one of its mixins by
kind beside movement.py (broadcast, all-gathers, all-to-all): it uses the group's _submit,
_op_timeout, _on_device, _device_path, group, rank() and size(). The two live together
because they mirror each other: the same overloads, root checks and messages, with inputs
and outputs swapped.
"""

import torch
import torch.distributed as dist

from . import checks
from .convert import as_array
from .fast import gather_inline, scatter_inline
from .pg_args import gloo_value, nested, set_timeout

__all__ = ["GatherScatterMixin"]


class GatherScatterMixin:
    """gather and scatter of EngineProcessGroup (see the module docstring)."""

    def gather(self, output_lists, input_tensors, opts=None, timeout=None):
        """gather(output_lists, inputs, opts) | gather(outputs, input, root, timeout=None)."""
        work = gather_inline(self, output_lists, input_tensors, opts)
        if work is not None:
            return work
        name = "gather"
        opts, root, inputs, outs, output_lists, device = self._rooted_args(
            name, input_tensors, output_lists, opts, timeout, dist.GatherOptions, "output")
        if device:
            return self._device_path(inputs).gather(outs, inputs, opts, gloo_value(output_lists))
        src = as_array(inputs[0], False)[0]
        dsts = [as_array(o, False)[0] for o in outs] or None
        t_s = self._op_timeout(opts)

        def run():
            self.group.gather(src, dsts, root, t_s)
        return self._submit(name, run, gloo_value(output_lists), opts=opts)

    def scatter(self, output_tensors, input_lists, opts=None, timeout=None):
        """scatter(outputs, input_lists, opts) | scatter(output, inputs, root, timeout=None)."""
        work = scatter_inline(self, output_tensors, input_lists, opts)
        if work is not None:
            return work
        name = "scatter"
        opts, root, outputs, ins, _, device = self._rooted_args(
            name, output_tensors, input_lists, opts, timeout, dist.ScatterOptions, "input")
        if device:
            return self._device_path(outputs).scatter(outputs, ins, opts)
        dst = as_array(outputs[0], False)[0]
        srcs = [as_array(t, False)[0] for t in ins] or None
        t_s = self._op_timeout(opts)

        def run():
            self.group.scatter(dst, srcs, root, t_s)
        return self._submit(name, run, outputs, opts=opts)

    def _rooted_args(self, name, singles, lists, opts, timeout, options, side):
        """Both call forms and gloo's checks, shared by gather (`side` "output": the root's
        list receives) and scatter ("input": the root's list sends). `singles`: this rank's
        one tensor (a list of it, or the tensor itself in the convenience form, where `opts`
        is the root); `lists`: the root's list of world_size tensors, as a one-element nested
        list (empty on other ranks). -> (opts, root, singles, the root's tensors or [],
        lists, whether the tensors are on a device)."""
        if isinstance(singles, torch.Tensor):  # convenience overload
            root = 0 if opts is None else int(opts)
            opts = options()
            opts.rootRank = root
            given = list(lists)
            lists = [given] if (given or self.rank() == root) else []
            singles = [singles]
        opts = set_timeout(opts or options(), timeout)
        singles = list(singles)
        lists = nested(lists)
        root = opts.rootRank
        checks.root_rank(name, root, self.size())
        checks.single(name, singles, f"{'input' if side == 'output' else 'output'} tensor list")
        device = self._on_device(name, singles)
        mine = []
        if self.rank() == root:
            if len(lists) != 1:
                checks.fail(name, f"requires a single-element {side} list containing a list "
                                  f"with {self.size()} tensors (got {len(lists)} lists)")
            if len(lists[0]) != self.size():
                checks.fail(name, f"Incorrect {side} list size {len(lists[0])}. "
                                  f"{side.capitalize()} list size should be {self.size()}, "
                                  f"same as size of the process group.")
            mine = list(lists[0])
            self._on_device(name, mine)
            checks.type_and_size_match(name, mine, singles[0])
        elif len(lists) != 0:
            checks.fail(name, f"requires empty {side} on non-root (rank {self.rank()}, root "
                              f"{root})")
        return opts, root, singles, mine, lists, device
