"""Stages, the swapped stage: the swap runtime's executor over one stage's sub-model range.

input:  the generated package, the stage's range [a, b) and boundary names, the device, the
        optimizer settings
output: a `Stage` (atomc.stages.base) whose `run` executes the stage's action list on the
        executor that the swap trainer uses (atomc.runtime.interpret.run_actions: loads,
        forward, recomputation with the forward's RNG state and buffers, gradients to the host)

What differs from the swap trainer: the stage's inputs come from the previous stage and carry
gradients back to it; a stage that does not hold the model output ends on received output
gradients; gradients stay in the host store until the runner has summed tied weights across
stages and averaged over the data-parallel group, so the action list has no U: `update` runs
the optimizer afterwards (`optimizer_step`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from atomc.actions import Action, ActionKind
from atomc.actions.orders import swapped_stage_order
from atomc.errors import RuntimeMismatchError
from atomc.runtime.executor import SwapExecutor
from atomc.runtime.interpret import Links, run_actions
from atomc.runtime.optim import AdamWConfig
from atomc.runtime.package import SwapPackage
from atomc.runtime.steprun import StageEnds, StepOptions
from atomc.runtime.trace import Tracer
from atomc.stages.base import StageSpec, named_buffers, original_tensor, tensor_attr


def restrict(pkg: SwapPackage, spec: StageSpec) -> SwapPackage:
    """The package seen by one stage: sub-models [a, b) renumbered from 0; what it receives
    (and the model inputs it reads) are its inputs; ties only among the stage's own holders."""
    a, b = spec.start, spec.stop
    classes = pkg.classes[a:b]
    read = [n for i in range(a, b) for n in pkg.inputs[i]]
    inputs = tuple(dict.fromkeys([n for n in read if n in spec.recv or n in pkg.model_inputs]))
    tied = {}
    for fqn, holders in pkg.tied.items():
        here = [(i - a, local) for i, local in holders if a <= i < b]
        if len(here) > 1:
            tied[fqn] = here

    def build(device: Any = None) -> list[nn.Module]:
        if device is None:
            return [cls() for cls in classes]
        with torch.device(device):
            return [cls() for cls in classes]

    return SwapPackage(
        path=pkg.path, module=pkg.module, classes=classes, model_inputs=inputs,
        inputs=pkg.inputs[a:b], outputs=pkg.outputs[a:b], boundaries=pkg.boundaries[a:b],
        plan=pkg.plan, param_names=pkg.param_names[a:b], tied=tied, build_submodels=build,
        load_original_state_dict=pkg.load_original_state_dict,
        export_state_dict=pkg.export_state_dict)


