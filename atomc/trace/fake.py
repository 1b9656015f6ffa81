"""Trace a meta-device model as if it lived on the device it will run on.

Model code branches on where its tensors are: Hugging Face's mixture-of-experts layers count
tokens per expert with `histc` on float32 on a CPU and int32 elsewhere; others upcast only on
the CPU, or take fused paths only on CUDA. A model built on the meta device reports "meta",
so torch.export records the non-CPU branch, and the graph (and the code generated from it)
calls kernels the CPU does not have.

So the meta weights and inputs are wrapped as fake tensors (torch's FakeTensor: shapes,
strides and dtypes, no storage) that report the device type the model will run on, the model
is traced and its graph run once on them (strides follow that device's kernels: attention's
output layout differs between devices, and export drops a `.contiguous()` that was a no-op
there), and then graph, weights and recorded values become meta again, so the later stages
see what they always saw.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_map

META = torch.device("meta")


@dataclass
class Faked:
    """What `faked_on` made: the inputs to trace with, and how to undo it afterwards."""

    inputs: tuple
    mode: FakeTensorMode | None = None  # None: nothing was faked
    device_type: str = ""
    originals: dict[int, torch.Tensor] = field(default_factory=dict)  # id(fake) -> meta

    def running(self) -> Any:
        """Context for running the traced graph on the fake tensors (factories included)."""
        return self.mode if self.mode is not None else contextlib.nullcontext()

    def to_meta(self, value: Any) -> Any:
        """`value` with every fake tensor the model's own meta tensor, or a meta tensor of its
        shape, strides and dtype."""
        if self.mode is None:
            return value

        def back(t: Any) -> Any:
            if not isinstance(t, FakeTensor):
                return t
            if id(t) in self.originals:
                return self.originals[id(t)]
            meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=META)
            if isinstance(t, nn.Parameter):
                return nn.Parameter(meta, requires_grad=t.requires_grad)
            return meta

        return tree_map(back, value)

    def unfake(self, gm: fx.GraphModule) -> None:
        """Make the traced graph a meta graph again: its tensors meta (the model's own weights,
        which later stages know by identity), and the faked device the meta device in every
        argument (`torch.arange(n, device=x.device)` recorded it)."""
        if self.mode is None:
            return
        for module in gm.modules():
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    table[name] = self.to_meta(t)
            for name, value in list(vars(module).items()):
                if isinstance(value, FakeTensor):
                    setattr(module, name, self.to_meta(value))

        def meta_device(a: Any) -> Any:
            return META if isinstance(a, torch.device) and a.type == self.device_type else a

        for node in gm.graph.nodes:
            node.args = fx.node.map_aggregate(node.args, meta_device)
            node.kwargs = fx.node.map_aggregate(node.kwargs, meta_device)
        gm.recompile()


@contextlib.contextmanager
def faked_on(model: nn.Module, inputs: tuple, device_type: str | None) -> Iterator[Faked]:
    """Inside: the model's meta parameters and buffers, and the inputs yielded (`.inputs`), are
    fake tensors on `device_type` ("cpu", "cuda"); afterwards the model's own are back. Nothing
    changes when `device_type` is None or nothing is on the meta device."""
    tensors = [*model.parameters(), *model.buffers(),
               *(x for x in inputs if isinstance(x, torch.Tensor))]
    # A torch built without CUDA aborts the process (not an exception) in some operators on
    # fake CUDA tensors: there the meta device stands in for CUDA, as model code reads any
    # device but the CPU as an accelerator.
    if device_type == "cuda" and not torch.backends.cuda.is_built():
        device_type = None
    if device_type is None or not any(t.device.type == "meta" for t in tensors):
        yield Faked(inputs)
        return
    device = torch.device(device_type)
    faked = Faked((), FakeTensorMode(allow_non_fake_inputs=True), device_type)

    def fake(t: torch.Tensor) -> torch.Tensor:
        f = FakeTensor(faked.mode, t.detach(), device)
        f = nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f
        faked.originals[id(f)] = t
        return f

    made: dict[int, torch.Tensor] = {}  # one fake per tensor object: tied weights stay tied
    undo = []
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or t.device.type != "meta":
                    continue
                if id(t) not in made:
                    made[id(t)] = fake(t)
                undo.append((table, name, t))
                table[name] = made[id(t)]
    faked.inputs = tuple(fake(x) if isinstance(x, torch.Tensor) and x.device.type == "meta"
                         else x for x in inputs)
    try:
        yield faked
    finally:
        for table, name, t in undo:
            table[name] = t


@contextlib.contextmanager
def all_faked(model: nn.Module, inputs: tuple, device_type: str | None
              ) -> Iterator[tuple[FakeTensorMode, torch.device, tuple]]:
    """Inside: every parameter and buffer of `model` is a fake tensor (meta ones reporting
    `device_type`, as `faked_on` makes them; real ones on their own device), and so are the
    inputs yielded, with the mode to run in and the device the meta device stands for (a
    traced graph names it where the model named its device, see Faked.unfake). What runs
    there writes only the fakes: the model's own tensors, their values and their autograd
    state, stay as they were."""
    if device_type == "cuda" and not torch.backends.cuda.is_built():
        device_type = None  # as in faked_on
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    device = torch.device(device_type) if device_type is not None else META

    def fake(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "meta":
            f = FakeTensor(mode, t.detach(), device)
        else:
            f = mode.from_tensor(t.detach())
        return nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
            else f.requires_grad_(t.requires_grad)

    made: dict[int, torch.Tensor] = {}  # one fake per tensor object: tied weights stay tied
    undo = []
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in made:
                    made[id(t)] = fake(t)
                undo.append((table, name, t))
                table[name] = made[id(t)]
    try:
        yield mode, device, tuple(fake(x) if isinstance(x, torch.Tensor) else x
                                  for x in inputs)
    finally:
        for table, name, t in undo:
            table[name] = t
