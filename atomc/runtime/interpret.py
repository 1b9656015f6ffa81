"""Runtime, the one interpreter of the action IR: `run_actions(stage, actions, ...)`.

The action list (atomc.actions) is the schedule: the same list the simulator times. Every
runtime runs its lists here, on a `Stage` (atomc.runtime.stage): the swap trainer (ATOM's
order on the swap executor), a layout's stages (GPipe, 1F1B, or ATOM's order between a
swapped stage's receives and sends) and a SWARM server's calls (one micro-batch's forward, or
its forward again and its backward). What an action does:

  L i    the stage loads sub-model i's weights (ahead of their use)
  F i m  forward of micro-batch m through index i, on m's RNG stream
  B i m  backward of micro-batch m through index i; a recomputing index runs its forward again
         first, with the RNG state and the buffers its forward started from
  O i    sub-model i's gradients to the host store
  U i    hand them to the CPU optimizer
  S m    before m's first backward: m's boundary values and its RNG state to the next stage;
         after it: the gradients of what m received, to the previous stage
  R m    before m's first forward: m's values (and RNG state) from the previous stage; after
         it: the gradients of what m sent, from the next stage

Owned here for every runtime: S and R in the direction atomc.actions.directions gives, the
RNG rule of atomc.runtime.rng (each micro-batch's stream, its replay for a recomputation, its
state on the wire), and when the buffer rule of atomc.runtime.stage applies (a recomputation; with
`recomputing`, every forward of the list: a SWARM backward call repeats the forward call's).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from atomc.actions import Action, directions
from atomc.runtime.rng import RNG_VALUE, StepRng
from atomc.runtime.stage import Links, Stage, buffer_snapshot, buffers_as_in_forward


def run_actions(stage: Stage, actions: list[Action], micro_batches: list[tuple],
                links: Links | None = None, *, seed: int, step: int, first_micro: int = 0,
                recomputing: bool = False) -> list[torch.Tensor]:
    """Execute `actions` on `stage` over `micro_batches` (local micro-batch m is number
    `first_micro + m` of the step's global batch: its RNG stream); S and R go through
    `links`. Returns the losses the stage computed, in micro-batch order. The caller's RNG
    state is as it was afterwards."""
    rng = StepRng(stage.device, seed, step, len(micro_batches), first_micro)
    try:
        with stage.session(micro_batches, step):
            _Run(stage, actions, links, rng, recomputing).run()
        return stage.losses()
    finally:
        rng.restore()


class _Run:
    def __init__(self, stage: Stage, actions: list[Action], links: Links | None, rng: StepRng,
                 recomputing: bool):
        self.stage, self.actions, self.links, self.rng = stage, actions, links, rng
        self.recomputing = recomputing
        self.direction = directions(actions)
        # positions the flags hang on: first and last F and B of each index, and the compute
        # action that follows each position
        self.last_f: dict[int, int] = {}
        self.first_b: dict[int, int] = {}
        self.last_b: dict[int, int] = {}
        for pos, a in enumerate(actions):
            if a.kind == "F":
                self.last_f[a.index] = pos
            elif a.kind == "B":
                self.first_b.setdefault(a.index, pos)
                self.last_b[a.index] = pos
        self.next_compute: list[int | None] = [None] * len(actions)
        nxt = None
        for pos in range(len(actions) - 1, -1, -1):
            self.next_compute[pos] = nxt
            if actions[pos].kind in "FB":
                nxt = pos
        # (index, micro) -> the RNG state and buffers its forward started from
        self.forward_state: dict[tuple[int, int], tuple[Any, list[torch.Tensor] | None]] = {}
        self.received: dict[int, dict[str, Any]] = {}

    def run(self) -> None:
        for pos, a in enumerate(self.actions):
            getattr(self, "_" + a.kind)(pos, a)

    # ---- compute -------------------------------------------------------------------------------

    def _F(self, pos: int, a: Action) -> None:
        st, i, m = self.stage, a.index, a.micro
        modules = st.forward_modules(i)
        saved = buffer_snapshot(modules) if st.recomputes(i) else None
        again = buffer_snapshot(modules) if self.recomputing else None
        with self.rng.forward(m) as state, buffers_as_in_forward(modules, again):
            st.forward(i, m, last=pos == self.last_f[i])
        if st.recomputes(i):
            self.forward_state[(i, m)] = (state, saved)

    def _B(self, pos: int, a: Action) -> None:
        st, i, m = self.stage, a.index, a.micro
        state, saved = self.forward_state.pop((i, m), (None, None))
        replay = self.rng.replay(state) if state is not None else nullcontext()
        with replay, buffers_as_in_forward(st.forward_modules(i), saved):
            st.backward(i, m, first=pos == self.first_b[i], last=pos == self.last_b[i])

    # ---- weights -------------------------------------------------------------------------------

    def _L(self, pos: int, a: Action) -> None:
        nxt = self.next_compute[pos]
        b = self.actions[nxt] if nxt is not None else None
        first_backward = b.index if b is not None and self.first_b.get(b.index) == nxt else None
        self.stage.load(a.index, next_first_backward=first_backward, trailing=b is None)

    def _O(self, pos: int, a: Action) -> None:
        self.stage.offload(a.index)

    def _U(self, pos: int, a: Action) -> None:
        self.stage.update(a.index)

    # ---- S, R ----------------------------------------------------------------------------------

    def _links(self, a: Action) -> Links:
        if self.links is None:
            raise ValueError(f"action {a} sends or receives, and this list runs without links")
        return self.links

    def _S(self, pos: int, a: Action) -> None:
        st, m, links = self.stage, a.micro, self._links(a)
        if self.direction[pos] == "values":
            values = dict(st.values_out(m))
            values[RNG_VALUE] = self.rng.state(m)
            with st.exchange():
                links.send(m, values)
        else:
            grads = st.grads_out(m)
            with st.exchange():
                links.send_grads(m, grads, self.received.pop(m, {}))

    def _R(self, pos: int, a: Action) -> None:
        st, m, links = self.stage, a.micro, self._links(a)
        values = self.direction[pos] == "values"
        with st.exchange():
            got = links.recv(m) if values else links.recv_grads(m)
        got = dict(got or {})
        if values:
            state = got.pop(RNG_VALUE, None)
            if state is not None:
                self.rng.resume(m, state)
            self.received[m] = got
            st.take_values(m, got)
        else:
            st.take_grads(m, got)


__all__ = ["run_actions"]
