"""Runtime, gradient buffers: the pinned host buffers the device's gradients come back into,
one per sub-model or a ring of the sub-models in flight (`GradBuffers`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from atomc.runtime.layouts import SubLayout
from atomc.runtime.pinned import HostArena


class GradBuffers:
    """The pinned host buffers the device's gradients come back into, in one arena.

    Whole (`slots=None`): one buffer per sub-model, held from its gradients' arrival to its
    update; what clipping and loss scaling need (no update before every gradient is in, for
    the global norm). A ring (`slots=R`): R buffers of the largest sub-model's size, each
    taken by a sub-model when its gradients come back and given back when its update has
    consumed them, so that only the sub-models in flight hold one.
    """

    def __init__(self, layouts: Sequence[SubLayout], dtype: torch.dtype, pin: bool,
                 slots: int | None):
        self.sizes = [L.grad_numel for L in layouts]
        self.ring = slots is not None and slots < len(layouts)
        count = slots if self.ring else len(layouts)
        shapes = [(max(self.sizes),)] * count if self.ring else [(n,) for n in self.sizes]
        self.arena = HostArena([(shape, dtype) for shape in shapes], pin)
        self.holder: list[int | None] = list(range(count)) if not self.ring else [None] * count
        self.slot_of: dict[int, int] = {} if self.ring else {i: i for i in range(len(layouts))}
        self._order: list[int] = []  # ring: holders in the order they took their slots
        self._lock = threading.Condition()

    @property
    def num_slots(self) -> int:
        return len(self.arena.buffers)

    def acquire(self, i: int, wait_for: Callable[[int], None]) -> torch.Tensor:
        """The buffer sub-model i's gradients come back into. In a ring, a free slot; when
        none is, `wait_for(h)` waits for the update of the sub-model h that has held one
        longest, which gives it back."""
        if not self.ring:
            return self.tensor(i)
        while True:
            with self._lock:
                if i in self.slot_of:
                    return self.tensor(i)
                free = next((s for s, h in enumerate(self.holder) if h is None), None)
                if free is not None:
                    self.holder[free] = i
                    self.slot_of[i] = free
                    self._order.append(i)
                    return self.tensor(i)
                oldest = self._order[0]
            wait_for(oldest)
            with self._lock:
                if oldest in self.slot_of:  # its update did not give it back: a failure
                    raise RuntimeError(f"sub-model {oldest}'s update ended without giving back "
                                       f"its gradient buffer")

    def tensor(self, i: int) -> torch.Tensor:
        return self.arena.buffers[self.slot_of[i]][:self.sizes[i]]

    def release(self, i: int) -> None:
        """Sub-model i's update has consumed its gradients (a ring slot goes back)."""
        if not self.ring:
            return
        with self._lock:
            slot = self.slot_of.pop(i, None)
            if slot is not None:
                self.holder[slot] = None
                self._order.remove(i)
                self._lock.notify_all()

    def pinned_bytes(self) -> int:
        return self.arena.pinned_bytes()
