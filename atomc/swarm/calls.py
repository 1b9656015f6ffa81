"""SWARM server, its calls: a forward or backward of one micro-batch on the stage it serves,
and the throughput those calls measure.

A call is refused, in the server's words, when it names another stage, a step the stage has
taken, or an attempt that is not the server's current one (atomc.swarm.sums); else it runs on
the compute thread with the runtime core's interpreter (`serve_call`), its gradients are added
to the step's sums, and its time goes into the server's rate (`ServerRate`). The backward
recomputes the forward from the inputs it is sent, so any server of the stage can run it
(SWARM's design): nothing of a micro-batch stays on a server between calls.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from atomc.errors import PeerError
from atomc.stages.base import Stage, StageSpec
from atomc.swarm.records import ServerRecord
from atomc.swarm.state import StageState
from atomc.swarm.sums import StepSums
from atomc.swarm.wire import NotHere, StepTaken, WrongAttempt, decode, encode, join, refusal

BATCH = "atomc.batch."  # batch tensors travel as atomc.batch.0, atomc.batch.1, ...
GRAD = "atomc.grad."  # output gradients of a backward call
CALL_KINDS = ("forward", "backward")


class CallTime:
    """Time per sample of one kind of call, over about the last `window_s` seconds spent in
    such calls: time and samples each decay by exp(-t / window_s) as t seconds of calls pass.
    A per-call average with a fixed weight would swing with every call that CPU contention
    slows down, and rebalancing would move servers on those swings and back. The first call on
    a stage does not count: it pays for warm-up (allocation, caches), not for the device's
    speed."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.warm = False
        self.seconds = self.samples = 0.0

    def add(self, took: float, samples: int) -> None:
        if not self.warm:
            self.warm = True
            return
        keep = math.exp(-took / self.window_s)
        self.seconds = keep * self.seconds + took
        self.samples = keep * self.samples + max(1, samples)

    def per_sample(self) -> float | None:
        return self.seconds / self.samples if self.samples else None


class ServerRate:
    """The throughput (samples/s) a server announces: measured from its calls on the stage it
    serves (`CallTime` per kind of call), and until both kinds are measured there, a stand-in:
    the rate it measured on that stage before, or its last stage's rate at this stage's cost
    (`costs`: each stage's relative time per sample), or, new to the swarm, the others' mean
    (it joined to help). Meanwhile rebalancing does not move it (balance.ServerLoad.loading)."""

    def __init__(self, costs: Sequence[float], window_s: float):
        self.costs, self.window_s = costs, window_s
        self.spec: StageSpec | None = None  # the stage it measures on
        self.call_time: dict[str, CallTime] = {}
        self.carried: float | None = None  # the stand-in from the stage it served before
        self.served: dict[int, float] = {}  # stage -> its rate there when it last left it
        self.prior = 1.0  # the others' mean rate at this stage when it entered

    def enter(self, spec: StageSpec, others: Sequence[ServerRecord]) -> None:
        """The server enters stage `spec`; `others`: the other servers' records."""
        j = spec.index
        if self.spec is not None:  # moving: what it measured there before stands in, or
            # what it measured on its last stage at the new stage's cost
            old = self.measured()
            if old is not None:
                self.served[self.spec.index] = old
            old = old or self.carried
            self.carried = self.served.get(j) or (
                old and old * self.costs[self.spec.index] / self.costs[j])
        rates = [r.throughput * self.costs[r.stage] / self.costs[j] for r in others
                 if r.throughput > 0 and r.stage < len(self.costs)]
        self.prior = sum(rates) / len(rates) if rates else 1.0
        # measured anew on this stage: stages need not cost the same
        self.call_time = {k: CallTime(self.window_s) for k in CALL_KINDS}
        self.spec = spec

    def add(self, kind: str, took: float, samples: int) -> None:
        self.call_time[kind].add(took, samples)

    def measured(self) -> float | None:
        """Samples/s of the stage's whole work (a micro-batch costs a forward and a backward
        call at every stage but the last, whose backward call is its forward too); None until
        it has served both on this stage."""
        kinds = ("backward",) if self.spec.holds_output else CALL_KINDS
        known = [self.call_time[k].per_sample() for k in kinds]
        return None if None in known else 1.0 / sum(known)

    def announced(self) -> tuple[float, bool]:
        """The rate to announce, and whether it was measured on this stage."""
        rate = self.measured()
        if rate is not None:
            return rate, True
        return self.carried or self.prior, False

    def served_on(self, num_stages: int) -> tuple[float, ...]:
        """Its rate on each stage it left (0: never served there)."""
        return tuple(self.served.get(t, 0.0) for t in range(num_stages))


