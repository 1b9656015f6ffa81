"""Runtime, one step of a swapped stage: the executor's slots driven by a list of actions.

The action list (atomc.actions) is the schedule: the same list the simulator times. What an
action does here:

  L i    issue the load of sub-model i's weights into its slot (prefetch stream); when an
         optimizer update of them is still running, the load is retried before each later
         compute action and forced at i's first use; a load at the very end of the list (the
         next step's early prefetch) waits for that update
  F i m  forward of micro-batch m through sub-model i; the last sub-model of the model also
         computes the loss, with autograd, for its B
  B i m  backward of micro-batch m through sub-model i: recomputed from its boundary inputs
         with the RNG state and the buffers of its forward (or the kept graph), or the loss's
         backward; the gradients of its inputs go to their producers
  O i    sub-model i's gradients to the host store (offload stream)
  U i    hand them to the CPU optimizer (which updates sub-model i on its thread)
  S m    before m's backward: micro-batch m's boundary values (and its RNG state) to the next
         stage; after it: the gradients of what it received, to the previous stage
  R m    before m's forward: micro-batch m's values from the previous stage; after it: the
         gradients of what it sent, from the next stage

Owned here for every swapped runtime (the swap trainer and a layout's swapped stage): the
buffers as in the forward (running statistics updated once), the RNG replay, the zeroing of
gradient slots, which values are freed or stashed after their last forward or backward reader.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from atomc.actions import Action
from atomc.runtime.rng import RNG_VALUE, StepRng

if TYPE_CHECKING:
    from atomc.runtime.executor import SwapExecutor


def _as_tuple(out: Any) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _leaf(v: Any, grad: bool) -> Any:
    """A boundary input as an autograd leaf; floating tensors that carry a gradient get one."""
    if isinstance(v, torch.Tensor) and grad and (v.is_floating_point() or v.is_complex()):
        return v.detach().requires_grad_(True)
    return v


def _storages(module: torch.nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}


def _handed_on(v: Any, weights: set[int]) -> Any:
    """A sub-model's output as later sub-models read it. An output that is a view of the
    sub-model's own weights (Perceiver's `latents.expand(batch, -1, -1)` crossing a cut) is
    copied: those weights live in a slot that the next load into it overwrites."""
    if not isinstance(v, torch.Tensor):
        return v
    v = v.detach()
    return v.clone() if v.untyped_storage().data_ptr() in weights else v


def directions(actions: list[Action]) -> list[str | None]:
    """For each S and R action: "values" (activations forward) or "grads" (gradients back).
    A receive before its micro-batch's first forward brings values, after it gradients; a send
    before its micro-batch's first backward sends values, after it gradients."""
    forwarded: set[int | None] = set()
    backwarded: set[int | None] = set()
    out: list[str | None] = []
    for a in actions:
        if a.kind == "R":
            out.append("grads" if a.micro in forwarded else "values")
        elif a.kind == "S":
            out.append("grads" if a.micro in backwarded else "values")
        else:
            out.append(None)
            if a.kind == "F":
                forwarded.add(a.micro)
            elif a.kind == "B":
                backwarded.add(a.micro)
    return out


@dataclass
class StepResult:
    loss_sum: torch.Tensor  # sum of the micro-batch losses (float64; last stage only)
    losses: list[torch.Tensor]  # per micro-batch, detached, in micro-batch order
    offloads: list[Any]  # events of gradient copies to the host (CUDA), to wait for


