"""SWARM server, the step's sums: the gradients a server holds of the step its stage is at.

One object, handed to the parts that share it: the call handler adds each backward call's
gradients (atomc.swarm.calls), the commit takes them and advances the step (atomc.swarm.commit,
atomc.swarm.state), and adopting a downloaded state restarts them at its step. Its condition
`cv` also guards the stage those parts compute on, so a call, a commit and a download never
overlap. Every write goes through a method here; readers hold `cv`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch


class StepSums:
    """The gradient sums of one step of the stage a server serves (see the module docstring)."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.step = 0  # optimizer steps the stage has taken: the step the sums are for
        # which of this server's collections of the step's gradients the sums are; a trainer
        # that gives up on one excludes it in the DHT (atomc.swarm.records), and the server
        # starts the next. Never reused, not even across steps or stages, so that no old
        # exclusion can match a new attempt
        self.attempt = 0
        self.acc = torch.zeros(0)  # the gradients of the micro-batches in `ids`, summed
        self.ids: dict[str, int] = {}  # micro-batch id -> its samples
        # (peer, stage, attempt) excluded from `step`, as last read from the DHT
        self.excluded: set[tuple[str, int, int]] = set()

    def begin(self, numel: int, dtype: torch.dtype) -> None:
        """A new stage of `numel` parameters in `dtype`: nothing held, at step 0 until its
        state arrives (`restart`)."""
        self.acc = torch.zeros(numel, dtype=dtype)
        self.ids = {}
        self.excluded = set()
        self.step = 0

    def add(self, params: Iterable[tuple[str, torch.Tensor]], micro: str, samples: int) -> None:
        """The gradients a backward call left on `params` (in the stage's order), as micro-batch
        `micro` of `samples` samples."""
        off = 0
        for _, p in params:
            n = p.numel()
            if p.grad is not None:
                self.acc[off:off + n] += p.grad.detach().reshape(-1).to(self.acc.dtype)
            off += n
        self.ids[micro] = samples

    def samples(self) -> int:
        return sum(self.ids.values())

    def note_excluded(self, excluded: set[tuple[str, int, int]]) -> None:
        """The step's exclusions as read from the DHT (calls check theirs against them)."""
        self.excluded = excluded

    def next_attempt(self) -> None:
        """Our attempt was excluded: drop what it held and start the next."""
        self.clear()
        self.attempt += 1

    def advance(self) -> None:
        """The stage took the step: the sums start over for the next."""
        self.step += 1
        self.clear()

    def restart(self, step: int) -> None:
        """The stage's state at `step` was adopted: whatever we held of another step is void."""
        self.step = step
        self.clear()

    def clear(self) -> None:
        self.acc.zero_()
        self.ids = {}


__all__ = ["StepSums"]
