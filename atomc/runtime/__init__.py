"""Stage 6, runtime: a generated package -> swapped training on one device (ATOM, paper III-C).

Public:
- `SwapTrainer.from_package(dir, device=..., accum=..., optimizer=...)`, `trainer.step(batch)`,
  `state_dict()` / `load_state_dict()`, `save_checkpoint()` / `load_checkpoint()`,
  `export_state_dict()`, `traces` (measured event traces).
- `AdamWConfig`, `warmup_cosine`: optimizer settings and a learning-rate schedule.
- `micro_batch_rng(seed, step, m)`: the RNG rule, for running the plain model the same way.

Parts: `store` (flat pinned host buffers), `executor` (the schedule on streams and events),
`optim` (CPU AdamW on a worker thread), `trace` (event records), `checkpoint` (atomic files).
"""

from atomc.runtime.executor import micro_batch_rng, micro_batch_seed
from atomc.runtime.optim import AdamWConfig, LossScaler, warmup_cosine
from atomc.runtime.trace import StepTrace, TraceEvent
from atomc.runtime.trainer import SwapTrainer, check_device_memory

__all__ = [
           "AdamWConfig",
           "LossScaler",
           "StepTrace",
           "SwapTrainer",
           "TraceEvent",
           "check_device_memory",
           "micro_batch_rng",
           "micro_batch_seed",
           "warmup_cosine",
]
