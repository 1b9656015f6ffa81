"""SWARM server, the step's commit: a stage takes one optimizer step per global batch, the same on
every server of the stage.

A step commits when the stage's servers together hold the gradients of exactly the global
batch, each micro-batch once. Each server sums the gradients of the micro-batches it ran
(atomc.swarm.sums). The servers that are ready form a group with hivemind's
`DecentralizedAverager` (its matchmaking and all-gather of the ids of their micro-batches), then
each fetches the others' sums over p2p (`rpc_contribution`, streamed in parts) and adds them in
peer order. The sum is ordered so that every member gets the same bits: hivemind's all-reduce
hands each member the average as a delta to its own tensor, which rounds differently on each,
and the servers of one stage would drift apart. Every member sees the same gathered ids, so all
decide alike: apply the step when the ids cover the global batch with no repeats and no
member's attempt is excluded (atomc.swarm.records), otherwise keep their sums and try again (a
dead server's micro-batches come back from the trainers). BatchNorm statistics are updated by
the forward call only (the backward's recomputation runs on copies of them: the interpreter's
buffer rule) and averaged at the commit. A server that missed the round downloads the stage's
state from one that took it (atomc.swarm.state).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from atomc.errors import PeerError
from atomc.runtime.checkpoint import digest
from atomc.swarm.metrics import Metrics
from atomc.swarm.node import SwarmNode
from atomc.swarm.records import ServerRecord, excluded_key, excluded_subkey, read_excluded
from atomc.swarm.servicer import SwarmServicer
from atomc.swarm.state import StageState, StateNotShared
from atomc.swarm.sums import StepSums


class StepCommit:
    """A server's part in its stage's steps (see the module docstring): the averaging group of
    the stage it serves, the sums it offers its groupmates, and the decision to step.

    `announce` publishes the server's record at once (after its sums change hands).
    """

    def __init__(self, node: SwarmNode, state: StageState, sums: StepSums, *, prefix: str,
                 name: str, target_batch_size: int, matchmaking_s: float,
                 averaging_timeout_s: float, announce: Callable[[], None], metrics: Metrics,
                 log: Callable[[str], None]):
        self.node, self.state, self.sums = node, state, sums
        self.prefix, self.name = prefix, name
        self.target_batch_size = target_batch_size
        self.matchmaking_s, self.averaging_timeout_s = matchmaking_s, averaging_timeout_s
        self.announce, self.metrics, self.log = announce, metrics, log
        self.averager: Any = None
        self.offers: dict[int, torch.Tensor] = {}  # step -> our sums (and buffers) offered

    def join(self, j: int) -> None:
        """Join stage j's averaging group; it forms groups and gathers their ids, while the
        sums travel by rpc_contribution."""
        self.offers = {}
        # state travels by rpc_state: the averager neither declares nor serves it
        self.averager = self.node.hm.averaging.DecentralizedAverager(
            [torch.zeros(1)], self.node.dht, start=True, prefix=f"{self.prefix}_stage{j}",
            min_group_size=2, min_matchmaking_time=self.matchmaking_s,
            request_timeout=max(0.5, self.matchmaking_s / 2),
            allreduce_timeout=self.averaging_timeout_s, next_chunk_timeout=10.0,
            client_mode=False, allow_state_sharing=False)

    def leave(self) -> None:
        self.averager.shutdown()

    def close(self) -> None:
        try:
            if self.averager is not None:
                self.averager.shutdown()
        except Exception as e:  # noqa: BLE001 - shutting down: close the rest anyway
            self.log(f"averager shutdown failed: {e}")

    def _stage_samples(self, servers: list[ServerRecord],
                       excluded: set[tuple[str, int, int]]) -> int:
        return sum(r.samples for r in servers if r.stage == self.state.spec.index
                   and r.step == self.sums.step
                   and (r.peer, r.stage, r.attempt) not in excluded)

    def try_commit(self, servers: list[ServerRecord]) -> None:
        """Take the step if the stage's servers (`servers`, as this one sees them) hold its
        whole batch; drop our sums if a trainer excluded our attempt, and catch up if the
        stage stepped without us."""
        peer, sums, j = self.node.peer, self.sums, self.state.spec.index
        excluded = read_excluded(self.node.dht, self.prefix, sums.step)
        sums.note_excluded(excluded)
        if (peer, j, sums.attempt) in excluded:
            with sums.cv:  # a trainer gave up on us: our part of this step is sent elsewhere
                self.log(f"excluded from attempt {sums.attempt} of step {sums.step}: dropping "
                         f"{len(sums.ids)} micro-batches")
                sums.next_attempt()
            self.announce()
        others = self.state.sharers(j, servers)
        ahead = [r for r in others if r.step > sums.step]
        if ahead:
            # the stage took the step without us (whatever we hold of it was sent again
            # elsewhere, or counted in a round we could not finish): take its state. A group
            # for our step would never form, its other servers being past it
            self._catch_up()
            return
        if self._stage_samples(servers, excluded) < self.target_batch_size:
            return
        with sums.cv:
            mine = {"peer": peer, "ids": sorted(sums.ids), "samples": sums.samples(),
                    "step": sums.step, "attempt": sums.attempt}
            acc = sums.acc.clone()
        buffers = [b.detach().reshape(-1).to(acc.dtype) for b in self.state.float_buffers]
        if not others or mine["samples"] == self.target_batch_size:
            # alone, or holding the whole batch: no one else's sums can count (a server that
            # held none catches up by downloading the state), and a dead server whose record
            # has not expired yet must not hold the step up
            group = {peer: mine}
            total, buf_mean = acc, (torch.cat(buffers) if buffers else None)
        else:
            group, total, buf_mean = self._average(acc, buffers, mine)
            if group is None:
                return
        ok, why = self._valid(group, excluded)
        if not ok:
            self.log(f"step {sums.step}: not taken ({why}); waiting")
            return
        self.state.apply_step(total, buf_mean)
        self.announce()
        names = sorted(str(v.get("peer", "?"))[-6:] for v in group.values())
        self.log(f"stage {j} step {sums.step}: took the step with {names}")
        if self.metrics.on:
            self.metrics.write({"event": "step", "stage": j, "step": sums.step,
                                "group": len(group),
                                "digest": digest([p for _, p in self.state.params])})

    def contribution(self, step: int) -> list[Any]:
        """Our sums (then our floating-point buffers) for `step`, in streaming parts."""
        offer = self.offers.get(step)
        if offer is None:
            raise PeerError(f"server {self.name} offers no sums for step {step}")
        return list(split_for_streaming(serialize_torch_tensor(offer)))

    def _average(self, acc: torch.Tensor, buffers: list[torch.Tensor], mine: dict[str, Any]
                 ) -> tuple[dict[str, Any] | None, torch.Tensor, torch.Tensor | None]:
        step = self.sums.step
        offer = torch.cat([acc, *buffers])
        self.offers = {s: t for s, t in self.offers.items() if s >= step - 1}
        self.offers[step] = offer
        try:
            # a groupmate that never comes (dead, its record not yet expired) costs only a few
            # matchmaking periods: then the round is retried with the servers still announced
            gathered = self.averager.step(gather=mine, weight=1.0,
                                          timeout=3 * self.matchmaking_s + 2.0)
        except Exception as e:  # noqa: BLE001 - a groupmate died mid-round: keep our sums
            self.log(f"step {step}: no group ({type(e).__name__}: {e})")
            return None, acc, None
        if not gathered:
            return None, acc, None
        group = {str(v.get("peer")): v for v in gathered.values() if isinstance(v, dict)}
        parts = {}
        for peer in sorted(group):
            if peer == self.node.peer:
                parts[peer] = offer
                continue
            try:
                parts[peer] = self.node.run(asyncio.wait_for(
                    self._fetch(peer, step), self.averaging_timeout_s))
            except Exception as e:  # noqa: BLE001 - a groupmate died after matchmaking
                self.log(f"step {step}: sums of ...{peer[-6:]} unavailable "
                         f"({type(e).__name__}: {e})")
                return None, acc, None
        total = torch.zeros_like(offer)
        for peer in sorted(parts):  # one order on every member: the same bits everywhere
            total += parts[peer].to(total.dtype)
        n = acc.numel()
        buf_mean = total[n:] / len(parts) if buffers else None
        return group, total[:n], buf_mean

    async def _fetch(self, peer: str, step: int) -> torch.Tensor:
        stub = SwarmServicer.get_stub(self.node.p2p, PeerID.from_base58(peer),
                                      namespace=self.prefix)
        stream = await stub.rpc_contribution(runtime_pb2.ExpertUID(uid=str(step)))
        chunks = [part async for part in stream]
        return deserialize_torch_tensor(combine_from_streaming(chunks))

    def _valid(self, group: dict[str, Any], excluded: set[tuple[str, int, int]]
               ) -> tuple[bool, str]:
        seen: set[str] = set()
        samples = 0
        for peer, info in group.items():
            if int(info.get("step", -1)) != self.sums.step:
                return False, f"{peer} is at step {info.get('step')}"
            if (peer, self.state.spec.index, int(info.get("attempt", -1))) in excluded \
                    and info.get("ids"):
                return False, f"{peer} is excluded from this step"
            repeated = seen.intersection(info["ids"])
            if repeated:
                return False, f"micro-batches {sorted(repeated)[:3]} counted twice"
            seen.update(info["ids"])
            samples += int(info["samples"])
        if samples != self.target_batch_size:
            return False, (f"the group holds {samples} of the {self.target_batch_size} "
                           f"samples")
        return True, ""

    def _catch_up(self) -> None:
        """The stage moved on without us: take its state (which drops what we held of the
        step)."""
        # from a server ahead of us only: one at our step has nothing to give
        try:
            got = self.state.download(self.state.spec.index, self.averaging_timeout_s,
                                      past=self.sums.step)
        except StateNotShared as e:  # the serving loop tries again at its next look
            self.log(f"catching up: {e}")
            return
        if got is not None:
            self.log(f"caught up to step {self.sums.step} from {got}")


def exclude(dht: Any, prefix: str, step: int, peer: str, stage: int, attempt: int,
            ttl_s: float = 600.0) -> None:
    """Record that `peer`'s gradients of `step` under `attempt` must not count (a trainer's
    call to it failed, or its record is gone)."""
    dht.store(excluded_key(prefix, step), subkey=excluded_subkey(peer, stage, attempt), value=True,
              expiration_time=get_dht_time() + ttl_s)


__all__ = ["StepCommit", "exclude"]
