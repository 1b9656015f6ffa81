"""SWARM server, the step: it commits when the stage's servers together hold the gradients of
exactly the global batch, each micro-batch once (see atomc.swarm.server's docstring for the
protocol). The ready servers form a group with hivemind's `DecentralizedAverager`, fetch one
another's sums over p2p and add them in peer order, so every member gets the same bits; then
each applies the optimizer step (with delayed updates, on another thread) and checkpoints.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from atomc.errors import PeerError
from atomc.runtime.checkpoint import digest
from atomc.swarm.records import ServerRecord, excluded_key, excluded_subkey, read_excluded
from atomc.swarm.servicer import SwarmServicer
from atomc.swarm.state import StateNotShared


class StepCommit:
    """SwarmServer's step: averaging the stage's gradient sums and applying the update."""

    def _stage_samples(self, servers: list[ServerRecord],
                       excluded: set[tuple[str, int, int]]) -> int:
        return sum(r.samples for r in servers if r.stage == self.spec.index
                   and r.step == self.step and (r.peer, r.stage, r.attempt) not in excluded)

    def _try_commit(self, servers: list[ServerRecord]) -> None:
        cfg = self.cfg
        excluded = self.excluded = read_excluded(self.dht, cfg.prefix, self.step)
        if (self.peer, self.spec.index, self.attempt) in excluded:
            with self.cv:  # a trainer gave up on us: our part of this step is sent elsewhere
                self.log(f"excluded from attempt {self.attempt} of step {self.step}: dropping "
                         f"{len(self.ids)} micro-batches")
                self.acc.zero_()
                self.ids = {}
                self.attempt += 1
            self._announce()
        others = self._sharers(self.spec.index, servers)
        ahead = [r for r in others if r.step > self.step]
        if ahead:
            # the stage took the step without us (whatever we hold of it was sent again
            # elsewhere, or counted in a round we could not finish): take its state. Waiting
            # for a group while holding such gradients stalled a stage for good on a real run
            self._catch_up()
            return
        if self._stage_samples(servers, excluded) < cfg.target_batch_size:
            return
        with self.cv:
            mine = {"peer": self.peer, "ids": sorted(self.ids), "samples": sum(self.ids.values()),
                    "step": self.step, "attempt": self.attempt}
            acc = self.acc.clone()
        buffers = [b.detach().reshape(-1).to(acc.dtype) for b in self.float_buffers]
        if not others or mine["samples"] == cfg.target_batch_size:
            # alone, or holding the whole batch: no one else's sums can count (a server that
            # held none catches up by downloading the state), and a dead server whose record
            # has not expired yet must not hold the step up
            group = {self.peer: mine}
            total, buf_mean = acc, (torch.cat(buffers) if buffers else None)
        else:
            group, total, buf_mean = self._average(acc, buffers, mine)
            if group is None:
                return
        ok, why = self._valid(group, excluded)
        if not ok:
            self.log(f"step {self.step}: not taken ({why}); waiting")
            return
        self._apply(total, buf_mean, group)

    def contribution(self, step: int) -> list[Any]:
        """Our sums (then our floating-point buffers) for `step`, in streaming parts."""
        offer = self.offers.get(step)
        if offer is None:
            raise PeerError(f"server {self.cfg.name} offers no sums for step {step}")
        return list(split_for_streaming(serialize_torch_tensor(offer)))

    def _average(self, acc: torch.Tensor, buffers: list[torch.Tensor], mine: dict[str, Any]
                 ) -> tuple[dict[str, Any] | None, torch.Tensor, torch.Tensor | None]:
        offer = torch.cat([acc, *buffers])
        self.offers = {s: t for s, t in self.offers.items() if s >= self.step - 1}
        self.offers[self.step] = offer
        try:
            # a groupmate that never comes (dead, its record not yet expired) costs only a few
            # matchmaking periods: then the round is retried with the servers still announced
            gathered = self.averager.step(gather=mine, weight=1.0,
                                          timeout=3 * self.cfg.matchmaking_s + 2.0)
        except Exception as e:  # noqa: BLE001 - a groupmate died mid-round: keep our sums
            self.log(f"step {self.step}: no group ({type(e).__name__}: {e})")
            return None, acc, None
        if not gathered:
            return None, acc, None
        group = {str(v.get("peer")): v for v in gathered.values() if isinstance(v, dict)}
        parts = {}
        for peer in sorted(group):
            if peer == self.peer:
                parts[peer] = offer
                continue
            try:
                parts[peer] = self.run(asyncio.wait_for(
                    self._fetch(peer, self.step), self.cfg.averaging_timeout_s))
            except Exception as e:  # noqa: BLE001 - a groupmate died after matchmaking
                self.log(f"step {self.step}: sums of ...{peer[-6:]} unavailable "
                         f"({type(e).__name__}: {e})")
                return None, acc, None
        total = torch.zeros_like(offer)
        for peer in sorted(parts):  # one order on every member: the same bits everywhere
            total += parts[peer].to(total.dtype)
        n = acc.numel()
        buf_mean = total[n:] / len(parts) if buffers else None
        return group, total[:n], buf_mean

    async def _fetch(self, peer: str, step: int) -> torch.Tensor:
        stub = SwarmServicer.get_stub(self.p2p, PeerID.from_base58(peer), namespace=self.cfg.prefix)
        stream = await stub.rpc_contribution(runtime_pb2.ExpertUID(uid=str(step)))
        chunks = [part async for part in stream]
        return deserialize_torch_tensor(combine_from_streaming(chunks))

    def _valid(self, group: dict[str, Any], excluded: set[tuple[str, int, int]]
               ) -> tuple[bool, str]:
        seen: set[str] = set()
        samples = 0
        for peer, info in group.items():
            if int(info.get("step", -1)) != self.step:
                return False, f"{peer} is at step {info.get('step')}"
            if (peer, self.spec.index, int(info.get("attempt", -1))) in excluded \
                    and info.get("ids"):
                return False, f"{peer} is excluded from this step"
            repeated = seen.intersection(info["ids"])
            if repeated:
                return False, f"micro-batches {sorted(repeated)[:3]} counted twice"
            seen.update(info["ids"])
            samples += int(info["samples"])
        if samples != self.cfg.target_batch_size:
            return False, (f"the group holds {samples} of the {self.cfg.target_batch_size} "
                           f"samples")
        return True, ""

    def _apply(self, total: torch.Tensor, buf_mean: torch.Tensor | None,
               group: dict[str, Any]) -> None:
        delayed = self.master is not self.stage
        with self.cv:
            if delayed:
                # the update of the last step ran during this one; its result serves the next
                self._finish_update()
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
            self.master.step = self.step
            self.step += 1
            if delayed:
                ckpt = self._checkpoint_path(self.spec.index)
                in_use = self.stage.state_dict() if ckpt is not None else None
                self.pending = self.updater.submit(self._update, self.step, in_use)
            else:
                self.master.optimizer_step(None)
                if self.cfg.checkpoint_dir is not None:
                    self._save_checkpoint({**self._state(), "step": self.step})
            self.acc.zero_()
            self.ids = {}
            self.cv.notify_all()
        self._announce()
        names = sorted(str(v.get("peer", "?"))[-6:] for v in group.values())
        self.log(f"stage {self.spec.index} step {self.step}: took the step with {names}")
        if self.cfg.metrics_path is not None:
            self._metric({"event": "step", "stage": self.spec.index, "step": self.step,
                          "group": len(group), "digest": digest([p for _, p in self.params])})

    def _update(self, step: int, in_use: dict[str, Any] | None) -> None:
        """DPU, on the update thread: the optimizer step, then the checkpoint of `step` (the
        weights in use as they were at the commit, and the updated copy)."""
        self.master.optimizer_step(None)
        if in_use is not None:
            self._save_checkpoint({**in_use, "master": self.master.state_dict(), "step": step})

    def _catch_up(self) -> None:
        """The stage moved on without us: take its state (and drop what we held of the step,
        `_adopt`)."""
        # from a server ahead of us only: one at our step has nothing to give
        try:
            got = self._download(self.spec.index, self.cfg.averaging_timeout_s, past=self.step)
        except StateNotShared as e:  # the serving loop tries again at its next look
            self.log(f"catching up: {e}")
            return
        if got is not None:
            self.log(f"caught up to step {self.step} from {got}")


def exclude(dht: Any, prefix: str, step: int, peer: str, stage: int, attempt: int,
            ttl_s: float = 600.0) -> None:
    """Record that `peer`'s gradients of `step` under `attempt` must not count (a trainer's
    call to it failed, or its record is gone)."""
    dht.store(excluded_key(prefix, step), subkey=excluded_subkey(peer, stage, attempt), value=True,
              expiration_time=get_dht_time() + ttl_s)


__all__ = ["StepCommit", "exclude"]