@dataclass
class _Step:
    ex: SwapExecutor
    actions: list[Action]
    micro_batches: list[tuple]
    step: int
    rng: StepRng
    scale: float
    io: Any
    caller: Any  # the caller's CUDA stream (None on the CPU)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ex = self.ex
        self.C = len(self.micro_batches)
        self.batches = [tuple(ex._to_device(t) for t in mb) for mb in self.micro_batches]
        self.envs: list[dict[str, Any]] = [dict(zip(ex.pkg.model_inputs, b)) for b in self.batches]
        self.fwd_states: dict[tuple[int, int], Any] = {}
        self.buffer_states: dict[tuple[int, int], Any] = {}  # see _buffers_as_in_forward
        self.kept: dict[tuple[int, int], Any] = {}
        self.pending_loss: dict[int, tuple[torch.Tensor, list[Any]]] = {}
        self.grads: list[dict[str, torch.Tensor]] = [{} for _ in range(self.C)]
        self.received: dict[int, dict[str, Any]] = {}
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=ex.device)
        self.offloads: dict[int, Any] = {}
        self.all_offloads: list[Any] = []
        self.unstashed: set[int] = set()
        self.deferred: set[int] = set()  # loads waiting for an update of their weights
        self.active: int | None = None  # sub-model whose slot the compute stream reads
        self.waited = False
        self._index()

    def _index(self) -> None:
        """Positions the actions' side effects hang on: the first and last F and B of each
        sub-model, and the compute action that follows each position."""
        self.first_b: dict[int, int] = {}
        self.last_f: dict[int, int] = {}
        self.last_b: dict[int, int] = {}
        for pos, a in enumerate(self.actions):
            if a.kind == "F":
                self.last_f[a.index] = pos
            elif a.kind == "B":
                self.first_b.setdefault(a.index, pos)
                self.last_b[a.index] = pos
        self.next_compute: list[int | None] = [None] * len(self.actions)
        nxt = None
        for pos in range(len(self.actions) - 1, -1, -1):
            self.next_compute[pos] = nxt
            if self.actions[pos].kind in "FB":
                nxt = pos
        self.direction = directions(self.actions)

    # ---- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        ex = self.ex
        spans = ExitStack()
        span_key: tuple[int, str] | None = None
        try:
            for pos, a in enumerate(self.actions):
                if a.kind in "FB":
                    key = (a.index, a.kind)
                    # a compute span times compute only: what may load or wait first (the
                    # weights into the slot, deferred loads, checkpoints) runs outside it
                    if key != span_key or self.deferred:
                        spans.close()
                        span_key = None
                    self._prepare(pos, a)
                    if span_key is None:
                        kind = "forward" if a.kind == "F" else "backward"
                        spans.enter_context(ex.tracer.span("compute", a.index, kind,
                                                           ex.compute_stream))
                        span_key = key
                    self._compute(pos, a)
                    if a.kind == "F" and pos == self.last_f[a.index]:
                        spans.close()  # its boundary values may be stashed: a copy, not compute
                        span_key = None
                        self._after_forward(pos, a.index)
                else:
                    spans.close()
                    span_key = None
                    if self.active is not None:
                        # the compute issued so far is what a load into that slot (or a copy of
                        # its gradients) must wait for (CUDA: the slot's free event)
                        ex.release(self.active)
                        self.active = None
                    getattr(self, "_" + a.kind)(pos, a)
        finally:
            spans.close()
        if self.active is not None:
            ex.release(self.active)
            self.active = None

    def result(self) -> StepResult:
        losses = [self.losses[m] for m in sorted(self.losses)]
        return StepResult(self.loss_sum, losses, self.all_offloads)

    def _prepare(self, pos: int, a: Action) -> None:
        """Before a compute action: retry deferred loads, have its sub-model's weights in the
        slot, and before its first backward, the previous step's updates done and its
        checkpoints issued back."""
        ex, i = self.ex, a.index
        for j in sorted(self.deferred):
            if ex._load(j, wait=False):
                self.deferred.discard(j)
        if self.active != i:
            if self.active is not None:
                ex.release(self.active)
            ex.use(i)
            self.deferred.discard(i)
            self.active = i
        if a.kind == "B" and pos == self.first_b[i]:
            self._first_backward(i)

    def _compute(self, pos: int, a: Action) -> None:
        ex, i = self.ex, a.index
        if a.kind == "F":
            self._forward(i, a.micro)
        else:
            if pos == self.first_b[i]:
                ex.zero_grads(i)  # device work on the compute stream, after the slot's last copy
            self._backward(i, a.micro)
            if pos == self.last_b[i]:
                ex._free_after_backward(self.envs, i)

    def _after_forward(self, pos: int, i: int) -> None:
        """After sub-model i's last forward (unless its backward came first: the last
        sub-model's), drop or stash the values no later forward reads."""
        if self.first_b.get(i, len(self.actions)) > pos:
            self.ex._free_after_forward(self.envs, i)

    def _first_backward(self, i: int) -> None:
        ex = self.ex
        if not self.waited:
            ex.opt.wait_step(self.step - 1)  # the previous step's updates read the host gradients
            self.waited = True
        self._unstash(i)
        ex.wait_grad_slot(i)  # so that the compute span starts after that wait (CUDA)

    def _unstash(self, i: int) -> None:
        if i not in self.unstashed:
            self.unstashed.add(i)
            self.ex.stash.unstash(self.envs, i, self.ex.pkg.inputs[i])

    # ---- F and B -------------------------------------------------------------------------------

    def _is_loss(self, i: int) -> bool:
        return self.ex.holds_output and i == self.ex.k - 1

    def _args(self, i: int, m: int, leaves: bool) -> list[Any]:
        ex = self.ex
        names = ex.pkg.inputs[i]
        args = [ex._value(self.envs[m], n) for n in names]
        if leaves:
            args = [_leaf(v, n in ex.grad_inputs) for v, n in zip(args, names)]
        return args

    def _forward(self, i: int, m: int) -> None:
        ex = self.ex
        mod = ex.modules[i]
        if self._is_loss(i):
            args = self._args(i, m, leaves=True)
            with self.rng.forward(m), ex._autocast():
                loss = ex.loss_fn(mod(*args), self.batches[m])
            self.pending_loss[m] = (loss, args)
            return
        args = self._args(i, m, leaves=ex.keep)
        if not ex.keep and ex._has_buffers[i]:
            self.buffer_states[(i, m)] = [b.clone() for b in ex._buffer_slots(i)[2]]
        with self.rng.forward(m) as state, ex._autocast(), torch.set_grad_enabled(ex.keep):
            outs = _as_tuple(mod(*args))
        self.fwd_states[(i, m)] = state
        if ex.keep:
            self.kept[(i, m)] = (args, outs)
        env = self.envs[m]
        weights = _storages(mod)
        for n, v in zip(ex.pkg.outputs[i], outs):
            env[n] = _handed_on(v, weights)

    def _backward(self, i: int, m: int) -> None:
        ex = self.ex
        ex.ties.mb = m  # read by the tie hooks
        if self._is_loss(i):
            loss, args = self.pending_loss.pop(m)
            scaled = loss / self.C
            if self.scale != 1.0:
                scaled = scaled * self.scale
            scaled.backward()
            ex.ties.finish(i)
            ex._collect_input_grads(self.grads[m], i, args)
            self.loss_sum += loss.detach().to(torch.float64)
            self.losses[m] = loss.detach()
            if ex.cuda and len(self.losses) == self.C:  # copied out while the backward goes on
                ex._loss_host.copy_(self.loss_sum, non_blocking=True)
                ex._loss_ready = torch.cuda.Event()
                ex._loss_ready.record(ex.compute_stream)
            return
        if ex.cuda:
            ex.stash.inputs_ready(i, m)
        out_grads = [self.grads[m].pop(n, None) for n in ex.pkg.outputs[i]]
        kept = self.kept.pop((i, m), None)
        saved = self.buffer_states.pop((i, m), None)
        if all(g is None for g in out_grads):
            return  # nothing this sub-model computed reaches the loss
        if ex.keep:
            args, outs = kept
        else:
            args = self._args(i, m, leaves=True)
            with self.rng.replay(self.fwd_states.pop((i, m))), ex._autocast(), \
                    torch.enable_grad(), ex._buffers_as_in_forward(i, saved):
                outs = _as_tuple(ex.modules[i](*args))
        pairs = [(o, g) for o, g in zip(outs, out_grads)
                 if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        ex.ties.finish(i)
        ex._collect_input_grads(self.grads[m], i, args)

    # ---- L, O, U -------------------------------------------------------------------------------

    def _L(self, pos: int, a: Action) -> None:
        ex = self.ex
        nxt = self.next_compute[pos]
        if nxt is None:  # the next step's early prefetch: after the update it waits for
            ex._load(a.index)
            return
        b = self.actions[nxt]
        if b.kind == "B" and self.first_b[b.index] == nxt:
            self._unstash(b.index)  # its checkpoints stream in ahead of the next load
        if not ex._load(a.index, wait=False):
            self.deferred.add(a.index)

    def _O(self, pos: int, a: Action) -> None:
        ex = self.ex
        ready = ex.grads_to_host(a.index)
        self.offloads[a.index] = ready
        self.all_offloads.append(ready)

    def _U(self, pos: int, a: Action) -> None:
        ex = self.ex
        ex.slots.bump(a.index)
        ex.opt.submit(a.index, self.offloads.pop(a.index, None))

    # ---- S, R ----------------------------------------------------------------------------------

    def _to_caller(self) -> Any:
        """Run the block on the caller's stream after the compute stream's work (CUDA)."""
        if self.caller is None:
            return ExitStack()
        self.caller.wait_stream(self.ex.compute_stream)
        return torch.cuda.stream(self.caller)

    def _from_caller(self) -> None:
        if self.caller is not None:
            self.ex.compute_stream.wait_stream(self.caller)

    def _S(self, pos: int, a: Action) -> None:
        m = a.micro
        with self._to_caller():
            if self.direction[pos] == "values":
                values = {n: self.envs[m][n] for n in self.ex.send_names}
                values[RNG_VALUE] = self.rng.state(m)
                self.io.send(m, values)
            else:
                got = self.received.get(m, {})
                self.io.send_grads(m, {n: self.grads[m].get(n) for n in got}, got)

    def _R(self, pos: int, a: Action) -> None:
        ex, m = self.ex, a.micro
        with self._to_caller():
            got = self.io.recv(m) if self.direction[pos] == "values" else self.io.recv_grads(m)
        self._from_caller()
        got = dict(got or {})
        if self.direction[pos] == "values":
            state = got.pop(RNG_VALUE, None)
            if state is not None:
                self.rng.resume(m, state)
            for v in got.values():
                ex.adopt(v)  # made on the caller's stream, read (and freed) on the compute stream
            self.received[m] = got
            self.envs[m].update(got)
        else:
            for n, g in got.items():
                self.grads[m][n] = ex.adopt(g)
