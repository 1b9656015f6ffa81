"""Stages, the choice between the two implementations: `make_stage`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from atomc.runtime.optim import AdamWConfig
from atomc.runtime.package import SwapPackage
from atomc.stages.base import Stage, StageSpec
from atomc.stages.resident import ResidentStage
from atomc.stages.swapped import SwappedStage


def make_stage(swapped: bool, pkg: SwapPackage, spec: StageSpec, device: torch.device,
               loss_fn: Callable[[Any, tuple], torch.Tensor] | None, opt_cfg: AdamWConfig,
               dtype: torch.dtype | None = None, seed: int = 0) -> Stage:
    """The stage `spec` of `pkg`: swapped (the swap runtime's executor) or resident. A stage
    that does not hold the model output gets no loss function."""
    loss = loss_fn if spec.holds_output else None
    if swapped:
        return SwappedStage(pkg, spec, device, loss, opt_cfg, dtype=dtype, seed=seed)
    return ResidentStage(pkg, spec, device, loss, opt_cfg, dtype=dtype, seed=seed)


__all__ = ["make_stage"]
