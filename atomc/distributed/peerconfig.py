"""Peers, the options of one peer (atomc.distributed.peer): the run it joins, when it averages,
how long each wait may last, and where its metrics and final weights go."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atomc.distributed.outer import OuterConfig
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


__all__ = ["PeerConfig"]
