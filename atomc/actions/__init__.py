"""Schedule IR (docs/design.md, section "Runtime: one core for every way of training"):
one training step as a list of actions, with a compact text form.

Input of the runtimes that execute a schedule and of the simulator that times it, so that the
two cannot disagree on what happens, only on how long it takes. `atomc.actions.orders` writes
the lists: ATOM's order for the swap runtime, GPipe and 1F1B for a pipeline stage.

An action is one kind of work for one sub-model (the swap runtime) or one stage (a pipeline
order), and for the kinds that move a micro-batch, that micro-batch:

    F  forward of a micro-batch                          2F0   sub-model 2, micro-batch 0
    B  backward of a micro-batch (recomputation first)   2B0
    L  load the weights, host to device                  1L
    O  offload the gradients, device to host             1O
    U  update the weights (CPU AdamW) once they are out  0U
    S  send a micro-batch's values, or their gradients   1S3   stage 1, micro-batch 3
    R  receive them                                      1R3

A stage's S and R of one micro-batch carry its values the first time they appear and their
gradients the second (values go forward before gradients come back). A sub-model's offloaded
boundary activations (checkpoints) are not actions of their own: they belong to its first B,
and stream in ahead of the loads listed between the compute before that B and the B, one
micro-batch ahead of the backward.

Text form: tokens `INDEX KIND [MICRO]` separated by spaces, commas or newlines; `parse_actions` and
`format_actions` are inverses.
"""

from __future__ import annotations

from atomc.actions.action import (
    GRAMMAR,
    Action,
    ActionKind,
    Run,
    directions,
    format_actions,
    parse_actions,
    phases,
    runs,
)
from atomc.actions.orders import (
    PIPELINE_ORDERS,
    atom_order,
    atom_runs,
    gpipe,
    max_in_flight,
    one_f_one_b,
    pipeline_order,
)

__all__ = [
    "GRAMMAR", "PIPELINE_ORDERS", "Action", "ActionKind", "Run", "atom_order", "atom_runs",
    "directions", "format_actions", "gpipe", "max_in_flight", "one_f_one_b", "parse_actions",
    "phases", "pipeline_order", "runs",
]
