"""SWARM server settings (`atomc swarm serve` options), checked when made."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atomc.errors import UsageError


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


__all__ = ["ServeConfig"]
