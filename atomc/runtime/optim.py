"""Runtime stage, optimizer settings: AdamW's hyperparameters (`AdamWConfig`), a learning-rate
schedule (`warmup_cosine`), fp16 dynamic loss scaling (`LossScaler`), and whether the updates
run on a thread of their own (`updates_on_a_thread`).

The CPU optimizer that runs the updates is atomc.runtime.cpuoptimizer; the AdamW kernels over
one sub-model's flat buffers are atomc.runtime.adamw.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from atomc.errors import UsageError
from atomc.partition.hostmem import moment_bytes
from atomc.runtime.layouts import DecayFilter

IMPLS = ("fused", "foreach", "for-loop")


@dataclass(frozen=True)
class AdamWConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float | None = None  # global clipping, as torch.nn.utils.clip_grad_norm_
    lr_schedule: Callable[[int], float] | None = None  # step -> multiplier of lr
    impl: str = "fused"
    decay_filter: DecayFilter | None = None  # (FQN, shape) -> decay it? default: all
    # dtype the two moments are kept in on the host: "float32", or "bfloat16" (half the bytes;
    # the update computes in float32 and rounds them back to nearest, see CpuOptimizer)
    states: str = "float32"

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise UsageError(f"optimizer implementation {self.impl!r} is unknown; "
                             f"choose one of {', '.join(IMPLS)}")
        if self.lr < 0 or self.eps <= 0 or not all(0 <= b < 1 for b in self.betas):
            raise UsageError(f"AdamW settings lr={self.lr}, betas={self.betas}, eps={self.eps} are "
                             f"out of range; give lr >= 0, 0 <= betas < 1, eps > 0")
        moment_bytes(self.states)  # one line naming the choices
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise UsageError(f"max_grad_norm {self.max_grad_norm} must be positive (or None: no "
                             f"clipping)")

    def lr_at(self, step: int) -> float:
        return self.lr * (self.lr_schedule(step) if self.lr_schedule is not None else 1.0)

    def set_lr(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Step `step`'s learning rate into every group of `optimizer` (the one LR rule)."""
        lr = self.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr

    def decays(self, fqn: str, shape: tuple[int, ...]) -> bool:
        """Whether weight decay applies to the weight `fqn` (the one decay-group rule)."""
        return True if self.decay_filter is None else bool(self.decay_filter(fqn, tuple(shape)))

    def clip_coefficient(self, total_norm: torch.Tensor) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_'s factor for a global norm (1 without clipping)."""
        if self.max_grad_norm is None:
            return torch.ones_like(total_norm)
        return torch.clamp(self.max_grad_norm / (total_norm + 1e-6), max=1.0)

    def torch_kwargs(self) -> dict[str, Any]:
        impl = {"fused": {"fused": True}, "foreach": {"foreach": True},
                "for-loop": {"foreach": False}}[self.impl]
        return dict(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
                    **impl)

    @classmethod
    def coerce(cls, value: AdamWConfig | dict[str, Any] | None) -> AdamWConfig:
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise UsageError(f"optimizer settings {sorted(unknown)} are unknown; "
                                 f"known: {', '.join(cls.__dataclass_fields__)}")
            kw = dict(value)
            if "betas" in kw:
                kw["betas"] = tuple(kw["betas"])
            return cls(**kw)
        raise UsageError(f"optimizer= takes an AdamWConfig or a dict of its fields, "
                         f"got {type(value).__name__}")


def warmup_cosine(warmup_steps: int, total_steps: int,
                  min_ratio: float = 0.1) -> Callable[[int], float]:
    """Linear warm-up to 1, then cosine decay to `min_ratio` at `total_steps`."""
    def schedule(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return schedule


@dataclass
class LossScaler:
    """Dynamic loss scaling for fp16 (the rule of torch.amp.GradScaler)."""

    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0
    skipped_steps: int = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)


def updates_on_a_thread(device: torch.device) -> bool:
    """Whether the runtime updates on a thread of its own, beside the compute (its default):
    on CUDA only. On a CPU device the compute already uses every core, and a second thread's
    torch work gave it a second OpenMP team: the compute's parallel regions then ran up to
    2.4x slower (a 2-core box: a mini GPT's step 299 ms with the update threaded, 164 ms with
    it on the runtime's thread; bench/RESULTS.md)."""
    return device.type == "cuda"

