"""One global batch in each way of training, predicted with the simulators.

input:  the devices (`Machine`: hardware, memory, host memory), the network (atomc.place's
        Network: bandwidth and latency of every link), the model on each kind of device
        (costs.HardwareModel) and the `Setting` (global batch, the peers' C, ...)
output: a `ModeResult` per mode: the time of one global batch, each device's busy share, the
        bytes on each link and the resource that binds

- **peers**: atomc.compare.peers
- **diloco**: atomc.compare.diloco
- **gpipe**, **1f1b**: atomc.compare.layouts
- **swarm**: atomc.compare.swarm

Every simulated step is integer nanoseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from atomc.distributed.outer import OuterConfig
from atomc.place.network import Network
from atomc.simulate.network import Links
from atomc.swarm.config import ServeConfig
from atomc.units import NS_PER_MS

MODES = ("peers", "diloco", "gpipe", "1f1b", "swarm", "pipedream")
# modelled only, as the papers' baselines: no atomc runtime trains them, so compare predicts
# them when asked for by name (--modes), never by default, and never calls them the fastest
BASELINES = ("pipedream",)
# DiLoCo trains another model than the global batch's data parallelism does (the outer step
# over H local steps): predicted when asked for by name
DEFAULT_MODES = tuple(m for m in MODES if m not in BASELINES and m != "diloco")
BOUND = 0.6  # a resource busy this share of the step or more is what binds it


@dataclass(frozen=True)
class Machine:
    """A device as compare sees it."""

    name: str
    hardware: str  # key of its HardwareModel
    memory_bytes: int
    host_memory_bytes: int | None = None  # None: not checked


@dataclass(frozen=True)
class Setting:
    global_batch: int  # samples in one global batch, all devices together
    accum: int | None = None  # the peers' C (None: the partitioner's choice)
    sync: bool = True  # average and update after the global batch (False: ATOM Fig. 14)
    matchmaking_s: float = 2.0  # hivemind's min_matchmaking_time (atomc peer's default)
    # how late a peer sees the others' progress: the refresh period of the progress tracker
    # atomc peer runs (hivemind's ProgressTracker, default_refresh_period=0.5)
    progress_lag_s: float = 0.5
    # how long a SWARM stage's servers look for their group at a commit (atomc swarm serve's
    # matchmaking_s)
    swarm_matchmaking_s: float = ServeConfig.matchmaking_s
    # hivemind's all-reduce cuts the averaged vector into parts of this size (part_size_bytes:
    # atomc peer keeps DecentralizedAverager's default, 2**19) and gives each member whole parts
    averaging_part_bytes: int = 1 << 19
    # how far the leader's parts run ahead of a member's start in an averaging round: one
    # flow-control window of a libp2p stream (yamux's initial window, 256 KiB), which the
    # member's own matchmaking messages wait behind (atomc.compare.peers)
    stream_window_bytes: int = 256 << 10
    # DiLoCo (--modes diloco): local steps between rounds (None: a round per global batch),
    # the pseudo-gradients' dtype on the wire (None: the master dtype), fragments in turn
    inner_steps: int | None = None
    round_dtype: str | None = None
    fragments: int = 1
    stages: tuple[int, ...] | None = None  # D_PP to try (None: every divisor)
    place_budget_s: float = 2.0
    place_patience: int = 2000
    swarm_trainer: int = 0  # device index the SWARM trainer runs on
    seed: int = 0

    def outer(self, mode: str) -> OuterConfig:
        """The outer options of `mode`'s peers: ATOM's averaging (peers), or DiLoCo's outer
        step (Nesterov at its default momentum: two master-sized vectors of outer state) with
        this setting's rounds (diloco)."""
        if mode != "diloco":
            return OuterConfig()
        return OuterConfig.make("nesterov", inner_steps=self.inner_steps,
                                round_dtype=self.round_dtype, fragments=self.fragments)


@dataclass(frozen=True)
class ModeResult:
    mode: str
    feasible: bool
    reason: str = ""  # why the devices cannot hold it
    step_ns: int = 0  # one global batch
    samples: int = 0  # what that step trains: the global batch, or more (peers overshoot it)
    config: str = ""  # the configuration chosen, in words
    busy: tuple[tuple[str, float], ...] = ()  # (device, compute-busy share of the step)
    links: tuple[tuple[str, str, int, float], ...] = ()  # (from, to, bytes, busy share)
    resources: tuple[tuple[str, float], ...] = ()  # every resource's busy share, busiest first
    # the step's parts one after another (peers: local steps, then averaging), as shares
    phases: tuple[tuple[str, float], ...] = ()
    detail: dict = field(default_factory=dict)

    @property
    def step_s(self) -> float:
        return self.step_ns / 1e9

    def per_sample_s(self) -> float:
        return self.step_s / self.samples if self.samples else 0.0

    @property
    def binding(self) -> str:
        """The busiest resource, in words: a device's compute or copies, a link, or a link
        used one direction at a time (GPipe sends values, then gradients back), or waits."""
        if not self.resources:
            return ""
        name, share = self.resources[0]
        if share >= BOUND:
            return f"{name} ({share:.0%} busy)"
        if self.phases:
            parts = ", then ".join(f"{p} {x:.0%}" for p, x in self.phases if x >= 0.005)
            return f"{parts} of the step (the busiest: {name}, {share:.0%})"
        both: dict[tuple[str, str], list[float]] = {}
        for a, b, _, s in self.links:
            key = (a, b) if a < b else (b, a)
            both.setdefault(key, []).append(s)
        if both:
            (a, b), ways = max(both.items(), key=lambda kv: sum(kv[1]))
            pair = sum(ways)
            if BOUND <= pair <= 1.05:  # the two ways take turns: values, then gradients
                return f"link {a} <-> {b}, one way at a time ({pair:.0%} busy)"
            if pair > 1.05:  # both ways part of the time: the work in flight waits on it
                return (f"link {a} <-> {b} both ways ({' and '.join(f'{x:.0%}' for x in ways)} "
                        f"busy), the micro-batches in flight waiting on it")
        return f"waits (the busiest: {name}, {share:.0%} busy)"

    def mean_busy(self) -> float:
        return float(np.mean([b for _, b in self.busy])) if self.busy else 0.0


def links_of(network: Network) -> Links:
    bw = tuple(tuple(g * 1e9 for g in row) for row in network.bandwidth_gbps)
    lat = tuple(tuple(round(ms * NS_PER_MS) for ms in row) for row in network.delay_ms)
    return Links(bw, lat)


def infeasible(mode: str, reason: str) -> ModeResult:
    return ModeResult(mode=mode, feasible=False, reason=reason)


def link_rows(names, link_bytes, link_busy, span_ns, scale: float = 1.0):
    rows = [(names[a], names[b], round(nbytes * scale),
             link_busy.get((a, b), 0) * scale / span_ns if span_ns else 0.0)
            for (a, b), nbytes in link_bytes.items() if nbytes]
    return tuple(sorted(rows, key=lambda r: (-r[3], -r[2], r[0], r[1])))


def resources_of(busy, links, extra=()) -> tuple[tuple[str, float], ...]:
    out = [(f"compute on {d}", s) for d, s in busy]
    out += [(f"link {a} -> {b}", s) for a, b, _, s in links]
    out += list(extra)
    return tuple(sorted(out, key=lambda r: -r[1]))


__all__ = ["BASELINES", "BOUND", "DEFAULT_MODES", "MODES", "Machine", "ModeResult", "Setting",
           "infeasible", "link_rows", "links_of", "resources_of"]
