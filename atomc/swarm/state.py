"""SWARM server, the stage it serves and that stage's state.

It builds the stage (with delayed updates, also the copy that takes each update while calls
compute with the weights before it), applies a committed step to it, and moves its state:
handed to a server that joins, moves to the stage or fell behind (`rpc_state`), taken from such
a server (the one furthest ahead first) or from the checkpoint directory, and written there
after every step. A server asks the servers its roster holds, by name, rather than through the
averager's own state sharing, which finds its peers through records declared every second: on a
loaded machine a joining server can miss those for longer than its connect timeout while its
stage's server is up and serving.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from atomc.distributed.hive import state_bytes, state_from_bytes
from atomc.errors import PeerError, UsageError
from atomc.runtime.checkpoint import load_checkpoint, save_checkpoint
from atomc.stages.base import Stage, StageSpec
from atomc.swarm.node import SwarmNode
from atomc.swarm.records import ServerRecord
from atomc.swarm.servicer import SwarmServicer
from atomc.swarm.sums import StepSums
from atomc.swarm.wire import NotHere, check_refusal, join


class StateNotShared(PeerError):
    """Servers of the stage were there, and none shared its state in time."""


class StageState:
    """The stage a server serves, and its state (see the module docstring).

    `build(j)` makes stage j afresh, its gradients summed in `sums_dtype`; `initial_state`
    (the model's weights under their original names; None when the model file is not found)
    starts a stage that no one has trained. Everything that touches the stage holds
    `sums.cv`.
    """

    def __init__(self, node: SwarmNode, sums: StepSums, build: Callable[[int], Stage], *,
                 sums_dtype: torch.dtype, initial_state: dict[str, torch.Tensor] | None,
                 delayed_updates: bool,
                 checkpoint_dir: str | Path | None, prefix: str, name: str,
                 connect_timeout_s: float, log: Callable[[str], None]):
        self.node, self.sums, self.build = node, sums, build
        self.sums_dtype = sums_dtype
        self.initial_state = initial_state
        self.delayed_updates = delayed_updates
        self.checkpoint_dir = checkpoint_dir
        self.prefix, self.name = prefix, name
        self.connect_timeout_s = connect_timeout_s
        self.log = log
        self.spec: StageSpec | None = None  # the stage served (or being entered)
        self.stage: Stage | None = None
        # the stage whose optimizer steps: the stage itself, or with delayed updates its copy
        self.master: Stage | None = None
        self.params: list[tuple[str, torch.Tensor]] = []  # the stage's, in its order
        self.float_buffers: list[torch.Tensor] = []  # averaged at each commit
        self.pending: Future | None = None  # delayed updates: the update in flight
        self.updater = ThreadPoolExecutor(1, thread_name_prefix="swarm-update")
        self.started = 0.0  # DHT time at which it entered its stage
        self.moving_to: int | None = None  # leaving its stage for this one
        self.sharing = False  # holds its stage's state: others may download it

    @property
    def moving(self) -> bool:
        return self.moving_to is not None

    # ---- entering and leaving a stage ------------------------------------------------------

    def enter(self, j: int) -> None:
        """Build stage j, holding nothing of its step; its state comes from `load`."""
        stage = self.build(j)
        # no one may download from it before it holds the stage's state (it would hand out
        # the initial weights as the stage's, at step 0)
        self.sharing = False
        self.params = stage.named_parameters()
        sizes = [p.numel() for _, p in self.params]
        self.sums.begin(sum(sizes), self.sums_dtype)
        self.float_buffers = [b for b in stage.buffers().values() if b.is_floating_point()]
        self.stage = stage
        # delayed updates: calls compute with the weights before the last step's update while
        # a copy of the stage (its optimizer with it) takes that update in the background
        self.master = self.build(j) if self.delayed_updates else stage
        self.pending = None
        self.spec = self.node.specs[j]
        self.started = float(get_dht_time())

    def load(self, j: int) -> str:
        """Take stage j's latest state: from a server of the stage, else the checkpoint
        directory, else (at step 0) the initial weights; say where it came from. The server
        shares the state from then on, and is no longer moving."""
        source = self._load(j)
        self.sharing = True
        self.moving_to = None
        return source

    def _load(self, j: int) -> str:
        records = self.node.roster(self.prefix).read()
        unshared: StateNotShared | None = None
        try:
            got = self.download(j, timeout=self.connect_timeout_s)
            if got is not None:
                return got
        except StateNotShared as e:  # a checkpoint may still hold the stage's state
            unshared = e
        ckpt = self.checkpoint_path(j)
        if ckpt is not None and ckpt.is_file():
            self.adopt(dict(load_checkpoint(ckpt)))
            return f"checkpoint {ckpt}"
        if unshared is not None:
            raise unshared
        # servers started together: one announces itself once it has its state, so the first
        # look may find no server and a later one a server, which shares when asked
        got = self.download(j, timeout=self.connect_timeout_s)
        if got is not None:
            return got
        trained = max((r.step for r in records if r.peer != self.node.peer), default=0)
        if trained > 0:
            # the swarm has trained, and nothing holds this stage's state: starting it afresh
            # would pair new weights with the other stages' trained ones
            raise PeerError(f"stage {j}'s state is lost: no server holds it and no checkpoint "
                            f"of it is in --checkpoint-dir "
                            f"{self.checkpoint_dir or '(not given)'}, while the other stages "
                            f"are at step {trained}; give the servers a shared --checkpoint-dir")
        if self.initial_state is None:
            raise UsageError(f"no initial weights for stage {j}: the model file "
                             f"{self.node.pkg.plan.model_path!r} is not found from here")
        self.stage.load_original(self.initial_state)
        if self.master is not self.stage:
            self.master.load_original(self.initial_state)
        return "the initial weights"

    def start_move(self, to: int) -> None:
        """From now on the server is announced at stage `to` and refuses calls and downloads."""
        self.moving_to = to

    def hand_over(self, timeout_s: float, closing: threading.Event) -> None:
        """Before leaving the stage, let its servers that are behind us take our state: a
        server that took a step alone and left would leave the others a step behind with no
        one to catch up from (only the checkpoint holds it), and the trainers would wait for
        a step the stage had lost. Bounded: a server that does not catch up is not waited
        for."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not closing.is_set():
            behind = [r for r in self.sharers(self.spec.index) if r.step < self.sums.step]
            if not behind:
                return
            time.sleep(0.2)
        self.log(f"leaving stage {self.spec.index} at step {self.sums.step} with servers "
                 f"behind it")

    def leave(self) -> None:
        """Let the update in flight finish, and free the stage."""
        with self.sums.cv:
            self.finish_update()
            self.stage.close()

    def close(self) -> None:
        self.updater.shutdown(wait=True)  # an update in flight finishes (and checkpoints)
        if self.stage is not None:
            self.stage.close()

    # ---- a committed step ------------------------------------------------------------------

    def apply_step(self, total: torch.Tensor, buf_mean: torch.Tensor | None) -> None:
        """The stage's step with the group's summed gradients `total` (and mean floating-point
        buffers `buf_mean`), then the checkpoint; with delayed updates the optimizer step runs
        on the update thread, and the calls of the next step use its result only after it."""
        delayed = self.master is not self.stage
        with self.sums.cv:
            if delayed:
                # the update of the last step ran during this one; its result serves the next
                self.finish_update()
                with torch.no_grad():
                    for (_, p), (_, q) in zip(self.params, self.master.named_parameters()):
                        p.copy_(q)
            off = 0
            for _, p in self.master.named_parameters():
                n = p.numel()
                if not p.requires_grad:  # frozen, or no gradient in the model: AdamW skips it
                    off += n
                    continue
                g = total[off:off + n].view(p.shape).to(p.dtype)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
                off += n
            if buf_mean is not None:
                off = 0
                with torch.no_grad():
                    for b in self.float_buffers:
                        n = b.numel()
                        b.copy_(buf_mean[off:off + n].view_as(b))
                        off += n
            self.master.step = self.sums.step
            self.sums.advance()
            step = self.sums.step
            if delayed:
                ckpt = self.checkpoint_path(self.spec.index)
                in_use = self.stage.state_dict() if ckpt is not None else None
                self.pending = self.updater.submit(self._update, step, in_use)
            else:
                self.master.optimizer_step(None)
                if self.checkpoint_dir is not None:
                    self.save_checkpoint({**self.state(), "step": step})
            self.sums.cv.notify_all()

    def _update(self, step: int, in_use: dict[str, Any] | None) -> None:
        """Delayed updates, on the update thread: the optimizer step, then the checkpoint of
        `step` (the weights in use as they were at the commit, and the updated copy)."""
        self.master.optimizer_step(None)
        if in_use is not None:
            self.save_checkpoint({**in_use, "master": self.master.state_dict(), "step": step})

    def finish_update(self) -> None:
        if self.pending is not None:
            self.pending.result()  # re-raises what failed in the update
            self.pending = None

    # ---- moving the state between servers --------------------------------------------------

    def state_message(self, j: int) -> Any:
        """The state of stage j as one response (rpc_state); PeerError when this server does
        not hold it now (another stage, moving, or still loading it)."""
        with self.sums.cv:
            if self.stage is None or self.spec.index != j or self.moving or not self.sharing:
                raise NotHere(f"server {self.name} holds no state of stage {j} now")
            meta = {"step": self.sums.step, "stage": j, "package": self.node.fingerprint,
                    "name": self.name}
            blob = state_bytes(self.state())
        return runtime_pb2.ExpertResponse(tensors=[serialize_torch_tensor(blob)],
                                          metadata=json.dumps(meta).encode())

    def sharers(self, j: int, records: list[ServerRecord] | None = None) -> list[ServerRecord]:
        """The other servers of stage j (not moving), from `records` or as the node's roster
        holds them: a fresh read would still count a server reported gone, and a move to a
        stage emptied by a kill would wait the whole download timeout for the dead server."""
        if records is None:
            records = self.node.roster(self.prefix).read()
        return [r for r in records if r.stage == j and r.peer != self.node.peer and not r.moving]

    def download(self, j: int, timeout: float, past: int = -1) -> str | None:
        """Stage j's state from a server of it past step `past`, the one furthest ahead first
        (None: there is no such server, or none is left); StateNotShared if none shared it
        within `timeout`."""
        deadline = time.monotonic() + timeout
        failed: dict[str, str] = {}  # sharer -> why its last try failed
        sharers: list[ServerRecord] = []
        while time.monotonic() < deadline:
            sharers = sorted((r for r in self.sharers(j) if r.step > past),
                             key=lambda r: (-r.step, r.peer))
            if not sharers:
                return None
            for r in sharers:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    msg = self.node.run(asyncio.wait_for(self._ask_state(r.peer, j), left))
                except Exception as e:  # noqa: BLE001 - gone or not ready: try another
                    said = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
                    if failed.get(r.peer) != said:  # once per reason, not once per try
                        self.log(f"state of stage {j} from {r.name or r.peer[-6:]} failed "
                                 f"({said}); trying again")
                    failed[r.peer] = said
                    continue
                meta = json.loads(msg.metadata.decode())
                if meta.get("package") != self.node.fingerprint:
                    raise PeerError(f"stage {meta.get('stage')} servers serve package "
                                    f"{meta.get('package')}, this one {self.node.fingerprint}; "
                                    f"give every server the same generated package")
                state = state_from_bytes(deserialize_torch_tensor(msg.tensors[0]))
                state["step"] = int(meta["step"])
                self.adopt(state)
                return f"server {meta.get('name') or '?'} (step {meta['step']})"
            time.sleep(0.3)
        raise StateNotShared(f"stage {j} has servers "
                             f"({', '.join(r.name or r.peer for r in sharers)}) but none shared "
                             f"its state within {timeout:.0f} s; check that they are alive, or "
                             f"give --checkpoint-dir")

    async def _ask_state(self, peer: str, j: int) -> Any:
        stub = SwarmServicer.get_stub(self.node.p2p, PeerID.from_base58(peer),
                                      namespace=self.prefix)
        stream = await stub.rpc_state(runtime_pb2.ExpertUID(uid=str(j)))
        return check_refusal(join([part async for part in stream]))

    def state(self) -> dict[str, Any]:
        """The stage's state: its weights, optimizer and buffers (with delayed updates, the
        weights in use and, under "master", the copy that has taken every update); call under
        `sums.cv`."""
        self.finish_update()
        state = self.stage.state_dict()
        if self.master is not self.stage:
            state["master"] = self.master.state_dict()
        return state

    def adopt(self, state: dict[str, Any]) -> None:
        """Take `state` (what `state` returned, with its "step") as the stage's."""
        with self.sums.cv:
            self.finish_update()
            step = int(state.pop("step", 0))
            master = state.pop("master", None)
            if (master is not None) != (self.master is not self.stage) and step > 0:
                how = "with" if master is not None else "without"
                raise PeerError(f"stage {self.spec.index}'s state at step {step} was trained "
                                f"{how} --delayed-updates, this server is not; give every "
                                f"server of the swarm the same --delayed-updates")
            self.stage.load_state_dict(state)
            if self.master is not self.stage:
                self.master.load_state_dict(master if master is not None else state)
            self.sums.restart(step)
            self.sums.cv.notify_all()

    # ---- checkpoints -----------------------------------------------------------------------

    def checkpoint_path(self, j: int) -> Path | None:
        if self.checkpoint_dir is None:
            return None
        return Path(self.checkpoint_dir) / f"stage{j}.pt"

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        path = self.checkpoint_path(self.spec.index)
        if path is None:
            return
        save_checkpoint(path, state)


__all__ = ["StageState", "StateNotShared"]
