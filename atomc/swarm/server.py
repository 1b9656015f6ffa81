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

The server is composed of one part per job, each in its own module: the p2p handlers
(`servicer`), one call (`calls`), the stage's state and checkpoints (`state`), the step's
commit and averaging (`commit`) and rebalancing (`rebalance`); this module wires them to a DHT
node (`node`) and runs the serving loop.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from hivemind.utils import get_dht_time

from atomc.distributed.stage import LayoutStage, stage_dtype
from atomc.distributed.swapstage import make_stage
from atomc.runtime.optim import AdamWConfig
from atomc.swarm import balance
from atomc.swarm.calls import CallHandling, CallTime
from atomc.swarm.commit import StepCommit
from atomc.swarm.config import ServeConfig
from atomc.swarm.node import SwarmNode
from atomc.swarm.rebalance import Rebalancing
from atomc.swarm.records import Roster, ServerRecord, read_servers, servers_key
from atomc.swarm.servicer import SwarmServicer
from atomc.swarm.state import StageState


class SwarmServer(CallHandling, StageState, StepCommit, Rebalancing, SwarmNode):
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
        self.dtype = stage_dtype(cfg.dtype)
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

    def _metric(self, line: dict[str, Any]) -> None:
        if self.cfg.metrics_path is None:
            return
        line = {"server": self.cfg.name, "peer": self.peer, "time": time.time(), **line}
        with open(self.cfg.metrics_path, "a") as f:
            f.write(json.dumps(line) + "\n")

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


__all__ = ["SwarmServer"]
