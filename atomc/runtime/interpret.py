"""Runtime, the one interpreter of the action IR: `run_actions(executor, actions, ...)`, and the
`Executor` seam it drives.

The action list (atomc.actions) is the schedule: the same list the simulator times. Every
runtime runs its lists here, as torch.distributed.pipelining's schedule runtime executes its IR
on a pipeline stage: the swap trainer (ATOM's order on the swap executor), a stage of a layout
or of a SWARM server (atomc.stages: GPipe, 1F1B, or ATOM's order between a swapped stage's
receives and sends; a SWARM call is one micro-batch's forward, or its forward again and its
backward). What an action does:

  L i    the executor loads sub-model i's weights (ahead of their use)
  F i m  forward of micro-batch m through index i, on m's RNG stream
  B i m  backward of micro-batch m through index i; a recomputing index runs its forward again
         first, with the RNG state and the buffers its forward started from
  O i    sub-model i's gradients to the host store
  U i    hand them to the CPU optimizer
  S m    before m's first backward: m's boundary values and its RNG state to the next stage;
         after it: the gradients of what m received, to the previous stage
  R m    before m's first forward: m's values (and RNG state) from the previous stage; after
         it: the gradients of what m sent, from the next stage

An `Executor` offers one operation per kind of action it runs and declares those kinds
(`action_kinds`); `run_actions` checks a list against them once, before it starts. It also
takes and hands out what its neighbours exchange. Two implementations:
- the swap executor (atomc.runtime.executor), every kind: an index is a sub-model, loaded into
  a weight slot, recomputed in its backward from its boundary inputs; it runs the swap
  trainer's step and a swapped stage's lists (atomc.stages.swapped);
- the resident stage (atomc.stages.resident), F, B, S and R: an index is the whole stage, on
  the device, with the autograd graph of every micro-batch in flight.

Owned here for every runtime: S and R in the direction atomc.actions.directions gives, the
RNG rule of atomc.runtime.rng (each micro-batch's stream, its replay for a recomputation, its
state on the wire), `boundary_leaf` (a boundary value as a stage's autograd leaf) and the
buffer rule, `buffers_as_in_forward`: a recomputation reads and updates copies of the buffers
as they were before its forward, so that running statistics are updated once; with
`recomputing`, every forward of the list does (a SWARM backward call repeats the forward
call's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from atomc.actions import Action, ActionKind, directions
from atomc.errors import RuntimeMismatchError
from atomc.runtime.rng import RNG_VALUE, StepRng


class Links(Protocol):
    """An executor's S and R: one call per micro-batch (a layout's links: runner.StageIO; the
    one micro-batch of a SWARM call)."""

    def recv(self, m: int) -> dict[str, Any]: ...

    def send(self, m: int, values: dict[str, Any]) -> None: ...

    def recv_grads(self, m: int) -> dict[str, torch.Tensor]: ...

    def send_grads(self, m: int, grads: dict[str, Any], received: dict[str, Any]) -> None: ...


@runtime_checkable
class Executor(Protocol):
    """The operations `run_actions` drives: one per kind of action in `action_kinds`, and the
    exchange with the neighbours. An action's index is what the executor's lists name (a
    sub-model of the swap executor, the stage itself when resident).

    Flags the interpreter reads off the list, as pipelining's runtime passes `last_backward`:
    `last` on a forward, its index's last forward in the list; `first`/`last` on a backward,
    its index's first/last backward; on a load, `next_first_backward` (the index whose first
    backward is the next compute, if it is one) and `trailing` (no compute follows: the next
    step's early prefetch).

    An executor that declares L, O and U (the swap executor) also defines
    `load(index, *, next_first_backward, trailing)`, `offload(index)` and `update(index)`; one
    that does not (the resident stage) has no such operations, and `run_actions` refuses a list
    with a kind its executor does not declare before running any of it.
    """

    device: torch.device
    action_kinds: frozenset[ActionKind]

    def session(self, micro_batches: list[tuple], step: int) -> AbstractContextManager[None]:
        """The context one list runs in: the executor's per-list state and its streams."""
        ...

    def exchange(self) -> AbstractContextManager[None]:
        """The context an S or R runs in (CUDA: the caller's stream, after the compute issued
        so far, and the compute after it)."""
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


def check_action_kinds(executor: Executor, actions: list[Action]) -> None:
    """Refuse `actions` when one of its kinds is not among the executor's `action_kinds`."""
    declared = executor.action_kinds
    for a in actions:
        if a.kind not in declared:
            runs = " ".join(k.value for k in ActionKind if k in declared)
            raise RuntimeMismatchError(
                f"{type(executor).__name__} runs {runs} actions; the list has {a} "
                f"({a.kind.name.lower()}), which it does not run: give it a list of its own "
                f"kinds (a resident stage's pipeline order, a swapped stage's for L, O and U)")


def run_actions(executor: Executor, actions: list[Action], micro_batches: list[tuple],
                links: Links | None = None, *, seed: int, step: int, first_micro: int = 0,
                recomputing: bool = False) -> list[torch.Tensor]:
    """Execute `actions` on `executor` over `micro_batches` (local micro-batch m is number
    `first_micro + m` of the step's global batch: its RNG stream); S and R go through
    `links`. Returns the losses the executor computed, in micro-batch order. The caller's RNG
    state is as it was afterwards. A list with a kind the executor does not declare is refused
    before any of it runs."""
    check_action_kinds(executor, actions)
    rng = StepRng(executor.device, seed, step, len(micro_batches), first_micro)
    try:
        with executor.session(micro_batches, step):
            _Run(executor, actions, links, rng, recomputing).run()
        return executor.losses()
    finally:
        rng.restore()


_COMPUTE = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD})


