"""Peers, ATOM's decentralized mode (paper III-E), with DiLoCo's outer step: full model copies that
average when the collaboration has processed a global batch, or every H local steps.

input:  a generated package (every peer trains a full copy with the swap runtime), a run id,
        any live peer's address (none for the first peer), when to average (the global batch:
        samples over all peers between two rounds; or `--inner-steps H`: local steps), the
        outer options (atomc.distributed.outer.OuterConfig) and the number of rounds
output: local training steps; rounds with every peer that is ready; a state any new peer can
        download; metrics per step and round (bytes, waits) and a summary at the end

Built on hivemind (Learning@home): a DHT holds each peer's progress (samples, or local steps,
since the last round, heartbeat-like, expiring when a peer stops reporting); hivemind's
`ProgressTracker` sums it and says when the global batch is reached; with `--inner-steps` a
peer that has taken its H steps waits until every peer it sees has (the peers wait for one
another, bounded by the round's timeout). hivemind's `DecentralizedAverager` forms a group of
the peers that are ready and all-reduces, weighted by the samples each contributed:

- ATOM's averaging (`--outer sgd --outer-lr 1`, the default): the weights themselves, exact,
  as before (the outer SGD at learning rate 1 without momentum gives every peer the average);
- otherwise DiLoCo (atomc.distributed.diloco): pseudo-gradients in the round dtype, one
  fragment of sub-models a round, and the outer step on each peer.

A peer joins through any live peer and first downloads the current state (weights, optimizer
state, outer state, round) from one of them; peers whose outer options differ from the run's
are refused, naming both. A peer that dies leaves a round that hivemind retries without it, and
its progress entry expires; training goes on as long as one peer is alive. A peer whose round
found no group while others are alive downloads the state of one that had it. At the end,
final rounds average the weights exactly until one holds every live peer, so every peer ends
with the same weights.

Every wait is bounded: DHT start-up (an initial peer that never answers is an error after
`connect_timeout_s`), state download, the wait for the others, matchmaking and all-reduce.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from atomc.distributed.diloco import (
    OuterRounds,
    RoundInfo,
    fragment_widths,
    master_sizes,
    outer_on_disk,
)
from atomc.distributed.hive import import_hivemind, start_dht, state_bytes, state_from_bytes
from atomc.distributed.outer import (
    OuterConfig,
    check_host_bytes,
    describe_host_bytes,
    fragments_of,
    peer_host_bytes,
)
from atomc.distributed.rounds import register_codecs, round_bytes
from atomc.errors import PeerError, UsageError
from atomc.units import format_bytes


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
    outer: OuterConfig = field(default_factory=OuterConfig)  # ATOM's averaging by default
    # peers the run starts with: a peer of a new run (round 0) takes its first local step once
    # this many have their state, and its first round waits for that many (bounded by
    # connect_timeout_s and averaging_timeout_s); 1: start at once, as before
    min_peers: int = 1

    def __post_init__(self) -> None:
        if self.target_batch_size < 1:
            raise UsageError(f"--target-batch-size {self.target_batch_size} must be at least 1")
        if self.rounds < 1:
            raise UsageError(f"--rounds {self.rounds} must be at least 1")
        if self.min_peers < 1:
            raise UsageError(f"--min-peers {self.min_peers} must be at least 1")
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


def _tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor in a nest of dicts, lists and tuples."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


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
        self.steps_in_round = 0
        self.rounds_done: list[dict[str, Any]] = []
        self.finished_how = ""  # how this peer's final weights came about (see _finish)
        # what the run cost this peer: bytes of its rounds, its local steps' time, its waits
        self.totals = {"rounds": 0, "sent_bytes": 0, "received_bytes": 0, "compute_s": 0.0,
                       "others_wait_s": 0.0, "round_wait_s": 0.0}
        self._snapshot: tuple[dict[str, Any], list[torch.Tensor]] | None = None
        self._at_gate = False  # a state loaded at a boundary: its round is launched at once
        self._weight_zero = False  # ... with weight 0: its pseudo-gradient is another's
        self.rounds: OuterRounds | None = None
        self.dht = self.tracker = self.averager = self.round_averager = None
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    # ---- set-up --------------------------------------------------------------------------------

    def _start(self) -> None:
        cfg = self.cfg
        master = str(self.trainer.store.master_dtype).removeprefix("torch.")
        if cfg.outer.round_dtype == master:  # exact either way: one spelling for the check
            cfg.outer = dataclasses.replace(cfg.outer, round_dtype=None)
        outer = cfg.outer
        fragments = fragments_of(master_sizes(self.trainer), outer.fragments)  # K <= sub-models
        # checked before the outer state is made
        self.host_bytes = self._check_host(fragments, master)
        if not outer.plain(master):
            self.rounds = OuterRounds(self.trainer, outer, fragments, name=cfg.name,
                                      log=self.log)
        flat = round_vector(self.trainer)
        # before the averager starts: it serves the snapshot to a peer that joins at once
        self._take_snapshot()
        self.dht = start_dht(self.hm, cfg.initial_peers, cfg.host_maddrs, cfg.announce_maddrs,
                             cfg.connect_timeout_s)
        self.maddrs = [str(a) for a in self.dht.get_visible_maddrs()]
        if cfg.maddr_path:
            from atomc.jsonio import write_atomic

            write_atomic(cfg.maddr_path, "\n".join(self.maddrs) + "\n")
        from hivemind.optim.progress_tracker import ProgressTracker

        # with --inner-steps the progress counts local steps, and a round is due at H / K
        target = (cfg.target_batch_size if outer.steps_per_round is None
                  else outer.steps_per_round)
        self.tracker = ProgressTracker(
            self.dht, cfg.run_id, target, client_mode=False, min_refresh_period=0.2,
            max_refresh_period=1.0, default_refresh_period=0.5, expected_drift_peers=1,
            metadata_expiration=cfg.progress_expiration_s, start=True)
        self.vector_values = flat.numel()
        self.averager = _make_averager(self.hm, [flat], self.dht, cfg, self._current_state)
        if self.rounds is not None:
            self.round_averager = _make_averager(
                self.hm, self.rounds.tensors(), self.dht, cfg, None,
                prefix=f"{cfg.run_id}_rounds", compression=self.rounds.compression())
            self.rounds.averager = self.round_averager
        on_disk = self.rounds.outer.disk_bytes if self.rounds is not None else 0
        self._metric({"event": "start", "outer": outer.to_json(), "fragments": fragments,
                      "host_bytes": self.host_bytes, "vector_values": self.vector_values,
                      "outer_disk_bytes": on_disk, "samples_per_step": self.samples_per_step})
        self.log(f"outer: {outer.describe()}; {len(fragments)} fragment(s) of "
                 f"{len(self.trainer.store.layouts)} sub-models; "
                 f"beside the trainer {describe_host_bytes(self.host_bytes)}"
                 + (f"; outer state on the offload drives: {format_bytes(on_disk)}"
                    if on_disk else ""))
        if cfg.initial_peers:
            self._join()
        self._announce()

    def _announce(self) -> None:
        """Tell the run this peer has its state and is about to train (what `min_peers`
        counts)."""
        from hivemind.utils import get_dht_time

        self.dht.store(f"{self.cfg.run_id}_present", subkey=self.cfg.name or str(id(self)),
                       value=self.epoch,
                       expiration_time=get_dht_time() + 2 * self.cfg.connect_timeout_s + 60)

    def _wait_for_start(self) -> None:
        """A new run (round 0) with `min_peers`: wait until that many peers have their state
        (bounded by connect_timeout_s: PeerError after it)."""
        want = self.cfg.min_peers
        if want <= 1 or self.epoch > 0 or self.local_steps > 0:
            return
        t0 = time.monotonic()
        while True:
            found = self.dht.get(f"{self.cfg.run_id}_present", latest=True)
            have = len(found.value) if found is not None and isinstance(found.value, dict) else 0
            if have >= want:
                break
            if time.monotonic() - t0 > self.cfg.connect_timeout_s:
                raise PeerError(f"--min-peers {want}: {have} peer(s) of run {self.cfg.run_id} "
                                f"were ready within {self.cfg.connect_timeout_s:.0f} s; start "
                                f"the others, or give fewer or a longer --connect-timeout")
            time.sleep(0.1)
        self.log(f"{have} peers ready after {time.monotonic() - t0:.1f} s: training starts")

    def _check_host(self, fragments: list[list[int]], master: str) -> dict[str, int]:
        """The peer's own host bytes (outer.peer_host_bytes), checked against what is
        available now that the swap trainer holds its share."""
        from atomc.partition import hostmem

        tr = self.trainer
        masters = sum(master_sizes(tr))
        state = masters * tr.store.master_dtype.itemsize + sum(
            t.numel() * t.element_size() for t in _tensors(tr.optimizer.state_dict()))
        width, buffer_width = fragment_widths(tr, fragments)
        by_kind = peer_host_bytes(masters, width, buffer_width, master, state, self.cfg.outer,
                                  outer_on_disk=outer_on_disk(tr))
        check_host_bytes(by_kind, hostmem.available_host_bytes())
        return by_kind

    def _take_snapshot(self, at_gate: bool = False) -> None:
        """What a joining peer downloads: the whole trainer state, the outer state and where
        in the round it stands (`at_gate`: at a boundary whose round is not launched yet)."""
        meta = {"epoch": self.epoch, "run_id": self.cfg.run_id, "name": self.cfg.name,
                "package": self.trainer.package.fingerprint(),
                "outer": self.cfg.outer.to_json(), "steps_in_round": self.steps_in_round,
                "samples": self.samples, "at_gate": at_gate}
        tensors = [state_bytes(self.trainer.state_dict())]
        if self.rounds is not None:
            tensors.append(state_bytes(self.rounds.state_dict()))
        self._snapshot = (meta, tensors)

    def _current_state(self) -> tuple[dict[str, Any], list[torch.Tensor], None]:
        meta, tensors = self._snapshot
        return meta, tensors, None

    def _check_outer(self, meta: dict[str, Any]) -> None:
        """Refuse the run's state when its outer options are not this peer's, naming both."""
        theirs = OuterConfig.from_json(meta.get("outer", OuterConfig().to_json()),
                                       f"peer {meta.get('name', '?')}'s state")
        diff = self.cfg.outer.disagreement(theirs)
        if diff:
            raise PeerError(f"this peer's outer options differ from those of run "
                            f"{self.cfg.run_id} (peer {meta.get('name', '?')}): {diff}; give "
                            f"every peer the same "
                            f"--outer, --outer-lr, --outer-momentum, --inner-steps, --round-dtype "
                            f"and --fragments")

    def _load(self, meta: dict[str, Any], tensors: list[torch.Tensor], source: str) -> None:
        """Take a downloaded state: the trainer's, the outer state, the round's position."""
        self.trainer.load_state_dict(state_from_bytes(tensors[0]), source=source)
        if self.rounds is not None:
            if len(tensors) < 2:
                raise PeerError(f"{source} has no outer state; every peer of a DiLoCo run "
                                f"must run it (give the same outer options)")
            self.rounds.load_state_dict(state_from_bytes(tensors[1]), source)
        self.epoch = int(meta["epoch"])
        self.steps_in_round = int(meta.get("steps_in_round", 0))
        self.samples = int(meta.get("samples", 0))
        self._at_gate = bool(meta.get("at_gate", False))
        self._weight_zero = self._at_gate  # its pseudo-gradient is the sender's: count it once

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
        self._check_outer(meta)
        self._load(meta, tensors, "a peer's state")
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

    def _progress(self) -> int:
        """What the progress tracker counts: samples (the global batch rule), or local steps."""
        return self.samples if self.cfg.outer.inner_steps is None else self.steps_in_round

    def _due(self) -> bool:
        """A round is due: the collaboration has the global batch, or this peer its H/K steps."""
        per = self.cfg.outer.steps_per_round
        if per is None:
            return bool(self.tracker.ready_to_update_epoch)
        return self.steps_in_round >= per

    def train(self, batch_of: Callable[[int], Any]) -> None:
        """Local steps until `rounds` rounds are done, then the finish (see `_finish`)."""
        tr = self.tracker
        self._wait_for_start()
        t_train = time.monotonic()
        while self.epoch < self.cfg.rounds:
            self._check_time()
            if tr.global_epoch > self.epoch + 1:
                self._catch_up()
            if not self._at_gate:
                step = self.local_steps
                t0 = time.monotonic()
                loss = self.trainer.step(batch_of(step))
                self.totals["compute_s"] += time.monotonic() - t0
                self.local_steps += 1
                self.samples += self.samples_per_step
                self.steps_in_round += 1
                tr.report_local_progress(self.epoch, self._progress())
                self._metric({"event": "step", "step": step, "epoch": self.epoch, "loss": loss})
                if not self._due():
                    continue
            self._at_gate = False
            if self._finished_peers():  # the others are done: their final state is the result
                self._adopt_final()
                break
            if self.rounds is None:
                self._average()
            else:
                self._outer_round()
        if self.rounds is not None and self.rounds.pending is not None:
            if self.finished_how:  # adopted a finished peer's state: its round is moot
                self.rounds.pending.control.cancel()
                self.rounds.pending = None
            else:
                self._record(self.rounds.complete())
        self._finish()
        wall = time.monotonic() - t_train
        t = self.totals
        summary = {**t, "wall_s": wall,
                   "compute_utilization": t["compute_s"] / wall if wall else 0.0,
                   "bytes_per_round": t["sent_bytes"] / t["rounds"] if t["rounds"] else 0}
        self.log(f"done: {t['rounds']} rounds, sent {format_bytes(t['sent_bytes'])} "
                 f"({format_bytes(summary['bytes_per_round'])} a round), received "
                 f"{format_bytes(t['received_bytes'])}; final rounds sent "
                 f"{format_bytes(t.get('final_sent_bytes', 0))}; local steps "
                 f"{summary['compute_utilization']:.0%} of {wall:.0f} s; waited "
                 f"{t['others_wait_s']:.1f} s for the others and {t['round_wait_s']:.1f} s for "
                 f"rounds")
        self._metric({"event": "done", "epoch": self.epoch, "digest": weights_digest(self.trainer),
                      "how": self.finished_how, **summary})

    def _catch_up(self, newer_than: int | None = None, wait_s: float = 0.0) -> bool:
        """Fell behind (stalled, or a round found no group while others went on): take the
        state of a live peer that is past round `newer_than` (default: this peer's round),
        waiting up to `wait_s` for one; True when one was taken."""
        newer_than = self.epoch if newer_than is None else newer_than
        deadline = time.monotonic() + wait_s
        while True:
            try:
                got = self.averager.load_state_from_peers(timeout=self.cfg.connect_timeout_s)
            except Exception as e:  # noqa: BLE001 - a peer that left between listing and download
                self.log(f"state download failed ({type(e).__name__}: {e})")
                got = None
            if got is not None and int(got[0]["epoch"]) > newer_than:
                break
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)
        meta, tensors = got
        self._check_outer(meta)
        self._load(meta, tensors, "a peer's state")
        self.tracker.report_local_progress(self.epoch, self._progress())
        self.log(f"caught up: state of round {self.epoch} from {meta.get('name', '?')}")
        self._metric({"event": "caught_up", "epoch": self.epoch, "from": meta.get("name", "")})
        return True

    def _wait_for_others(self) -> float:
        """With --inner-steps: wait until every peer the tracker sees has taken its steps of
        this round, or moved on (bounded by the round's timeout); the seconds waited."""
        tr, per = self.tracker, self.cfg.outer.steps_per_round
        # a peer shows in the tracker once it has stepped: the first round counts the peers
        # the run started with (min_peers) even before they have
        peers = self.cfg.min_peers if self.epoch == 0 else 1
        t0 = time.monotonic()
        deadline = t0 + self.cfg.averaging_timeout_s
        while time.monotonic() < deadline:
            gp = tr.global_progress
            if (gp.epoch > self.epoch
                    or gp.samples_accumulated >= per * max(gp.num_peers, peers)):
                break
            time.sleep(0.02)
        return time.monotonic() - t0

    def _round(self, weight: float, timeout_s: float) -> dict[str, Any]:
        """One averaging round of the weights with the peers looking for a group now; returns
        what each member sent along ({} when no group formed or the round failed: the weights
        stay local)."""
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
        names = [v.get("name") if isinstance(v, dict) else None for v in group.values()]
        if self.cfg.name in names:
            self._last_bytes = round_bytes(
                [(self.vector_values, None, self.trainer.store.master_dtype.itemsize)],
                len(group), names.index(self.cfg.name))
        return {str(v["name"]): int(v["epoch"]) for v in group.values() if isinstance(v, dict)}

    _last_bytes: tuple[int, int] = (0, 0)

    def _record(self, info: dict[str, Any] | RoundInfo, final: bool = False,
                others_wait_s: float = 0.0) -> None:
        """A round in the metrics and the log: its group, bytes and waits. `info`: a DiLoCo
        round's RoundInfo, or a round of the weights (ATOM's averaging, final rounds) as a
        dict of members, seconds and bytes."""
        overlapped = False
        if isinstance(info, RoundInfo):
            members = info.members
            overlapped = self.cfg.outer.fragments > 1
            line = {"epoch": info.epoch, "fragment": info.fragment,
                    "sent_bytes": info.sent_bytes, "received_bytes": info.received_bytes,
                    "group_wait_s": info.group_wait_s, "allreduce_s": info.allreduce_s,
                    "seconds": info.exposed_s, "weight": info.weight,
                    "round_dtype": self.cfg.outer.round_dtype or "master"}
        else:
            members = info["members"]
            line = {**{k: v for k, v in info.items() if k != "members"}, "round_dtype": "master"}
        line.update({"event": "round", "group": sorted(members), "ok": bool(members),
                     "final": final, "others_wait_s": others_wait_s,
                     "digest": weights_digest(self.trainer)})
        self.rounds_done.append(line)
        t = self.totals
        key = "final_" if final else ""
        t[f"{key}rounds"] = t.get(f"{key}rounds", 0) + 1
        t[f"{key}sent_bytes"] = t.get(f"{key}sent_bytes", 0) + line.get("sent_bytes", 0)
        t[f"{key}received_bytes"] = (t.get(f"{key}received_bytes", 0)
                                     + line.get("received_bytes", 0))
        t["round_wait_s"] += line.get("seconds", 0.0)
        t["others_wait_s"] += others_wait_s
        self._metric(line)
        what = f"averaged with {', '.join(sorted(members))}" if members else "no group"
        frag = (f", fragment {line['fragment'] + 1}/{self.cfg.outer.fragments}"
                if overlapped else "")
        if overlapped:
            took = (f"ran beside the local steps, then {line['seconds']:.1f} s more at the "
                    f"boundary")
        else:
            took = ", ".join(x for x in (
                f"waited {others_wait_s:.1f} s for the others" if others_wait_s >= 0.05 else "",
                f"{line['group_wait_s']:.1f} s for the group" if line.get("group_wait_s") else "",
                f"{line.get('seconds', 0.0):.1f} s in all") if x)
        self.log(f"{'final ' if final else ''}round {line['epoch']}{frag}: {what} "
                 f"({line['round_dtype']}): sent {format_bytes(line.get('sent_bytes', 0))}, "
                 f"received {format_bytes(line.get('received_bytes', 0))}; {took}")

    def _average(self) -> None:
        """One round of ATOM's averaging: the weights, with every peer ready now."""
        tr = self.tracker
        waited = self._wait_for_others() if self.cfg.outer.inner_steps is not None else 0.0
        t0 = time.monotonic()
        self._last_bytes = (0, 0)
        with tr.pause_updates():
            members = self._round(float(max(self.samples, 1)), self.cfg.averaging_timeout_s)
            epoch = self.epoch
            self.epoch = tr.update_epoch(max(self.epoch + 1, tr.global_epoch))
            self.samples = 0
            self.steps_in_round = 0
        sent, received = self._last_bytes
        self._record({"epoch": epoch, "members": members, "seconds": time.monotonic() - t0,
                      "allreduce_s": time.monotonic() - t0, "sent_bytes": sent,
                      "received_bytes": received}, others_wait_s=waited)
        self._take_snapshot()

    def _outer_round(self) -> None:
        """A DiLoCo round at this boundary: the round in flight (K > 1) is applied first, then
        the peers wait for one another, then this round's fragment is averaged (K = 1: here;
        K > 1: in the background, applied at the next boundary)."""
        tr, rounds = self.tracker, self.rounds
        if rounds.pending is not None:
            info = rounds.complete()
            self._record(info)
            if self._went_alone(info):
                return  # took a newer state, at its boundary: its round is launched next
            self._take_snapshot(at_gate=True)
        waited = self._wait_for_others() if self.cfg.outer.inner_steps is not None else 0.0
        weight = 0.0 if self._weight_zero else float(max(self.samples, 1))
        self._weight_zero = False
        with tr.pause_updates():
            rounds.launch(self.epoch, weight, self.cfg.averaging_timeout_s)
            info = rounds.complete() if self.cfg.outer.fragments == 1 else None
            self.epoch = tr.update_epoch(max(self.epoch + 1, tr.global_epoch))
            self.samples = 0
            self.steps_in_round = 0
        if info is not None:
            self._record(info, others_wait_s=waited)
            if self._went_alone(info):
                return
            self._take_snapshot()
        else:
            self.totals["others_wait_s"] += waited

    def _went_alone(self, info: RoundInfo) -> bool:
        """A round without a group while other peers are alive leaves this peer's outer state
        apart from theirs: take the state of a peer that had the round (True) when one shows
        within the round's timeout; otherwise the outer step on its own stays."""
        if info.ok or self._alive() <= 1:
            return False
        return self._catch_up(newer_than=info.epoch,
                              wait_s=self.cfg.averaging_timeout_s + self.cfg.matchmaking_time_s)

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
            self._last_bytes = (0, 0)
            members = self._round(1.0, max(3.0, 3 * cfg.matchmaking_time_s))
            sent, received = self._last_bytes
            self._record({"epoch": self.epoch, "members": members,
                          "seconds": time.monotonic() - t0, "allreduce_s": time.monotonic() - t0,
                          "sent_bytes": sent, "received_bytes": received}, final=True)
            self._take_snapshot()
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
        # hivemind's parts leave tasks pending in their event loops when shut down mid-call (a
        # peer refused while it downloads the run's state from a live group); asyncio reports
        # each as "Task was destroyed but it is pending!" when the loop is collected at exit,
        # lines that would follow the peer's one-line error. Their objects are gone by then.
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        for obj in (getattr(self, "round_averager", None), getattr(self, "averager", None),
                    getattr(self, "tracker", None), getattr(self, "dht", None)):
            if obj is None:
                continue
            try:
                obj.shutdown()
            except Exception as e:  # noqa: BLE001 - shutting down: close the rest anyway
                self.log(f"shutdown of {type(obj).__name__} failed: {e}")
        if self.rounds is not None:
            self.rounds.close()  # the outer state's files, where it has them
        self.trainer.close()


def _make_averager(hm: Any, tensors: list[torch.Tensor], dht: Any, cfg: PeerConfig,
                   current_state: Callable | None, *, prefix: str | None = None,
                   compression: Any = None) -> Any:
    """A DecentralizedAverager with atomc peer's settings over `tensors`; it serves
    `current_state()` to joining peers (None: it shares no state)."""
    dtype = tensors[0].dtype

    class PeerAverager(hm.averaging.DecentralizedAverager):
        def get_current_state(self):  # runs in this process when a peer downloads our state
            return current_state()

        def run(self):  # the averager's own process
            # hivemind sums every part in a tensor of torch's default dtype (float32): a float64
            # run's rounds would be float32-exact only; and the round codecs (rounds.py)
            torch.set_default_dtype(dtype)
            register_codecs()
            super().run()

    extra: dict[str, Any] = {} if compression is None else {"compression": compression}
    if current_state is None:
        extra["allow_state_sharing"] = False
    return PeerAverager(tensors, dht, start=True, prefix=prefix or f"{cfg.run_id}_averaging",
                        min_group_size=2, **extra,
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
