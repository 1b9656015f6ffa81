"""Place stage: search for the partition into data-parallel groups of least cost (DT-FM 3.4).

input:  a CostModel (network, D_PP, D_DP, c_PP, c_DP), a strategy, a seed and a budget
output: the best partition found (D_PP groups of D_DP device indices), its cost, and the
        search's history (best total cost against evaluations and seconds)

Strategies:
- "ours": hybrid genetic algorithm (steady state: two parents, crossover, local search; the
  offspring replaces the worst member when it is better) whose local search takes DT-FM's
  swap candidates: for two groups C_j, C_k the two ends of each group's fastest internal
  link, four swaps, ranked by DT-FM's gain (a device's expected pipeline cost towards the
  other group minus its fast internal link, both sides).
- "kl": the same algorithm with Kernighan-Lin's gain instead (the decrease of the summed
  within-group link cost), taking its four best swaps of every pair of groups.
- "random": random partitions; the best is kept.

Both local searches try their candidates best gain first and take the first swap that beats
the current layout, until none does. "Beats" is lexicographic on (total, tie-breaker): the
model's max (slowest group) and bottleneck (slowest pair) terms are flat over wide plateaus,
where no single swap changes the total; the tie-breaker (mean group cost, and each pipeline
edge refined by how many of its pairs must stay at the bottleneck) still moves, so descent
goes on across them. Exact costs are cheap because a swap only changes two groups: eq. 2 of
two groups and the 2*D_PP - 3 pipeline edges touching them (cached by the pair of device
sets); a lower bound (every device's fastest partner in the other group, then Held-Karp)
rejects most swaps before any matching is solved.

The population starts from random partitions plus two built from the links alone: devices
in nearest-neighbour order cut into consecutive blocks (groups inside fast clusters) and
dealt round-robin (groups across clusters, so pipelines can stay inside one). Ties between
equal gains or equal links are broken at random.

Seeded with numpy's Generator: with an evaluation budget the result is reproducible; with a
time budget it is a prefix of that same trajectory, cut where the time ran out.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from atomc.errors import UsageError
from atomc.place.cost import CostModel

STRATEGIES = ("ours", "kl", "random")
CANDIDATES_PER_PAIR = 4  # DT-FM's four swaps; the KL variant keeps as many of its best
POPULATION_SIZE = 12
_EPS = 1e-12  # relative: an improvement must beat rounding
_JITTER = 1e-9  # relative noise that only reorders exact ties


@dataclass
class Budget:
    time_s: float | None = 5.0  # wall-clock seconds
    max_evals: int | None = None  # candidate layouts whose cost was bounded or computed
    patience: int | None = None  # stop after this many evaluations without a better layout

    def __post_init__(self) -> None:
        if self.time_s is not None and self.time_s <= 0:
            raise UsageError(f"time budget {self.time_s} s: expected a positive number of seconds")
        if self.max_evals is not None and self.max_evals <= 0:
            raise UsageError(f"evaluation budget {self.max_evals}: expected a positive count")
        if self.patience is not None and self.patience <= 0:
            raise UsageError(f"patience {self.patience}: expected a positive count of evaluations")
        if self.time_s is None and self.max_evals is None and self.patience is None:
            raise UsageError(
                "the search needs a limit: give a time budget, an evaluation budget or a patience"
            )


@dataclass
class PlacementResult:
    groups: np.ndarray  # (pp, dp) device indices, rows sorted
    total_s: float
    evaluations: int
    elapsed_s: float
    stopped: str  # "time", "evaluations", "converged" or "complete"
    history: list[tuple[int, float, float]] = field(default_factory=list)  # (evals, s, best total)


class _Stop(Exception):
    pass


@dataclass
class _State:
    groups: np.ndarray  # (pp, dp), rows sorted
    group_dp: np.ndarray  # (pp,) eq. 2 of each group
    edges: np.ndarray  # (pp, pp) exact coarsened graph (eq. 3)
    refined: np.ndarray  # (pp, pp) the edges refined for tie-breaking (matching.refined_values)
    total: float  # DP + 2*PP: what the search minimises
    tie: float  # mean group DP + 2 * open path over refined edges

    def beats(self, other: _State) -> bool:
        if self.total < other.total * (1 - _EPS):
            return True
        return self.total <= other.total * (1 + _EPS) and self.tie < other.tie * (1 - _EPS)


Proposer = Callable[[_State], list]


class Searcher:
    def __init__(self, model: CostModel, seed: int, budget: Budget):
        self.model = model
        self.rng = np.random.default_rng(seed)
        self.budget = budget
        self.evaluations = 0
        self.best: _State | None = None
        self.history: list[tuple[int, float, float]] = []
        self.last_improvement = 0
        self.start = time.perf_counter()
        # For each group j: the pair indices (into model.pair_j/pair_k) whose edge touches j.
        self._touching = [
            np.flatnonzero((model.pair_j == j) | (model.pair_k == j)) for j in range(model.pp)
        ]

    # -- budget and bookkeeping -----------------------------------------------------------------

    def _tick(self) -> None:
        """Count one evaluation; stop the search when a budget or convergence says so."""
        b = self.budget
        if b.max_evals is not None and self.evaluations >= b.max_evals:
            raise _Stop("evaluations")
        if b.time_s is not None and time.perf_counter() - self.start >= b.time_s:
            raise _Stop("time")
        if b.patience is not None and self.evaluations - self.last_improvement >= b.patience:
            raise _Stop("converged")
        self.evaluations += 1

    def _offer(self, state: _State) -> None:
        if self.best is None or state.total < self.best.total * (1 - _EPS):
            self.best = state
            self.last_improvement = self.evaluations
            self.history.append((self.evaluations, time.perf_counter() - self.start, state.total))

    def _tsp(self, edges: np.ndarray) -> float:
        return float(self.model.tsp_costs(edges[None])[0])

    def _set_pairs(self, matrix: np.ndarray, pairs: np.ndarray, values: np.ndarray) -> None:
        m = self.model
        matrix[m.pair_j[pairs], m.pair_k[pairs]] = values
        matrix[m.pair_k[pairs], m.pair_j[pairs]] = values

    # -- evaluations ------------------------------------------------------------------------------

    def full(self, groups: np.ndarray) -> _State:
        self._tick()
        return self._evaluate(groups)

    def _evaluate(self, groups: np.ndarray) -> _State:
        m = self.model
        groups = np.sort(groups, axis=1)
        group_dp = m.group_dp_costs(groups)
        edges, refined = np.zeros((m.pp, m.pp)), np.zeros((m.pp, m.pp))
        every = np.arange(len(m.pair_j))
        values, refined_values = m.edges_refined(groups[m.pair_j], groups[m.pair_k])
        self._set_pairs(edges, every, values)
        self._set_pairs(refined, every, refined_values)
        total = float(group_dp.max()) + 2.0 * self._tsp(edges)
        tie = float(group_dp.mean()) + 2.0 * self._tsp(refined)
        state = _State(groups, group_dp, edges, refined, total, tie)
        self._offer(state)
        return state

    def bounded(self, groups: np.ndarray, bound: float) -> None:
        """Offer a random partition, proving most of them no better than `bound` by bounds alone."""
        self._tick()
        m = self.model
        groups = np.sort(groups, axis=1)
        dp_s = float(m.group_dp_costs(groups).max())
        if dp_s >= bound:
            return
        if dp_s + 2.0 * self._tsp(m.bound_matrix(groups)) >= bound * (1 - _EPS):
            return
        total = dp_s + 2.0 * self._tsp(m.edge_matrix(groups))
        if total < bound * (1 - _EPS):
            self._evaluate(groups)

    def try_swap(self, s: _State, j: int, x: int, k: int, y: int) -> _State | None:
        """The state after swapping groups[j][x] with groups[k][y], if it beats s."""
        self._tick()
        m = self.model
        groups = s.groups.copy()
        groups[j, x], groups[k, y] = s.groups[k, y], s.groups[j, x]
        groups[j].sort()
        groups[k].sort()
        group_dp = s.group_dp.copy()
        group_dp[j], group_dp[k] = m.group_dp_costs(groups[[j, k]])
        dp_s = float(group_dp.max())
        ceiling = s.total * (1 + _EPS)  # above this it cannot beat s, not even on the tie-breaker
        if dp_s > ceiling:
            return None
        pairs = np.union1d(self._touching[j], self._touching[k])
        a, b = groups[m.pair_j[pairs]], groups[m.pair_k[pairs]]
        lb = m.edge_bounds(a, b)
        edges = s.edges.copy()
        self._set_pairs(edges, pairs, lb)
        pp_lb = self._tsp(edges)
        if dp_s + 2.0 * pp_lb > ceiling:
            return None
        exact, refined_values = m.edges_refined(a, b)
        if np.array_equal(exact, lb):
            pp_s = pp_lb
        else:
            self._set_pairs(edges, pairs, exact)
            pp_s = self._tsp(edges)
        total = dp_s + 2.0 * pp_s
        if total > ceiling:
            return None
        refined = s.refined.copy()
        self._set_pairs(refined, pairs, refined_values)
        tie = float(group_dp.mean()) + 2.0 * self._tsp(refined)
        state = _State(groups, group_dp, edges, refined, total, tie)
        if not state.beats(s):
            return None
        self._offer(state)
        return state

    # -- local search -----------------------------------------------------------------------------

    def _jitter(self, shape: tuple[int, ...], scale: float) -> np.ndarray:
        return self.rng.random(shape) * (_JITTER * max(scale, 1e-300))

    def candidates_ours(self, s: _State) -> list[tuple[float, int, int, int, int]]:
        """DT-FM's swap candidates for every pair of groups, best gain first."""
        m, g = self.model, s.groups
        pp, dp = g.shape
        w = m.pp_link_s
        inside = w[g[:, :, None], g[:, None, :]]
        inside = inside + self._jitter(inside.shape, float(w.max()))
        inside[:, np.arange(dp), np.arange(dp)] = np.inf
        flat = inside.reshape(pp, -1).argmin(axis=1)
        ends = np.stack([flat // dp, flat % dp], axis=1)  # positions of the fastest link's two ends
        dev = np.take_along_axis(g, ends, axis=1)  # (pp, 2) devices
        partner = dev[:, ::-1]
        onehot = np.zeros((m.network.num_devices, pp))
        onehot[g, np.arange(pp)[:, None]] = 1.0 / dp
        mean_to = w @ onehot  # mean_to[d, k]: expected pipeline cost of d towards group k
        # term[j, e, k]: what end e of group j's fast link gains by going to group k.
        term = mean_to[dev] - w[dev, partner][:, :, None]  # (pp, 2, pp)
        jj, kk = m.pair_j, m.pair_k
        gain = term[jj, :, kk][:, :, None] + term[kk, :, jj][:, None, :]  # (pairs, 2, 2)
        noisy = gain + self._jitter(gain.shape, float(np.abs(gain).max()))
        order = np.argsort(-noisy.ravel(), kind="stable")
        p, e1, e2 = np.unravel_index(order, gain.shape)
        return list(
            zip(
                gain.ravel()[order].tolist(),
                jj[p].tolist(),
                ends[jj[p], e1].tolist(),
                kk[p].tolist(),
                ends[kk[p], e2].tolist(),
            )
        )

    def candidates_kl(self, s: _State) -> list[tuple[float, int, int, int, int]]:
        """Kernighan-Lin's best swaps for every pair of groups, best gain first. The weight is
        the data-parallel link cost, so the gain is the drop of the summed within-group cost
        (DT-FM's GAIN_KL with affinity = -cost)."""
        m, g = self.model, s.groups
        pp, dp = g.shape
        w = m.dp_link_s
        onehot = np.zeros((m.network.num_devices, pp))
        onehot[g, np.arange(pp)[:, None]] = 1.0
        to_group = w @ onehot  # summed cost from d to the members of group k
        jj, kk = m.pair_j, m.pair_k
        a, b = g[jj], g[kk]  # (pairs, dp)
        da = to_group[a, jj[:, None]] - to_group[a, kk[:, None]]  # a leaves j for k
        db = to_group[b, kk[:, None]] - to_group[b, jj[:, None]]
        gain = da[:, :, None] + db[:, None, :] + 2.0 * w[a[:, :, None], b[:, None, :]]
        flat = gain.reshape(len(jj), -1)
        noisy = flat + self._jitter(flat.shape, float(np.abs(flat).max()))
        keep = min(CANDIDATES_PER_PAIR, flat.shape[1])
        top = np.argpartition(-noisy, keep - 1, axis=1)[:, :keep]
        top_noisy = np.take_along_axis(noisy, top, axis=1)
        order = np.argsort(-top_noisy.ravel(), kind="stable")
        p, t = np.unravel_index(order, top.shape)
        cell = top[p, t]
        return list(
            zip(
                flat[p, cell].tolist(),
                jj[p].tolist(),
                (cell // dp).tolist(),
                kk[p].tolist(),
                (cell % dp).tolist(),
            )
        )

    def local_search(self, s: _State, propose: Proposer) -> _State:
        """Take the first candidate, in gain order, that beats the current state; stop when
        none does."""
        while True:
            for _gain, j, x, k, y in propose(s):
                better = self.try_swap(s, j, x, k, y)
                if better is not None:
                    s = better
                    break
            else:
                return s

    # -- genetic algorithm ------------------------------------------------------------------------

    def random_groups(self) -> np.ndarray:
        m = self.model
        return self.rng.permutation(m.network.num_devices).reshape(m.pp, m.dp)

    def link_seeds(self) -> list[np.ndarray]:
        """Devices in nearest-neighbour order (each next device the closest unvisited one),
        cut into consecutive blocks and dealt round-robin."""
        m = self.model
        n = m.network.num_devices
        link = m.pp_link_s + m.dp_link_s
        order = [0]
        left = np.ones(n, bool)
        left[0] = False
        for _ in range(n - 1):
            row = np.where(left, link[order[-1]], np.inf)
            nxt = int(row.argmin())
            order.append(nxt)
            left[nxt] = False
        order_arr = np.array(order)
        blocks = order_arr.reshape(m.pp, m.dp)
        dealt = order_arr.reshape(m.dp, m.pp).T.copy()
        return [blocks, dealt]

    def crossover(self, p1: np.ndarray, p2: np.ndarray) -> np.ndarray:
        """Devices keep the group both parents agree on; the rest take either parent's group at
        random (parent 2's groups renamed to the parent-1 groups they overlap most), then sizes
        are repaired by moving random extra members to groups that are short."""
        pp, dp = p1.shape
        n = pp * dp
        lab1, lab2 = np.empty(n, np.int64), np.empty(n, np.int64)
        lab1[p1] = np.arange(pp)[:, None]
        lab2[p2] = np.arange(pp)[:, None]
        overlap = np.zeros((pp, pp), np.int64)
        np.add.at(overlap, (lab2, lab1), 1)
        rename = np.full(pp, -1)
        used = np.zeros(pp, bool)
        for cell in np.argsort(-overlap.ravel(), kind="stable"):
            b, a = divmod(int(cell), pp)
            if rename[b] < 0 and not used[a]:
                rename[b], used[a] = a, True
        lab2 = rename[lab2]
        child = np.where(self.rng.random(n) < 0.5, lab1, lab2)
        counts = np.bincount(child, minlength=pp)
        for d in self.rng.permutation(n):
            if counts[child[d]] > dp:
                short = np.flatnonzero(counts < dp)
                target = short[self.rng.integers(len(short))]
                counts[child[d]] -= 1
                counts[target] += 1
                child[d] = target
        return np.argsort(child, kind="stable").reshape(pp, dp)

    def mutate(self, groups: np.ndarray, swaps: int) -> np.ndarray:
        pp, dp = groups.shape
        groups = groups.copy()
        for _ in range(swaps):
            j, k = self.rng.choice(pp, size=2, replace=False)
            x, y = self.rng.integers(dp, size=2)
            groups[j, x], groups[k, y] = groups[k, y], groups[j, x]
        return groups

    def genetic(self, propose: Proposer, population_size: int, link_seeds: bool) -> None:
        population: list[_State] = []
        keys: set[bytes] = set()
        starts = self.link_seeds() if link_seeds else []
        attempts = 0
        while len(population) < population_size and attempts < 4 * population_size:
            attempts += 1
            groups = starts.pop(0) if starts else self.random_groups()
            s = self.local_search(self.full(groups), propose)
            key = _key(s.groups)
            if key not in keys:
                population.append(s)
                keys.add(key)
        while True:
            p1 = self._tournament(population)
            p2 = self._tournament(population)
            child = self.crossover(p1.groups, p2.groups)
            if self.rng.random() < 0.5:
                child = self.mutate(child, 1 + int(self.rng.integers(self.model.pp)))
            s = self.local_search(self.full(child), propose)
            worst = max(range(len(population)), key=lambda i: population[i].total)
            key = _key(s.groups)
            if key not in keys and s.beats(population[worst]):
                keys.discard(_key(population[worst].groups))
                population[worst] = s
                keys.add(key)

    def _tournament(self, population: list[_State]) -> _State:
        a, b = self.rng.integers(len(population), size=2)
        return population[a] if population[a].total <= population[b].total else population[b]

    def random_search(self) -> None:
        self.full(self.random_groups())
        while True:
            assert self.best is not None
            self.bounded(self.random_groups(), self.best.total)

    def run(
        self, strategy: str, population_size: int = POPULATION_SIZE, link_seeds: bool = True
    ) -> PlacementResult:
        m = self.model
        stopped = "complete"
        try:
            if m.pp == 1 or m.dp == 1:
                # One group of everything, or groups of one device: every partition is the
                # same partition; only the pipeline order differs, and Held-Karp picks it.
                self.full(np.arange(m.network.num_devices).reshape(m.pp, m.dp))
            elif strategy == "random":
                self.random_search()
            elif strategy == "ours":
                self.genetic(self.candidates_ours, population_size, link_seeds)
            elif strategy == "kl":
                self.genetic(self.candidates_kl, population_size, link_seeds)
            else:
                raise UsageError(
                    f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}"
                )
        except _Stop as stop:
            stopped = str(stop)
        if self.best is None:  # the budget ran out before one evaluation: take a random layout
            self.budget = Budget(time_s=None)
            self.full(self.random_groups())
        assert self.best is not None
        return PlacementResult(
            groups=self.best.groups,
            total_s=self.best.total,
            evaluations=self.evaluations,
            elapsed_s=time.perf_counter() - self.start,
            stopped=stopped,
            history=self.history,
        )


def _key(groups: np.ndarray) -> bytes:
    """Same partition, same key: rows sorted inside, then rows in order."""
    rows = np.sort(groups, axis=1)
    return rows[np.lexsort(rows.T[::-1])].tobytes()


def search_placement(
    model: CostModel,
    strategy: str = "ours",
    seed: int = 0,
    budget: Budget | None = None,
    population_size: int = POPULATION_SIZE,
    link_seeds: bool = True,
) -> PlacementResult:
    """Best partition `strategy` finds within `budget`. link_seeds=False starts the genetic
    algorithm from random partitions only (DT-FM's setting)."""
    if strategy not in STRATEGIES:
        raise UsageError(f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
    return Searcher(model, seed, budget or Budget()).run(strategy, population_size, link_seeds)
