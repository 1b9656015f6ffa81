"""Rebalance: the servers' reported loads -> which server changes stage, which stage a newcomer
takes, and the best static assignment (SWARM, Ryabinin et al. 2023, Sec. 3.2 and Algorithm 2).

Pure Python with numpy, shared by the SWARM servers (atomc.swarm) and the swarm simulator
(atomc.swarm.simulate). Every function is deterministic in its inputs (ties go to the lower
stage index, then the lower peer id), so every peer that evaluates it on the same snapshot of
the DHT reaches the same decision, as Algorithm 2 needs: each peer decides alone whether it
is the one that moves.

Units: a server's `queue` and `throughput` are in one unit of work, micro-batches (queue:
micro-batches waiting or in service; throughput: micro-batches per second it serves on its
stage). Stages cost the same unless `cost` says otherwise (each stage's time per micro-batch
on one server, relative): SWARM's experiments use identical blocks, but a server of the last
stage runs only a backward call (the forward is in it) while the others run a forward call
too, so the last stage costs less per sample. A server of throughput v on stage a then serves
stage b at v * cost[a] / cost[b]; taking the stages alike would send servers back and forth
between a cheap stage and a dear one. A pipeline's throughput X is its lowest stage throughput,
a stage's throughput T_s being the sum of its servers'.

Load of a stage (`stage_loads`): X / T_s, the share of its capacity that the pipeline's flow
uses (its utilisation; 1 at the bottleneck, inf for a stage without servers). Every
micro-batch visits every stage, so every stage meets the same demand X and the most loaded
stage is the one of least throughput. Algorithm 2 measures load as the sum of the stage's
queue sizes (lines 3-18), which is how this shows in a saturated pipeline: queues form where
utilisation is highest. As a ranking signal, though, queue sums mislead: a stage of many slow
servers holds more queued micro-batches than one of few fast servers of the same throughput,
and near-tied stages all fill up to the trainers' in-flight limit. So stages are ranked by
throughput, and queues choose which server of the source stage moves (Algorithm 2, lines
21-26: the one with the least work in flight to drop). An empty stage is the most in need
(Algorithm 2 as printed sums nothing for it, ranks it least loaded and never fills it).

No-flap rule (`choose_move`): a server of throughput v moves from stage a (least loaded) to
stage b (most loaded) only when the lower of the two stages' throughputs rises strictly,
min(T_a - v, T_b + v) > min(T_a, T_b) = T_b; that is, v < T_a - T_b. Every move then raises
the stage throughputs, sorted ascending, lexicographically, so no sequence of moves returns
to an earlier assignment (no A -> B -> A), a stage is never emptied, and the pipeline
throughput (the lowest stage) never falls. Requiring the minimum itself to rise would stall
at ties: from stage throughputs (10, 10, 8, 8) no single move raises the minimum, yet two
moves reach (9, 9, 9, 9).

Small swarms (`plan_moves`): with a few unequal servers single moves stall short of the best
assignment (servers of 1 and 1 against 2 and 2: only a trade reaches 3 and 3). Where the
assignments of the movable servers can be counted (4096 or fewer), every one is, and the
servers whose stage differs in the best one move together; beyond that, Algorithm 2.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ServerLoad:
    """What one server reports each rebalancing period (Algorithm 2, lines 3-4)."""

    peer: str
    stage: int
    throughput: float  # micro-batches/s it serves
    queue: float  # micro-batches waiting or in service there
    # still downloading its stage's state (it just joined or moved): it counts for its
    # stage's throughput, so that the next decision does not send a second server for the
    # same gap, but it is not moved again until it serves
    loading: bool = False
    # its throughput on each stage it served before, as it measured it there (0: never
    # served): stages' costs estimate the rest (`rate_on`)
    served: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not (self.stage >= 0 and self.throughput >= 0 and self.queue >= 0
                and all(x >= 0 for x in self.served)):
            raise ValueError(f"server {self.peer} reports stage {self.stage}, throughput "
                             f"{self.throughput}, queue {self.queue}, rates where it served "
                             f"{list(self.served)}: all must be non-negative numbers")


@dataclass(frozen=True)
class Move:
    """`peer` leaves `from_stage` for `to_stage`; the stages' throughputs before the move."""

    peer: str
    from_stage: int
    to_stage: int
    from_throughput: float
    to_throughput: float

    def __str__(self) -> str:
        return (f"{self.peer}: stage {self.from_stage} ({self.from_throughput:.3g}/s) -> "
                f"stage {self.to_stage} ({self.to_throughput:.3g}/s)")


