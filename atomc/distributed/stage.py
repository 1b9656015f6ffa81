"""Layout runner, one stage: a range of a generated package's sub-models, run per micro-batch.

input:  the generated package (runtime's `SwapPackage`), this stage's sub-model range [a, b),
        the names it receives from the previous stage and sends to the next, the device
output: a stage executor with `forward(m, values)` (the values to send, or the loss on the last
        stage) and `backward(m, grads)` (the gradients of the received values), and its trainable
        parameters named by their original FQNs

Two executors keep this one interface:
- `ResidentStage` keeps the stage's sub-models on the device and the autograd graph of every
  micro-batch in flight (when the stage fits the device's memory budget);
- `SwappedStage` (in `atomc.distributed.swapstage`) runs the stage with the runtime's swap
  machinery: sub-models loaded one after another from the host store, internals recomputed in
  the backward, the CPU optimizer over flat buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from atomc.errors import RuntimeMismatchError
from atomc.runtime.package import SwapPackage


def tensor_attr(module: nn.Module, name: str) -> torch.Tensor:
    owner, _, leaf = name.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, leaf)


def set_param(module: nn.Module, name: str, value: nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, leaf, value)


def original_tensor(pkg: SwapPackage, state_dict: dict[str, torch.Tensor], fqn: str) -> torch.Tensor:
    if fqn in state_dict:
        return state_dict[fqn]
    aliases = dict(getattr(pkg.module, "ALIASES", {}) or {})
    for alias, canonical in aliases.items():
        if canonical == fqn and alias in state_dict:
            return state_dict[alias]
    raise RuntimeMismatchError(f"the initial state dict has no {fqn!r}, which the package's sub-models "
                               f"hold; give the original model's state_dict()")


@dataclass
class StageSpec:
    """What a stage computes and exchanges (the same on every replica of the stage)."""

    index: int  # stage j
    num_stages: int
    start: int  # sub-models [start, stop)
    stop: int
    recv: tuple[str, ...]  # values from stage j-1
    send: tuple[str, ...]  # values to stage j+1
    is_last: bool
    num_submodels: int  # of the whole package

    @property
    def holds_output(self) -> bool:
        return self.stop == self.num_submodels


def param_fqns(pkg: SwapPackage, modules: dict[int, nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """Unique trainable parameters of the given sub-models as (original FQN, parameter)."""
    out: list[tuple[str, nn.Parameter]] = []
    seen: set[int] = set()
    for i in sorted(modules):
        mod = modules[i]
        for local, p in mod.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            fqn = pkg.param_names[i].get(local)
            if fqn is None:
                raise RuntimeMismatchError(f"sub-model {i} parameter {local} is not in PARAM_NAMES; "
                                           f"the package is damaged, regenerate it")
            out.append((fqn, p))
    return out


class ResidentStage:
    """The stage's sub-models on the device; one autograd graph per micro-batch in flight."""

    kind = "resident"

    def __init__(self, pkg: SwapPackage, spec: StageSpec, device: torch.device,
                 loss_fn: Callable[[Any, tuple], torch.Tensor] | None, dtype: torch.dtype | None = None):
        self.pkg = pkg
        self.spec = spec
        self.device = device
        self.loss_fn = loss_fn
        self.modules: dict[int, nn.Module] = {}
        for i in range(spec.start, spec.stop):
            with torch.device(device):  # only this stage's classes: the others live elsewhere
                mod = pkg.classes[i]()
            if dtype is not None:
                mod = mod.to(dtype)
            self.modules[i] = mod.train()
        self._tie_within()
        self._flight: dict[int, tuple[dict[str, Any], Any]] = {}  # m -> (received leaves, outputs)
        self.num_micro = 1

    def _tie_within(self) -> None:
        """Holders of a tied weight inside this stage share one parameter (as in one process)."""
        for holders in self.pkg.tied.values():
            here = [(i, local) for i, local in holders if i in self.modules]
            if len(here) < 2:
                continue
            (i0, l0), *rest = here
            shared = tensor_attr(self.modules[i0], l0)
            for i, local in rest:
                set_param(self.modules[i], local, shared)

    # ---- weights -------------------------------------------------------------------------------

    def load_original(self, state_dict: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for i, mod in self.modules.items():
                buffers = dict(mod.named_buffers())
                for local, fqn in self.pkg.param_names[i].items():
                    if local in buffers and fqn not in state_dict:
                        continue  # a non-persistent buffer: the constructor made it
                    src = original_tensor(self.pkg, state_dict, fqn)
                    dst = tensor_attr(mod, local)
                    if tuple(src.shape) != tuple(dst.shape):
                        raise RuntimeMismatchError(
                            f"{fqn} has shape {tuple(src.shape)} in the initial state but sub-model {i} "
                            f"holds {local} with shape {tuple(dst.shape)}; the package was generated "
                            f"for another model: regenerate it")
                    dst.copy_(src)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return param_fqns(self.pkg, self.modules)

    def buffers_state(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, mod in self.modules.items():
            for local, b in mod.named_buffers():
                out[f"{i}:{local}"] = b.detach().cpu().clone()
        return out

    def load_buffers_state(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for i, mod in self.modules.items():
                for local, b in mod.named_buffers():
                    key = f"{i}:{local}"
                    if key in state:
                        b.copy_(state[key])

    # ---- a step --------------------------------------------------------------------------------

    def begin_step(self, num_micro: int) -> None:
        self.num_micro = num_micro
        self._flight.clear()
        for _, p in self.named_parameters():
            p.grad = None

    def forward(self, m: int, received: dict[str, Any], batch: tuple) -> Any:
        """Run micro-batch m; returns the values to send, or (last stage) the loss tensor."""
        env: dict[str, Any] = dict(zip(self.pkg.model_inputs, batch))
        env.update(received)
        out: Any = None
        for i in range(self.spec.start, self.spec.stop):
            args = [env[n] for n in self.pkg.inputs[i]]
            result = self.modules[i](*args)
            if i == self.spec.num_submodels - 1:
                out = result
            else:
                result = result if isinstance(result, tuple) else (result,)
                env.update(zip(self.pkg.outputs[i], result))
        if self.spec.holds_output:
            assert self.loss_fn is not None
            loss = self.loss_fn(out, batch)
            self._flight[m] = (received, loss)
            return loss
        sent = {n: env[n] for n in self.spec.send}
        self._flight[m] = (received, sent)
        return sent

    def backward(self, m: int, grads: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor | None]:
        received, out = self._flight.pop(m)
        if self.spec.holds_output:
            (out / self.num_micro).backward()
        else:
            pairs = [(out[n], g) for n, g in (grads or {}).items()
                     if isinstance(out.get(n), torch.Tensor) and out[n].requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        return {n: v.grad for n, v in received.items() if isinstance(v, torch.Tensor) and v.requires_grad}

    def end_step(self) -> None:
        self._flight.clear()
