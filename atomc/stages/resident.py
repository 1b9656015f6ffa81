"""Stages, the resident stage: the stage's sub-models on the device, one autograd graph per
micro-batch in flight, torch's AdamW (when the stage fits the device's memory budget).

It is its own executor (atomc.runtime.interpret.Executor), one index: the stage. It runs F, B,
S and R actions (a pipeline order, `pipeline_order`); the interpreter refuses a list with any
other kind before running it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from atomc.actions import Action, ActionKind, pipeline_order
from atomc.dtypes import cast_floating
from atomc.errors import RuntimeMismatchError
from atomc.runtime.interpret import Links, boundary_leaf, run_actions
from atomc.runtime.optim import AdamWConfig
from atomc.runtime.package import SwapPackage
from atomc.stages.base import StageSpec, named_buffers, original_tensor, tensor_attr


def set_param(module: nn.Module, name: str, value: nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, leaf, value)


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
                raise RuntimeMismatchError(f"sub-model {i} parameter {local} is not in "
                                           f"PARAM_NAMES; the package is damaged, regenerate it")
            out.append((fqn, p))
    return out


class ResidentStage:
    """The stage's sub-models on the device; one autograd graph per micro-batch in flight."""

    kind = "resident"
    action_kinds = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.SEND,
                              ActionKind.RECEIVE})

    def __init__(self, pkg: SwapPackage, spec: StageSpec, device: torch.device,
                 loss_fn: Callable[[Any, tuple], torch.Tensor] | None, opt_cfg: AdamWConfig,
                 dtype: torch.dtype | None = None, seed: int = 0):
        self.pkg = pkg
        self.spec = spec
        self.device = device
        self.loss_fn = loss_fn
        self.opt_cfg = opt_cfg
        self.seed = seed
        self.modules: dict[int, nn.Module] = {}
        for i in range(spec.start, spec.stop):
            with torch.device(device):  # only this stage's classes: the others live elsewhere
                mod = pkg.classes[i]()
            if dtype is not None:
                mod = cast_floating(mod, dtype)
            self.modules[i] = mod.train()
        self._tie_within()
        # received values that carry a gradient back: those the model computes with them at
        # the cut before this stage
        self.grad_inputs = {n for n in spec.recv if pkg.carries_grad(n, spec.start)}
        self._params = param_fqns(pkg, self.modules)
        self.optimizer = self._make_optimizer()
        self.step = 0
        self.first_micro = 0
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

    def _make_optimizer(self) -> torch.optim.Optimizer:
        decay, plain = [], []
        for fqn, p in self._params:
            (decay if self.opt_cfg.decays(fqn, tuple(p.shape)) else plain).append(p)
        groups = [{"params": decay, "weight_decay": self.opt_cfg.weight_decay}]
        if plain:
            groups.append({"params": plain, "weight_decay": 0.0})
        return torch.optim.AdamW(groups, **self.opt_cfg.torch_kwargs())

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
                            f"{fqn} has shape {tuple(src.shape)} in the initial state but "
                            f"sub-model {i} holds {local} with shape {tuple(dst.shape)}; the "
                            f"package was generated for another model: regenerate it")
                    dst.copy_(src)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return self._params

    def export(self) -> dict[str, torch.Tensor]:
        return {fqn: p.detach().cpu().clone() for fqn, p in self._params}

    def buffers(self) -> dict[str, torch.Tensor]:
        """The live buffers (running statistics) by original FQN."""
        return named_buffers(self.pkg, self.modules)

    def state_dict(self) -> dict[str, Any]:
        buffers = {f"{i}:{local}": b.detach().cpu().clone()
                   for i, mod in self.modules.items() for local, b in mod.named_buffers()}
        return {"params": self.export(), "optimizer": self.optimizer.state_dict(),
                "buffers": buffers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        named = dict(self._params)
        with torch.no_grad():
            for fqn, value in state["params"].items():
                named[fqn].copy_(value)
            for i, mod in self.modules.items():
                for local, b in mod.named_buffers():
                    key = f"{i}:{local}"
                    if key in state["buffers"]:
                        b.copy_(state["buffers"][key])
        self.optimizer.load_state_dict(state["optimizer"])

    # ---- a step --------------------------------------------------------------------------------

    def begin_step(self, step: int, num_micro: int, first_micro: int = 0) -> None:
        self.step = step
        self.num_micro = num_micro
        self.first_micro = first_micro
        for _, p in self._params:
            p.grad = None

    def order(self, schedule: str, num_micro: int) -> list[Action]:
        return pipeline_order(schedule, num_micro, self.spec.index, self.spec.num_stages)

    def forward_order(self, num_micro: int) -> list[Action]:
        """Values in, values out: each micro-batch's receive, forward and send."""
        j = self.spec.index
        return [a for m in range(num_micro) for a in (
            *([Action(ActionKind.RECEIVE, j, m)] if j > 0 else []),
            Action(ActionKind.FORWARD, j, m),
            *([Action(ActionKind.SEND, j, m)] if not self.spec.holds_output else []))]

    def run(self, actions: list[Action], micro: list[tuple], io: Links | None, *,
            recomputing: bool = False) -> list[torch.Tensor]:
        """Execute the stage's F, B, S and R actions (indices: stages); returns the losses of
        the last stage's micro-batches. `recomputing`: the list's forwards repeat ones that ran
        before (atomc.runtime.interpret)."""
        return run_actions(self, actions, micro, io, seed=self.seed, step=self.step,
                           first_micro=self.first_micro, recomputing=recomputing)

    def optimizer_step(self, coef: float | None) -> None:
        if coef is not None:
            for _, p in self._params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        self.opt_cfg.set_lr(self.optimizer, self.step)
        self.optimizer.step()

    def close(self) -> None:
        pass

    # ---- the Executor (atomc.runtime.interpret): one index, the stage ------------------------

    @contextmanager
    def session(self, micro_batches: list[tuple], step: int) -> Iterator[None]:
        self._micro = micro_batches
        self._inputs: dict[int, dict[str, Any]] = {}  # m -> received values, as leaves
        self._flight: dict[int, Any] = {}  # m -> what its forward returned (values or loss)
        self._grads_in: dict[int, dict[str, torch.Tensor]] = {}
        self._grads_back: dict[int, dict[str, torch.Tensor | None]] = {}
        self._losses: dict[int, torch.Tensor] = {}
        yield

    def exchange(self) -> Any:
        return nullcontext()

    def recomputes(self, index: int) -> bool:
        return False  # the graph of every micro-batch in flight is kept

    def forward_modules(self, index: int) -> list[nn.Module]:
        return [self.modules[i] for i in range(self.spec.start, self.spec.stop)]

    def forward(self, index: int, micro: int, *, last: bool) -> None:
        out = self._forward(self._inputs.get(micro, {}), self._micro[micro])
        self._flight[micro] = out
        if self.spec.holds_output:
            self._losses[micro] = out.detach()

    def backward(self, index: int, micro: int, *, first: bool, last: bool) -> None:
        self._grads_back[micro] = self._backward(self._inputs.pop(micro, {}),
                                                 self._flight.pop(micro),
                                                 self._grads_in.pop(micro, None))

    def take_values(self, micro: int, values: dict[str, Any]) -> None:
        self._inputs[micro] = {n: boundary_leaf(v, n in self.grad_inputs)
                               for n, v in values.items()}

    def take_grads(self, micro: int, grads: dict[str, torch.Tensor]) -> None:
        self._grads_in[micro] = grads

    def values_out(self, micro: int) -> dict[str, Any]:
        return dict(self._flight[micro])

    def grads_out(self, micro: int) -> dict[str, torch.Tensor | None]:
        return self._grads_back.pop(micro)

    def losses(self) -> list[torch.Tensor]:
        return [self._losses[m] for m in sorted(self._losses)]

    def _forward(self, received: dict[str, Any], batch: tuple) -> Any:
        """One micro-batch through the stage: the values to send, or (last stage) the loss."""
        env: dict[str, Any] = dict(zip(self.pkg.model_inputs, batch))
        env.update(received)
        out: Any = None
        for i in range(self.spec.start, self.spec.stop):
            result = self.modules[i](*[env[n] for n in self.pkg.inputs[i]])
            if i == self.spec.num_submodels - 1:
                out = result
            else:
                env.update(zip(self.pkg.outputs[i],
                               result if isinstance(result, tuple) else (result,)))
        if self.spec.holds_output:
            assert self.loss_fn is not None
            return self.loss_fn(out, batch)
        return {n: env[n] for n in self.spec.send}

    def _backward(self, received: dict[str, Any], out: Any,
                  grads: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor | None]:
        if self.spec.holds_output:
            (out / self.num_micro).backward()
        else:
            pairs = [(out[n], g) for n, g in (grads or {}).items()
                     if isinstance(out.get(n), torch.Tensor) and out[n].requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        return {n: v.grad for n, v in received.items()
                if isinstance(v, torch.Tensor) and v.requires_grad}


__all__ = ["ResidentStage", "param_fqns", "set_param"]
