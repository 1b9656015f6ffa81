"""SWARM server, rebalancing: at the multiples of T in DHT time every server reads the swarm and
plans the moves (atomc.swarm.balance); a server whose own move is among them moves to the stage
it was sent to (the serving loop carries the move out, atomc.swarm.server).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hivemind.utils import get_dht_time

from atomc.swarm import balance
from atomc.swarm.records import Roster, ServerRecord, read_servers

GUESS_S = 30.0  # rebalancing waits this long at most for a new server's first measured rate
READ_AHEAD_S = 0.25  # servers read the DHT this long before each decision moment
EVENT_TICK_S = 0.5  # between periods, servers look this often for a swarm that changed


class Rebalancer:
    """One server's rebalancing decisions, on their own thread (`run`).

    `view(roster)`: the servers as this one sees them through `roster`, its own record
    included; `wake()` tells the serving loop that a move is decided (`move_to`), and the loop
    calls `moved()` once it has carried it out.
    """

    def __init__(self, dht: Any, prefix: str, peer: str, *, num_stages: int,
                 period_s: float, min_gain: float, costs: Sequence[float],
                 view: Callable[[Roster], list[ServerRecord]], wake: Callable[[], None],
                 closing: threading.Event, log: Callable[[str], None]):
        self.dht, self.prefix, self.peer = dht, prefix, peer
        self.num_stages, self.period_s = num_stages, period_s
        self.min_gain, self.costs = min_gain, costs
        self.view, self.wake, self.closing, self.log = view, wake, closing, log
        self.move_to: int | None = None  # the stage decided on, until the move is done
        self.measured_since: float | None = None  # when this server first saw a measured rate

    def moved(self) -> None:
        self.move_to = None

    def run(self) -> None:
        """Decide until the server closes. Every server decides at the same moments, the
        multiples of T in DHT time, each from the servers as it read them just before, so the
        moves of one plan start at once on all their servers: deciding one by one, the first
        to move would hold the others back (its rate is a guess until it serves), and a server
        busy averaging at its turn would lag behind. Between those moments servers read the
        DHT every EVENT_TICK_S and decide at the next tick when the swarm itself changed (a
        server left or joined, or a new one's rate became known), so a stage emptied by a
        kill, or a newcomer, does not wait up to T at reduced throughput. Rates drifting is
        not such a change: that waits for T."""
        period = self.period_s
        tick = min(period, EVENT_TICK_S)
        roster = Roster(self.dht, self.prefix)  # this thread's own reads (and state)
        swarm_then: frozenset | None = None  # the swarm at the last decision
        period_then = period_of(get_dht_time(), period)  # the period of the last decision
        while not self.closing.is_set():
            t = get_dht_time()
            boundary = (t // tick + 1) * tick
            time.sleep(max(0.0, boundary - min(READ_AHEAD_S, tick / 2) - t))
            try:
                view = self.view(roster)
            except Exception as e:  # noqa: BLE001 - the next period reads again
                self.log(f"rebalancing: reading the servers failed ({type(e).__name__}: {e})")
                continue
            time.sleep(max(0.0, boundary - get_dht_time()))
            if self.move_to is not None or self.closing.is_set():
                continue
            swarm_now = frozenset((r.peer, r.measured) for r in view if not r.moving)
            # the first tick of each period (a late tick, after a slow read, still counts)
            now_period = period_of(boundary, period)
            if now_period <= period_then and swarm_now == swarm_then:
                continue
            swarm_then, period_then = swarm_now, now_period
            try:
                move = self.choose_move(view)
            except Exception as e:  # noqa: BLE001 - a bad record must not end rebalancing
                self.log(f"rebalancing: no decision ({type(e).__name__}: {e})")
                continue
            if move is not None:
                self.log(f"rebalancing: {move}")
                self.move_to = move.to_stage
                self.wake()

    def choose_move(self, servers: list[ServerRecord]) -> balance.Move | None:
        """Our move in the plan for `servers` (balance.plan_moves, or for a large swarm
        SWARM's Algorithm 2), or None."""
        now = get_dht_time()
        if self.measured_since is None and any(r.measured for r in servers):
            self.measured_since = now  # training has begun
        empty = len({r.stage for r in servers}) < self.num_stages
        if not empty and (self.measured_since is None or any(
                r.moving or (not r.measured
                             and now - max(r.started, self.measured_since) < GUESS_S)
                for r in servers)):
            # a server that moved or joined, or waited for the first trainer, has a guessed
            # throughput until it has served (at the very start, 1 sample/s), and decisions on
            # guesses move servers for nothing. One that gets no calls for GUESS_S (failing,
            # say) is not waited for, and an empty stage waits for nothing
            return None
        # one not yet measured on its stage counts where it is announced and is not moved
        loads = [balance.ServerLoad(r.peer, r.stage, r.throughput, r.queue,
                                    r.moving or not r.measured, r.served) for r in servers]
        plan = balance.plan_moves(loads, self.num_stages, self.min_gain, self.costs)
        if plan is None:  # too many servers to search: SWARM's one move per period
            one = balance.choose_move(loads, self.num_stages, self.min_gain, self.costs)
            plan = [one] if one is not None else []
        return next((m for m in plan if m.peer == self.peer), None)


def stage_in_need(dht: Any, prefix: str, peer: str, num_stages: int) -> int:
    """The stage a server `peer` joining the swarm under `prefix` serves: the one that needs a
    server most (balance.choose_join_stage)."""
    servers = [balance.ServerLoad(r.peer, r.stage, r.throughput, r.queue)
               for r in read_servers(dht, prefix)
               if r.peer != peer]  # one moving counts where it goes
    return balance.choose_join_stage(servers, num_stages)


def period_of(t: float, period: float) -> int:
    """Which rebalancing period DHT time `t` is in: a server decides at the first tick of each
    (the same tick on every server, whatever T is)."""
    return math.floor(t / period + 1e-9)


__all__ = ["EVENT_TICK_S", "GUESS_S", "READ_AHEAD_S", "Rebalancer", "period_of",
           "stage_in_need"]
