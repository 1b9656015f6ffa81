"""SWARM server, rebalancing: at the multiples of T in DHT time every server reads the swarm,
plans the moves (atomc.swarm.balance) and, when its own is among them, hands its state over
and moves to the stage it was sent to.
"""

from __future__ import annotations

import math
import time

from hivemind.utils import get_dht_time

from atomc.swarm import balance
from atomc.swarm.commit import exclude
from atomc.swarm.records import Roster, ServerRecord

GUESS_S = 30.0  # rebalancing waits this long at most for a new server's first measured rate
READ_AHEAD_S = 0.25  # servers read the DHT this long before each decision moment
EVENT_TICK_S = 0.5  # between periods, servers look this often for a swarm that changed


class Rebalancing:
    """SwarmServer's rebalancing: decisions on their own thread, moves in the serving loop."""

    def _decide(self) -> None:
        """Rebalancing decisions (its own thread): every server decides at the same moments,
        the multiples of T in DHT time, each from the servers as it read them just before.
        A plan of several moves then starts at once on all its servers: deciding one by one,
        the first to move held the others back (its rate was a guess until it served), and a
        server busy averaging at its turn lagged behind. Between those moments servers read
        the DHT every EVENT_TICK_S and decide at the next tick when the swarm itself changed
        (a server left or joined, or a new one's rate became known): waiting up to T for a
        stage emptied by a kill or for a newcomer cost a run on real processes 3-6 s at half
        throughput per event. Rates drifting is not such a change: that waits for T. The move
        itself runs in the serving loop, when it is free (`_move`)."""
        period = self.cfg.rebalance_s
        tick = min(period, EVENT_TICK_S)
        roster = Roster(self.dht, self.cfg.prefix)  # this thread's own reads (and state)
        swarm_then: frozenset | None = None  # the swarm at the last decision
        period_then = period_of(get_dht_time(), period)  # the period of the last decision
        while not self.closing:
            t = get_dht_time()
            boundary = (t // tick + 1) * tick
            time.sleep(max(0.0, boundary - min(READ_AHEAD_S, tick / 2) - t))
            try:
                view = self._view(roster)
            except Exception as e:  # noqa: BLE001 - the next period reads again
                self.log(f"rebalancing: reading the servers failed ({type(e).__name__}: {e})")
                continue
            time.sleep(max(0.0, boundary - get_dht_time()))
            if self.moving or self.move_to is not None or self.closing:
                continue
            swarm_now = frozenset((r.peer, r.measured) for r in view if not r.moving)
            # the first tick of each period (a late tick, after a slow read, still counts)
            now_period = period_of(boundary, period)
            if now_period <= period_then and swarm_now == swarm_then:
                continue
            swarm_then, period_then = swarm_now, now_period
            try:
                move = self._choose_move(view)
            except Exception as e:  # noqa: BLE001 - a bad record must not end rebalancing
                self.log(f"rebalancing: no decision ({type(e).__name__}: {e})")
                continue
            if move is not None:
                self.log(f"rebalancing: {move}")
                self.move_to = move.to_stage
                self.wake.set()

    def _choose_move(self, servers: list[ServerRecord]) -> balance.Move | None:
        """Our move in the plan for `servers` (balance.plan_moves, or for a large swarm
        SWARM's Algorithm 2), or None."""
        now = get_dht_time()
        if self.measured_since is None and any(r.measured for r in servers):
            self.measured_since = now  # training has begun
        empty = len({r.stage for r in servers}) < self.cfg.num_stages
        if not empty and (self.measured_since is None or any(
                r.moving or (not r.measured
                             and now - max(r.started, self.measured_since) < GUESS_S)
                for r in servers)):
            # a server that moved or joined, or waited for the first trainer, has a guessed
            # throughput until it has served (at the very start, 1 sample/s): decisions on
            # guesses moved servers for nothing. One that gets no calls for GUESS_S (failing,
            # say) is not waited for, and an empty stage waits for nothing
            return None
        # one not yet measured on its stage counts where it is announced and is not moved
        loads = [balance.ServerLoad(r.peer, r.stage, r.throughput, r.queue,
                                    r.moving or not r.measured, r.served) for r in servers]
        plan = balance.plan_moves(loads, self.cfg.num_stages, self.cfg.min_gain, self.costs)
        if plan is None:  # too many servers to search: SWARM's one move per period
            one = balance.choose_move(loads, self.cfg.num_stages, self.cfg.min_gain, self.costs)
            plan = [one] if one is not None else []
        return next((m for m in plan if m.peer == self.peer), None)

    def _hand_over(self) -> None:
        """Before leaving a stage, let its servers that are behind us take our state: a
        server that took a step alone and moved on left the others a step behind with no one
        to catch up from (only the checkpoint held it), and the trainer waited for a step
        the stage had lost. Bounded: a server that does not catch up is not waited for."""
        deadline = time.monotonic() + self.cfg.averaging_timeout_s
        while time.monotonic() < deadline and not self.closing:
            behind = [r for r in self._sharers(self.spec.index) if r.step < self.step]
            if not behind:
                return
            time.sleep(0.2)
        self.log(f"leaving stage {self.spec.index} at step {self.step} with servers behind it")

    def _move(self, to: int) -> None:
        self._hand_over()
        self._metric({"event": "move", "from": self.spec.index, "to": to})
        self.moving, self.moving_to = True, to
        self._announce()
        if self.ids:  # what we hold of this step goes to the stage's other servers again
            exclude(self.dht, self.cfg.prefix, self.step, self.peer, self.spec.index,
                    self.attempt)
        with self.cv:
            old = self.averager
            self._finish_update()
            self.stage.close()
        old.shutdown()
        self.move_to = None
        self._enter(to)


def period_of(t: float, period: float) -> int:
    """Which rebalancing period DHT time `t` is in: a server decides at the first tick of each
    (the same tick on every server, whatever T is)."""
    return math.floor(t / period + 1e-9)


__all__ = ["EVENT_TICK_S", "GUESS_S", "READ_AHEAD_S", "Rebalancing", "period_of"]
