"""The constraints a partition plan must meet (docs/design.md, section "Partition: Algorithm 1,
exact", plus the two gradient-lane ones), as slack per sub-model and constraint, with the message
that names what is compared.

The search applies the same constraints as masks over all ranges (search.py lists them);
`plan_slacks` lists them for one plan's `RangeCost`s, for the plan's report and messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from atomc.ir import Submodel
from atomc.partition.cost import RangeCost, first_tail
from atomc.units import NS_PER_MS, format_bytes

# constraint names, and the search tier from which each is relaxed (memory never is)
MEMORY = "memory"
FORWARD_OVERLAP = "forward overlap"
BACKWARD_OVERLAP = "backward overlap"
GRADIENT_OFFLOAD = "gradient offload"
OPTIMIZER = "optimizer"
TIME_CONSTRAINTS = (FORWARD_OVERLAP, BACKWARD_OVERLAP, GRADIENT_OFFLOAD, OPTIMIZER)


def slot_bytes(costs: Sequence[RangeCost] | Sequence[Submodel]) -> int:
    """Device bytes of the runtime's weight and gradient slots (atomc.runtime.slots): two of
    each (one with one sub-model), each sized for the largest sub-model, and held all step. A
    plan of uneven sub-models needs more than the pairs of neighbours the search checks.
    `costs`: the sub-models' ranges, or a plan's sub-models (a swapped layout stage's)."""
    return min(2, len(costs)) * 2 * max((c.param_bytes for c in costs), default=0)


@dataclass(frozen=True)
class Slack:
    """How much room one constraint of one sub-model has; negative when it is violated."""

    submodel: int  # the sub-model computing while the constraint applies
    constraint: str  # MEMORY or one of TIME_CONSTRAINTS
    slack: int  # bytes for MEMORY, ns otherwise
    detail: str  # what is compared, for messages


def plan_slacks(costs: list[RangeCost], usable_bytes: int,
                early_prefetch: bool = False) -> list[Slack]:
    """Every constraint of docs/design.md, section "Partition: Algorithm 1, exact"
    (plus the two gradient-lane ones) for a plan's ranges.

    With `early_prefetch` sub-model 1 loads during sub-model 0's update tail, so sub-model 0's
    forward overlap compares that tail with the load, and the tail has a memory requirement.
    Sub-model 1's offload and update against sub-model 0's backward are no constraint: they
    meet at the step boundary, where the handover prices what they overrun (first_pair).
    """

    def ms(ns: int) -> str:
        return f"{ns / NS_PER_MS:.1f} ms"

    out: list[Slack] = []
    k = len(costs)
    slots = slot_bytes(costs)
    for i, c in enumerate(costs):
        nxt = costs[i + 1] if i + 1 < k else None
        prv = costs[i - 1] if i > 0 else None
        need = [(c.mem_fwd_bytes, "its forward alone"), (c.mem_bwd_bytes, "its backward alone"),
                (slots + c.mem_fwd_bytes - c.param_bytes,
                 f"its forward in the runtime's slots ({format_bytes(slots)})"),
                (slots + c.mem_bwd_bytes - c.param_bytes - c.grad_bytes,
                 f"its backward in the runtime's slots ({format_bytes(slots)})")]
        if nxt:
            need.append((c.mem_fwd_bytes + nxt.param_bytes,
                         f"its forward + loading sub-model {i + 1}'s parameters"))
            need.append((c.mem_bwd_bytes + nxt.grad_bytes,
                         f"its backward + sub-model {i + 1}'s gradients leaving"))
        if prv:
            need.append((c.mem_bwd_bytes + prv.param_bytes,
                         f"its backward + loading sub-model {i - 1}'s parameters"))
        for num_bytes, what in need:
            out.append(Slack(i, MEMORY, usable_bytes - num_bytes,
                             f"{what} needs {format_bytes(num_bytes)} of "
                             f"{format_bytes(usable_bytes)}"))
        if nxt and i == 0 and early_prefetch:
            tail, wait = first_tail(costs)
            out.append(Slack(i, FORWARD_OVERLAP, tail - wait,
                             f"its update tail {ms(tail)} vs sub-model 1's update and load "
                             f"{ms(wait)}"))
            num_bytes = c.param_bytes + c.grad_bytes + nxt.param_bytes
            out.append(Slack(i, MEMORY, usable_bytes - num_bytes,
                             f"its update tail + loading sub-model 1 needs "
                             f"{format_bytes(num_bytes)} of {format_bytes(usable_bytes)}"))
        elif nxt:
            out.append(Slack(i, FORWARD_OVERLAP, c.accum_fwd_ns - nxt.load_fwd_ns,
                             f"C*t_fwd {ms(c.accum_fwd_ns)} vs loading sub-model {i + 1} "
                             f"{ms(nxt.load_fwd_ns)}"))
        if nxt and i:  # between P_1 and P_0 the handover prices it (first_pair)
            out.append(Slack(i, GRADIENT_OFFLOAD, c.accum_bwd_ns - nxt.offload_ns,
                             f"C*t_bwd {ms(c.accum_bwd_ns)} vs offloading sub-model {i + 1}'s "
                             f"gradients {ms(nxt.offload_ns)}"))
            out.append(Slack(i, OPTIMIZER,
                             c.accum_bwd_ns + c.offload_ns - nxt.offload_ns - nxt.optimizer_ns,
                             f"C*t_bwd + own offload {ms(c.accum_bwd_ns + c.offload_ns)} vs "
                             f"sub-model {i + 1}'s offload + CPU update "
                             f"{ms(nxt.offload_ns + nxt.optimizer_ns)}"))
        if prv and nxt:  # the last one's predecessor is still in its slot: nothing loads
            out.append(Slack(i, BACKWARD_OVERLAP,
                             c.accum_bwd_ns - c.checkpoint_ns - prv.load_fwd_ns,
                             f"C*t_bwd {ms(c.accum_bwd_ns)} vs its checkpoints "
                             f"{ms(c.checkpoint_ns)} + loading sub-model {i - 1} "
                             f"{ms(prv.load_fwd_ns)}"))
        elif c.checkpoint_ns:
            out.append(Slack(i, BACKWARD_OVERLAP, c.accum_bwd_ns - c.checkpoint_ns,
                             f"C*t_bwd {ms(c.accum_bwd_ns)} vs its checkpoints "
                             f"{ms(c.checkpoint_ns)}"))
    return out
