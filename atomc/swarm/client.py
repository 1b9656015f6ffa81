"""SWARM trainer: each micro-batch through one server per stage, chosen by stochastic wiring.

input:  a generated package, the number of stages, the DHT of the servers, batches
output: one optimizer step of every stage per global batch; the step's loss

Routing is SWARM's Algorithm 1 (`Router`): per stage, servers keyed by the work routed to them,
each use adding its EMA time per sample times the samples sent, the least keyed taken (an
interleaved weighted round robin: a server twice as fast gets twice the micro-batches), among
the servers with fewer than `max_in_flight` of our calls unanswered; a call finding every
server of its stage at that bound waits for one to answer. Without the bound a step's calls
would queue at the servers known when they were sent: a server that joins mid-step would sit
idle while the slow ones work through their queues, and a killed server would take its queue
with it. A call that fails or times out bans its server with exponential backoff, until it
announces a new incarnation, and the micro-batch goes to another server of the stage (a
refusal that is no fault bans nothing: a server that moved is routed around, one whose attempt
moved on is called again with it: every call in flight names the attempt a server has just
left, and banning it for those would shut the only server of a stage out); if every server of
a stage is banned the bans are ignored (as Petals does). Every call has a timeout: a SIGKILLed
hivemind server gives its client no error at all. A call that cannot reach its server (no
daemon to dial, or its stream ended mid-call) also reports it gone in the DHT, so that the
swarm stops counting it before its record expires (atomc.swarm.records).

A backward carries the stage's inputs and output gradients, and the server recomputes the
forward (SWARM's design): so the backward goes to any server of the stage, and a micro-batch
whose forward server is gone re-runs its forward there as part of the backward. The trainer
keeps each stage's inputs and output gradients until every stage has taken the step. If a
server that holds some of its gradients fails (a call errs, or its record expires), the
trainer excludes that server's attempt at the step in the DHT and sends those micro-batches'
backward again: the stage's step waits until its servers hold every micro-batch exactly once
(atomc.swarm.commit). A server that refuses a call says why, and whether it holds the call's
micro-batch: one that does not is not excluded for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hivemind.p2p import P2PDaemonError, PeerID
from hivemind.utils.asyncio import iter_as_aiter

from atomc.errors import PeerError, UsageError
from atomc.swarm.calls import BATCH, GRAD
from atomc.swarm.codec import message_bytes
from atomc.swarm.commit import exclude
from atomc.swarm.node import SwarmNode
from atomc.swarm.records import ServerRecord, read_excluded, read_servers, report_gone
from atomc.swarm.servicer import SwarmServicer
from atomc.swarm.wire import (
    Refused,
    StepTaken,
    StreamClosed,
    check_refusal,
    decode,
    encode,
    join,
    split,
)

GONE_TTL_S = 120.0  # a report that a server is unreachable outlives any record it names
ROUTES_S = 1.0  # a step's calls re-read the servers this often
STALE_TRIES = 50  # calls refused for a stale attempt before the server counts as failing
STALE_WAIT_S = 0.1  # a server reads its exclusions every tick of its serving loop (0.1 s)
STALE_TRUST = 4  # refusals of a server behind our idea of its attempt before we take its own


@dataclass
class TrainConfig:
    package: str | Path
    num_stages: int
    prefix: str = "atomc-swarm"
    initial_peers: tuple[str, ...] = ()
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    micro_batch_size: int | None = None  # default: the plan's
    global_micro: int | None = None  # micro-batches of all trainers per step (default: ours)
    first_micro: int = 0  # our micro-batches' indices in the global batch start here
    compress: bool = False  # 8-bit blockwise activations and gradients on the links
    request_timeout_s: float = 30.0
    connect_timeout_s: float = 20.0
    servers_timeout_s: float = 60.0  # a stage without servers for this long is an error
    step_timeout_s: float = 600.0
    ban_s: float = 1.0  # first ban; doubles with each further failure
    ban_max_s: float = 60.0  # up to this (a server back from a fault is tried again)
    max_in_flight: int = 2  # our unanswered calls per server (one running, one queued)
    name: str = ""


@dataclass
class _Server:
    priority: float = 0.0
    ema: float | None = None  # seconds per sample
    banned_until: float = 0.0
    failures: int = 0
    started: float = 0.0  # the incarnation banned
    attempt: int = 0  # its attempt at the step, as last announced (atomc.swarm.records)
    in_flight: int = 0  # our calls to it not answered yet


FULL = ""  # Router.choose: every server of the stage has its bound of calls in flight


class Router:
    """SWARM Algorithm 1 (see the module docstring); `now` is monotonic seconds."""

    def __init__(self, num_stages: int, ban_s: float = 1.0, alpha: float = 0.1,
                 ban_max_s: float = 60.0):
        self.stages: list[dict[str, _Server]] = [{} for _ in range(num_stages)]
        self.ban_s, self.ban_max_s = ban_s, ban_max_s
        self.alpha = alpha

    def refresh(self, records: list[ServerRecord]) -> None:
        """The live servers: new ones enter at the stage's lowest key (not flooded with work,
        not starved); a banned server that announces a new incarnation is forgiven."""
        seen: list[set[str]] = [set() for _ in self.stages]
        for r in records:
            if r.moving or not 0 <= r.stage < len(self.stages):
                continue
            queue = self.stages[r.stage]
            seen[r.stage].add(r.peer)
            s = queue.get(r.peer)
            if s is None:
                low = min((x.priority for x in queue.values()), default=0.0)
                queue[r.peer] = s = _Server(priority=low)
            if r.started > s.started:  # a new incarnation: forgiven, its attempts anew
                s.banned_until, s.failures = 0.0, 0
                s.started, s.attempt = r.started, r.attempt
            else:  # attempts only rise: the trainer may know of one the record has not shown
                s.attempt = max(s.attempt, r.attempt)
        for queue, live in zip(self.stages, seen):
            for peer in set(queue) - live:
                del queue[peer]

    def servers(self, stage: int) -> list[str]:
        return sorted(self.stages[stage])

    def choose(self, stage: int, samples: int, now: float, avoid: set[str] = frozenset(),
               limit: int | None = None) -> str | None:
        """The server for a call of `samples` (its call counted in flight until `answered`);
        None if the stage has none to try, FULL if each has `limit` calls in flight."""
        queue = self.stages[stage]
        cands = [p for p in queue if p not in avoid]
        open_ = [p for p in cands if queue[p].banned_until <= now]
        pool = open_ or cands  # every server banned: try them anyway rather than stop
        if not pool:
            return None
        if limit is not None:
            pool = [p for p in pool if queue[p].in_flight < limit]
            if not pool:
                return FULL
        peer = min(pool, key=lambda p: (queue[p].priority, p))
        s = queue[peer]
        known = [x.ema for x in queue.values() if x.ema is not None]
        ema = s.ema if s.ema is not None else (sum(known) / len(known) if known else 1.0)
        s.priority += ema * samples
        s.in_flight += 1
        return peer

    def answered(self, stage: int, peer: str) -> None:
        """A call `choose` sent to `peer` ended (answered, failed or given up)."""
        s = self.stages[stage].get(peer)
        if s is not None:  # (dropped and seen again since: counted anew from 0)
            s.in_flight = max(0, s.in_flight - 1)

    def banned_for(self, stage: int, peer: str, now: float) -> float:
        s = self.stages[stage].get(peer)
        return max(0.0, s.banned_until - now) if s is not None else 0.0

    def attempt(self, stage: int, peer: str) -> int:
        s = self.stages[stage].get(peer)
        return s.attempt if s is not None else 0

    def learn_attempt(self, stage: int, peer: str, attempt: int, trust: bool = False) -> None:
        """The server is on `attempt` (it said so, or we excluded the one before it): a later
        one than we knew, or with `trust`, whatever we took it to be."""
        s = self.stages[stage].get(peer)
        if s is not None:
            s.attempt = attempt if trust else max(s.attempt, attempt)

    def drop(self, stage: int, peer: str) -> None:
        """The server left the stage (it said so): no calls until a record shows it there."""
        self.stages[stage].pop(peer, None)

    def report(self, stage: int, peer: str, seconds: float, samples: int) -> None:
        s = self.stages[stage].get(peer)
        if s is None:
            return
        per = seconds / max(1, samples)
        s.ema = per if s.ema is None else self.alpha * per + (1 - self.alpha) * s.ema

    def ban(self, stage: int, peer: str, now: float) -> float:
        s = self.stages[stage].get(peer)
        if s is None:
            return 0.0
        s.failures += 1
        span = min(self.ban_max_s, self.ban_s * 2 ** min(s.failures - 1, 60))
        s.banned_until = now + span
        return span


@dataclass
class _Held:
    """What a micro-batch's backward at one stage needs to run again elsewhere."""

    peer: str
    attempt: int  # the server's attempt its gradients went to
    inputs: dict[str, Any]
    grads: dict[str, torch.Tensor] | None


