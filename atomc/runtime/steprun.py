"""Runtime, a step on the swap executor: how it runs each step (`StepOptions`), where a pipeline
stage's range meets the rest of the model (`StageEnds`), and what one list of actions keeps while
it runs (`RunState`) and leaves (`StepResult`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class StepOptions:
    """How the executor runs each step."""

    accum: int  # micro-batches a step
    activations: str  # "recompute", "keep" or "auto" (the plan's quotas)
    offload_activations: bool  # recompute: boundary values to host memory between the passes
    autocast_dtype: torch.dtype | None
    loss_fn: Callable[[Any, tuple], torch.Tensor]
    seed: int  # of each micro-batch's random draws
    tied_grads: str = "fast"  # or "exact": tied weights' gradients summed on the device
    early_prefetch: bool = False  # sub-model 1 loads during sub-model 0's update tail


@dataclass(frozen=True)
class StageEnds:
    """Where a pipeline stage's range meets the rest of the model: whether it ends on the
    model's output (else on received gradients), and the boundary values it receives and
    sends (those it receives carry gradients back like its own values)."""

    holds_output: bool = True
    recv: tuple[str, ...] = ()
    send: tuple[str, ...] = ()


WHOLE_MODEL = StageEnds()


@dataclass
class StepResult:
    loss_sum: torch.Tensor  # sum of the micro-batch losses (float64; a loss-holding stage only)
    losses: list[torch.Tensor]  # per micro-batch, detached, in micro-batch order
    offloads: list[Any]  # events of gradient copies to the host (CUDA), to wait for


class RunState:
    """One list's state on the executor: the micro-batches' values and gradients, and where
    the list stands (the slot the compute reads, the loads waiting for an update, the open
    compute span)."""

    def __init__(self, batches: list[tuple], model_inputs: Sequence[str], step: int, caller: Any,
                 device: torch.device):
        self.step = step
        self.caller = caller  # the caller's CUDA stream (None on the CPU)
        self.C = len(batches)
        self.batches = batches  # on the device
        self.envs: list[dict[str, Any]] = [dict(zip(model_inputs, b)) for b in self.batches]
        self.kept: dict[tuple[int, int], Any] = {}
        self.pending_loss: dict[int, tuple[torch.Tensor, list[Any]]] = {}
        self.grads: list[dict[str, torch.Tensor]] = [{} for _ in range(self.C)]
        self.received: dict[int, tuple[str, ...]] = {}
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.losses: dict[int, torch.Tensor] = {}
        self.offloads: dict[int, Any] = {}
        self.all_offloads: list[Any] = []
        self.unstashed: set[int] = set()
        self.backwarded: set[int] = set()  # sub-models whose backward began
        self.deferred: set[int] = set()  # loads waiting for an update of their weights
        self.active: int | None = None  # sub-model whose slot the compute stream reads
        self.waited = False
        self.spans = ExitStack()
        self.span: tuple[int, str] | None = None  # (sub-model, kind) of the open compute span

    def result(self) -> StepResult:
        return StepResult(self.loss_sum, [self.losses[m] for m in sorted(self.losses)],
                          self.all_offloads)
