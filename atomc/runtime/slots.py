"""Runtime, weight slots: the device buffers that the swap executor loads sub-models into.

Device memory holds two weight slots and two gradient slots, each a flat buffer sized for
the largest sub-model; sub-model i always uses slot i % 2, so at most two sub-models' weights
are on the device at once. Its parameters are views of the slot's weight buffer, their .grad
views of the gradient buffer (`views`).

What a slot holds is recorded as (sub-model, weight epochs of the sub-models it was loaded
from): a sub-model whose weights may change (an update is scheduled) has its epoch bumped, and
a slot whose recorded content still matches needs no load. The copies themselves, and the
streams they run on, are the executor's (atomc.runtime.executor); it records the slots' CUDA
events here.
"""

from __future__ import annotations

from typing import Any

import torch

from atomc.runtime.layouts import SubLayout


class WeightSlots:
    """The device weight and gradient slots, what each holds, and the load statistics."""

    def __init__(self, layouts: list[SubLayout], load_deps: list[tuple[int, ...]],
                 dtype: torch.dtype, device: torch.device):
        self.layouts = layouts
        self.load_deps = load_deps  # sub-models whose updates change what sub-model i loads
        self.num = min(2, len(layouts))
        numel = max(L.numel for L in layouts)
        grad_numel = max(L.grad_numel for L in layouts)  # trainable weights only
        self.params = [torch.zeros(numel, dtype=dtype, device=device) for _ in range(self.num)]
        self.grads = [torch.zeros(grad_numel, dtype=dtype, device=device)
                      for _ in range(self.num)]
        # slot s holds (sub-model, weight epochs of what it was loaded from), or None
        self.holds: list[tuple[int, tuple[int, ...]] | None] = [None] * self.num
        self.epoch = [0] * len(layouts)  # bumped whenever an update of sub-model i is scheduled
        self.loads = 0  # weight loads issued, all steps
        self.max_resident = 0  # most sub-models with weights in slots at once (always <= 2)
        # CUDA events per slot, recorded by the executor (None on the CPU and before the first)
        self.loaded: list[Any] = [None] * self.num  # the slot's load is done
        self.free: list[Any] = [None] * self.num  # the last compute reading it is done
        self.grad_free: list[Any] = [None] * self.num  # the gradient copy out of it is done

    def slot(self, i: int) -> int:
        return i % self.num

    def views(self, i: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Sub-model i's parameters and their gradients by local name: views of its slots (a
        frozen parameter has no gradient)."""
        s = self.slot(i)
        entries = self.layouts[i].entries
        return ({e.local: e.image_view(self.params[s]) for e in entries},
                {e.local: e.grad_view(self.grads[s]) for e in entries if e.trainable})

    def content(self, i: int) -> tuple[int, tuple[int, ...]]:
        """What sub-model i's slot holds once its current weights are loaded."""
        return (i, tuple(self.epoch[j] for j in self.load_deps[i]))

    def current(self, i: int) -> bool:
        """Sub-model i's slot holds its current weights: no load needed."""
        return self.holds[self.slot(i)] == self.content(i)

    def resident(self) -> dict[int, int]:
        """Slot -> the sub-model whose weights it holds (current or not)."""
        return {s: h[0] for s, h in enumerate(self.holds) if h is not None}

    def loaded_now(self, i: int) -> None:
        """Record that the load of sub-model i's current weights into its slot was issued."""
        self.holds[self.slot(i)] = self.content(i)
        self.loads += 1
        self.max_resident = max(self.max_resident, len(set(self.resident().values())))

    def bump(self, i: int) -> None:
        """An update of sub-model i's weights is scheduled: slots holding them load again."""
        self.epoch[i] += 1

    def invalidate(self) -> None:
        """Forget what the slots hold (the weights were replaced): every sub-model loads again."""
        self.holds = [None] * self.num
