"""Stages: one range of a generated package's sub-models on one rank, with its weights, its
optimizer and its part of each step's action list; a layout rank (atomc.distributed.runner) and
a SWARM server (atomc.swarm) each hold one.

As torch.distributed.pipelining keeps its stage apart from its schedules, a stage runs the
lists it is given through the one interpreter of the action IR
(atomc.runtime.interpret.run_actions), which owns the sends and receives, the RNG state that
travels with a micro-batch (atomc.runtime.rng: micro-batch m's stream is seeded by its index in
the global batch) and the buffer rule.

- `base`: the `Stage` protocol (`begin_step`, `run(actions, micro_batches, io)` returning the
  losses on the last stage, `named_parameters` by original FQN with their gradients after
  `run`, `optimizer_step(coef)`, `state_dict`/`load_state_dict`, `export`) and `StageSpec`;
- `cut`: `cut_stages`, the `StageSpec` of each stage of a package cut at sub-model ranges,
  with the values that cross each boundary (`stage_boundaries`);
- `resident`: `ResidentStage`, the sub-models on the device with the autograd graph of every
  micro-batch in flight and torch's AdamW, its own executor (F, B, S and R);
- `swapped`: `SwappedStage`, the swap runtime's executor over the stage: sub-models loaded one
  after another from the host store, internals recomputed in the backward, the CPU optimizer
  over flat buffers;
- `make`: `make_stage`, one or the other for a spec.
"""

from atomc.stages.base import Stage, StageSpec, stage_dtype
from atomc.stages.cut import cut_stages, package_plan, stage_boundaries
from atomc.stages.make import make_stage
from atomc.stages.resident import ResidentStage
from atomc.stages.swapped import SwappedStage

__all__ = ["ResidentStage", "Stage", "StageSpec", "SwappedStage", "cut_stages", "make_stage",
           "package_plan", "stage_boundaries", "stage_dtype"]
