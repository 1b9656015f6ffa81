"""Runtime stage, evaluation: the loss of a batch through a swap trainer's sub-models, forward
only, changing nothing.

`eval_loss(trainer, batch)` runs a list of forward actions (atomc.actions: each sub-model
over the batch's C micro-batches, the next one loading meanwhile, as in a step's forward) on
the trainer's executor, through the one interpreter (atomc.runtime.interpret.run_actions),
with the sub-models in eval mode (dropout off, normalisation on its running statistics) and
no autograd graph, and returns the mean of the micro-batches' `loss_fn`: the held-out loss
of `atomc train --eval-data`. The weights are those of the last step (a pending optimizer
update is waited for before its sub-model loads); the buffers, the caller's RNG state and the
trainer's traces are as they were afterwards.
"""

from __future__ import annotations

from typing import Any

import torch

from atomc.actions import Action
from atomc.runtime.interpret import run_actions


def forward_only(num_submodels: int, num_micro: int) -> list[Action]:
    """Each sub-model's forward over every micro-batch, the next sub-model's load issued
    after the first of them."""
    actions: list[Action] = []
    for i in range(num_submodels):
        for m in range(num_micro):
            actions.append(Action("F", i, m))
            if m == 0 and i + 1 < num_submodels:
                actions.append(Action("L", i + 1))
    return actions


def eval_loss(trainer: Any, batch: Any) -> float:
    """The mean loss of `batch` (as SwapTrainer.step takes it) under the current weights."""
    micro = trainer.split_batch(batch)
    ex = trainer.executor
    trainer.wait()  # the buffers as the last step left them
    modules = [ex.module(i) for i in range(trainer.package.num_submodels)]
    buffers = [[b.clone() for b in m.buffers()] for m in modules]
    modes = [[s.training for s in m.modules()] for m in modules]
    losses: list[torch.Tensor] = []
    loss_fn = ex.loss_fn

    def keep_loss(outputs: Any, micro_batch: tuple) -> torch.Tensor:
        loss = loss_fn(outputs, micro_batch)
        losses.append(loss.detach().to(torch.float64))
        return loss

    tracing = ex.tracer.enabled
    try:
        ex.tracer.enabled = False  # not a step: nothing of it in the last step's trace
        ex.loss_fn = keep_loss
        for m in modules:
            m.eval()
        with torch.no_grad():
            run_actions(ex, forward_only(len(modules), len(micro)), micro, seed=trainer.seed,
                        step=trainer.step_count)
        ex.synchronize()  # the losses were computed on the executor's streams
        return float(torch.stack(losses).sum()) / len(micro)
    finally:
        ex.loss_fn = loss_fn
        ex.tracer.enabled = tracing
        with torch.no_grad():
            for m, saved in zip(modules, buffers):
                for b, v in zip(m.buffers(), saved):
                    b.copy_(v)
        for m, flags in zip(modules, modes):
            for s, flag in zip(m.modules(), flags):
                s.training = flag


__all__ = ["eval_loss", "forward_only"]
