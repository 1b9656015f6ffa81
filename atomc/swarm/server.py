"""SWARM server: one pipeline stage of a generated package, served over hivemind's p2p RPC.

input:  a generated package, the number of stages, the stage to serve (or the one that needs a
        server most), the global batch (samples over all trainers per step), the DHT to join
output: forward and backward calls for that stage from any trainer; one optimizer step per
        global batch, the same on every server of the stage

A call carries one micro-batch (its step, its index in the global batch, the stage's input
values and RNG state, the batch, and for a backward the output gradients). A stage computes
with the runtime core's `Stage` (resident, or swapped with `swap=True`).

The server is built from parts, each in its own module and each given what it reads when it
is made, as hivemind's `moe.server.Server` is built from its connection handlers, runtime and
checkpoint saver:

- the node (`node`): the DHT, the package split into stages, the p2p event loop;
- the step's sums (`sums`): the gradients held of the current step, and the lock over them and
  the stage, shared by the parts below;
- the stage state (`state`): the stage, its updates, downloads and checkpoints;
- the call handler (`calls`) and the rate it measures: forward and backward calls;
- the step commit (`commit`): the stage's averaging group and the decision to step;
- the rebalancer (`rebalance`): which stage to move to, decided on its own thread;
- the p2p handlers (`servicer`), which hand each call to its part.

This module wires them, runs the serving loop (heartbeats, commits, moves) and composes the
record the server announces.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
from hivemind.utils import get_dht_time

from atomc.runtime.optim import AdamWConfig
from atomc.stages.base import Stage, stage_dtype
from atomc.stages.make import make_stage
from atomc.swarm.calls import CallHandler, ServerRate
from atomc.swarm.commit import StepCommit, exclude
from atomc.swarm.config import ServeConfig
from atomc.swarm.metrics import Metrics
from atomc.swarm.node import SwarmNode
from atomc.swarm.rebalance import Rebalancer, stage_in_need
from atomc.swarm.records import Roster, ServerRecord, read_servers, servers_key
from atomc.swarm.servicer import SwarmServicer
from atomc.swarm.state import StageState
from atomc.swarm.sums import StepSums


class SwarmServer:
    """One server (see the module docstring)."""

    def __init__(self, cfg: ServeConfig, *, loss_fn: Callable | None = None,
                 initial_state: dict[str, torch.Tensor] | None = None,
                 log: Callable[[str], None] = print):
        self.cfg, self.log = cfg, log
        emulating = None if cfg.slowdown is None else f"--slowdown {cfg.slowdown:g}"
        node = self.node = SwarmNode(cfg.package, cfg.num_stages, cfg.initial_peers,
                                     cfg.host_maddrs, cfg.announce_maddrs, cfg.connect_timeout_s,
                                     "server", emulating)
        pkg = node.pkg
        loss_fn = loss_fn or pkg.model_loss_fn()
        opt_cfg = AdamWConfig.coerce(cfg.optimizer)
        dtype = stage_dtype(cfg.dtype)
        device = torch.device(cfg.device)

        def build(j: int) -> Stage:
            return make_stage(cfg.swap, pkg, node.specs[j], device, loss_fn, opt_cfg,
                              dtype=dtype, seed=cfg.seed)

        self.closing = threading.Event()
        self.wake = threading.Event()  # the serving loop looks now, not at its next tick
        self.announce_soon = False  # the serving loop announces at its next look
        self.last_beat = 0.0  # when the record was last announced (time.monotonic)
        self.metrics = Metrics(cfg.metrics_path, cfg.name, node.peer)
        self.sums = StepSums()
        self.state = StageState(
            node, self.sums, build, sums_dtype=dtype or torch.float32,
            initial_state=(initial_state if initial_state is not None
                           else pkg.initial_state_dict(cfg.seed)),
            delayed_updates=cfg.delayed_updates, checkpoint_dir=cfg.checkpoint_dir,
            prefix=cfg.prefix, name=cfg.name, connect_timeout_s=cfg.connect_timeout_s, log=log)
        self.rate = ServerRate(node.costs, cfg.rate_window_s)
        self.calls = CallHandler(
            self.state, self.sums, self.rate, peer=node.peer, fingerprint=node.fingerprint,
            name=cfg.name, device=device, request_wait_s=cfg.request_wait_s,
            slowdown=cfg.slowdown, profile_times=node.call_times, closing=self.closing,
            on_gradients=self._gradients_added)
        self.commit = StepCommit(
            node, self.state, self.sums, prefix=cfg.prefix, name=cfg.name,
            target_batch_size=cfg.target_batch_size, matchmaking_s=cfg.matchmaking_s,
            averaging_timeout_s=cfg.averaging_timeout_s, announce=self._announce,
            metrics=self.metrics, log=log)
        self.rebalancer = None if cfg.rebalance_s is None else Rebalancer(
            node.dht, cfg.prefix, node.peer, num_stages=cfg.num_stages,
            period_s=cfg.rebalance_s, min_gain=cfg.min_gain, costs=node.costs, view=self._view,
            wake=self.wake.set, closing=self.closing, log=log)
        self.maddrs = [str(a) for a in node.dht.get_visible_maddrs()]
        if cfg.maddr_path:
            from atomc.jsonio import write_atomic

            write_atomic(cfg.maddr_path, "\n".join(self.maddrs) + "\n")
        servicer = SwarmServicer(self.calls.answer, self.commit.contribution,
                                 self.state.state_message)
        node.run(servicer.add_p2p_handlers(node.p2p, namespace=cfg.prefix))
        node.servers(cfg.prefix)  # servers of another package must not share this prefix
        self._enter(cfg.stage if cfg.stage is not None
                    else stage_in_need(node.dht, cfg.prefix, node.peer, cfg.num_stages))

    def _gradients_added(self) -> None:
        """A backward call added to the step's sums: the stage may hold its batch now, so the
        serving loop announces it and looks for a commit at once."""
        self.announce_soon = True
        self.wake.set()

    def _enter(self, j: int) -> None:
        """Serve stage j: build it, join its averaging group, take its latest state from a
        server of the stage (or the checkpoint directory; the initial weights at step 0)."""
        t0 = time.monotonic()
        self.state.enter(j)
        self.rate.enter(self.state.spec, [r for r in read_servers(self.node.dht, self.cfg.prefix)
                                          if r.peer != self.node.peer])
        self.commit.join(j)
        source = self.state.load(j)
        self._announce()
        spec = self.state.spec
        self.log(f"serving stage {j} (sub-models {spec.start}..{spec.stop - 1}) at "
                 f"step {self.sums.step}, state from {source}, in {time.monotonic() - t0:.1f} s")
        self.metrics.write({"event": "enter", "stage": j, "step": self.sums.step,
                            "source": source})

    def _move(self, to: int) -> None:
        """Leave the stage for stage `to`: hand the state over, void what we hold of the step
        (the trainers send it to the stage's other servers again), and enter `to`."""
        state, sums = self.state, self.sums
        state.hand_over(self.cfg.averaging_timeout_s, self.closing)
        self.metrics.write({"event": "move", "from": state.spec.index, "to": to})
        state.start_move(to)
        self._announce()
        if sums.ids:
            exclude(self.node.dht, self.cfg.prefix, sums.step, self.node.peer, state.spec.index,
                    sums.attempt)
        state.leave()
        self.commit.leave()
        self._enter(to)

    def record(self) -> ServerRecord:
        """What the server announces now. While it moves it is announced at the stage it goes
        to (so that no second server is sent to the same gap), holding nothing there yet."""
        rate, measured = self.rate.announced()
        state = self.state
        stage = state.moving_to if state.moving else state.spec.index
        return ServerRecord(self.node.peer, self.cfg.name, stage, self.sums.step,
                            0 if state.moving else self.sums.samples(), rate, self.calls.queue,
                            self.node.fingerprint, state.started, state.moving, measured,
                            self.sums.attempt, self.rate.served_on(self.cfg.num_stages),
                            float(get_dht_time()))

    def _announce(self) -> None:
        now = get_dht_time()
        self.node.dht.store(servers_key(self.cfg.prefix), subkey=self.node.peer,
                            value=self.record().to_value(),
                            expiration_time=now + self.cfg.expiration_s)

    def serve(self, stop: threading.Event | None = None, max_seconds: float | None = None) -> None:
        """Heartbeats, commits and rebalancing until `stop` is set (or `max_seconds`)."""
        t0 = time.monotonic()
        last_load = 0.0
        self.last_beat = 0.0
        threading.Thread(target=self._beat_while_busy, daemon=True, name="swarm-beat").start()
        if self.rebalancer is not None:
            threading.Thread(target=self.rebalancer.run, daemon=True,
                             name="swarm-rebalance").start()
        while not (stop is not None and stop.is_set()):
            if max_seconds is not None and time.monotonic() - t0 > max_seconds:
                break
            now = time.monotonic()
            if now - self.last_beat >= self.cfg.heartbeat_s or self.announce_soon:
                self.announce_soon = False
                self.last_beat = now
                self._announce()
            if self.metrics.on and now - last_load >= 1.0:
                rec = self.record()  # what it announces, once a second (bench/swarm_bench.py)
                self.metrics.write({"event": "load", "stage": rec.stage, "step": rec.step,
                                    "throughput": rec.throughput, "queue": rec.queue,
                                    "moving": rec.moving, "measured": rec.measured})
                last_load = now
            self.commit.try_commit(self._view())
            if self.rebalancer is not None and self.rebalancer.move_to is not None:
                self._move(self.rebalancer.move_to)
                self.rebalancer.moved()
            self.wake.wait(0.1)  # a tick, or sooner when a backward call finishes
            self.wake.clear()

    def _view(self, roster: Roster | None = None) -> list[ServerRecord]:
        """The servers as this one sees them (a record one DHT read missed counts until it
        expires: else a stage looks empty for a moment and a server moves there for nothing),
        and our own record as it is now, not as last announced. `roster`: whose reads (the
        node's by default; another thread keeps its own)."""
        others = (roster or self.node.roster(self.cfg.prefix)).read()
        return [r for r in others if r.peer != self.node.peer] + [self.record()]

    def _beat_while_busy(self) -> None:
        """Heartbeats while the serving loop is held up (averaging, a state download, a move:
        each can outlast the record's expiration, and trainers drop the gradients of a server
        whose record expired)."""
        while not self.closing.is_set():
            time.sleep(self.cfg.heartbeat_s / 2)
            if time.monotonic() - self.last_beat >= self.cfg.heartbeat_s:
                self.last_beat = time.monotonic()
                try:
                    self._announce()
                except Exception as e:  # noqa: BLE001 - the next beat tries again
                    self.log(f"heartbeat failed ({type(e).__name__}: {e})")

    def close(self) -> None:
        self.closing.set()
        with self.sums.cv:
            self.sums.cv.notify_all()
        self.calls.close()
        self.commit.close()
        self.state.close()
        self.node.close(self.log)


__all__ = ["SwarmServer"]