class _Run:
    def __init__(self, executor: Executor, actions: list[Action], links: Links | None,
                 rng: StepRng, recomputing: bool):
        self.executor, self.actions, self.links, self.rng = executor, actions, links, rng
        self.recomputing = recomputing
        self.direction = directions(actions)
        # positions the flags hang on: first and last F and B of each index, and the compute
        # action that follows each position
        self.last_f: dict[int, int] = {}
        self.first_b: dict[int, int] = {}
        self.last_b: dict[int, int] = {}
        for pos, a in enumerate(actions):
            if a.kind == ActionKind.FORWARD:
                self.last_f[a.index] = pos
            elif a.kind == ActionKind.BACKWARD:
                self.first_b.setdefault(a.index, pos)
                self.last_b[a.index] = pos
        self.next_compute: list[int | None] = [None] * len(actions)
        nxt = None
        for pos in range(len(actions) - 1, -1, -1):
            self.next_compute[pos] = nxt
            if actions[pos].kind in _COMPUTE:
                nxt = pos
        # (index, micro) -> the RNG state and buffers its forward started from
        self.forward_state: dict[tuple[int, int], tuple[Any, list[torch.Tensor] | None]] = {}
        self.received: dict[int, dict[str, Any]] = {}
        self.handlers: dict[ActionKind, Callable[[int, Action], None]] = {
            ActionKind.FORWARD: self.forward,
            ActionKind.BACKWARD: self.backward,
            ActionKind.LOAD: self.load,
            ActionKind.OFFLOAD: self.offload,
            ActionKind.UPDATE: self.update,
            ActionKind.SEND: self.send,
            ActionKind.RECEIVE: self.receive,
        }

    def run(self) -> None:
        for pos, a in enumerate(self.actions):
            self.handlers[a.kind](pos, a)

    # ---- compute -------------------------------------------------------------------------------

    def forward(self, pos: int, a: Action) -> None:
        ex, i, m = self.executor, a.index, a.micro
        modules = ex.forward_modules(i)
        saved = buffer_snapshot(modules) if ex.recomputes(i) else None
        again = buffer_snapshot(modules) if self.recomputing else None
        with self.rng.forward(m) as state, buffers_as_in_forward(modules, again):
            ex.forward(i, m, last=pos == self.last_f[i])
        if ex.recomputes(i):
            self.forward_state[(i, m)] = (state, saved)

    def backward(self, pos: int, a: Action) -> None:
        ex, i, m = self.executor, a.index, a.micro
        state, saved = self.forward_state.pop((i, m), (None, None))
        replay = self.rng.replay(state) if state is not None else nullcontext()
        with replay, buffers_as_in_forward(ex.forward_modules(i), saved):
            ex.backward(i, m, first=pos == self.first_b[i], last=pos == self.last_b[i])

    # ---- weights (executors that declare L, O and U define these operations) ------------------

    def load(self, pos: int, a: Action) -> None:
        nxt = self.next_compute[pos]
        b = self.actions[nxt] if nxt is not None else None
        first_backward = b.index if b is not None and self.first_b.get(b.index) == nxt else None
        self.executor.load(a.index, next_first_backward=first_backward, trailing=b is None)

    def offload(self, pos: int, a: Action) -> None:
        self.executor.offload(a.index)

    def update(self, pos: int, a: Action) -> None:
        self.executor.update(a.index)

    # ---- S, R ----------------------------------------------------------------------------------

    def _links(self, a: Action) -> Links:
        if self.links is None:
            raise ValueError(f"action {a} sends or receives, and this list runs without links")
        return self.links

    def send(self, pos: int, a: Action) -> None:
        ex, m, links = self.executor, a.micro, self._links(a)
        if self.direction[pos] == "values":
            values = dict(ex.values_out(m))
            values[RNG_VALUE] = self.rng.state(m)
            with ex.exchange():
                links.send(m, values)
        else:
            grads = ex.grads_out(m)
            with ex.exchange():
                links.send_grads(m, grads, self.received.pop(m, {}))

    def receive(self, pos: int, a: Action) -> None:
        ex, m, links = self.executor, a.micro, self._links(a)
        values = self.direction[pos] == "values"
        with ex.exchange():
            got = links.recv(m) if values else links.recv_grads(m)
        got = dict(got or {})
        if values:
            state = got.pop(RNG_VALUE, None)
            if state is not None:
                self.rng.resume(m, state)
            self.received[m] = got
            ex.take_values(m, got)
        else:
            ex.take_grads(m, got)


__all__ = ["Executor", "Links", "boundary_leaf", "buffer_snapshot", "buffers_as_in_forward",
           "check_action_kinds", "run_actions"]
