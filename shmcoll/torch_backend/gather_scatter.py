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
from .pg_args import gloo_value, nested, set_timeout

__all__ = ["GatherScatterMixin"]


class GatherScatterMixin:
    """gather and scatter of EngineProcessGroup (see the module docstring)."""

    def gather(self, output_lists, input_tensors, opts=None, timeout=None):
        """gather(output_lists, inputs, opts) | gather(outputs, input, root, timeout=None)."""
        name = "gather"
        if isinstance(input_tensors, torch.Tensor):  # convenience overload
            root = 0 if opts is None else int(opts)
            opts = dist.GatherOptions()
            opts.rootRank = root
            outs = list(output_lists)
            output_lists = [outs] if (outs or self.rank() == root) else []
            input_tensors = [input_tensors]
        opts = set_timeout(opts or dist.GatherOptions(), timeout)
        inputs = list(input_tensors)
        output_lists = nested(output_lists)
        root = opts.rootRank
        checks.root_rank(name, root, self.size())
        checks.single(name, inputs, "input tensor list")
        device = self._on_device(name, inputs)
        outs = []
        if self.rank() == root:
            if len(output_lists) != 1:
                checks.fail(name, f"requires a single-element output list containing a list "
                                  f"with {self.size()} tensors (got {len(output_lists)} lists)")
            if len(output_lists[0]) != self.size():
                checks.fail(name, f"Incorrect output list size {len(output_lists[0])}. Output "
                                  f"list size should be {self.size()}, same as size of the "
                                  f"process group.")
            outs = list(output_lists[0])
            self._on_device(name, outs)
            checks.type_and_size_match(name, outs, inputs[0])
        elif len(output_lists) != 0:
            checks.fail(name, f"requires empty output on non-root (rank {self.rank()}, root "
                              f"{root})")
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
        name = "scatter"
        if isinstance(output_tensors, torch.Tensor):  # convenience overload
            root = 0 if opts is None else int(opts)
            opts = dist.ScatterOptions()
            opts.rootRank = root
            ins = list(input_lists)
            input_lists = [ins] if (ins or self.rank() == root) else []
            output_tensors = [output_tensors]
        opts = set_timeout(opts or dist.ScatterOptions(), timeout)
        outputs = list(output_tensors)
        input_lists = nested(input_lists)
        root = opts.rootRank
        checks.root_rank(name, root, self.size())
        checks.single(name, outputs, "output tensor list")
        device = self._on_device(name, outputs)
        ins = []
        if self.rank() == root:
            if len(input_lists) != 1:
                checks.fail(name, f"requires a single-element input list containing a list "
                                  f"with {self.size()} tensors (got {len(input_lists)} lists)")
            if len(input_lists[0]) != self.size():
                checks.fail(name, f"Incorrect input list size {len(input_lists[0])}. Input "
                                  f"list size should be {self.size()}, same as size of the "
                                  f"process group.")
            ins = list(input_lists[0])
            self._on_device(name, ins)
            checks.type_and_size_match(name, ins, outputs[0])
        elif len(input_lists) != 0:
            checks.fail(name, f"requires empty input on non-root (rank {self.rank()}, root "
                              f"{root})")
        if device:
            return self._device_path(outputs).scatter(outputs, ins, opts)
        dst = as_array(outputs[0], False)[0]
        srcs = [as_array(t, False)[0] for t in ins] or None
        t_s = self._op_timeout(opts)

        def run():
            self.group.scatter(dst, srcs, root, t_s)
        return self._submit(name, run, outputs, opts=opts)
