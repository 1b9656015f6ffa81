"""SWARM server: one pipeline stage of a generated package, served over hivemind's p2p RPC.

input:  a generated package, the number of stages, the stage to serve (or the one that needs a
        server most), the global batch (samples over all trainers per step), the DHT to join
output: forward and backward calls for that stage from any trainer; one optimizer step per
        global batch, the same on every server of the stage

A call carries one micro-batch (its step, its index in the global batch, the stage's input
values and RNG state, the batch, and for a backward the output gradients). The backward
recomputes the forward from the inputs it is sent, so any server of the stage can run it
(SWARM's design): nothing of a micro-batch stays on a server between calls. A stage computes
with the runtime core's `Stage` (resident, or swapped with `swap=True`), one call at a time
on a worker thread; the p2p event loop only moves bytes.

A step commits when the stage's servers together hold the gradients of exactly the global
batch, each micro-batch once. Each server sums the gradients of the micro-batches it ran. The
servers that are ready form a group with hivemind's `DecentralizedAverager` (its matchmaking
and all-gather of the ids of their micro-batches), then each fetches the others' sums over
p2p (streamed in parts) and adds them in peer order. The sum is ordered, so every member gets
the same bits: hivemind's all-reduce hands each member the average as a delta to its own
tensor, which rounds differently on each, and servers of one stage would drift apart. Every
member sees the same gathered ids, so all decide alike: apply the step when the ids cover the
global batch with no repeats and no member's attempt is excluded (`records`), otherwise keep
their sums and try again (a dead server's micro-batches come back from the trainers). A call
that is refused (wrong step, stage or attempt) is answered with the reason, so the trainer logs
the server's words. A server that missed the round downloads the stage's state from one that
took it (`rpc_state`, from the server furthest ahead first), as does a server that joins or
moves to the stage. It asks the servers its roster holds, by name: the averager's own state
sharing found them through records its process declared every second, and twice on a loaded
CI box a joining server found none within 20 s while its stage's server was up and serving.
BatchNorm statistics are updated by the forward call only (the backward's recomputation
runs on copies of them: the interpreter's buffer rule) and averaged at the commit. With
delayed parameter updates, a copy of the stage takes each update on another thread while the
calls of the next step compute with the weights before it.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

# hivemind recognises streaming handlers by typing's AsyncIterator, not collections.abc's
from typing import Any, AsyncIterator  # noqa: UP035

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from atomc.distributed.peer import state_bytes, state_from_bytes
from atomc.distributed.runner import _dtype
from atomc.distributed.stage import LayoutStage, make_stage
from atomc.errors import PeerError, UsageError
from atomc.runtime.checkpoint import digest
from atomc.runtime.optim import AdamWConfig
from atomc.swarm import balance
from atomc.swarm.node import SwarmNode, stage_specs
from atomc.swarm.records import (
    Roster,
    ServerRecord,
    excluded_key,
    excluded_subkey,
    read_excluded,
    read_servers,
    servers_key,
)
from atomc.swarm.wire import (
    NotHere,
    StepTaken,
    WrongAttempt,
    check_refusal,
    decode,
    encode,
    join,
    refusal,
    split,
)

GUESS_S = 30.0  # rebalancing waits this long at most for a new server's first measured rate
READ_AHEAD_S = 0.25  # servers read the DHT this long before each decision moment
EVENT_TICK_S = 0.5  # between periods, servers look this often for a swarm that changed
BATCH = "atomc.batch."  # batch tensors travel as atomc.batch.0, atomc.batch.1, ...
GRAD = "atomc.grad."  # output gradients of a backward call


@dataclass
class ServeConfig:
    package: str | Path
    num_stages: int
    stage: int | None = None  # None: the stage that needs a server most
    target_batch_size: int = 8  # samples per step over all trainers (the global batch)
    prefix: str = "atomc-swarm"
    initial_peers: tuple[str, ...] = ()
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    device: str = "cpu"
    dtype: str | None = None  # master dtype (float64 for exact tests)
    seed: int = 0  # initial weights, as build_model makes them under manual_seed(seed)
    optimizer: dict[str, Any] | None = None
    swap: bool = False  # the swap runtime's stage (sub-models loaded one at a time)
    heartbeat_s: float = 0.5
    expiration_s: float = 4.0  # a server that stops refreshing its record drops out after this
    rebalance_s: float | None = None  # SWARM's T: None, no rebalancing
    min_gain: float = 0.0  # a move must raise the lower stage throughput by this fraction
    rate_window_s: float = 10.0  # throughput: over about the last this many seconds of calls
    matchmaking_s: float = 1.0
    averaging_timeout_s: float = 20.0
    connect_timeout_s: float = 20.0
    request_wait_s: float = 30.0  # a call for a step this server has not reached waits this long
    slowdown: float | None = None  # emulate a device this many times slower than the profiled
    delayed_updates: bool = False  # DPU: the optimizer step overlaps the next step's calls
    checkpoint_dir: str | Path | None = None  # the stage's state after every step (shared dir)
    name: str = ""
    maddr_path: str | Path | None = None
    metrics_path: str | Path | None = None

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise UsageError(f"--stages {self.num_stages} must be at least 1")
        if self.stage is not None and not 0 <= self.stage < self.num_stages:
            raise UsageError(f"--stage {self.stage} is not one of the {self.num_stages} stages "
                             f"(0 to {self.num_stages - 1}); or give --stage auto")
        if self.target_batch_size < 1:
            raise UsageError(f"--target-batch-size {self.target_batch_size} must be at least 1")
        if self.slowdown is not None and not self.slowdown > 0:
            raise UsageError(f"--slowdown {self.slowdown:g} must be more than 0")
        if self.min_gain < 0:
            raise UsageError(f"--min-gain {self.min_gain} must be 0 or more")
        if not self.rate_window_s > 0:
            raise UsageError(f"--rate-window {self.rate_window_s} must be more than 0 seconds")
        if self.delayed_updates and self.swap:
            raise UsageError("--delayed-updates keeps a second copy of the stage's weights and "
                             "optimizer for the update in flight, and --swap serves a stage that "
                             "does not fit in memory once; choose one of the two")


class StateNotShared(PeerError):
    """Servers of the stage were there, and none shared its state in time."""


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


class SwarmServicer(ServicerBase):
    """The p2p handlers; the work is the server's."""

    def __init__(self, server: SwarmServer):
        self.server = server

    # forward and backward stream both ways: a stage's activations outgrow one p2p message
    async def rpc_forward(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                          context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        for part in split(await self.server.answer("forward", requests)):
            yield part

    async def rpc_backward(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                           context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        for part in split(await self.server.answer("backward", requests)):
            yield part

    async def rpc_contribution(self, request: runtime_pb2.ExpertUID,
                               context: P2PContext) -> AsyncIterator[runtime_pb2.Tensor]:
        for part in self.server.contribution(int(request.uid)):
            yield part

    async def rpc_state(self, request: runtime_pb2.ExpertUID,
                        context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """The stage's state for a server that joins it, moves to it or fell behind; a
        refusal, in the server's words, when it does not hold that stage's state now."""
        try:
            msg = await asyncio.get_running_loop().run_in_executor(
                None, self.server.state_message, int(request.uid))
        except Exception as e:  # noqa: BLE001 - told to the caller, who asks another server
            msg = refusal(e, held=False)
        for part in split(msg):
            yield part


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


class SwarmServer(SwarmNode):
    """One server (see the module docstring)."""

    def __init__(self, cfg: ServeConfig, *, loss_fn: Callable | None = None,
                 initial_state: dict[str, torch.Tensor] | None = None,
                 log: Callable[[str], None] = print):
        emulating = None if cfg.slowdown is None else f"--slowdown {cfg.slowdown:g}"
        super().__init__(cfg.package, cfg.num_stages, cfg.initial_peers, cfg.host_maddrs,
                         cfg.announce_maddrs, cfg.connect_timeout_s, "server", emulating)
        self.cfg = cfg
        self.log = log
        self.loss_fn = loss_fn or self.pkg.model_loss_fn()
        self.initial_state = (initial_state if initial_state is not None
                              else self.pkg.initial_state_dict(cfg.seed))
        self.opt_cfg = AdamWConfig.coerce(cfg.optimizer)
        self.dtype = _dtype(cfg.dtype)
        self.device = torch.device(cfg.device)
        self.cv = threading.Condition()  # guards the stage, its step and its gradient sums
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="swarm-compute")
        self.queue = 0
        self.call_time: dict[str, CallTime] = {}  # call kind -> its time per sample
        self.carried_rate: float | None = None  # measured on the stage it served before
        self.served: dict[int, float] = {}  # stage -> its rate there when it last left it
        self.moving_to: int | None = None  # the stage it is moving to (announced as its stage)
        self.closing = False
        self.moving = False
        self.sharing = False  # holds its stage's state: others may download it
        self.announce_soon = False
        self.wake = threading.Event()  # a backward call finished: the serving loop looks now
        # of the gradients it holds; an exclusion voids one (records). Never reused, not even
        # across steps or stages, so that no old exclusion can match a new attempt
        self.attempt = 0
        self.measured_since: float | None = None  # when this server first saw a measured rate
        self.move_to: int | None = None  # the stage rebalancing decided we move to
        self.stage: LayoutStage | None = None
        # the stage whose optimizer steps (the stage itself, or DPU's copy)
        self.master: LayoutStage | None = None
        self.pending: Any = None  # DPU: the update in flight
        self.updater = ThreadPoolExecutor(1, thread_name_prefix="swarm-update")
        self.averager: Any = None
        self.maddrs = [str(a) for a in self.dht.get_visible_maddrs()]
        if cfg.maddr_path:
            from atomc.jsonio import write_atomic

            write_atomic(cfg.maddr_path, "\n".join(self.maddrs) + "\n")
        self.run(SwarmServicer(self).add_p2p_handlers(self.p2p, namespace=cfg.prefix))
        self.servers(cfg.prefix)  # servers of another package must not share this prefix
        self._enter(cfg.stage if cfg.stage is not None else self._stage_in_need())

    # ---- plumbing ------------------------------------------------------------------------------

    def _metric(self, line: dict[str, Any]) -> None:
        if self.cfg.metrics_path is None:
            return
        line = {"server": self.cfg.name, "peer": self.peer, "time": time.time(), **line}
        with open(self.cfg.metrics_path, "a") as f:
            f.write(json.dumps(line) + "\n")

    # ---- stages --------------------------------------------------------------------------------

    def _stage_in_need(self) -> int:
        servers = [balance.ServerLoad(r.peer, r.stage, r.throughput, r.queue)
                   for r in read_servers(self.dht, self.cfg.prefix)
                   if r.peer != self.peer]  # one moving counts where it goes
        return balance.choose_join_stage(servers, self.cfg.num_stages)

    def _build_stage(self, j: int) -> LayoutStage:
        return make_stage(self.cfg.swap, self.pkg, self.specs[j], self.device, self.loss_fn,
                          self.opt_cfg, dtype=self.dtype, seed=self.cfg.seed)

    def _enter(self, j: int) -> None:
        """Serve stage j: build it, join its averaging group, take its latest state from a
        server of the stage (or the checkpoint directory; the initial weights at step 0)."""
        t0 = time.monotonic()
        if self.stage is not None:  # moving: what it measured there before stands in, or
            # what it measured on its last stage at the new stage's cost
            old = self._measured_rate()
            if old is not None:
                self.served[self.spec.index] = old
            old = old or self.carried_rate
            self.carried_rate = self.served.get(j) or (
                old and old * self.costs[self.spec.index] / self.costs[j])
        stage = self._build_stage(j)
        self.params = stage.named_parameters()
        sizes = [p.numel() for _, p in self.params]
        master = self.dtype or torch.float32
        self.acc = torch.zeros(sum(sizes), dtype=master)
        self.ids: dict[str, int] = {}
        self.excluded: set[tuple[str, int, int]] = set()  # this step's, last read from the DHT
        self.float_buffers = [b for b in stage.buffers().values() if b.is_floating_point()]
        self.step = 0
        self.stage = stage
        # DPU: calls compute with the weights before the last step's update while a copy of
        # the stage (its optimizer with it) takes that update in the background
        self.master = self._build_stage(j) if self.cfg.delayed_updates else stage
        self.pending = None
        self.spec = self.specs[j]
        self.started = float(get_dht_time())
        rates = [r.throughput * self.costs[r.stage] / self.costs[j]
                 for r in read_servers(self.dht, self.cfg.prefix)
                 if r.peer != self.peer and r.throughput > 0 and r.stage < len(self.costs)]
        self.prior_rate = sum(rates) / len(rates) if rates else 1.0
        # measured anew on this stage: stages need not cost the same
        self.call_time = {k: CallTime(self.cfg.rate_window_s) for k in ("forward", "backward")}
        self.offers: dict[int, torch.Tensor] = {}  # step -> our sums (and buffers) offered
        # the averager forms groups and gathers their ids; the sums travel by rpc_contribution
        self.averager = self._make_averager(j, [torch.zeros(1)])
        # no one may download from it before it holds the stage's state (it would hand out
        # the initial weights as the stage's, at step 0)
        self.sharing = False
        source = self._load_state(j)
        self.sharing = True
        self.moving, self.moving_to = False, None
        self._announce()
        self.log(f"serving stage {j} (sub-models {self.spec.start}..{self.spec.stop - 1}) at "
                 f"step {self.step}, state from {source}, in {time.monotonic() - t0:.1f} s")
        self._metric({"event": "enter", "stage": j, "step": self.step, "source": source})

    def _make_averager(self, j: int, tensors: list[torch.Tensor]) -> Any:
        cfg = self.cfg
        # state travels by rpc_state: the averager neither declares nor serves it
        return self.hm.averaging.DecentralizedAverager(
            tensors, self.dht, start=True, prefix=f"{cfg.prefix}_stage{j}", min_group_size=2,
            min_matchmaking_time=cfg.matchmaking_s,
            request_timeout=max(0.5, cfg.matchmaking_s / 2),
            allreduce_timeout=cfg.averaging_timeout_s, next_chunk_timeout=10.0,
            client_mode=False, allow_state_sharing=False)

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
            from atomc.runtime.checkpoint import load_checkpoint

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
        from atomc.runtime.checkpoint import save_checkpoint

        save_checkpoint(path, state)

    # ---- calls ---------------------------------------------------------------------------------

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

    # ---- the step ------------------------------------------------------------------------------

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

    # ---- load and rebalancing ------------------------------------------------------------------

    def _measured_rate(self) -> float | None:
        """Samples/s of the stage's whole work (a micro-batch costs a forward and a backward
        call at every stage but the last, whose backward call is its forward too); None until
        it has served both on this stage."""
        kinds = ("backward",) if self.spec.holds_output else ("forward", "backward")
        known = [self.call_time[k].per_sample() for k in kinds]
        return None if None in known else 1.0 / sum(known)

    def record(self) -> ServerRecord:
        # until it has served on this stage, a server counts at the rate it had on its last
        # one (stages are taken to cost the same), or, new, as fast as the others (it joined
        # to help); meanwhile it is not moved again (balance.ServerLoad.loading)
        rate = self._measured_rate()
        measured = rate is not None
        if rate is None:
            rate = self.carried_rate or self.prior_rate
        # moving: announced at the stage it goes to (so that no second server is sent to the
        # same gap), holding nothing there yet
        stage = self.moving_to if self.moving_to is not None else self.spec.index
        served = tuple(self.served.get(t, 0.0) for t in range(self.cfg.num_stages))
        return ServerRecord(self.peer, self.cfg.name, stage, self.step,
                            0 if self.moving else sum(self.ids.values()), rate, self.queue,
                            self.fingerprint, self.started, self.moving, measured,
                            self.attempt, served, float(get_dht_time()))

    def _announce(self) -> None:
        now = get_dht_time()
        self.dht.store(servers_key(self.cfg.prefix), subkey=self.peer,
                       value=self.record().to_value(), expiration_time=now + self.cfg.expiration_s)

    def _decide(self) -> None:
        """Rebalancing decisions (its own thread): every server decides at the same moments,
        the multiples of T in DHT time, each from the servers as it read them just before.
        A plan of several moves then starts at once on all its servers: deciding one by one,
        the first to move held the others back (its rate was a guess until it served), and a
        server busy averaging at its turn lagged behind. Between those moments servers read
        the DHT every EVENT_TICK_S and decide at the next tick when the swarm itself changed
        (a server left or joined, or a new one's rate became known): waiting up to T for a
        stage emptied by a kill or for a newcomer cost a run on real processes 3-6 s at half
        throughput per event. Rates drifting is not such a change: that waits for T. The move
        itself runs in the serving loop, when it is free (`_move`)."""
        period = self.cfg.rebalance_s
        tick = min(period, EVENT_TICK_S)
        roster = Roster(self.dht, self.cfg.prefix)  # this thread's own reads (and state)
        swarm_then: frozenset | None = None  # the swarm at the last decision
        period_then = period_of(get_dht_time(), period)  # the period of the last decision
        while not self.closing:
            t = get_dht_time()
            boundary = (t // tick + 1) * tick
            time.sleep(max(0.0, boundary - min(READ_AHEAD_S, tick / 2) - t))
            try:
                view = self._view(roster)
            except Exception as e:  # noqa: BLE001 - the next period reads again
                self.log(f"rebalancing: reading the servers failed ({type(e).__name__}: {e})")
                continue
            time.sleep(max(0.0, boundary - get_dht_time()))
            if self.moving or self.move_to is not None or self.closing:
                continue
            swarm_now = frozenset((r.peer, r.measured) for r in view if not r.moving)
            # the first tick of each period (a late tick, after a slow read, still counts)
            now_period = period_of(boundary, period)
            if now_period <= period_then and swarm_now == swarm_then:
                continue
            swarm_then, period_then = swarm_now, now_period
            try:
                move = self._choose_move(view)
            except Exception as e:  # noqa: BLE001 - a bad record must not end rebalancing
                self.log(f"rebalancing: no decision ({type(e).__name__}: {e})")
                continue
            if move is not None:
                self.log(f"rebalancing: {move}")
                self.move_to = move.to_stage
                self.wake.set()

    def _choose_move(self, servers: list[ServerRecord]) -> balance.Move | None:
        """Our move in the plan for `servers` (balance.plan_moves, or for a large swarm
        SWARM's Algorithm 2), or None."""
        now = get_dht_time()
        if self.measured_since is None and any(r.measured for r in servers):
            self.measured_since = now  # training has begun
        empty = len({r.stage for r in servers}) < self.cfg.num_stages
        if not empty and (self.measured_since is None or any(
                r.moving or (not r.measured
                             and now - max(r.started, self.measured_since) < GUESS_S)
                for r in servers)):
            # a server that moved or joined, or waited for the first trainer, has a guessed
            # throughput until it has served (at the very start, 1 sample/s): decisions on
            # guesses moved servers for nothing. One that gets no calls for GUESS_S (failing,
            # say) is not waited for, and an empty stage waits for nothing
            return None
        # one not yet measured on its stage counts where it is announced and is not moved
        loads = [balance.ServerLoad(r.peer, r.stage, r.throughput, r.queue,
                                    r.moving or not r.measured, r.served) for r in servers]
        plan = balance.plan_moves(loads, self.cfg.num_stages, self.cfg.min_gain, self.costs)
        if plan is None:  # too many servers to search: SWARM's one move per period
            one = balance.choose_move(loads, self.cfg.num_stages, self.cfg.min_gain, self.costs)
            plan = [one] if one is not None else []
        return next((m for m in plan if m.peer == self.peer), None)

    def _hand_over(self) -> None:
        """Before leaving a stage, let its servers that are behind us take our state: a
        server that took a step alone and moved on left the others a step behind with no one
        to catch up from (only the checkpoint held it), and the trainer waited for a step
        the stage had lost. Bounded: a server that does not catch up is not waited for."""
        deadline = time.monotonic() + self.cfg.averaging_timeout_s
        while time.monotonic() < deadline and not self.closing:
            behind = [r for r in self._sharers(self.spec.index) if r.step < self.step]
            if not behind:
                return
            time.sleep(0.2)
        self.log(f"leaving stage {self.spec.index} at step {self.step} with servers behind it")

    def _move(self, to: int) -> None:
        self._hand_over()
        self._metric({"event": "move", "from": self.spec.index, "to": to})
        self.moving, self.moving_to = True, to
        self._announce()
        if self.ids:  # what we hold of this step goes to the stage's other servers again
            exclude(self.dht, self.cfg.prefix, self.step, self.peer, self.spec.index,
                    self.attempt)
        with self.cv:
            old = self.averager
            self._finish_update()
            self.stage.close()
        old.shutdown()
        self.move_to = None
        self._enter(to)

    def serve(self, stop: threading.Event | None = None, max_seconds: float | None = None) -> None:
        """Heartbeats, commits and rebalancing until `stop` is set (or `max_seconds`)."""
        t0 = time.monotonic()
        last_load = 0.0
        self.last_beat = 0.0
        threading.Thread(target=self._beat_while_busy, daemon=True, name="swarm-beat").start()
        if self.cfg.rebalance_s is not None:
            threading.Thread(target=self._decide, daemon=True, name="swarm-rebalance").start()
        while not (stop is not None and stop.is_set()):
            if max_seconds is not None and time.monotonic() - t0 > max_seconds:
                break
            now = time.monotonic()
            if now - self.last_beat >= self.cfg.heartbeat_s or self.announce_soon:
                self.announce_soon = False
                self.last_beat = now
                self._announce()
            if self.cfg.metrics_path is not None and now - last_load >= 1.0:
                rec = self.record()  # what it announces, once a second (bench/swarm_bench.py)
                self._metric({"event": "load", "stage": rec.stage, "step": rec.step,
                              "throughput": rec.throughput, "queue": rec.queue,
                              "moving": rec.moving, "measured": rec.measured})
                last_load = now
            self._try_commit(self._view())
            if self.move_to is not None:
                self._move(self.move_to)
            self.wake.wait(0.1)  # a tick, or sooner when a backward call finishes
            self.wake.clear()

    def _view(self, roster: Roster | None = None) -> list[ServerRecord]:
        """The servers as this one sees them (a record one DHT read missed counts until it
        expires: else a stage looks empty for a moment and a server moves there for nothing),
        and our own record as it is now, not as last announced. `roster`: whose reads (the
        node's by default; another thread keeps its own)."""
        others = (roster or self.roster(self.cfg.prefix)).read()
        return [r for r in others if r.peer != self.peer] + [self.record()]

    def _beat_while_busy(self) -> None:
        """Heartbeats while the serving loop is held up (averaging, a state download, a move:
        each can outlast the record's expiration, and trainers drop the gradients of a server
        whose record expired)."""
        while not self.closing:
            time.sleep(self.cfg.heartbeat_s / 2)
            if time.monotonic() - self.last_beat >= self.cfg.heartbeat_s:
                self.last_beat = time.monotonic()
                try:
                    self._announce()
                except Exception as e:  # noqa: BLE001 - the next beat tries again
                    self.log(f"heartbeat failed ({type(e).__name__}: {e})")

    def close(self) -> None:
        self.closing = True
        with self.cv:
            self.cv.notify_all()
        self.pool.shutdown(wait=False, cancel_futures=True)
        try:
            if self.averager is not None:
                self.averager.shutdown()
        except Exception as e:  # noqa: BLE001 - shutting down: close the rest anyway
            self.log(f"averager shutdown failed: {e}")
        self.updater.shutdown(wait=True)  # an update in flight finishes (and checkpoints)
        if self.stage is not None:
            self.stage.close()
        self.close_node(self.log)


def period_of(t: float, period: float) -> int:
    """Which rebalancing period DHT time `t` is in: a server decides at the first tick of each
    (the same tick on every server, whatever T is)."""
    return math.floor(t / period + 1e-9)


def exclude(dht: Any, prefix: str, step: int, peer: str, stage: int, attempt: int,
            ttl_s: float = 600.0) -> None:
    """Record that `peer`'s gradients of `step` under `attempt` must not count (a trainer's
    call to it failed, or its record is gone)."""
    dht.store(excluded_key(prefix, step), subkey=excluded_subkey(peer, stage, attempt), value=True,
              expiration_time=get_dht_time() + ttl_s)


__all__ = ["ServeConfig", "SwarmServer", "SwarmServicer", "exclude", "stage_specs"]