@dataclass
class StepStats:
    loss: float
    seconds: float
    calls: int = 0
    retries: int = 0
    resent: int = 0  # backward calls sent again because their server failed
    bytes_sent: int = 0
    bytes_received: int = 0


class SwarmTrainer:
    """One trainer (see the module docstring); its membership of the swarm is `node`."""

    def __init__(self, cfg: TrainConfig, log: Callable[[str], None] = print):
        if cfg.max_in_flight < 1:
            raise UsageError(f"--max-in-flight {cfg.max_in_flight}: a trainer needs at least "
                             f"one call in flight per server")
        self.node = SwarmNode(cfg.package, cfg.num_stages, cfg.initial_peers, cfg.host_maddrs,
                              cfg.announce_maddrs, cfg.connect_timeout_s, "trainer")
        self.cfg = cfg
        self.log = log
        self.micro_batch_size = cfg.micro_batch_size or int(self.node.pkg.plan.batch_size or 1)
        self.router = Router(cfg.num_stages, cfg.ban_s, ban_max_s=cfg.ban_max_s)
        self.step_count = 0
        self.name = cfg.name or f"trainer-{self.node.peer[-6:]}"
        self._reporting: set[str] = set()  # servers whose gone report is being stored

    # ---- servers -------------------------------------------------------------------------------

    def _records(self) -> list[ServerRecord]:
        return self.node.servers(self.cfg.prefix)

    def wait_for_servers(self, timeout_s: float | None = None) -> list[ServerRecord]:
        """Block until every stage has a server; PeerError naming the empty stages if not."""
        timeout_s = self.cfg.servers_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            records = self._records()
            self.router.refresh(records)
            empty = [j for j in range(self.cfg.num_stages) if not self.router.servers(j)]
            if not empty:
                return records
            if time.monotonic() > deadline:
                raise PeerError(
                    f"no server for stage{'s' if len(empty) > 1 else ''} "
                    f"{', '.join(map(str, empty))} under DHT prefix {self.cfg.prefix!r} within "
                    f"{timeout_s:.0f} s; start one (atomc swarm serve PACKAGE --stage "
                    f"{empty[0]}) with --initial-peers pointing at this swarm")
            time.sleep(0.3)

    # ---- a step --------------------------------------------------------------------------------

    def micro_batches(self, batch: tuple) -> list[tuple]:
        size = self.micro_batch_size
        n = batch[0].shape[0]
        if n % size:
            raise UsageError(f"the batch has {n} samples, not a multiple of the micro-batch "
                             f"size {size}")
        return [tuple(t[i:i + size] for t in batch) for i in range(0, n, size)]

    def step(self, batch: tuple | torch.Tensor) -> StepStats:
        """One step: every micro-batch of `batch` through the swarm; returns once every stage
        has taken the step (the mean loss of our micro-batches)."""
        batch = batch if isinstance(batch, tuple) else (batch,)
        micro = self.micro_batches(batch)
        self.wait_for_servers()
        future = asyncio.run_coroutine_threadsafe(self._step(self.step_count, micro),
                                                  self.node.loop)
        try:
            stats = future.result(self.cfg.step_timeout_s)
        except concurrent.futures.TimeoutError:  # (TimeoutError itself from Python 3.11)
            future.cancel()
            raise PeerError(f"step {self.step_count} did not finish within "
                            f"{self.cfg.step_timeout_s:.0f} s; see the servers' logs") from None
        self.step_count += 1
        return stats

    async def _step(self, k: int, micro: list[tuple]) -> StepStats:
        t0 = time.monotonic()
        self._stats = StepStats(0.0, 0.0)
        self._held: dict[tuple[int, int], _Held] = {}
        self._answered = asyncio.Condition()  # a call ended, or the routes were read again
        total = self.cfg.global_micro or len(micro)
        refresher = asyncio.create_task(self._refresh_routes())
        try:
            losses = await asyncio.gather(*[
                self._micro(k, self.cfg.first_micro + m, b, total) for m, b in enumerate(micro)])
        finally:
            refresher.cancel()
        await self._wait_for_commit(k, micro, total)
        stats = self._stats
        stats.loss = float(sum(losses) / len(losses))
        stats.seconds = time.monotonic() - t0
        return stats

    async def _refresh_routes(self) -> None:
        """The servers as announced, every ROUTES_S while a step's calls run: a newcomer gets
        calls (and so a measured rate) within a second, not at the next step, and a server that
        moved or left is no longer called."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(ROUTES_S)
            try:
                self.router.refresh(await loop.run_in_executor(None, self._records))
            except Exception as e:  # noqa: BLE001 - the calls themselves read and raise again
                self.log(f"reading the servers failed ({type(e).__name__}: {e}); routes kept")
            async with self._answered:  # a newcomer takes calls waiting for a server
                self._answered.notify_all()

    async def _micro(self, k: int, g: int, batch: tuple, total: int) -> float:
        S = self.cfg.num_stages
        inputs: list[dict[str, Any]] = []
        x: dict[str, Any] = {}
        for j in range(S - 1):
            inputs.append(x)
            x, _ = await self._call(j, "forward", k, g, batch, total, x)
        inputs.append(x)
        grads: dict[str, torch.Tensor] | None = None
        loss = None
        for j in range(S - 1, -1, -1):
            try:
                out, meta = await self._call(j, "backward", k, g, batch, total, inputs[j], grads)
            except StepTaken:
                if j == 0 and loss is not None:
                    # a call sent again (the first answer was lost): the first stage counted
                    # the micro-batch, and its answer carries nothing a stage needs
                    self.log(f"stage 0 took step {k} before answering micro-batch {g}'s "
                             f"backward again: it was counted")
                    break
                raise PeerError(f"stage {j} took step {k} before answering micro-batch {g}'s "
                                f"backward (its first answer was lost); the gradients stage "
                                f"{j - 1} needs are gone with it: restart the trainer") from None
            if j == S - 1:
                loss = meta["loss"]
            grads = out
        return float(loss)

    async def _call(self, j: int, kind: str, k: int, g: int, batch: tuple, total: int,
                    values: dict[str, Any], grads: dict[str, torch.Tensor] | None = None,
                    avoid: set[str] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """One call to some server of stage j, retried on others until one answers."""
        cfg = self.cfg
        avoid = set(avoid or ())
        samples = int(batch[0].shape[0])
        request = self._request(j, k, g, batch, total, values, grads)
        deadline = time.monotonic() + cfg.servers_timeout_s
        stale = 0  # calls refused for naming another attempt than the server's
        while True:
            now = time.monotonic()
            peer = self.router.choose(j, samples, now, avoid, cfg.max_in_flight)
            if peer == FULL:  # the stage has servers, all busy: no "no server" time runs
                deadline = time.monotonic() + cfg.servers_timeout_s
                async with self._answered:
                    try:
                        await asyncio.wait_for(self._answered.wait(), ROUTES_S)
                    except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
                        pass
                continue
            if peer is None:
                if now > deadline:
                    raise PeerError(f"no server of stage {j} under DHT prefix {cfg.prefix!r} "
                                    f"answered within {cfg.servers_timeout_s:.0f} s")
                await asyncio.sleep(0.3)
                records = await asyncio.get_running_loop().run_in_executor(None, self._records)
                self.router.refresh(records)
                avoid.clear()  # every server failed once: they may have come back
                continue
            # a backward names the server's attempt its gradients go to (atomc.swarm.records)
            attempt = self.router.attempt(j, peer)
            request.uid = str(attempt)
            try:
                response, t0 = await self._send(j, kind, peer, request, now)
            except Exception as e:  # noqa: BLE001 - any failure of a remote call: route elsewhere
                stale = await self._failed(e, j, kind, k, g, peer, attempt, stale, avoid)
                continue
            self.router.report(j, peer, time.monotonic() - t0, samples)
            self._stats.bytes_sent += message_bytes([request])
            self._stats.bytes_received += message_bytes([response])
            if kind == "backward":
                self._held[(j, g)] = _Held(peer, attempt, values, grads)
            return decode(response, torch.device("cpu"))

    def _request(self, j: int, k: int, g: int, batch: tuple, total: int, values: dict[str, Any],
                 grads: dict[str, torch.Tensor] | None) -> Any:
        """The call's message: the stage's inputs, the batch, the output gradients (backward)
        and what the server checks the call against."""
        cfg = self.cfg
        payload = dict(values)
        payload.update({f"{BATCH}{i}": t for i, t in enumerate(batch)})
        payload.update({f"{GRAD}{n}": t for n, t in (grads or {}).items()})
        samples = int(batch[0].shape[0])
        meta = {"step": k, "stage": j, "micro": g, "num_micro": total, "samples": samples,
                "id": f"{self.name}:{k}:{g}", "batch_len": len(batch),
                "package": self.node.fingerprint, "compress": cfg.compress}
        return encode(payload, meta, compress=cfg.compress)

    async def _send(self, j: int, kind: str, peer: str, request: Any,
                    now: float) -> tuple[Any, float]:
        """The server's answer to `request`, and when it was sent (monotonic seconds)."""
        try:
            wait = self.router.banned_for(j, peer, now)
            if wait > 0:  # every server of the stage is banned: not faster than 1 s
                await asyncio.sleep(min(wait, 1.0))
            stub = SwarmServicer.get_stub(self.node.p2p, PeerID.from_base58(peer),
                                          namespace=self.cfg.prefix)
            method = stub.rpc_forward if kind == "forward" else stub.rpc_backward
            t0 = time.monotonic()
            self._stats.calls += 1
            response = await asyncio.wait_for(
                self._exchange(method, request), self.cfg.request_timeout_s)
        finally:  # its place in flight is free, whatever became of the call
            self.router.answered(j, peer)
            async with self._answered:
                self._answered.notify_all()
        return response, t0

    async def _failed(self, e: Exception, j: int, kind: str, k: int, g: int, peer: str,
                      attempt: int, stale: int, avoid: set[str]) -> int:
        """Route around a call to `peer` that failed with `e` (banning it, or not, as the
        failure says; `avoid` gains the servers not to call again); StepTaken when the stage
        has taken the step. Returns the count of refusals for a stale attempt so far."""
        self._stats.retries += 1
        if isinstance(e, Refused) and e.taken:
            # the stage has taken the step: nothing of it is left to route (the callers say
            # what that means for this call)
            raise StepTaken(str(e)) from None
        if isinstance(e, Refused) and e.elsewhere:
            # it moved: not a fault, so no ban; no more calls to it for this stage until a
            # record shows it here (`refresh`)
            self.router.drop(j, peer)
            return stale
        said = e.attempt if isinstance(e, Refused) else None
        if said is not None and not e.held and stale < STALE_TRIES:
            # a trainer excluded an attempt of it: ours names the old one (call again at once
            # with its new one), or its next one before it has read that
            stale += 1
            if said > attempt:
                self.router.learn_attempt(j, peer, said)
            elif stale % STALE_TRUST == 0:
                # still behind after a few ticks: it never read our exclusion (it was for a
                # step it had taken already); its own word holds. Safe: a gradient it takes
                # under an attempt excluded later is sent again
                self.router.learn_attempt(j, peer, said, trust=True)
            else:
                await asyncio.sleep(STALE_WAIT_S)
            return stale
        if isinstance(e, (StreamClosed, P2PDaemonError)):
            self._report_gone(peer)
        span = self.router.ban(j, peer, time.monotonic())
        self.log(f"stage {j} server ...{peer[-6:]}: {kind} of micro-batch {g} failed "
                 f"({type(e).__name__}: {str(e).strip()[:160]}); banned for {span:.1f} s")
        if kind == "backward" and getattr(e, "held", True):
            # it may hold this gradient (a call lost on the way, or timed out): nothing of that
            # attempt may count; a server that refused says whether it holds it (in the
            # attempt it is on, which it names when ours is another)
            held_at = attempt if said is None else said
            await self._exclude(k, j, peer, held_at)
            self.router.learn_attempt(j, peer, held_at + 1)
        avoid.add(peer)
        return stale

    @staticmethod
    async def _exchange(method: Any, request: Any) -> Any:
        stream = await method(iter_as_aiter(split(request)))
        return check_refusal(join([part async for part in stream]))

    def _report_gone(self, peer: str) -> None:
        """The server could not be reached (no daemon to dial, or its stream died): unless it
        announces again within a second, servers and trainers drop its record then, not when
        it expires (which is what a SIGKILLed server's stage waits for before rebalancing,
        and its held micro-batches before they are sent again). In the background: the
        micro-batch goes elsewhere meanwhile."""
        if peer in self._reporting:
            return
        self._reporting.add(peer)
        done = asyncio.get_running_loop().run_in_executor(None, self._report_latest, peer)
        done.add_done_callback(lambda _: self._reporting.discard(peer))

    def _report_latest(self, peer: str) -> None:
        """Report the server's latest announcement gone, as a fresh read finds it: readers
        ignore a report of an announcement older than one they hold, and a live server
        announces every heartbeat, so the one our routes were last read from (up to a second
        old) would be ignored, and the swarm would wait for the dead server's record to
        expire."""
        try:
            # a fresh read (it honours no report yet)
            record = next((r for r in read_servers(self.node.dht, self.cfg.prefix)
                           if r.peer == peer), None)
            if record is not None:
                report_gone(self.node.dht, self.cfg.prefix, record, GONE_TTL_S)
        except Exception as e:  # noqa: BLE001 - the record then expires as it would have
            self.log(f"reporting ...{peer[-6:]} gone failed ({type(e).__name__}: {e})")

    async def _exclude(self, k: int, j: int, peer: str, attempt: int) -> None:
        await asyncio.get_running_loop().run_in_executor(
            None, exclude, self.node.dht, self.cfg.prefix, k, peer, j, attempt)

    async def _wait_for_commit(self, k: int, micro: list[tuple], total: int) -> None:
        """Until every stage has taken step k; backward calls held by servers that failed
        (excluded by any trainer, or whose record expired) are sent again."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.cfg.step_timeout_s
        while True:
            records = await loop.run_in_executor(None, self._records)
            done = {r.stage for r in records if r.step > k and not r.moving}
            if len(done) == self.cfg.num_stages:
                return
            excluded = await loop.run_in_executor(None, read_excluded, self.node.dht,
                                                  self.cfg.prefix, k)
            live = {r.peer for r in records}  # a record counts until it expires (Roster)
            gone = {h.peer for h in self._held.values()} - live
            self.router.refresh(records)
            lost = [(j, g) for (j, g), h in self._held.items() if j not in done and (
                (h.peer, j, h.attempt) in excluded or h.peer in gone)]
            for j, g in lost:
                h = self._held.pop((j, g))
                if (h.peer, j, h.attempt) not in excluded:
                    await self._exclude(k, j, h.peer, h.attempt)
                    excluded.add((h.peer, j, h.attempt))
                self.router.learn_attempt(j, h.peer, h.attempt + 1)
                self.log(f"stage {j}: server ...{h.peer[-6:]} failed holding micro-batch {g} "
                         f"of step {k}; sending it again")
                self._stats.resent += 1
                m = g - self.cfg.first_micro
                try:
                    await self._call(j, "backward", k, g, micro[m], total, h.inputs, h.grads,
                                     avoid={h.peer})
                except StepTaken:
                    # its server was alive after all (its record missed a read) and the stage
                    # took the step with it: the next read shows the stage done
                    self.log(f"stage {j} took step {k} meanwhile: micro-batch {g} was counted")
            if time.monotonic() > deadline:
                raise PeerError(f"step {k} was not taken by stages "
                                f"{sorted(set(range(self.cfg.num_stages)) - done)} within "
                                f"{self.cfg.step_timeout_s:.0f} s")
            await asyncio.sleep(0.05)  # one DHT read: cheap, and every step waits on it

    def close(self) -> None:
        self.node.close(self.log)


__all__ = ["Router", "StepStats", "SwarmTrainer", "TrainConfig"]
