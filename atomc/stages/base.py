"""Stages, what every stage is: the `Stage` protocol, the `StageSpec` it is built from, and the
weight helpers both implementations share.

A stage is a range of a generated package's sub-models on one rank, with its weights, its
optimizer and its part of each step's action list; a layout rank and a SWARM server each hold
one. Its `run` hands its list to the one interpreter of the action IR
(atomc.runtime.interpret.run_actions) on the stage's executor: the resident stage is its own,
the swapped stage's is the swap runtime's executor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from atomc.actions import Action
from atomc.dtypes import parse_dtype
from atomc.errors import RuntimeMismatchError, UsageError
from atomc.runtime.interpret import Links
from atomc.runtime.package import SwapPackage


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


class Stage(Protocol):
    """What a layout rank and a SWARM server hold: one stage's weights, optimizer and steps.

    `begin_step`, then `run` on lists from `order` (a step's part of the pipeline schedule) or
    `forward_order` (values in, values out), with `io` for its sends and receives; the losses
    come back on the stage that holds the output. `named_parameters` are by original FQN, with
    their gradients after `run`; `optimizer_step(coef)` scales them by `coef` first.
    """

    kind: str  # "resident" or "swapped" (checkpoints record it)
    spec: StageSpec

    def begin_step(self, step: int, num_micro: int, first_micro: int = 0) -> None: ...

    def order(self, schedule: str, num_micro: int) -> list[Action]: ...

    def forward_order(self, num_micro: int) -> list[Action]: ...

    def run(self, actions: list[Action], micro: list[tuple], io: Links | None, *,
            recomputing: bool = False) -> list[torch.Tensor]: ...

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]: ...

    def buffers(self) -> dict[str, torch.Tensor]: ...

    def optimizer_step(self, coef: float | None) -> None: ...

    def load_original(self, state_dict: dict[str, torch.Tensor]) -> None: ...

    def export(self) -> dict[str, torch.Tensor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def stage_dtype(name: str | None) -> torch.dtype | None:
    """The master dtype a stage trains in (None: float32)."""
    dtype = parse_dtype(name, "dtype")
    if dtype not in (None, torch.float32, torch.float64):
        raise UsageError(f"dtype {name!r}: a pipeline stage trains in float32 or float64")
    return dtype


def tensor_attr(module: nn.Module, name: str) -> torch.Tensor:
    owner, _, leaf = name.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, leaf)


def original_tensor(pkg: SwapPackage, state_dict: dict[str, torch.Tensor],
                    fqn: str) -> torch.Tensor:
    if fqn in state_dict:
        return state_dict[fqn]
    aliases = dict(getattr(pkg.module, "ALIASES", {}) or {})
    for alias, canonical in aliases.items():
        if canonical == fqn and alias in state_dict:
            return state_dict[alias]
    raise RuntimeMismatchError(f"the initial state dict has no {fqn!r}, which the package's "
                               f"sub-models hold; give the original model's state_dict()")


def named_buffers(pkg: SwapPackage, modules: dict[int, nn.Module]) -> dict[str, torch.Tensor]:
    """The buffers of the given sub-models by original FQN (those PARAM_NAMES knows)."""
    out = {}
    for i, mod in modules.items():
        for local, b in mod.named_buffers():
            fqn = pkg.param_names[i].get(local)
            if fqn is not None:
                out.setdefault(fqn, b)
    return out


__all__ = ["Stage", "StageSpec", "named_buffers", "original_tensor", "stage_dtype",
           "tensor_attr"]