class _CallIO:
    """What one call brought for the stage (its inputs, and for a backward the output
    gradients), and what the stage sends back: the interpreter's receive and send ends for
    one micro-batch."""

    def __init__(self, values: dict[str, Any], grads: dict[str, torch.Tensor]):
        self.values, self.grads = values, grads
        self.sent: dict[str, Any] = {}
        self.sent_grads: dict[str, torch.Tensor] = {}

    def recv(self, m: int) -> dict[str, Any]:
        return self.values

    def recv_grads(self, m: int) -> dict[str, torch.Tensor]:
        return self.grads

    def send(self, m: int, values: dict[str, Any]) -> None:
        self.sent = values

    def send_grads(self, m: int, grads: dict[str, Any], received: dict[str, Any]) -> None:
        self.sent_grads = {n: g if g is not None else torch.zeros_like(received[n])
                           for n, g in grads.items()}


def serve_call(stage: Stage, kind: str, values: dict[str, Any], meta: dict[str, Any],
               step: int) -> tuple[dict[str, Any], float | None]:
    """One call on `stage` at `step`: a forward of its micro-batch, or (kind "backward") its
    forward again and its backward; returns what goes back to the trainer and, on the last
    stage, the loss. Both are one micro-batch's actions on the stage, run by the interpreter
    (atomc.runtime.interpret). A backward call's forward repeats the forward call's, so the
    buffers stay as that call left them; the last stage gets no forward call, and its backward
    call's forward is the micro-batch's only one."""
    batch = tuple(values.pop(f"{BATCH}{i}") for i in range(int(meta["batch_len"])))
    grads = {n[len(GRAD):]: values.pop(n) for n in list(values) if n.startswith(GRAD)}
    stage.begin_step(step, int(meta["num_micro"]), int(meta["micro"]))
    io = _CallIO(values, grads)
    if kind == "forward":
        with torch.no_grad():
            stage.run(stage.forward_order(1), [batch], io)
        return io.sent, None
    losses = stage.run(stage.order("gpipe", 1), [batch], io,
                       recomputing=not stage.spec.holds_output)
    return io.sent_grads, (float(losses[0]) if losses else None)


