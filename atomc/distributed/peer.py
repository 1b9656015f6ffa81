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

Here: `PeerTrainer` (set-up and joining, local steps, rounds, the finish) and `run_peer`. Its
options are `peerconfig.PeerConfig`; what a round of the weights averages and the hivemind
averager are in `averaging`; its metrics, round lines and summary in `peermetrics`; DiLoCo's
rounds in `diloco`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from atomc.distributed.averaging import (
    average_weights,
    make_averager,
    round_vector,
    weights_digest,
)
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
from atomc.distributed.peerconfig import PeerConfig
from atomc.distributed.peermetrics import PeerMetrics
from atomc.errors import PeerError
from atomc.units import format_bytes


def _tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor in a nest of dicts, lists and tuples."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


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
        self.finished_how = ""  # how this peer's final weights came about (see _finish)
        # what the run cost this peer: bytes of its rounds, its local steps' time, its waits
        self.metrics = PeerMetrics(cfg, log, lambda: weights_digest(self.trainer))
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
        self.averager = make_averager(self.hm, [flat], self.dht, cfg, self._current_state)
        if self.rounds is not None:
            self.round_averager = make_averager(
                self.hm, self.rounds.tensors(), self.dht, cfg, None,
                prefix=f"{cfg.run_id}_rounds", compression=self.rounds.compression())
            self.rounds.averager = self.round_averager
        on_disk = self.rounds.outer.disk_bytes if self.rounds is not None else 0
        self.metrics.write({"event": "start", "outer": outer.to_json(), "fragments": fragments,
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
        self.metrics.write({"event": "joined", **self.joined})

    # ---- training ------------------------------------------------------------------------------

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
                self.metrics.totals["compute_s"] += time.monotonic() - t0
                self.local_steps += 1
                self.samples += self.samples_per_step
                self.steps_in_round += 1
                tr.report_local_progress(self.epoch, self._progress())
                self.metrics.write({"event": "step", "step": step, "epoch": self.epoch,
                                    "loss": loss})
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
                self.metrics.record(self.rounds.complete())
        self._finish()
        self.metrics.done(time.monotonic() - t_train, self.epoch, self.finished_how)

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
        self.metrics.write({"event": "caught_up", "epoch": self.epoch,
                            "from": meta.get("name", "")})
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

    def _average(self) -> None:
        """One round of ATOM's averaging: the weights, with every peer ready now."""
        tr = self.tracker
        waited = self._wait_for_others() if self.cfg.outer.inner_steps is not None else 0.0
        t0 = time.monotonic()
        with tr.pause_updates():
            members, (sent, received) = self._round(float(max(self.samples, 1)),
                                                    self.cfg.averaging_timeout_s)
            epoch = self.epoch
            self.epoch = tr.update_epoch(max(self.epoch + 1, tr.global_epoch))
            self.samples = 0
            self.steps_in_round = 0
        self.metrics.record({"epoch": epoch, "members": members, "seconds": time.monotonic() - t0,
                      "allreduce_s": time.monotonic() - t0, "sent_bytes": sent,
                      "received_bytes": received}, others_wait_s=waited)
        self._take_snapshot()

    def _round(self, weight: float, timeout_s: float) -> tuple[dict[str, int], tuple[int, int]]:
        """One averaging round of the weights with the peers looking for a group now
        (averaging.average_weights): the members' rounds, and this peer's (sent, received)
        bytes."""
        return average_weights(self.averager, self.trainer, name=self.cfg.name, epoch=self.epoch,
                               weight=weight, timeout_s=timeout_s, log=self.log)

    def _outer_round(self) -> None:
        """A DiLoCo round at this boundary: the round in flight (K > 1) is applied first, then
        the peers wait for one another, then this round's fragment is averaged (K = 1: here;
        K > 1: in the background, applied at the next boundary)."""
        tr, rounds = self.tracker, self.rounds
        if rounds.pending is not None:
            info = rounds.complete()
            self.metrics.record(info)
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
            self.metrics.record(info, others_wait_s=waited)
            if self._went_alone(info):
                return
            self._take_snapshot()
        else:
            self.metrics.totals["others_wait_s"] += waited

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
        last = self.metrics.rounds_done[-1] if self.metrics.rounds_done else None
        deadline = time.monotonic() + cfg.finish_timeout_s
        while time.monotonic() < deadline:
            alive = self._alive()
            if alive <= 1:
                self.finished_how = "alone"
                break
            self.tracker.report_local_progress(self.epoch, 0)
            t0 = time.monotonic()
            members, (sent, received) = self._round(1.0, max(3.0, 3 * cfg.matchmaking_time_s))
            self.metrics.record({"epoch": self.epoch, "members": members,
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


__all__ = ["PeerTrainer", "run_peer"]
