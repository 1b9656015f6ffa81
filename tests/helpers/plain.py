"""The reference swap runs are compared with: the unpartitioned model trained the plain way
(test_runtime, test_weights).

For each micro-batch m of step s: forward and loss under micro_batch_rng(seed, s, m) (the
runtime's RNG rule), (loss / C).backward(); then clip_grad_norm_ and torch.optim.AdamW with
the same settings.
"""

from __future__ import annotations

import torch

from atomc.runtime import micro_batch_rng


def plain_run(model, loss_fn, batches, C, *, lr=1e-2, weight_decay=0.01, seed=0, clip=None,
              schedule=None, groups=None, autocast=None, start=0):
    """Each step's mean loss of `model` trained plainly on `batches` (each split in C
    micro-batches), from step `start`."""
    opt = torch.optim.AdamW(groups if groups is not None else model.parameters(), lr=lr,
                            weight_decay=weight_decay, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if schedule else None
    losses = []
    for step, batch in enumerate(batches, start=start):
        opt.zero_grad()
        total = 0.0
        for m, mb in enumerate(batch.chunk(C)):
            with micro_batch_rng(seed, step, m), \
                    torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                loss = loss_fn(model(mb), (mb,))
            (loss / C).backward()
            total += loss.item()
        losses.append(total / C)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
    return losses
