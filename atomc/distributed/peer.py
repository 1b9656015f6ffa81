"""Peers, ATOM's decentralized mode (paper III-E): full model copies that average when the
collaboration has processed a global batch.

input:  a generated package (every peer trains a full copy with the swap runtime), a run id,
        any live peer's address (none for the first peer), the global batch (samples over all
        peers between two averaging rounds) and the number of rounds
output: local training steps; after every global batch a parameter-averaging round with every
        peer that is ready; a state any new peer can download; metrics per step and round

Built on hivemind (Learning@home): a DHT holds each peer's progress (samples since the last
round, heartbeat-like, expiring when a peer stops reporting); hivemind's `ProgressTracker` sums
it and says when the global batch is reached; hivemind's `DecentralizedAverager` forms a group
of the peers that are ready and all-reduces their weights (weighted by the samples each
contributed). A peer joins through any live peer and first downloads the current state (weights,
optimizer state, round) from one of them. A peer that dies leaves a round that fails for its
group (the others retry at the next round) and its progress entry expires; training goes on as
long as one peer is alive.

Every wait is bounded: DHT start-up (an initial peer that never answers is an error after
`connect_timeout_s`), state download, matchmaking and all-reduce.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from atomc.distributed.hive import import_hivemind, start_dht, state_bytes, state_from_bytes
from atomc.errors import PeerError, UsageError


@dataclass
class PeerConfig:
    package: str | Path
    run_id: str = "atomc"
    initial_peers: tuple[str, ...] = ()
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    target_batch_size: int = 64  # samples over all peers per averaging round (the global batch)
    rounds: int = 10  # stop after this many averaging rounds (global epochs)
    accum: int | None = None  # micro-batches per local step (default: the plan's C)
    optimizer: dict[str, Any] | None = None
    device: str = "cpu"
    dtype: str | None = None  # master dtype (default float32; float64 for tests)
    seed: int = 0
    matchmaking_time_s: float = 2.0  # how long a ready peer waits for others to join its group
    averaging_timeout_s: float = 30.0  # one round: matchmaking + all-reduce
    connect_timeout_s: float = 20.0  # DHT start-up and joining through the initial peers
    progress_expiration_s: float = 10.0  # a silent peer's progress stops counting after this
    max_seconds: float | None = None  # give up (error) when the run takes longer
    metrics_path: str | Path | None = None
    final_path: str | Path | None = None  # this peer's final weights (torch file)
    maddr_path: str | Path | None = None  # where to write this peer's address for others
    final_linger_s: float = 8.0  # after finishing: serve the final state to peers that are late
    finish_timeout_s: float = 60.0  # final rounds until one holds every live peer
    name: str = ""

    def __post_init__(self) -> None:
        if self.target_batch_size < 1:
            raise UsageError(f"--target-batch-size {self.target_batch_size} must be at least 1")
        if self.rounds < 1:
            raise UsageError(f"--rounds {self.rounds} must be at least 1")
        for a in self.initial_peers:
            if not a.startswith("/"):
                raise PeerError(f"initial peer {a!r} is not a multiaddress; give one another peer "
                                f"printed, e.g. /ip4/127.0.0.1/tcp/PORT/p2p/PEER_ID")


def round_vector(trainer: Any) -> torch.Tensor:
    """What a round averages, as one vector in the master dtype (float64 runs average in
    float64): every master weight, then every persistent buffer, so that BatchNorm's running
    statistics are averaged with the weights they belong to (as the weights' own rule, weighted
    by samples). Optimizer state stays local, as in ATOM."""
    buffers = trainer.persistent_buffers()  # first: it waits for the step's updates
    dtype = trainer.store.master_dtype
    store = trainer.store
    parts = [store.read_master(i).reshape(-1).to(dtype) for i in range(len(store.layouts))]
    parts += [b.detach().reshape(-1).to(dtype) for _, _, b in buffers]
    return torch.cat(parts)


def set_round_vector(trainer: Any, flat: torch.Tensor) -> None:
    """Load a vector `round_vector` laid out (averaged) into `trainer`; integer buffers (batch
    counters) take the rounded average."""
    buffers = trainer.persistent_buffers()
    state = trainer.state_dict()
    off = 0
    for i, m in enumerate(state["masters"]):
        n = m.numel()
        state["masters"][i] = flat[off:off + n].view_as(m).to(m.dtype)
        off += n
    for i, name, b in buffers:
        n = b.numel()
        value = flat[off:off + n].view_as(b)
        state["buffers"][i][name] = (value if b.is_floating_point() else value.round()).to(b.dtype)
        off += n
    trainer.load_state_dict(state, source="averaged weights")


def weights_digest(trainer: Any) -> str:
    from atomc.runtime.checkpoint import digest

    store = trainer.store
    return digest([store.read_master(i) for i in range(len(store.layouts))])


class PeerTrainer:
    """One peer (see the module docstring)."""

    def __init__(self, cfg: PeerConfig, *, loss_fn: Callable | None = None,
                 initial_state: dict[str, torch.Tensor] | None = None,
                 log: Callable[[str], None] = print):
        self.cfg = cfg
        self.log = log
        self.t_start = time.monotonic()
        self.hm = import_hivemind()
        from atomc.runtime import SwapTrainer

        self.trainer = SwapTrainer.from_package(
            cfg.package, device=cfg.device, accum=cfg.accum, optimizer=cfg.optimizer,
            dtype=cfg.dtype, seed=cfg.seed, loss_fn=loss_fn, state_dict=initial_state)
        self.samples_per_step = self.trainer.accum * self.trainer.micro_batch_size
        self.epoch = 0
        self.samples = 0
        self.local_steps = 0
        self.rounds_done: list[dict[str, Any]] = []
        self.finished_how = ""  # how this peer's final weights came about (see _finish)
        self._snapshot: tuple[dict[str, Any], list[torch.Tensor]] | None = None
        self.dht = start_dht(self.hm, cfg.initial_peers, cfg.host_maddrs, cfg.announce_maddrs,
                             cfg.connect_timeout_s)
        self.maddrs = [str(a) for a in self.dht.get_visible_maddrs()]
        if cfg.maddr_path:
            from atomc.jsonio import write_atomic

            write_atomic(cfg.maddr_path, "\n".join(self.maddrs) + "\n")
        from hivemind.optim.progress_tracker import ProgressTracker

        self.tracker = ProgressTracker(
            self.dht, cfg.run_id, cfg.target_batch_size, client_mode=False, min_refresh_period=0.2,
            max_refresh_period=1.0, default_refresh_period=0.5, expected_drift_peers=1,
            metadata_expiration=cfg.progress_expiration_s, start=True)
        self.flat = round_vector(self.trainer)
        self.averager = _make_averager(self.hm, [self.flat.clone()], self.dht, cfg,
                                       self._current_state)
        self._take_snapshot()
        if cfg.initial_peers:
            self._join()

    # ---- set-up --------------------------------------------------------------------------------

    def _take_snapshot(self) -> None:
        """What a joining peer downloads: the whole trainer state and the round it belongs to."""
        meta = {"epoch": self.epoch, "run_id": self.cfg.run_id, "name": self.cfg.name,
                "package": self.trainer.package.fingerprint()}
        self._snapshot = (meta, [state_bytes(self.trainer.state_dict())])

    def _current_state(self) -> tuple[dict[str, Any], list[torch.Tensor], None]:
        meta, tensors = self._snapshot
        return meta, tensors, None

    def _join(self) -> None:
        t0 = time.monotonic()
        got = None
        deadline = t0 + self.cfg.connect_timeout_s
        while got is None and time.monotonic() < deadline:
            try:
                got = self.averager.load_state_from_peers(
                    timeout=max(1.0, deadline - time.monotonic()))
            except Exception as e:  # noqa: BLE001 - a peer that left between listing and download
                self.log(f"state download failed ({type(e).__name__}: {e}); retrying")
                got = None
            if got is None:
                time.sleep(0.5)
        if got is None:
            self.log(f"no peer shared its state within {self.cfg.connect_timeout_s:.0f} s; "
                     f"starting from the initial weights")
            return
        meta, tensors = got
        if meta.get("package") != self.trainer.package.fingerprint():
            raise PeerError(f"the peers train package {meta.get('package')}, this peer "
                            f"{self.trainer.package.fingerprint()} ({self.cfg.package}); give "
                            f"every peer the same generated package")
        self.trainer.load_state_dict(state_from_bytes(tensors[0]), source="a peer's state")
        self.epoch = int(meta["epoch"])
        self.joined = {"from": meta.get("name", ""), "epoch": self.epoch,
                       "seconds": time.monotonic() - t0, "digest": weights_digest(self.trainer)}
        self._take_snapshot()
        if self.epoch >= self.cfg.rounds:  # the run is over: that peer's final state is the result
            self.finished_how = f"joined after the end, state from {meta.get('name', '?')}"
        self.log(f"joined: downloaded the state of round {self.epoch} from peer "
                 f"{meta.get('name', '?')} in {time.monotonic() - t0:.1f} s")
        self._metric({"event": "joined", **self.joined})

    # ---- training ------------------------------------------------------------------------------

    def _metric(self, line: dict[str, Any]) -> None:
        if self.cfg.metrics_path is None:
            return
        line = {"peer": self.cfg.name, "time": time.time(), **line}
        with open(self.cfg.metrics_path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def _check_time(self) -> None:
        if (self.cfg.max_seconds is not None
                and time.monotonic() - self.t_start > self.cfg.max_seconds):
            raise PeerError(f"the run took longer than {self.cfg.max_seconds:.0f} s (round "
                            f"{self.epoch} of {self.cfg.rounds}); the other peers may be gone: "
                            f"start more peers or lower --target-batch-size")

    def train(self, batch_of: Callable[[int], Any]) -> None:
        """Local steps until `rounds` averaging rounds are done, then the finish (see `_finish`)."""
        tr = self.tracker
        while self.epoch < self.cfg.rounds:
            self._check_time()
            if tr.global_epoch > self.epoch + 1:
                self._catch_up()
            step = self.local_steps
            loss = self.trainer.step(batch_of(step))
            self.local_steps += 1
            self.samples += self.samples_per_step
            tr.report_local_progress(self.epoch, self.samples)
            self._metric({"event": "step", "step": step, "epoch": self.epoch, "loss": loss})
            if tr.ready_to_update_epoch:
                if self._finished_peers():  # the others are done: their final state is the result
                    self._adopt_final()
                    break
                self._average()
        self._finish()
        self._metric({"event": "done", "epoch": self.epoch, "digest": weights_digest(self.trainer),
                      "how": self.finished_how})

    def _catch_up(self) -> None:
        """Fell behind by more than one round (e.g. stalled): take the state of a live peer."""
        got = self.averager.load_state_from_peers(timeout=self.cfg.connect_timeout_s)
        if got is None:
            return
        meta, tensors = got
        if int(meta["epoch"]) > self.epoch:
            self.trainer.load_state_dict(state_from_bytes(tensors[0]), source="a peer's state")
            self.epoch = int(meta["epoch"])
            self.samples = 0
            self.log(f"caught up: state of round {self.epoch} from {meta.get('name', '?')}")

    def _round(self, weight: float, timeout_s: float) -> dict[str, Any]:
        """One averaging round with the peers looking for a group now; returns what each member
        sent along ({} when no group formed or the round failed: the weights stay local)."""
        flat = round_vector(self.trainer)
        with self.averager.get_tensors() as tensors:
            tensors[0].copy_(flat)
        group = None
        try:
            group = self.averager.step(weight=weight,
                                       gather={"name": self.cfg.name, "epoch": self.epoch},
                                       timeout=timeout_s, allow_retries=True)
        except Exception as e:  # noqa: BLE001 - a groupmate died mid-round: keep the local weights
            self.log(f"round {self.epoch}: averaging failed ({type(e).__name__}: {e})")
        if not group:
            return {}
        with self.averager.get_tensors() as tensors:
            averaged = tensors[0].clone()
        set_round_vector(self.trainer, averaged)
        return {str(v["name"]): int(v["epoch"]) for v in group.values() if isinstance(v, dict)}

    def _record_round(self, members: dict[str, Any], t0: float, final: bool = False) -> None:
        info = {"event": "round", "epoch": self.epoch, "group": sorted(members),
                "ok": bool(members), "final": final, "seconds": time.monotonic() - t0,
                "digest": weights_digest(self.trainer)}
        self.rounds_done.append(info)
        self._take_snapshot()
        self._metric(info)
        self.log(f"{'final ' if final else ''}round {self.epoch}: "
                 f"{'averaged with ' + ', '.join(sorted(members)) if members else 'no group'} "
                 f"in {info['seconds']:.1f} s")

    def _average(self) -> None:
        """One round: average weights with every peer ready now, then the next round."""
        tr = self.tracker
        t0 = time.monotonic()
        with tr.pause_updates():
            members = self._round(float(max(self.samples, 1)), self.cfg.averaging_timeout_s)
            self.epoch = tr.update_epoch(max(self.epoch + 1, tr.global_epoch))
            self.samples = 0
        self._record_round(members, t0)

    # ---- the finish: every live peer ends with the same weights ----------------------------------

    def _alive(self) -> int:
        return int(self.tracker.global_progress.num_peers)

    def _finished_peers(self) -> dict[str, Any]:
        found = self.dht.get(f"{self.cfg.run_id}_finished", latest=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        return {str(k): v.value for k, v in found.value.items()
                if hasattr(v, "value") and str(k) != self.cfg.name}

    def _adopt_final(self) -> None:
        """Take the final state of a peer that finished (they share it with top priority)."""
        got = None
        deadline = time.monotonic() + self.cfg.connect_timeout_s
        while time.monotonic() < deadline:
            got = self.averager.load_state_from_peers(timeout=max(1.0, deadline - time.monotonic()))
            if got is not None and int(got[0]["epoch"]) >= self.cfg.rounds:
                break
            got = None  # not a finished peer's state (priorities are declared every few seconds)
            time.sleep(0.5)
        if got is None:
            self.log("the finished peers did not share their state; keeping this peer's weights")
            self.finished_how = "alone"
            return
        meta, tensors = got
        self.trainer.load_state_dict(state_from_bytes(tensors[0]), source="a finished peer's state")
        self.epoch = max(self.epoch, int(meta["epoch"]))
        self.finished_how = f"adopted from {meta.get('name', '?')}"
        self.log(f"adopted the final state of round {meta['epoch']} from {meta.get('name', '?')}")

    def _finish(self) -> None:
        """The copies must not end apart: repeat short final rounds until one holds every live
        peer, all of them done; a peer that finds no group while others are already finished
        takes their state instead. Bounded by `finish_timeout_s`."""
        cfg = self.cfg
        if self.finished_how:  # adopted a finished peer's state already
            self._declare_finished()
            return
        last = self.rounds_done[-1] if self.rounds_done else None
        deadline = time.monotonic() + cfg.finish_timeout_s
        while time.monotonic() < deadline:
            alive = self._alive()
            if alive <= 1:
                self.finished_how = "alone"
                break
            self.tracker.report_local_progress(self.epoch, 0)
            t0 = time.monotonic()
            members = self._round(1.0, max(3.0, 3 * cfg.matchmaking_time_s))
            self._record_round(members, t0, final=True)
            if members and len(members) >= alive and min(members.values()) >= cfg.rounds:
                self.finished_how = f"final round with {len(members)} peers"
                break
            if not members and self._finished_peers():
                self._adopt_final()
                break
        else:
            self.finished_how = "finish timed out"
            self.log(f"no final round held every live peer within {cfg.finish_timeout_s:.0f} s "
                     f"(last: {last['group'] if last else []}); keeping this peer's weights")
        self._declare_finished()

    def _declare_finished(self) -> None:
        """Tell late peers that this one is done and serve its state to them first."""
        from hivemind.utils import get_dht_time

        self._take_snapshot()
        self.averager.state_sharing_priority = 1e6 + self.epoch
        self.dht.store(f"{self.cfg.run_id}_finished", subkey=self.cfg.name, value=self.epoch,
                       expiration_time=get_dht_time() + 120)

    # ---- end -----------------------------------------------------------------------------------

    def save_final(self) -> None:
        if self.cfg.final_path:
            from atomc.runtime.checkpoint import save_checkpoint

            save_checkpoint(self.cfg.final_path, {"params": self.trainer.export_state_dict(),
                                                  "epoch": self.epoch, "steps": self.local_steps,
                                                  "digest": weights_digest(self.trainer)})

    def linger(self, seconds: float) -> None:
        """Keep serving state and rounds for a while, so peers finishing later find a group."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.2)

    def close(self) -> None:
        for obj in (getattr(self, "averager", None), getattr(self, "tracker", None),
                    getattr(self, "dht", None)):
            if obj is None:
                continue
            try:
                obj.shutdown()
            except Exception as e:  # noqa: BLE001 - shutting down: close the rest anyway
                self.log(f"shutdown of {type(obj).__name__} failed: {e}")
        self.trainer.close()


