"""Swarm simulation: a churn trace + a rebalancing policy -> SWARM pipeline throughput over time
and its time average as a share of the optimal one (SWARM, Ryabinin et al. 2023, App. I).

Two models, one validating the other.

`simulate_wiring` (event level, a fixed swarm): trainers route every micro-batch through one
server per stage by Algorithm 1 (stochastic wiring: per stage a priority queue of servers
keyed by accumulated expected response time, each use adding the server's EMA of response
time; interleaved weighted round robin), forward through the stages and back. Servers are
FIFO queues; a micro-batch's work at a stage takes microbatch_s / speed (split between its
forward and its backward). It measures the pipeline throughput against the flow model's,
min over stages of the sum of the servers' speeds / microbatch_s.

`simulate_swarm` (flow model, hundreds of peers over a 32-hour trace): stochastic wiring is
taken to split each stage's work in proportion to its servers' speeds and the trainers to
keep the pipeline saturated, so between two events the throughput is constant, the lowest
stage throughput over the servers that have their stage's state. `simulate_wiring` checks
the assumption (tests/swarm/test_swarm_sim.py: >= 95% of it with enough micro-batches in flight);
a shortfall would scale policy and optimum alike. Events:

- start: the trace's initial peers, assigned by `best_assignment`, serving at t = 0;
- churn (a `ChurnTrace`): a leave removes one live peer. With removal="stage" (SWARM App. I)
  its stage is drawn uniformly among the stages that have live peers, then the peer
  uniformly within it; with removal="peer", any live peer, equally likely (independent
  preemptions of identical VMs). A join brings a new peer, which takes the stage
  `choose_join_stage` gives (join="neediest") or a uniformly random one (join="random", a
  swarm without the protocol), downloads the stage's state and then serves;
- every `rebalance_period_s` (None: never) all peers evaluate `choose_move` on the same
  snapshot and at most one peer moves (Algorithm 2); it stops serving at once and serves
  its new stage once it has downloaded that stage's state: stage_state_bytes over its own
  bandwidth. Peers still downloading report their stage and speed (they count for its
  throughput in the snapshot, so two periods do not send two peers for one gap) and are not
  moved again meanwhile.

What a peer reports: its speed / microbatch_s as its throughput and, the flow model having
no queues, an empty queue (so `choose_move` picks, of the servers that may move, the one
whose move gains most).

Optimal: at each moment the best assignment of the peers that hold some stage's state
(serving or migrating; newcomers count once their first download is done), with no moving
cost: exact (`best_assignment`) for up to `exact_limit` such peers, else the upper bound
`assignment_bound`. With hundreds of peers the bound is within a fraction of a percent of
what `best_assignment` reaches (bench/swarm_bench.py prints the gap), and a bound only makes
the reported share of optimal lower than the true one.

Cost: O(peers) per join and per rebalancing period, O(1) otherwise; 400 peers over a 32-hour
trace with T = 60 s take about a second.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from atomc.swarm.balance import (
    ServerLoad,
    assignment_bound,
    best_assignment,
    choose_join_stage,
    choose_move,
    min_stage_throughput,
)

HOUR_S = 3600.0


@dataclass(frozen=True)
class SwarmSimConfig:
    """A swarm, its churn and its policy. Defaults: SWARM's App. I setting (4 stages, 32 h)
    with the 400 preemptible T4 peers of its Sec. 4.3; see bench/swarm_bench.py for the
    sources and the calibration of the churn."""

    num_stages: int = 4
    num_peers: int = 400  # at the start, assigned by best_assignment and serving
    duration_h: float = 32.0
    # churn (synthetic_churn_trace): Poisson preemptions, each live peer at rate
    # 1 / mean_lifetime_h, in bursts of burst_mean peers on average (1: one at a time); each
    # preempted peer is replaced with probability replace_probability after an exponential
    # delay of mean replace_delay_s. SWARM gives its trace only as a plot (Fig. 5) and no
    # rate: 12 h and 0.8 are calibrated so that no rebalancing loses about what it lost
    # there (Table 5: 82.7%); 10 min to relaunch an instance is ours
    mean_lifetime_h: float = 12.0
    replace_probability: float = 0.8
    replace_delay_s: float = 600.0
    burst_mean: float = 1.0
    removal: str = "stage"  # "stage" (SWARM App. I) or "peer"
    # peers: speed (1 = the median peer) and download bandwidth, both lognormal with median 1
    # and 500 Mbit/s (SWARM Table 3: a T4 takes ~400 Mbit/s; Sec. 4.3: ~100 more in training);
    # the spread of speeds is ours (App. I's peers are identical T4s)
    speed_sigma: float = 0.3
    bandwidth_mbps: float = 500.0
    bandwidth_sigma: float = 0.3
    # a stage's weights and Adam state: 1.01B parameters over 3 stages (Sec. 4.3) x 12 bytes
    stage_state_bytes: float = 4.0e9
    microbatch_s: float = 1.0  # forward + backward of one micro-batch, one stage, speed 1
    # policy
    rebalance_period_s: float | None = 300.0  # None: no rebalancing
    join: str = "neediest"  # "neediest" (choose_join_stage) or "random"
    min_gain: float = 0.0  # choose_move's
    exact_limit: int = 14
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.num_peers < 0 or self.duration_h <= 0:
            raise ValueError(f"a swarm needs >= 1 stage, >= 0 peers and a positive duration "
                             f"(got {self.num_stages}, {self.num_peers}, {self.duration_h} h)")
        if self.removal not in ("stage", "peer"):
            raise ValueError(f"removal {self.removal!r}: use 'stage' or 'peer'")
        if self.join not in ("neediest", "random"):
            raise ValueError(f"join {self.join!r}: use 'neediest' or 'random'")
        if self.rebalance_period_s is not None and self.rebalance_period_s <= 0:
            raise ValueError(f"rebalance_period_s {self.rebalance_period_s}: give a positive "
                             f"period, or None for no rebalancing")
        if self.mean_lifetime_h <= 0 or self.bandwidth_mbps <= 0 or self.microbatch_s <= 0:
            raise ValueError("mean_lifetime_h, bandwidth_mbps and microbatch_s must be positive")
        if self.burst_mean < 1:
            raise ValueError(f"burst_mean {self.burst_mean}: a burst preempts at least one peer")
        if not 0 <= self.replace_probability <= 1:
            raise ValueError(f"replace_probability {self.replace_probability}: a probability "
                             f"lies in [0, 1]")

    @property
    def duration_s(self) -> float:
        return self.duration_h * HOUR_S


@dataclass(frozen=True)
class ChurnTrace:
    """Who is there at the start, and every later join (+1) and leave (-1), in time order.

    A join brings a peer of the given speed and bandwidth; a leave names no peer (the
    simulator draws the victim, see `SwarmSimConfig.removal`)."""

    initial_speeds: np.ndarray
    initial_bandwidths_mbps: np.ndarray
    times_s: np.ndarray
    deltas: np.ndarray  # +1 join, -1 leave
    speeds: np.ndarray  # of the joining peer (0 for a leave)
    bandwidths_mbps: np.ndarray

    def num_live(self) -> tuple[np.ndarray, np.ndarray]:
        """(times_s, live peers just after each event), starting at t = 0."""
        counts = len(self.initial_speeds) + np.cumsum(self.deltas)
        return (np.concatenate(([0.0], self.times_s)),
                np.concatenate(([len(self.initial_speeds)], counts)))


def synthetic_churn_trace(config: SwarmSimConfig) -> ChurnTrace:
    """Preemptions as a Poisson process (each live peer at rate 1 / mean_lifetime_h, so the
    swarm's rate follows its size), in bursts of a geometric number of peers of mean
    burst_mean (at rate 1 / (mean_lifetime_h x burst_mean) per peer, so a peer's rate stays
    the same), each preempted peer followed with probability replace_probability by a
    replacement that joins after an exponential delay (the cloud relaunching the instance
    when it has capacity). Deterministic in config.seed; independent of the policy, so every
    policy meets the same trace."""
    rng = np.random.default_rng([config.seed, 0])

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        speeds = np.exp(rng.normal(0.0, config.speed_sigma, n)) if config.speed_sigma else \
            np.ones(n)
        bws = config.bandwidth_mbps * (np.exp(rng.normal(0.0, config.bandwidth_sigma, n))
                                       if config.bandwidth_sigma else np.ones(n))
        return speeds, bws

    initial_speeds, initial_bws = draw(config.num_peers)
    rate_per_peer = 1.0 / (config.mean_lifetime_h * HOUR_S * config.burst_mean)
    end = config.duration_s
    live = config.num_peers
    t = 0.0
    pending: list[float] = []
    times: list[float] = []
    deltas: list[int] = []
    while True:
        # competing exponentials: the next preemption is redrawn after every event
        leave_at = t + rng.exponential(1.0 / (rate_per_peer * live)) if live else math.inf
        if pending and pending[0] <= leave_at:
            t = heapq.heappop(pending)
            if t >= end:
                break
            live += 1
            deltas.append(1)
            times.append(t)
        else:
            t = leave_at
            if t >= end:
                break
            burst = 1 if config.burst_mean == 1 else \
                min(live, int(rng.geometric(1.0 / config.burst_mean)))
            for _ in range(burst):
                live -= 1
                deltas.append(-1)
                times.append(t)
                if rng.random() < config.replace_probability:
                    heapq.heappush(pending, t + rng.exponential(config.replace_delay_s))
    d = np.asarray(deltas, dtype=np.int64)
    speeds, bws = draw(len(d))
    return ChurnTrace(initial_speeds, initial_bws, np.asarray(times, dtype=float), d,
                      np.where(d > 0, speeds, 0.0), np.where(d > 0, bws, 0.0))


@dataclass(frozen=True)
class SwarmSimResult:
    """Throughput and optimum, piecewise constant: values[k] holds on [times_s[k],
    times_s[k + 1]); times_s ends at the end of the trace. Throughputs in micro-batches/s."""

    config: SwarmSimConfig
    times_s: np.ndarray = field(repr=False)
    throughput: np.ndarray = field(repr=False)
    optimal: np.ndarray = field(repr=False)
    num_live: np.ndarray = field(repr=False)  # live peers (serving or downloading)
    num_moves: int = 0
    num_joins: int = 0
    num_leaves: int = 0

    def _integral(self, values: np.ndarray, start_s: float, end_s: float) -> float:
        lo = np.clip(self.times_s[:-1], start_s, end_s)
        hi = np.clip(self.times_s[1:], start_s, end_s)
        return float(np.sum(values * (hi - lo)))

    def percent_of_optimal(self, start_s: float = 0.0, end_s: float | None = None) -> float:
        """100 x (integral of throughput) / (integral of optimum) over [start_s, end_s]."""
        end = self.times_s[-1] if end_s is None else end_s
        opt = self._integral(self.optimal, start_s, end)
        return 100.0 * self._integral(self.throughput, start_s, end) / opt if opt > 0 else 100.0

    def sample(self, step_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(times, throughput, optimal) every step_s seconds from 0."""
        t = np.arange(0.0, self.times_s[-1], step_s)
        k = np.searchsorted(self.times_s, t, side="right") - 1
        return t, self.throughput[k], self.optimal[k]

    def __str__(self) -> str:
        c = self.config
        period = "none" if c.rebalance_period_s is None else f"T={c.rebalance_period_s:g}s"
        last = max(0.0, c.duration_s - HOUR_S)
        return (f"swarm {c.num_stages} stages, {c.num_peers} peers, {c.duration_h:g} h, "
                f"rebalancing {period}, joins {c.join}: {self.percent_of_optimal():.1f}% of "
                f"optimal (first 1h {self.percent_of_optimal(0, HOUR_S):.1f}%, last 1h "
                f"{self.percent_of_optimal(last):.1f}%), {self.num_moves} moves, "
                f"{self.num_joins} joins, {self.num_leaves} leaves")


# peer states
_GONE, _LOADING, _SERVING = 0, 1, 2
# event kinds, in the order they apply at one instant
_CHURN, _READY, _TICK = 0, 1, 2


def simulate_swarm(config: SwarmSimConfig, trace: ChurnTrace | None = None) -> SwarmSimResult:
    """Run `config`'s policy over `trace` (default: synthetic_churn_trace(config))."""
    if trace is None:
        trace = synthetic_churn_trace(config)
    return _SwarmRun(config, trace).run()


class _SwarmRun:
    def __init__(self, config: SwarmSimConfig, trace: ChurnTrace) -> None:
        self.c = config
        self.trace = trace
        n0 = len(trace.initial_speeds)
        n = n0 + int(np.sum(trace.deltas > 0))
        self.speed = np.zeros(n)
        self.bw = np.zeros(n)
        self.speed[:n0] = trace.initial_speeds
        self.bw[:n0] = trace.initial_bandwidths_mbps
        self.state = [_GONE] * n
        self.stage = [0] * n
        self.epoch = [0] * n  # invalidates a download's end when its peer moved or left
        self.opt_speed = np.zeros(n)  # speed of the peers that count for the optimum
        self.num_opt = 0
        self.opt_cache: float | None = None
        self.stage_tput = [0.0] * config.num_stages  # serving peers' micro-batches/s
        self.members: list[list[int]] = [[] for _ in range(config.num_stages)]  # live peers
        self.where: dict[int, int] = {}  # peer -> index in its stage's member list
        self.reports: dict[int, ServerLoad] = {}  # live peer -> what it reports
        self.victims = np.random.default_rng([config.seed, 1])
        self.joins = np.random.default_rng([config.seed, 2])
        self.events: list[tuple[float, int, int, int]] = []  # (time, kind, seq, peer)
        self.seq = 0
        self.changed = True  # since the last snapshot that gave no move
        self.num_moves = 0

    # --- bookkeeping -------------------------------------------------------------------------

    def _tput(self, peer: int) -> float:
        return float(self.speed[peer]) / self.c.microbatch_s

    def _enter(self, peer: int, stage: int, state: int) -> None:
        self.stage[peer] = stage
        self.state[peer] = state
        self.where[peer] = len(self.members[stage])
        self.members[stage].append(peer)
        if state == _SERVING:
            self.stage_tput[stage] += self._tput(peer)
        self._report(peer)
        self.changed = True

    def _report(self, peer: int) -> None:
        self.reports[peer] = ServerLoad(str(peer), self.stage[peer], self._tput(peer), 0.0,
                                        loading=self.state[peer] == _LOADING)

    def _leave_stage(self, peer: int) -> None:
        stage = self.stage[peer]
        group = self.members[stage]
        i = self.where.pop(peer)
        last = group.pop()
        if last != peer:
            group[i] = last
            self.where[last] = i
        if self.state[peer] == _SERVING:
            self.stage_tput[stage] -= self._tput(peer)
        self.state[peer] = _GONE
        del self.reports[peer]
        self.epoch[peer] += 1
        self.changed = True

    def _count_for_optimum(self, peer: int, on: bool) -> None:
        self.opt_cache = None
        if on and not self.opt_speed[peer]:
            self.num_opt += 1
        elif not on and self.opt_speed[peer]:
            self.num_opt -= 1
        self.opt_speed[peer] = self.speed[peer] if on else 0.0

    def _download(self, peer: int, now: float) -> None:
        seconds = self.c.stage_state_bytes * 8 / (self.bw[peer] * 1e6)
        self._push(now + seconds, _READY, peer)

    def _push(self, time: float, kind: int, peer: int) -> None:
        # the epoch rides in the payload: a stale download end is dropped
        heapq.heappush(self.events, (time, kind, self.seq, peer * 1_000_003 + self.epoch[peer]))
        self.seq += 1

    def pipeline(self) -> float:
        return max(0.0, min(self.stage_tput))

    def optimum(self) -> float:
        if self.opt_cache is None:
            self.opt_cache = self._optimum()
        return self.opt_cache

    def _optimum(self) -> float:
        c = self.c
        if self.num_opt <= c.exact_limit:
            x = self.opt_speed[self.opt_speed > 0]
            assign = best_assignment(x, c.num_stages, exact_limit=c.exact_limit)
            return min_stage_throughput(x, assign, c.num_stages) / c.microbatch_s if len(x) \
                else 0.0
        return assignment_bound(self.opt_speed, c.num_stages) / c.microbatch_s

    def snapshot(self) -> list[ServerLoad]:
        """Every live peer's report (see the module docstring)."""
        return list(self.reports.values())

    # --- events ------------------------------------------------------------------------------

    def start(self) -> None:
        c = self.c
        n0 = len(self.trace.initial_speeds)
        assign = best_assignment(self.speed[:n0], c.num_stages, exact_limit=c.exact_limit)
        for p, s in enumerate(assign):
            self._enter(p, s, _SERVING)
            self._count_for_optimum(p, True)

    def churn(self, k: int, now: float, next_peer: int) -> int:
        """Apply trace event k; returns the next new peer's index."""
        c = self.c
        if self.trace.deltas[k] > 0:
            p = next_peer
            self.speed[p] = self.trace.speeds[k]
            self.bw[p] = self.trace.bandwidths_mbps[k]
            if c.join == "neediest":
                stage = choose_join_stage(self.snapshot(), c.num_stages)
            else:
                stage = int(self.joins.integers(c.num_stages))
            self._enter(p, stage, _LOADING)
            self._download(p, now)
            return next_peer + 1
        if c.removal == "stage":
            stages = [s for s in range(c.num_stages) if self.members[s]]
            if not stages:
                return next_peer
            group = self.members[stages[int(self.victims.integers(len(stages)))]]
            victim = group[int(self.victims.integers(len(group)))]
        else:
            live = [p for group in self.members for p in group]
            if not live:
                return next_peer
            victim = live[int(self.victims.integers(len(live)))]
        self._leave_stage(victim)
        self._count_for_optimum(victim, False)
        return next_peer

    def ready(self, peer: int) -> None:
        self.state[peer] = _SERVING
        self.stage_tput[self.stage[peer]] += self._tput(peer)
        self._report(peer)
        self._count_for_optimum(peer, True)
        self.changed = True

    def tick(self, now: float) -> None:
        if not self.changed:  # the same snapshot gives the same answer: none
            return
        move = choose_move(self.snapshot(), self.c.num_stages, self.c.min_gain)
        self.changed = False
        if move is None:
            return
        p = int(move.peer)
        self._leave_stage(p)
        self._enter(p, move.to_stage, _LOADING)
        self._download(p, now)
        self.num_moves += 1

    def run(self) -> SwarmSimResult:
        c = self.c
        end = c.duration_s
        self.start()
        trace_t = self.trace.times_s
        for k, t in enumerate(trace_t):
            heapq.heappush(self.events, (float(t), _CHURN, -len(trace_t) + k, k))
        if c.rebalance_period_s is not None:
            self._push(c.rebalance_period_s, _TICK, 0)
        next_peer = len(self.trace.initial_speeds)
        times, tputs, opts, lives = [0.0], [self.pipeline()], [self.optimum()], [next_peer]
        live = next_peer
        num_joins = num_leaves = 0
        while self.events and self.events[0][0] < end:
            now, kind, _, payload = heapq.heappop(self.events)
            if kind == _CHURN:
                next_peer = self.churn(payload, now, next_peer)
                live = sum(len(group) for group in self.members)
                if self.trace.deltas[payload] > 0:
                    num_joins += 1
                else:
                    num_leaves += 1
            elif kind == _READY:
                peer, epoch = divmod(payload, 1_000_003)
                if self.state[peer] != _LOADING or self.epoch[peer] != epoch:
                    continue
                self.ready(peer)
            else:
                self.tick(now)
                self._push(now + c.rebalance_period_s, _TICK, 0)
                if not self.changed:
                    continue
            x, opt = self.pipeline(), self.optimum()
            if now == times[-1]:
                tputs[-1], opts[-1], lives[-1] = x, opt, live
            elif x != tputs[-1] or opt != opts[-1] or live != lives[-1]:
                times.append(now)
                tputs.append(x)
                opts.append(opt)
                lives.append(live)
        times.append(end)
        return SwarmSimResult(
            config=c, times_s=np.asarray(times), throughput=np.asarray(tputs),
            optimal=np.asarray(opts), num_live=np.asarray(lives), num_moves=self.num_moves,
            num_joins=num_joins, num_leaves=num_leaves)


# ---------------------------------------------------------------------------------------------
# event level: Algorithm 1 over a fixed swarm


@dataclass(frozen=True)
class WiringResult:
    """Stochastic wiring over a fixed swarm: what the pipeline did against the flow model."""

    throughput: float  # micro-batches/s completed, measured after a warm-up
    capacity: float  # the flow model's: min over stages of sum(speed) / microbatch_s
    busy: tuple[tuple[float, ...], ...]  # per stage, per server: busy fraction when measured
    jobs: tuple[tuple[int, ...], ...]  # per stage, per server: micro-batches served (fwd)

    @property
    def efficiency(self) -> float:
        return self.throughput / self.capacity if self.capacity > 0 else 0.0


def simulate_wiring(stage_speeds: Sequence[Sequence[float]], *, num_trainers: int = 4,
                    inflight: int | None = None, num_microbatches: int = 4000,
                    microbatch_s: float = 1.0, backward_ratio: float = 2.0,
                    gamma: float = 0.1, latency_s: float = 0.0, epsilon: float = 1e-3,
                    seed: int = 0) -> WiringResult:
    """Route `num_microbatches` micro-batches by Algorithm 1 through servers of the given
    speeds (stage_speeds[s][j]: server j of stage s), forward through the stages, then
    backward (which, as in SWARM, may go to any server of the stage).

    Each of `num_trainers` trainers keeps its share of `inflight` micro-batches in flight
    (default: two per server), with its own priority queues and EMAs (smoothing `gamma`,
    initial priority and EMA `epsilon`). A hop's work is microbatch_s / speed split 1 :
    backward_ratio between forward and backward; its response time adds `latency_s`. The
    EMA is kept per unit of work (time / the hop's share of a micro-batch) and a choice adds
    EMA x share to the server's priority, so forward and backward hops price alike.
    Throughput is measured from the middle completion to the start of the drain.
    """
    num_stages = len(stage_speeds)
    if num_stages < 1 or any(len(s) == 0 for s in stage_speeds):
        raise ValueError("every stage needs at least one server")
    speeds = [np.asarray(s, dtype=float) for s in stage_speeds]
    if any(np.any(s <= 0) for s in speeds):
        raise ValueError("server speeds must be positive")
    num_servers = sum(len(s) for s in speeds)
    inflight = 2 * num_servers if inflight is None else inflight
    rng = np.random.default_rng(seed)
    share = (1.0 / (1.0 + backward_ratio), backward_ratio / (1.0 + backward_ratio))
    # per trainer, per stage: priorities (random tie-breaks, like SWARM's balancer) and EMAs
    prio = [[epsilon * (1 + 1e-6 * rng.random(len(s))) for s in speeds]
            for _ in range(num_trainers)]
    ema = [[np.full(len(s), epsilon) for s in speeds] for _ in range(num_trainers)]
    free = [np.zeros(len(s)) for s in speeds]  # when each server's FIFO queue empties
    log: list[tuple[float, int, int, float, bool]] = []  # (arrival, stage, server, work, fwd)
    hops = 2 * num_stages
    events: list[tuple[float, int, int, int]] = []  # (time, seq, trainer, hop)
    seq = 0
    for m in range(min(inflight, num_microbatches)):
        heapq.heappush(events, (0.0, seq, m % num_trainers, 0))
        seq += 1
    started = min(inflight, num_microbatches)
    done_times: list[float] = []
    while events:
        now, _, trainer, hop = heapq.heappop(events)
        if hop == hops:
            done_times.append(now)
            if started < num_microbatches:
                heapq.heappush(events, (now, seq, trainer, 0))
                seq += 1
                started += 1
            continue
        forward = hop < num_stages
        stage = hop if forward else hops - 1 - hop
        part = share[0] if forward else share[1]
        p, e = prio[trainer][stage], ema[trainer][stage]
        j = int(np.argmin(p))  # Algorithm 1, choose_server: the top of the queue
        p[j] += e[j] * part
        arrive = now + latency_s
        work = part * microbatch_s / speeds[stage][j]
        begin = max(arrive, free[stage][j])
        finish = free[stage][j] = begin + work
        log.append((arrive, stage, j, work, forward))
        e[j] = gamma * ((finish - now) / part) + (1 - gamma) * e[j]
        heapq.heappush(events, (finish, seq, trainer, hop + 1))
        seq += 1
    return _wiring_result(speeds, log, done_times, inflight, num_microbatches, microbatch_s)


def _wiring_result(speeds: list[np.ndarray], log: list[tuple[float, int, int, float, bool]],
                   done_times: list[float], inflight: int, num_microbatches: int,
                   microbatch_s: float) -> WiringResult:
    """Throughput and each server's load over the steady window of a routed run: `log` holds
    each hop's (arrival, stage, server, work, forward), `done_times` the completions."""
    # the measured window: from the middle completion to the one where the swarm starts to
    # drain (no new micro-batches), so neither the ramp-up nor the drain counts
    first = len(done_times) // 2
    last = max(first + 1, len(done_times) - 1 - inflight)
    if last >= len(done_times) or done_times[last] <= done_times[first]:
        raise ValueError(f"{num_microbatches} micro-batches with {inflight} in flight leave no "
                         f"steady window to measure: route more micro-batches")
    t0, t1 = done_times[first], done_times[last]
    throughput = (last - first) / (t1 - t0)
    busy = [np.zeros(len(s)) for s in speeds]
    jobs = [np.zeros(len(s), dtype=np.int64) for s in speeds]
    for arrive, stage, j, work, forward in log:
        if t0 <= arrive < t1:
            busy[stage][j] += work
            jobs[stage][j] += forward
    capacity = min(float(s.sum()) for s in speeds) / microbatch_s
    return WiringResult(
        throughput=throughput, capacity=capacity,
        busy=tuple(tuple(float(v) / (t1 - t0) for v in b) for b in busy),
        jobs=tuple(tuple(int(v) for v in j) for j in jobs))