def stage_throughputs(servers: Sequence[ServerLoad], num_stages: int) -> list[float]:
    """Each stage's throughput: the sum of its servers' (0 for a stage without servers)."""
    if num_stages < 1:
        raise ValueError(f"num_stages {num_stages}: a pipeline has at least one stage")
    out = [0.0] * num_stages
    try:
        for s in servers:  # ServerLoad checked the signs; the stage's range is checked here
            out[s.stage] += s.throughput
    except IndexError:
        bad = next(s for s in servers if s.stage >= num_stages)
        raise ValueError(f"server {bad.peer} reports stage {bad.stage}, outside the "
                         f"pipeline's {num_stages} stages (0..{num_stages - 1})") from None
    return out


def stage_loads(servers: Sequence[ServerLoad], num_stages: int) -> list[float]:
    """Each stage's load: the pipeline's throughput over the stage's (its utilisation when
    the pipeline runs flat out); inf for a stage that nothing serves."""
    throughput = stage_throughputs(servers, num_stages)
    x = min(throughput)
    return [x / t if t > 0 else math.inf for t in throughput]


def rate_on(server: ServerLoad, stage: int, cost: Sequence[float] | None = None) -> float:
    """`server`'s throughput on `stage`: where it is, or where it measured it before, or its
    throughput scaled by the two stages' costs. A profile's cost ratio is an estimate, so a
    rate the server measured on the stage itself counts first."""
    if stage == server.stage:
        return server.throughput
    if stage < len(server.served) and server.served[stage] > 0:
        return server.served[stage]
    if cost is None:
        return server.throughput
    return server.throughput * cost[server.stage] / cost[stage]


def _most_loaded(throughput: list[float]) -> int:
    # the least throughput is the highest load; ties: the lower index
    return min(range(len(throughput)), key=lambda s: (throughput[s], s))


def _check_policy(num_stages: int, min_gain: float, cost: Sequence[float] | None) -> None:
    if min_gain < 0:
        raise ValueError(f"min_gain {min_gain}: the gain asked of a move cannot be negative")
    if cost is not None and (len(cost) != num_stages or min(cost) <= 0):
        raise ValueError(f"stage costs {list(cost)}: give one positive cost per stage "
                         f"({num_stages})")


def choose_move(servers: Sequence[ServerLoad], num_stages: int, min_gain: float = 0.0,
                cost: Sequence[float] | None = None) -> Move | None:
    """Algorithm 2: a server of the least loaded stage moves to the most loaded one, or None.

    Of the least loaded stage's servers (not those still loading a stage), the candidates are
    those whose move satisfies the no-flap rule (module docstring), and the one with the
    smallest queue moves (Algorithm 2, lines 21-26); among equal queues, the one whose move
    leaves the two stages' lower throughput highest, then the lower peer id. None when no
    server qualifies: as far as one move can tell, the stages are balanced. `min_gain` (a
    fraction) asks for more: the lower throughput must rise by more than min_gain x T_b, so
    that noisy throughput estimates do not move servers for nothing. `cost`: each stage's
    relative time per micro-batch (module docstring; None: all alike).
    """
    _check_policy(num_stages, min_gain, cost)
    throughput = stage_throughputs(servers, num_stages)
    dst = _most_loaded(throughput)
    src = min(range(num_stages), key=lambda s: (-throughput[s], s))
    if src == dst:
        return None
    t_src, t_dst = throughput[src], throughput[dst]
    best: tuple | None = None
    for s in servers:
        if s.stage != src or s.loading:
            continue
        there = rate_on(s, dst, cost)
        lower = min(t_src - s.throughput, t_dst + there)
        if lower - t_dst <= min_gain * t_dst:
            continue
        key = (s.queue, -lower, s.peer)
        if best is None or key < best[0]:
            best = (key, s)
    if best is None:
        return None
    return Move(best[1].peer, src, dst, t_src, t_dst)


