"""Runtime, tied weights: their gradients summed micro-batch by micro-batch (tied_grads="exact").

A weight tied across sub-models has a parameter in each (the owner, the lowest index, holds
its master). By default ("fast") each holder sums its gradient over the micro-batches, and the
host store adds the holders' sums: one rounding away from the unpartitioned model, which adds
across holders first, then over micro-batches. "exact" keeps the later holders' gradient of
each micro-batch on the device (C copies of the tied weight), summed in the order the
backward reaches them (the last holder first, as autograd adds the uses of one weight in the
plain model: T5's output layer, then its decoder's and its encoder's embeddings), and adds it
to the owner's in the owner's backward of the same micro-batch, which reproduces the plain
model's sums bit for bit. The host store then leaves those weights' replicas out of its own
sum (`store.exact_keys`).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from atomc.runtime.layouts import SubLayout


class TiedGrads:
    """The exact ties' gradient hooks, the holders' per-micro-batch gradients they keep, and
    the micro-batch whose backward runs (`mb`, set by the interpreter before each backward)."""

    def __init__(self, modules: list[nn.Module], layouts: list[SubLayout], exact: bool):
        self.modules = modules
        self.mb = 0  # micro-batch whose backward is running (read by the hooks)
        self._held: dict[str, dict[int, torch.Tensor]] = {}  # key -> micro-batch -> gradient
        self._fired: set[str] = set()  # ties whose owner hook ran in this backward
        # key -> its holders (sub-model, local name), owner first; none when "fast"
        self.ties = self._hook(layouts) if exact else {}

    def _hook(self, layouts: list[SubLayout]) -> dict[str, tuple[tuple[int, str], ...]]:
        """Find each weight held by several sub-models and hook every holder's parameter."""
        by_key: dict[str, list[tuple[int, str]]] = {}
        for L in layouts:
            for e in L.entries:
                if e.trainable:  # a frozen weight has no gradient to sum
                    by_key.setdefault(e.key, []).append((L.index, e.local))
        ties: dict[str, tuple[tuple[int, str], ...]] = {}
        for key, holders in by_key.items():
            if len({i for i, _ in holders}) < 2:  # one sub-model: one parameter (codegen ties)
                continue
            (o, o_local), *later = ties[key] = tuple(sorted(holders))
            for h, h_local in later:
                self.modules[h].get_parameter(h_local).register_hook(partial(self._capture, key))
            self.modules[o].get_parameter(o_local).register_hook(partial(self._add, key))
        return ties

    def _capture(self, key: str, grad: torch.Tensor) -> None:
        held = self._held.setdefault(key, {})
        before = held.get(self.mb)
        held[self.mb] = grad.detach().clone() if before is None else before + grad.detach()

    def _add(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        self._fired.add(key)
        other = self._held.get(key, {}).pop(self.mb, None)
        return grad if other is None else grad + other

    def finish(self, i: int) -> None:
        """After sub-model i's backward of micro-batch `mb`: where i owns a tie, add a holder
        gradient that no hook took (the owner's parameter got no gradient of its own)."""
        for key, ((o, o_local), *_) in self.ties.items():
            if o != i:
                continue
            other = self._held.get(key, {}).pop(self.mb, None)
            if key not in self._fired and other is not None:
                p = self.modules[o].get_parameter(o_local)
                p.grad.add_(other)
            self._fired.discard(key)
