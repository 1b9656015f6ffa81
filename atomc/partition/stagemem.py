"""A pipeline stage's device bytes over a plan's sub-models [start, stop), resident or swapped,
and the bytes crossing a cut between sub-models.

input:  a Plan (the package's plan the layout runner cuts into stages, or the plan of blocks
        `atomc compare` cuts its layouts from) and a stage's sub-model range
output: bytes

One rule each, so that the layout runner's swap decision (atomc.distributed.runner) and the
layouts `atomc compare` predicts (atomc.compare.layouts, atomc.compare.swarm) are the same
decision, and `atomc place` sizes its messages with the same cut.
"""

from __future__ import annotations

from atomc.ir import Plan
from atomc.partition.constraints import slot_bytes
from atomc.units import FLOAT_BYTES

# a resident stage holds its weights, their gradients and AdamW's two moments; without an
# optimizer step (ATOM Fig. 14's setting, which compare predicts) the weights and their
# gradients
RESIDENT_COPIES = 4
RESIDENT_COPIES_NO_UPDATE = 2


def boundary_bytes(plan: Plan, start: int) -> tuple[int, int]:
    """(values, gradients) of one micro-batch crossing the cut before sub-model `start`: what
    earlier sub-models made and later ones read; gradients only of floating values."""
    subs = plan.submodels
    produced = {t.name: t for s in subs[:start] for t in s.outputs}
    needed = {t.name for s in subs[start:] for t in s.inputs}
    cross = [produced[n] for n in needed if n in produced]
    values = sum(t.num_bytes for t in cross)
    grads = sum(t.num_bytes for t in cross if t.dtype in FLOAT_BYTES)
    return int(values), int(grads)


def _activations(plan: Plan, start: int, stop: int) -> list[int]:
    """Each sub-model's bytes beyond its weights at its peak, for the plan's C micro-batches."""
    return [max(s.peak_bytes - s.param_bytes, 0) for s in plan.submodels[start:stop]]


def resident_stage_bytes(plan: Plan, start: int, stop: int, in_flight: int, *,
                         recompute: bool = False, copies: int = RESIDENT_COPIES) -> int:
    """Device bytes a resident stage over sub-models [start, stop) needs with `in_flight`
    micro-batches in flight: `copies` of its weights (weights, gradients, two AdamW moments),
    and for each micro-batch in flight the activations of every sub-model (the plan's peaks
    beyond the weights, a micro-batch's share of its C). Recomputing (GPipe's
    re-materialisation, Petals' servers; the runner does not): each micro-batch's values at
    the stage's inner cuts, and one sub-model's activations at a time."""
    weights = sum(s.param_bytes for s in plan.submodels[start:stop])
    acts = _activations(plan, start, stop)
    accum = max(plan.accum, 1)
    if recompute:
        cuts = sum(boundary_bytes(plan, i)[0] for i in range(max(start, 1), stop))
        return copies * weights + max(in_flight, 1) * cuts + max(acts, default=0) // accum
    return copies * weights + sum(acts) // accum * max(in_flight, 1)


def swapped_stage_bytes(plan: Plan, start: int, stop: int, num_micro: int) -> int:
    """Device bytes of a swapped stage over sub-models [start, stop) (atomc.stages.swapped:
    the swap runtime with activations recomputed): the runtime's weight and gradient slots
    (atomc.partition.constraints.slot_bytes); the values crossing the stage's cuts (what it
    receives, what passes between its sub-models, what it sends) for all `num_micro`
    micro-batches, which stay on the device from the forward to the backward; and one
    sub-model's activations (a backward after recomputing one micro-batch)."""
    n = len(plan.submodels)
    cuts = sum(boundary_bytes(plan, i)[0] for i in range(max(start, 1), min(stop + 1, n)))
    one = max(_activations(plan, start, stop)) // max(plan.accum, 1)
    return slot_bytes(plan.submodels[start:stop]) + num_micro * cuts + one


__all__ = ["RESIDENT_COPIES", "RESIDENT_COPIES_NO_UPDATE", "boundary_bytes",
           "resident_stage_bytes", "swapped_stage_bytes"]