def _make_averager(hm: Any, tensors: list[torch.Tensor], dht: Any, cfg: PeerConfig,
                   current_state: Callable) -> Any:
    class PeerAverager(hm.averaging.DecentralizedAverager):
        def get_current_state(self):  # runs in this process when a peer downloads our state
            return current_state()

    return PeerAverager(tensors, dht, start=True, prefix=f"{cfg.run_id}_averaging",
                        min_group_size=2,
                        min_matchmaking_time=cfg.matchmaking_time_s,
                        request_timeout=min(3.0, cfg.matchmaking_time_s / 2),
                        allreduce_timeout=cfg.averaging_timeout_s, next_chunk_timeout=10.0,
                        client_mode=False, declare_state_period=2.0)


def run_peer(cfg: PeerConfig, batch_of: Callable[[int], Any], *, loss_fn: Callable | None = None,
             initial_state: dict[str, torch.Tensor] | None = None, linger_s: float = 0.0,
             log: Callable[[str], None] = print) -> PeerTrainer:
    peer = PeerTrainer(cfg, loss_fn=loss_fn, initial_state=initial_state, log=log)
    try:
        log(f"peer {cfg.name or '(unnamed)'} of run {cfg.run_id}: {' '.join(peer.maddrs)}")
        peer.train(batch_of)
        peer.save_final()
        peer.linger(max(linger_s, cfg.final_linger_s))
    finally:
        peer.close()
    return peer


__all__ = ["PeerConfig", "PeerTrainer", "round_vector", "run_peer", "set_round_vector",
           "weights_digest"]
