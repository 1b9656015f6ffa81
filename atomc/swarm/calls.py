"""SWARM server, one call: a forward or backward of one micro-batch on the stage it serves.

A call is refused, in the server's words, when it names another stage, a step the stage has
taken, or an attempt that is not the server's current one (see atomc.swarm.commit); else it
runs on the compute thread with the runtime core's interpreter (`serve_call`), its gradients
are added to the step's sums, and its time goes into the server's measured rate (`CallTime`).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

import torch

from atomc.distributed.stage import LayoutStage
from atomc.errors import PeerError
from atomc.swarm.wire import NotHere, StepTaken, WrongAttempt, decode, encode, join, refusal

BATCH = "atomc.batch."  # batch tensors travel as atomc.batch.0, atomc.batch.1, ...
GRAD = "atomc.grad."  # output gradients of a backward call


class CallTime:
    """Time per sample of one kind of call, over about the last `window_s` seconds spent in
    such calls: time and samples each decay by exp(-t / window_s) as t seconds of calls pass.
    A per-call average with a fixed weight swings with every call that CPU contention slows
    down, and moves made on those swings were undone a period later. The first call on a stage
    does not count: it pays for warm-up (allocation, caches), not for the device's speed."""

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


class _OneMicro:
    """A stage's io for one micro-batch: what the call brought, and what the stage sends."""

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


def serve_call(stage: LayoutStage, kind: str, values: dict[str, Any], meta: dict[str, Any],
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
    io = _OneMicro(values, grads)
    if kind == "forward":
        with torch.no_grad():
            stage.run(stage.forward_order(1), [batch], io)
        return io.sent, None
    losses = stage.run(stage.order("gpipe", 1), [batch], io,
                       recomputing=not stage.spec.holds_output)
    return io.sent_grads, (float(losses[0]) if losses else None)


class CallHandling:
    """SwarmServer's calls: its p2p handlers' work (on the compute thread) and its measured
    rate."""

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
        with self.cv:
            return micro in self.ids

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
        with self.cv:
            # a server moving (its step is not its stage's until the state arrives) or on
            # another stage turns the call away at once rather than after the wait
            if not self.cv.wait_for(
                    lambda: self.step >= step or self.closing or self.moving
                    or self.spec.index != j, timeout=self.cfg.request_wait_s):
                raise PeerError(f"stage {j} server {self.cfg.name} is at step {self.step}, the "
                                f"call is for step {step}")
            if self.moving:
                raise NotHere(f"server {self.cfg.name} is moving to stage {self.moving_to}")
            if self.spec.index != j:
                raise NotHere(f"server {self.cfg.name} serves stage {self.spec.index}, not {j}")
            if self.step > step:
                raise StepTaken(f"stage {j} has taken step {step} already (at {self.step})")
            if kind == "backward":
                # the serving loop reads the step's exclusions every tick: no DHT read per call
                attempt = int(request.uid or -1)
                if attempt != self.attempt or (self.peer, j, attempt) in self.excluded:
                    # the trainer must name the attempt its gradients go to: had it failed, the
                    # trainer excludes that attempt, and nothing of it may count
                    raise WrongAttempt(f"server {self.cfg.name} is on attempt {self.attempt} "
                                       f"of step {step}, the call names attempt {attempt}",
                                       self.attempt)
                if meta["id"] in self.ids:
                    raise PeerError(f"server {self.cfg.name} holds micro-batch {meta['id']} of "
                                    f"step {step} already")
            t0 = time.perf_counter()
            out, loss = self._run(kind, values, meta)
            if kind == "backward":
                off = 0
                for _, p in self.params:
                    n = p.numel()
                    if p.grad is not None:
                        self.acc[off:off + n] += p.grad.detach().reshape(-1).to(self.acc.dtype)
                    off += n
                self.ids[meta["id"]] = int(meta["samples"])
                self.announce_soon = True  # the stage may hold its batch now: say so
                self.wake.set()
            took = time.perf_counter() - t0
            if self.cfg.slowdown is not None:
                took = self._emulated(kind, int(meta["samples"]), took)
            self.call_time[kind].add(took, int(meta["samples"]))
        return encode(out, {"loss": loss, "server": self.cfg.name}, response=True,
                      compress=bool(meta.get("compress")))

    def _emulated(self, kind: str, samples: int, took: float) -> float:
        """--slowdown: the call lasts `slowdown` times what the plan's profile says such a call
        takes on this stage (and no less than it took): a device of one speed from its first
        call. Earlier emulations drifted: a call's wall time carries the machine's other load
        (a server's rate swung 2x between periods), and the least processor time a call had
        taken so far fell over tens of calls (cold caches, then the tail of the noise), so a
        server that had just joined or moved looked 20-40% slower than it was, and moves
        planned on those rates undid themselves a period later."""
        busy = self.cfg.slowdown * self.call_times[self.spec.index][kind] * samples
        if busy > took:
            time.sleep(busy - took)
        return max(busy, took)

    def _run(self, kind: str, values: dict[str, Any], meta: dict[str, Any]
             ) -> tuple[dict[str, Any], float | None]:
        """One call: the stage's forward of its micro-batch, or its forward again and its
        backward, as one micro-batch's actions on the stage (atomc.runtime.interpret)."""
        return serve_call(self.stage, kind, values, meta, self.step)

    def _measured_rate(self) -> float | None:
        """Samples/s of the stage's whole work (a micro-batch costs a forward and a backward
        call at every stage but the last, whose backward call is its forward too); None until
        it has served both on this stage."""
        kinds = ("backward",) if self.spec.holds_output else ("forward", "backward")
        known = [self.call_time[k].per_sample() for k in kinds]
        return None if None in known else 1.0 / sum(known)


__all__ = ["BATCH", "GRAD", "CallHandling", "CallTime", "serve_call"]
