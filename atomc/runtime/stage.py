"""Runtime, the Stage seam: what the one interpreter of the action IR drives.

`atomc.runtime.interpret.run_actions` executes a list of actions (atomc.actions) on a `Stage`,
as torch.distributed.pipelining's schedule runtime executes its IR on a pipeline stage: the
stage offers one operation per kind of action (the forward and the backward of one micro-batch
through one of its indices, the load, offload and update of one sub-model's weights) and takes
and hands out what its neighbours exchange; the interpreter owns what every runtime shares
(which way an S or R goes, the RNG stream that travels with a micro-batch, the buffers a
recomputation sees).

Two implementations:
- the swap executor (atomc.runtime.executor): an index is a sub-model, loaded into a weight
  slot, recomputed in its backward from its boundary inputs; it runs the swap trainer's step,
  a layout's swapped stage and a SWARM server's swapped stage;
- the resident stage (atomc.distributed.stage): an index is the whole stage, on the device,
  with the autograd graph of every micro-batch in flight.

Owned here, one place each: `boundary_leaf` (a boundary value as a stage's autograd leaf) and
`buffers_as_in_forward` (a recomputation reads and updates copies of the buffers as they were
before its forward, so that running statistics are updated once).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


class Links(Protocol):
    """A stage's S and R: one call per micro-batch (a layout's links: runner.StageIO; the one
    micro-batch of a SWARM call)."""

    def recv(self, m: int) -> dict[str, Any]: ...

    def send(self, m: int, values: dict[str, Any]) -> None: ...

    def recv_grads(self, m: int) -> dict[str, torch.Tensor]: ...

    def send_grads(self, m: int, grads: dict[str, Any], received: dict[str, Any]) -> None: ...


@runtime_checkable
class Stage(Protocol):
    """The operations `run_actions` drives, one per kind of action; an action's index is what
    the stage's lists name (a sub-model of a swapped stage, the stage itself when resident).

    Flags the interpreter reads off the list, as pipelining's runtime passes `last_backward`:
    `last` on a forward, its index's last forward in the list; `first`/`last` on a backward,
    its index's first/last backward; on a load, `next_first_backward` (the index whose first
    backward is the next compute, if it is one) and `trailing` (no compute follows: the next
    step's early prefetch).
    """

    device: torch.device

    def session(self, micro_batches: list[tuple], step: int) -> AbstractContextManager[None]:
        """The context one list runs in: the stage's per-list state and its streams."""
        ...

    def exchange(self) -> AbstractContextManager[None]:
        """The context an S or R runs in (CUDA: the caller's stream, after the stage's compute
        issued so far, and the compute after it)."""
        ...

    def recomputes(self, index: int) -> bool:
        """Whether `index`'s backward runs its forward again (then with the forward's RNG state
        and buffers), rather than reading a graph kept from the forward."""
        ...

    def forward_modules(self, index: int) -> Sequence[nn.Module]:
        """The modules with buffers that `index`'s forward runs: what the buffer rule sets."""
        ...

    def forward(self, index: int, micro: int, *, last: bool) -> None: ...

    def backward(self, index: int, micro: int, *, first: bool, last: bool) -> None: ...

    def load(self, index: int, *, next_first_backward: int | None, trailing: bool) -> None: ...

    def offload(self, index: int) -> None: ...

    def update(self, index: int) -> None: ...

    def take_values(self, micro: int, values: dict[str, Any]) -> None:
        """R: micro-batch `micro`'s values from the previous stage (the RNG state taken off)."""
        ...

    def take_grads(self, micro: int, grads: dict[str, torch.Tensor]) -> None:
        """R: the gradients of what `micro` sent, from the next stage."""
        ...

    def values_out(self, micro: int) -> dict[str, Any]:
        """S: what `micro` sends the next stage, after its forwards."""
        ...

    def grads_out(self, micro: int) -> dict[str, torch.Tensor | None]:
        """S: the gradients of what `micro` received, after its backwards (None: no gradient
        reached it)."""
        ...

    def losses(self) -> list[torch.Tensor]:
        """After a list: the losses it computed, detached, in micro-batch order."""
        ...


def boundary_leaf(value: Any, grad: bool) -> Any:
    """A boundary value as the autograd leaf a stage computes from: a floating tensor that
    carries a gradient back gets a fresh leaf over the same memory; anything else stays as it
    is."""
    if isinstance(value, torch.Tensor) and grad and (value.is_floating_point()
                                                    or value.is_complex()):
        return value.detach().requires_grad_(True)
    return value


def _buffer_slots(modules: Sequence[nn.Module]) -> list[tuple[nn.Module, str, torch.Tensor]]:
    out = []
    for top in modules:
        for owner in top.modules():
            for name, buf in owner._buffers.items():
                if buf is not None:
                    out.append((owner, name, buf))
    return out


def buffer_snapshot(modules: Sequence[nn.Module]) -> list[torch.Tensor] | None:
    """Copies of the buffers of `modules` as they are now (None when they hold none)."""
    slots = _buffer_slots(modules)
    return [b.clone() for _, _, b in slots] if slots else None


@contextmanager
def buffers_as_in_forward(modules: Sequence[nn.Module],
                          saved: list[torch.Tensor] | None) -> Iterator[None]:
    """Run a recomputation on `saved` (a `buffer_snapshot` taken before the forward it repeats).

    A module that updates a buffer (running statistics) would otherwise update it a second
    time, and one that reads a buffer would see the later value; the recomputation reads and
    updates the copies, and the real buffers stay as they are.
    """
    if saved is None:
        yield
        return
    slots = _buffer_slots(modules)
    for (owner, name, _), value in zip(slots, saved):
        owner._buffers[name] = value
    try:
        yield
    finally:
        for owner, name, value in slots:
            owner._buffers[name] = value


__all__ = ["Links", "Stage", "boundary_leaf", "buffer_snapshot", "buffers_as_in_forward"]
