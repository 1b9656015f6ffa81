"""Stage 6, runtime: a generated package -> swapped training on one device (ATOM, paper III-C).

Public:
- `SwapTrainer.from_package(dir, config, device=..., accum=..., optimizer=...)`,
  `trainer.step(batch)`,
  `state_dict()` / `load_state_dict()`, `save_checkpoint()` / `load_checkpoint()`,
  `export_state_dict()`, `traces` (measured event traces).
- `TrainerConfig`: a run's choices; `resolve()` fills them from the plan (`RunSettings`).
- `AdamWConfig`, `warmup_cosine`: optimizer settings and a learning-rate schedule.
- `micro_batch_rng(seed, step, m)`: the RNG rule, for running the plain model the same way.

Parts: `package` (the generated package, checked), `config` (choices and defaults), `startup`
(what a trainer checks and builds before its first step), `layouts` (where each weight lies in
the host buffers), `store` (flat pinned host buffers), `executor` (the swap loop on streams and
events) with the pieces it
holds (`slots`: the two device weight slots; `stash`: boundary activations in host memory;
`ties`: tied weights' gradients), `interpret` (the one interpreter of action lists, on any
`Executor`: the protocol the executor and a resident stage, atomc.stages, implement),
`rng` (the dropout rule), `optim` (the optimizer's settings), `cpuoptimizer` (CPU AdamW on a
worker thread), `trace` (event records),
`checkpoint` (atomic files).
"""

from atomc.runtime.config import RunSettings, TrainerConfig
from atomc.runtime.optim import AdamWConfig, LossScaler, warmup_cosine
from atomc.runtime.rng import micro_batch_rng, micro_batch_seed
from atomc.runtime.startup import check_device_memory
from atomc.runtime.trace import StepTrace, TraceEvent
from atomc.runtime.trainer import SwapTrainer

__all__ = [
    "AdamWConfig", "LossScaler", "RunSettings", "StepTrace", "SwapTrainer", "TraceEvent",
    "TrainerConfig", "check_device_memory", "micro_batch_rng", "micro_batch_seed", "warmup_cosine",
]