class CallHandler:
    """A server's forward and backward calls (see the module docstring): its p2p handlers'
    work, run one call at a time on a compute thread while the p2p event loop only moves bytes.

    `on_gradients` is called when a backward call has added to the step's sums (the stage may
    hold its batch now). With `slowdown`, every call lasts that many times what `profile_times`
    (each stage's seconds per sample per kind of call, from the plan) say it takes.
    """

    def __init__(self, state: StageState, sums: StepSums, rate: ServerRate, *, peer: str,
                 fingerprint: str, name: str, device: torch.device, request_wait_s: float,
                 slowdown: float | None, profile_times: Sequence[dict[str, float]],
                 closing: threading.Event, on_gradients: Callable[[], None]):
        self.state, self.sums, self.rate = state, sums, rate
        self.peer, self.fingerprint, self.name = peer, fingerprint, name
        self.device = device
        self.request_wait_s = request_wait_s
        self.slowdown, self.profile_times = slowdown, profile_times
        self.closing = closing
        self.on_gradients = on_gradients
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="swarm-compute")
        self.queue = 0  # calls waiting or running

    async def answer(self, kind: str, requests: Any) -> Any:
        """The response to a call; a refusal travels in it, in the server's words."""
        request = None
        try:
            request = join([r async for r in requests])
            return await self.handle(kind, request)
        except Exception as e:  # noqa: BLE001 - any failure: the trainer routes elsewhere
            return refusal(e, held=kind == "backward" and self._holds(request))

    def _holds(self, request: Any) -> bool:
        """Whether the micro-batch of `request` is among our gradients: a trainer told so
        voids our attempt rather than also count it elsewhere."""
        try:
            micro = json.loads(request.metadata.decode())["meta"]["id"]
        except Exception:  # noqa: BLE001 - unreadable: then nothing of it was run
            return False
        with self.sums.cv:
            return micro in self.sums.ids

    async def handle(self, kind: str, request: Any) -> Any:
        self.queue += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self.pool, self._compute, kind, request)
        finally:
            self.queue -= 1

    def _compute(self, kind: str, request: Any) -> Any:
        values, meta = decode(request, self.device)
        step, j = int(meta["step"]), int(meta["stage"])
        if meta.get("package") != self.fingerprint:
            raise PeerError(f"this server serves package {self.fingerprint}, the trainer "
                            f"{meta.get('package')}; give both the same generated package")
        state, sums = self.state, self.sums
        with sums.cv:
            # a server moving (its step is not its stage's until the state arrives) or on
            # another stage turns the call away at once rather than after the wait
            if not sums.cv.wait_for(
                    lambda: sums.step >= step or self.closing.is_set() or state.moving
                    or state.spec.index != j, timeout=self.request_wait_s):
                raise PeerError(f"stage {j} server {self.name} is at step {sums.step}, the "
                                f"call is for step {step}")
            if state.moving:
                raise NotHere(f"server {self.name} is moving to stage {state.moving_to}")
            if state.spec.index != j:
                raise NotHere(f"server {self.name} serves stage {state.spec.index}, not {j}")
            if sums.step > step:
                raise StepTaken(f"stage {j} has taken step {step} already (at {sums.step})")
            if kind == "backward":
                # the serving loop reads the step's exclusions every tick: no DHT read per call
                attempt = int(request.uid or -1)
                if attempt != sums.attempt or (self.peer, j, attempt) in sums.excluded:
                    # the trainer must name the attempt its gradients go to: had it failed, the
                    # trainer excludes that attempt, and nothing of it may count
                    raise WrongAttempt(f"server {self.name} is on attempt {sums.attempt} "
                                       f"of step {step}, the call names attempt {attempt}",
                                       sums.attempt)
                if meta["id"] in sums.ids:
                    raise PeerError(f"server {self.name} holds micro-batch {meta['id']} of "
                                    f"step {step} already")
            t0 = time.perf_counter()
            out, loss = serve_call(state.stage, kind, values, meta, sums.step)
            if kind == "backward":
                sums.add(state.params, meta["id"], int(meta["samples"]))
                self.on_gradients()
            took = time.perf_counter() - t0
            if self.slowdown is not None:
                took = self._emulated(kind, int(meta["samples"]), took)
            self.rate.add(kind, took, int(meta["samples"]))
        return encode(out, {"loss": loss, "server": self.name}, response=True,
                      compress=bool(meta.get("compress")))

    def _emulated(self, kind: str, samples: int, took: float) -> float:
        """--slowdown: the call lasts `slowdown` times what the plan's profile says such a call
        takes on this stage (and no less than it took): a device of one speed from its first
        call. Scaling the call's own time instead would carry the machine's other load (wall
        time) or the warm-up of its first calls (processor time), so a server that had just
        joined or moved would look slower than it is, and rebalancing would undo its own
        moves a period later."""
        busy = self.slowdown * self.profile_times[self.state.spec.index][kind] * samples
        if busy > took:
            time.sleep(busy - took)
        return max(busy, took)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["BATCH", "CALL_KINDS", "GRAD", "CallHandler", "CallTime", "ServerRate", "serve_call"]
