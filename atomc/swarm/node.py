"""SWARM, what a server and a trainer both hold: a DHT node of the swarm, the generated package
they agree on (split into stages), and an event loop thread for hivemind's p2p calls (servers
answer on it, trainers call from it).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from atomc.distributed.hive import import_hivemind, start_dht
from atomc.errors import PeerError, UsageError
from atomc.place.cost import stage_ranges
from atomc.runtime.package import SwapPackage, load_swap_package
from atomc.stages.base import StageSpec
from atomc.stages.cut import cut_stages, package_plan
from atomc.swarm.records import Roster, ServerRecord


def call_times(pkg: SwapPackage, specs: Sequence[StageSpec]) -> list[dict[str, float]]:
    """Each stage's seconds per sample in a forward call and in a backward call, from the
    plan's times: a backward call runs the stage's forward again and then its backward (the
    plan's backward times hold the sub-models' recomputation; the last stage gets no forward
    call: its backward call is the micro-batch's forward too). All 0 when the plan has no
    times (made from a graph, not a profile)."""
    plan = package_plan(pkg)
    out = []
    for s in specs:
        subs = plan.submodels[s.start:s.stop]
        fwd = sum(m.fwd_ms for m in subs) / 1e3 / plan.batch_size
        bwd = sum(m.bwd_ms for m in subs) / 1e3 / plan.batch_size
        out.append({"forward": fwd, "backward": fwd + bwd})
    return out


def stage_costs(specs: Sequence[StageSpec], times: Sequence[dict[str, float]]) -> list[float]:
    """Each stage's time per sample on one server from its `call_times`: a forward call and a
    backward call, or on the last stage the backward call alone; relative (mean 1). All 1
    when the plan has no times."""
    costs = [t["backward"] + (0.0 if s.holds_output else t["forward"])
             for s, t in zip(specs, times)]
    if min(costs) <= 0:
        return [1.0] * len(specs)
    mean = sum(costs) / len(costs)
    return [c / mean for c in costs]


def stage_specs(pkg: SwapPackage, num_stages: int) -> list[StageSpec]:
    """The package's sub-models in `num_stages` consecutive stages of balanced compute."""
    specs = cut_stages(pkg, stage_ranges(package_plan(pkg), num_stages))
    where = {i: j for j, s in enumerate(specs) for i in range(s.start, s.stop)}
    for fqn, holders in pkg.tied.items():
        stages = sorted({where[i] for i, _ in holders})
        if len(stages) > 1:
            raise UsageError(
                f"{fqn} is tied across stages {stages} of {pkg.path}; SWARM averages gradients "
                f"within a stage, so a weight shared by two stages would drift apart: untie it "
                f"in the model (e.g. tie_word_embeddings=False) or train with fewer --stages")
    return specs


class SwarmNode:
    """A server's or a trainer's membership of the swarm (see the module docstring); each holds
    one as `node`."""

    def __init__(self, package: str | Path, num_stages: int, initial_peers: Sequence[str],
                 host_maddrs: Sequence[str], announce_maddrs: Sequence[str],
                 connect_timeout_s: float, role: str, times_for: str | None = None):
        """`times_for`: the option that needs the plan's measured times (refused without)."""
        self.hm = import_hivemind()
        self.role = role
        self.package_path = package
        self.pkg = load_swap_package(package)
        self.fingerprint = self.pkg.fingerprint()
        self.specs = stage_specs(self.pkg, num_stages)
        self.call_times = call_times(self.pkg, self.specs)
        self.costs = stage_costs(self.specs, self.call_times)
        if times_for and not all(t["backward"] > 0 for t in self.call_times):
            raise UsageError(
                f"{times_for} emulates a device from the times in the plan's profile, and the "
                f"plan of {package} has none (it was cut from a traced graph, not a profile); "
                f"generate the package from `atomc profile` and `atomc partition` output")
        self.dht = start_dht(self.hm, initial_peers, host_maddrs, announce_maddrs,
                             connect_timeout_s)
        self.peer = self.dht.peer_id.to_base58()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name=f"swarm-{role}").start()
        self.p2p = self.run(self.dht.replicate_p2p())
        self.rosters: dict[str, Roster] = {}

    def roster(self, prefix: str) -> Roster:
        """The servers under `prefix` as this node's successive DHT reads see them."""
        return self.rosters.setdefault(prefix, Roster(self.dht, prefix))

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        """Run a coroutine on the p2p loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def servers(self, prefix: str) -> list[ServerRecord]:
        """The servers under `prefix`; PeerError if one serves another package."""
        records = self.roster(prefix).read()
        for r in records:
            if r.package != self.fingerprint:
                raise PeerError(
                    f"server {r.name or r.peer} under prefix {prefix!r} serves package "
                    f"{r.package}, this {self.role} {self.fingerprint} ({self.package_path}); "
                    f"give every server and trainer the same generated package, or another "
                    f"--prefix")
        return records

    def close(self, log: Any) -> None:
        for what, stop in (("p2p", lambda: self.run(self.p2p.shutdown(), 5)),
                           ("DHT", self.dht.shutdown)):
            try:
                stop()
            except Exception as e:  # noqa: BLE001 - shutting down: close the rest anyway
                log(f"{what} shutdown failed: {e}")
        self.loop.call_soon_threadsafe(self.loop.stop)


__all__ = ["SwarmNode", "call_times", "stage_costs", "stage_specs"]