def plan_moves(servers: Sequence[ServerLoad], num_stages: int, min_gain: float = 0.0,
               cost: Sequence[float] | None = None, max_assignments: int = 4096
               ) -> list[Move] | None:
    """The best assignment of a small swarm as moves from the current one, or None when the
    swarm is too large to search (then `choose_move`).

    Single moves stall on few, unequal servers: with servers of 1 and 1 samples/s on stage 0
    and 2 and 2 on stage 1, moving a 2 gives (4, 2), no better, while a trade of a 1 and a 2
    reaches (3, 3). Stage costs make it worse: the fastest server belongs on the cheapest
    stage. So where the movable servers'
    assignments number at most `max_assignments` (num_stages ** movable), every one is tried
    (a server's throughput on another stage: `rate_on`). Each move is
    charged `min_gain` of the current pipeline throughput X (it downloads a stage's state
    and voids the gradients it held, and a plan of several moves made on noisy rates would be
    undone a period later): the winner has the highest X' - k min_gain X
    for k moves, then the fewest moves, then the lowest stage list, and its moves are
    returned only if that beats X ([] if not; for one move, `choose_move`'s test). Servers
    still loading stay where they are. Every peer evaluates the same snapshot and moves if
    the plan names it; the moves run at once, and the next decision waits until each moved
    server has served (its throughput is a guess until then).
    """
    _check_policy(num_stages, min_gain, cost)
    movable = sorted((s for s in servers if not s.loading), key=lambda s: s.peer)
    if num_stages ** len(movable) > max_assignments:
        return None
    now = stage_throughputs(servers, num_stages)
    base = stage_throughputs([s for s in servers if s.loading], num_stages)
    rates = np.array([[rate_on(s, t, cost) for t in range(num_stages)]
                      for s in movable]).reshape(len(movable), num_stages)
    current = tuple(s.stage for s in movable)
    x = min(now)
    best: tuple | None = None
    for assign in itertools.product(range(num_stages), repeat=len(movable)):
        sums = np.array(base)
        np.add.at(sums, list(assign), rates[np.arange(len(movable)), list(assign)])
        k = sum(a != c for a, c in zip(assign, current))
        # rounding must not pick a plan of more moves over an equal one
        key = (-round(float(sums.min()) - k * min_gain * x, 9), k, assign)
        if best is None or key < best:
            best = key
    if best is None or -best[0] <= x + 1e-9:
        return []
    return [Move(s.peer, s.stage, t, now[s.stage], now[t])
            for s, t in zip(movable, best[2]) if t != s.stage]


def choose_join_stage(servers: Sequence[ServerLoad], num_stages: int) -> int:
    """The stage a new server joins: the most loaded one, where a moving server would go
    (SWARM Sec. 3.2: a newcomer "is assigned to the optimal pipeline stage by following the
    same protocol"); a stage without servers first, then the lower index among equals. The
    newcomer's own speed does not change which stage needs it most."""
    return _most_loaded(stage_throughputs(servers, num_stages))


# ---------------------------------------------------------------------------------------------
# the best static assignment: max over assignments of the lowest stage throughput


def min_stage_throughput(throughputs: Sequence[float], assignment: Sequence[int],
                         num_stages: int) -> float:
    """The pipeline throughput of `assignment` (server i serves stage assignment[i])."""
    if len(assignment) != len(throughputs):
        raise ValueError(f"{len(assignment)} stages for {len(throughputs)} servers: give one "
                         f"stage per server")
    sums = np.zeros(num_stages)
    np.add.at(sums, np.asarray(assignment, dtype=np.int64), np.asarray(throughputs, float))
    return float(sums.min())