class SwappedStage:
    """One stage trained with the swap runtime (see the module docstring)."""

    kind = "swapped"

    def __init__(self, pkg: SwapPackage, spec: StageSpec, device: torch.device,
                 loss_fn: Callable[[Any, tuple], torch.Tensor] | None, opt_cfg: AdamWConfig,
                 dtype: torch.dtype | None = None, seed: int = 0):
        self.full = pkg
        self.spec = spec
        self.device = device
        self.loss_fn = loss_fn
        self.sub = restrict(pkg, spec)
        self.master_dtype = dtype or torch.float32
        self.host_modules = [m.to(self.master_dtype) for m in self.sub.build_submodels()]
        # the runner clips globally and reduces first; the optimizer here only applies updates
        self.opt_cfg = replace(opt_cfg, max_grad_norm=None)
        self.ex = SwapExecutor.assemble(
            self.sub, self.host_modules, self.opt_cfg, device=device,
            master_dtype=self.master_dtype, tracer=Tracer(device, enabled=False), threaded=False,
            step=StepOptions(accum=1, activations="recompute", offload_activations=False,
                             autocast_dtype=None, loss_fn=loss_fn or (lambda o, b: o),
                             seed=seed),
            ends=StageEnds(holds_output=spec.holds_output, recv=spec.recv, send=spec.send))
        self.store, self.opt = self.ex.store, self.ex.opt
        self.seed = seed
        self.first_micro = 0
        self.k = self.sub.num_submodels
        self._grad_views = self._make_grad_views()
        self.step = 0
        self.num_micro = 1

    # ---- weights -------------------------------------------------------------------------------

    def _make_grad_views(self) -> list[tuple[str, nn.Parameter]]:
        """(FQN, parameter over the master with .grad over the master gradient) per owned weight."""
        out = []
        for i, L in enumerate(self.store.layouts):
            for e in L.entries:
                if not e.owned:
                    continue
                p = nn.Parameter(self.store.read_entry(i, e), requires_grad=False)
                if e.trainable:  # a frozen weight has no gradient buffer
                    grad = self.store.master_grad(i)[e.owner_offset:e.owner_offset + e.numel]
                    p.grad = grad.view(e.shape)
                out.append((e.key, p))
        return out

    def load_original(self, state_dict: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for i, L in enumerate(self.store.layouts):
                gi = self.spec.start + i
                names = self.full.param_names[gi]
                for e in L.entries:
                    if e.owned:
                        src = original_tensor(self.full, state_dict, names.get(e.local, e.key))
                        if tuple(src.shape) != tuple(e.shape):
                            raise RuntimeMismatchError(
                                f"{e.key} has shape {tuple(src.shape)} in the initial state, "
                                f"sub-model {gi} holds {tuple(e.shape)}; regenerate the package "
                                f"for this model")
                        self.store.write_entry(i, e, src)
                for local, b in self.host_modules[i].named_buffers():
                    fqn = names.get(local)
                    if fqn is not None and fqn in state_dict:
                        b.copy_(state_dict[fqn])
                        tensor_attr(self.ex.module(i), local).copy_(state_dict[fqn])
        self.ex.wait_loads()  # no load still reads the images
        for i in range(self.k):
            self.store.refresh_images(i)
        self.ex.invalidate_slots()

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return self._grad_views

    def buffers(self) -> dict[str, torch.Tensor]:
        """The live buffers (running statistics, on the device) by original FQN."""
        return named_buffers(self.full, {self.spec.start + i: self.ex.module(i)
                                         for i in range(self.k)})

    def export(self) -> dict[str, torch.Tensor]:
        return {fqn: p.detach().cpu().clone() for fqn, p in self._grad_views}

    def state_dict(self) -> dict[str, Any]:
        return {"masters": [self.store.read_master(i).clone() for i in range(self.k)],
                "optimizer": self.opt.state_dict(),
                "buffers": [{n: b.detach().cpu().clone()
                             for n, b in self.ex.module(i).named_buffers()}
                            for i in range(self.k)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for i, m in enumerate(state["masters"]):
                want = (self.store.layouts[i].owned_numel,)
                if tuple(m.shape) != want:
                    raise RuntimeMismatchError(f"checkpoint weights of stage sub-model {i} have "
                                               f"shape {tuple(m.shape)}, expected {want}")
                self.store.write_master(i, m)
            for i, bufs in enumerate(state["buffers"]):
                own = dict(self.ex.module(i).named_buffers())
                for n, b in bufs.items():
                    own[n].copy_(b)
        self.ex.wait_loads()
        for i in range(self.k):
            self.store.refresh_images(i)
        self.opt.load_state_dict(state["optimizer"])
        self.ex.invalidate_slots()

    # ---- a step --------------------------------------------------------------------------------

    def begin_step(self, step: int, num_micro: int, first_micro: int = 0) -> None:
        self.num_micro = num_micro
        self.step = step
        self.first_micro = first_micro
        self.ex.loss_divisor = num_micro  # the mean over the step's micro-batches, all calls
        for i in range(self.k):
            self.store.grad(i).zero_()

    def run(self, actions: list[Action], micro: list[tuple], io: Links | None, *,
            recomputing: bool = False) -> list[torch.Tensor]:
        """Execute the stage's actions (sub-model indices local to the stage) on the executor;
        returns the micro-batch losses on the last stage. The gradients are on the host
        afterwards. `recomputing`: the list's forwards repeat ones that ran before."""
        losses = run_actions(self.ex, actions, micro, io, seed=self.seed, step=self.step,
                             first_micro=self.first_micro, recomputing=recomputing)
        self.ex.wait_offloads()
        for i in range(self.k):
            # replicas of tied weights inside the stage into their master
            self.store.add_replica_grads(i)
        return losses

    def order(self, schedule: str, num_micro: int) -> list[Action]:
        """ATOM's order inside the stage, between the pipeline's receives and sends: every
        micro-batch through each sub-model in turn (only GPipe neighbours wait for that)."""
        return swapped_stage_order(self.k, num_micro, self.spec.index,
                                   self.spec.holds_output)

    def forward_order(self, num_micro: int) -> list[Action]:
        """Values in, values out: every receive, ATOM's forward over the stage's sub-models
        (the last one's loss too, when it holds the output), every send."""
        j, M = self.spec.index, range(num_micro)
        R, L, F, S = ActionKind.RECEIVE, ActionKind.LOAD, ActionKind.FORWARD, ActionKind.SEND
        order = [] if j == 0 else [Action(R, j, m) for m in M]
        for i in range(self.k):
            order += [Action(L, i)] if i == 0 else []
            order += [Action(L, i + 1)] if i + 1 < self.k else []
            order += [Action(F, i, m) for m in M]
        return order + ([] if self.spec.holds_output else [Action(S, j, m) for m in M])

    def optimizer_step(self, coef: float | None) -> None:
        """The optimizer on the (reduced) master gradients, then fresh images for the next loads
        (each sub-model's slot loads again before its next use)."""
        for i in range(self.k):
            if coef is not None:
                self.store.master_grad(i).mul_(coef)
            self.ex.update_submodel(i, self.step)

    def close(self) -> None:
        self.opt.close()


__all__ = ["SwappedStage", "restrict"]
