"""SWARM server, the stage's state: handed to a server that joins, moves to the stage or fell
behind (`rpc_state`, from the server furthest ahead first), taken from such a server or from
the checkpoint directory, and written there after every step.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from atomc.distributed.hive import state_bytes, state_from_bytes
from atomc.errors import PeerError, UsageError
from atomc.runtime.checkpoint import load_checkpoint, save_checkpoint
from atomc.swarm.records import ServerRecord
from atomc.swarm.servicer import SwarmServicer
from atomc.swarm.wire import NotHere, check_refusal, join


class StateNotShared(PeerError):
    """Servers of the stage were there, and none shared its state in time."""


class StageState:
    """SwarmServer's stage state: download, adoption, sharing and checkpoints."""

    def state_message(self, j: int) -> Any:
        """The state of stage j as one response (rpc_state); PeerError when this server does
        not hold it now (another stage, moving, or still loading it)."""
        with self.cv:
            if self.stage is None or self.spec.index != j or self.moving or not self.sharing:
                raise NotHere(f"server {self.cfg.name} holds no state of stage {j} now")
            meta = {"step": self.step, "stage": j, "package": self.fingerprint,
                    "name": self.cfg.name}
            blob = state_bytes(self._state())
        return runtime_pb2.ExpertResponse(tensors=[serialize_torch_tensor(blob)],
                                          metadata=json.dumps(meta).encode())

    def _sharers(self, j: int, records: list[ServerRecord] | None = None) -> list[ServerRecord]:
        """The other servers of stage j (not moving), from `records` or as this node's roster
        holds them (a fresh read would still count a server reported gone: a move to a stage
        emptied by a kill then waited the whole download timeout for the dead server)."""
        if records is None:
            records = self.roster(self.cfg.prefix).read()
        return [r for r in records if r.stage == j and r.peer != self.peer and not r.moving]

    def _load_state(self, j: int) -> str:
        records = self.roster(self.cfg.prefix).read()
        unshared: StateNotShared | None = None
        try:
            got = self._download(j, timeout=self.cfg.connect_timeout_s)
            if got is not None:
                return got
        except StateNotShared as e:  # a checkpoint may still hold the stage's state
            unshared = e
        ckpt = self._checkpoint_path(j)
        if ckpt is not None and ckpt.is_file():
            self._adopt(dict(load_checkpoint(ckpt)))
            return f"checkpoint {ckpt}"
        if unshared is not None:
            raise unshared
        # servers started together: one that has its state announces itself, so a first
        # look may find none and a later one a server; asked again, it shares (the error
        # came from another look at the stage than the one that decided, in a bench run)
        got = self._download(j, timeout=self.cfg.connect_timeout_s)
        if got is not None:
            return got
        trained = max((r.step for r in records if r.peer != self.peer), default=0)
        if trained > 0:
            # the swarm has trained, and nothing holds this stage's state: starting it afresh
            # would pair new weights with the other stages' trained ones
            raise PeerError(f"stage {j}'s state is lost: no server holds it and no checkpoint "
                            f"of it is in --checkpoint-dir "
                            f"{self.cfg.checkpoint_dir or '(not given)'}, while the other stages "
                            f"are at step {trained}; give the servers a shared --checkpoint-dir")
        if self.initial_state is None:
            raise UsageError(f"no initial weights for stage {j}: the model file "
                             f"{self.pkg.plan.model_path!r} is not found from here")
        self.stage.load_original(self.initial_state)
        if self.master is not self.stage:
            self.master.load_original(self.initial_state)
        return "the initial weights"

    def _download(self, j: int, timeout: float, past: int = -1) -> str | None:
        """Stage j's state from a server of it past step `past`, the one furthest ahead first
        (None: there is no such server, or none is left); StateNotShared if none shared it
        within `timeout`."""
        deadline = time.monotonic() + timeout
        failed: dict[str, str] = {}  # sharer -> why its last try failed
        sharers: list[ServerRecord] = []
        while time.monotonic() < deadline:
            sharers = sorted((r for r in self._sharers(j) if r.step > past),
                             key=lambda r: (-r.step, r.peer))
            if not sharers:
                return None
            for r in sharers:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    msg = self.run(asyncio.wait_for(self._ask_state(r.peer, j), left))
                except Exception as e:  # noqa: BLE001 - gone or not ready: try another
                    said = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
                    if failed.get(r.peer) != said:  # once per reason, not once per try
                        self.log(f"state of stage {j} from {r.name or r.peer[-6:]} failed "
                                 f"({said}); trying again")
                    failed[r.peer] = said
                    continue
                meta = json.loads(msg.metadata.decode())
                if meta.get("package") != self.fingerprint:
                    raise PeerError(f"stage {meta.get('stage')} servers serve package "
                                    f"{meta.get('package')}, this one {self.fingerprint}; give "
                                    f"every server the same generated package")
                state = state_from_bytes(deserialize_torch_tensor(msg.tensors[0]))
                state["step"] = int(meta["step"])
                self._adopt(state)
                return f"server {meta.get('name') or '?'} (step {meta['step']})"
            time.sleep(0.3)
        raise StateNotShared(f"stage {j} has servers "
                             f"({', '.join(r.name or r.peer for r in sharers)}) but none shared "
                             f"its state within {timeout:.0f} s; check that they are alive, or "
                             f"give --checkpoint-dir")

    async def _ask_state(self, peer: str, j: int) -> Any:
        stub = SwarmServicer.get_stub(self.p2p, PeerID.from_base58(peer), namespace=self.cfg.prefix)
        stream = await stub.rpc_state(runtime_pb2.ExpertUID(uid=str(j)))
        return check_refusal(join([part async for part in stream]))

    def _state(self) -> dict[str, Any]:
        """The stage's state: its weights, optimizer and buffers (with DPU, the weights in use
        and, under "master", the copy that has taken every update); call under `cv`."""
        self._finish_update()
        state = self.stage.state_dict()
        if self.master is not self.stage:
            state["master"] = self.master.state_dict()
        return state

    def _finish_update(self) -> None:
        if self.pending is not None:
            self.pending.result()  # re-raises what failed in the update
            self.pending = None

    def _adopt(self, state: dict[str, Any]) -> None:
        with self.cv:
            self._finish_update()
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
            self.step = step
            self.acc.zero_()
            self.ids = {}
            self.cv.notify_all()

    def _checkpoint_path(self, j: int) -> Path | None:
        if self.cfg.checkpoint_dir is None:
            return None
        return Path(self.cfg.checkpoint_dir) / f"stage{j}.pt"

    def _save_checkpoint(self, state: dict[str, Any]) -> None:
        path = self._checkpoint_path(self.spec.index)
        if path is None:
            return
        save_checkpoint(path, state)


__all__ = ["StageState", "StateNotShared"]