def assignment_bound(throughputs: Sequence[float], num_stages: int) -> float:
    """An upper bound on the best assignment's pipeline throughput.

    For every k < S: the S - k stages that hold none of the k fastest servers share at most
    the others' total, so the lowest stage has at most (total - k fastest) / (S - k). The
    bound is the least of these (k = 0 is total / S). What `best_assignment` finds is never
    more than (S - 1) / S x the fastest server below it (see there), so the bound is tight
    when servers are many and each small next to a stage's share.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages {num_stages}: a pipeline has at least one stage")
    x = np.asarray(throughputs, dtype=float)
    if len(x) < num_stages:
        return 0.0
    # the k fastest for k < S: the S - 1 largest, in decreasing order
    top = np.sort(np.partition(x, len(x) - num_stages + 1)[len(x) - num_stages + 1:])[::-1] \
        if num_stages > 1 else x[:0]
    rest = x.sum() - np.concatenate(([0.0], np.cumsum(top)))
    return float(min(rest / np.arange(num_stages, 0, -1)))


def best_assignment(throughputs: Sequence[float], num_stages: int,
                    exact_limit: int = 14) -> list[int]:
    """Servers of the given throughputs -> stages, maximising the lowest stage's throughput.

    The problem (max-min partitioning, "Santa Claus" on identical machines) is strongly
    NP-hard. Exact for up to `exact_limit` servers: branch and bound over the servers,
    fastest first, trying one stage of each distinct partial sum (stages are interchangeable),
    pruning a branch when its water-filling bound (the remaining servers poured as a liquid
    onto the lowest stages) cannot beat the best found. Beyond that: LPT (fastest first, each
    onto the currently slowest stage), whose lowest stage is at least total / S - (S - 1) /
    S x the fastest server (when the fullest stage took its last server, it was the lowest,
    so fullest - lowest <= fastest), then single moves and swaps between the slowest stage
    and another while they raise the lower of the two (as `choose_move`'s rule). Compare with
    `assignment_bound` for the gap that remains.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages {num_stages}: a pipeline has at least one stage")
    x = np.asarray(throughputs, dtype=float)
    if x.ndim != 1 or not np.all(x >= 0):
        raise ValueError("throughputs must be a list of non-negative numbers")
    n = len(x)
    if n == 0:
        return []
    order = np.argsort(-x, kind="stable")
    stage_of = _lpt(x, order, num_stages)
    if n < num_stages:  # some stage stays empty whatever we do: the minimum is 0
        return stage_of
    if n <= exact_limit:
        found = _branch_and_bound(x[order], num_stages,
                                  min_stage_throughput(x, stage_of, num_stages))
        if found is not None:
            for rank, s in enumerate(found):
                stage_of[int(order[rank])] = s
        return stage_of
    return _improve(x, stage_of, num_stages)


def _lpt(x: np.ndarray, order: np.ndarray, num_stages: int) -> list[int]:
    stage_of = [0] * len(x)
    heap = [(0.0, s) for s in range(num_stages)]
    for i in order:
        load, s = heapq.heappop(heap)
        stage_of[int(i)] = s
        heapq.heappush(heap, (load + float(x[i]), s))
    return stage_of


def _water_level(loads: list[float], remaining: float) -> float:
    """The highest minimum reachable by pouring `remaining` (divisible) onto `loads`."""
    level = sorted(loads)
    filled = 0.0
    for k in range(len(level)):
        nxt = level[k + 1] if k + 1 < len(level) else math.inf
        # raising the k+1 lowest stages from level[k] to nxt costs (k+1)(nxt - level[k])
        need = (k + 1) * (nxt - level[k])
        if filled + need >= remaining:
            return level[k] + (remaining - filled) / (k + 1)
        filled += need
    return math.inf  # unreachable: the last step has an infinite capacity


def _branch_and_bound(x: np.ndarray, num_stages: int, incumbent: float) -> list[int] | None:
    """Exact max-min assignment of x (sorted descending), or None if nothing beats
    `incumbent`."""
    xs = [float(v) for v in x]
    n = len(xs)
    suffix = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix[i] = suffix[i + 1] + xs[i]
    loads = [0.0] * num_stages
    chosen = [0] * n
    best: list = [incumbent, None]
    # the incumbent must be beaten by more than rounding, or rounding decides the winner
    eps = 1e-12 * max(suffix[0], 1.0)

    def visit(i: int) -> None:
        if i == n:
            low = min(loads)
            if low > best[0] + eps:
                best[0], best[1] = low, chosen.copy()
            return
        if _water_level(loads, suffix[i]) <= best[0] + eps:
            return
        tried: set[float] = set()
        for s in range(num_stages):
            if loads[s] in tried:
                continue
            tried.add(loads[s])
            loads[s] += xs[i]
            chosen[i] = s
            visit(i + 1)
            loads[s] -= xs[i]

    visit(0)
    return best[1]


def _improve(x: np.ndarray, stage_of: list[int], num_stages: int,
             max_rounds: int = 10_000) -> list[int]:
    """Moves and swaps between the slowest stage and another while one raises the lower of
    the two stages (best such exchange first)."""
    assign = np.asarray(stage_of, dtype=np.int64)
    for _ in range(max_rounds):
        sums = np.bincount(assign, weights=x, minlength=num_stages)
        a = int(np.argmin(sums))
        mine = np.flatnonzero(assign == a)
        best = (0.0, None)  # (rise of the pair's lower throughput, (b, give, take))
        for b in range(num_stages):
            gap = sums[b] - sums[a]
            if b == a or gap <= 0:
                continue
            theirs = np.flatnonzero(assign == b)
            # stage a takes server `give` of b and hands back `take` of a (or nothing):
            # a rises by d = x[give] - x[take], b falls by d; the pair's lower rises by
            # min(d, gap - d), positive for 0 < d < gap
            outs = np.concatenate(([0.0], x[mine]))
            d = x[theirs][:, None] - outs[None, :]
            rise = np.minimum(d, gap - d)
            k = np.unravel_index(int(np.argmax(rise)), rise.shape)
            if rise[k] > best[0] + 1e-12 * max(sums[b], 1.0):
                take = None if k[1] == 0 else int(mine[k[1] - 1])
                best = (float(rise[k]), (b, int(theirs[k[0]]), take))
        if best[1] is None:
            break
        b, give, take = best[1]
        assign[give] = a
        if take is not None:
            assign[take] = b
    return [int(s) for s in assign]
