"""Place stage: DT-FM's communication cost of a layout (eq. 2-4).

input:  a Network, the degrees D_PP (stages) and D_DP (replicas), the message sizes c_PP
        (activation bytes one replica sends across a stage boundary per step) and c_DP
        (gradient bytes of one stage), and a partition of the devices into D_PP data-parallel
        groups of D_DP devices
output: DP cost (slowest group's sharded parameter-server exchange, eq. 2), PP cost (open-loop
        TSP over the bottleneck matchings between groups, eq. 3-4) and total = DP + 2*PP, in s

Units: delay_ms / 1e3 gives seconds; bytes * 8 / (Gbit/s * 1e9) gives seconds.
The factor 2 of eq. 3 (activations forward, their gradients backward over the same pairs) is
kept outside the matching and the path, as DT-FM's scheduler does: the bottleneck and the path
are the same with or without a positive factor, and total = DP + 2*PP equals eq. 1 with eq. 3.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from atomc.errors import LayoutError
from atomc.ir import Plan
from atomc.partition.stagemem import boundary_bytes
from atomc.place.matching import refined_values
from atomc.place.network import Network, symmetric
from atomc.place.tsp import open_loop_tsp, open_loop_tsp_costs

BITS_PER_BYTE = 8
SEARCH_EXACT_MAX_STAGES = 10  # Held-Karp over 2**10 subsets: about a millisecond per call


@dataclass(frozen=True)
class Cost:
    dp_s: float  # max over groups of eq. 2
    pp_s: float  # open-loop TSP over the coarsened graph (one direction)
    total_s: float  # dp_s + 2 * pp_s
    group_dp_s: tuple[float, ...]  # eq. 2 of each group, in the order the groups were given
    order: tuple[int, ...]  # groups in pipeline order (stage 0 first)
    edge_s: tuple[float, ...]  # bottleneck cost of each consecutive pair along `order`
    exact_order: bool  # False when the stage order came from the TSP heuristic (> 16 stages)


class CostModel:
    """Link costs of one network for one (D_PP, D_DP, c_PP, c_DP), with a matching cache."""

    def __init__(self, network: Network, pp: int, dp: int, c_pp_bytes: float, c_dp_bytes: float):
        check_degrees(network, pp, dp)
        if c_pp_bytes < 0 or c_dp_bytes < 0:
            raise LayoutError(
                f"message sizes c_PP={c_pp_bytes} and c_DP={c_dp_bytes} bytes: expected sizes >= 0"
            )
        self.network = network
        self.pp, self.dp = pp, dp
        self.c_pp_bytes, self.c_dp_bytes = float(c_pp_bytes), float(c_dp_bytes)
        delay_s = symmetric(network.delay_ms) / 1e3
        bandwidth_bps = symmetric(network.bandwidth_gbps) * 1e9
        np.fill_diagonal(bandwidth_bps, 1.0)  # self-links are never used; avoid dividing by 0
        # One replica's activations from d to d' (eq. 3 without its factor 2).
        self.pp_link_s = delay_s + self.c_pp_bytes * BITS_PER_BYTE / bandwidth_bps
        # Eq. 2's term: d exchanges a 1/D_DP shard with d', out and back.
        self.dp_link_s = 2.0 * (delay_s + self.c_dp_bytes * BITS_PER_BYTE / (dp * bandwidth_bps))
        np.fill_diagonal(self.pp_link_s, 0.0)
        np.fill_diagonal(self.dp_link_s, 0.0)
        self._edges: dict[tuple[bytes, bytes], tuple[float, float]] = {}
        iu = np.triu_indices(pp, k=1)
        self.pair_j, self.pair_k = iu[0], iu[1]
        self.num_edges_solved = 0  # pipeline edges computed (cache misses)

    # -- data parallel (eq. 2) -----------------------------------------------------------------

    def group_dp_costs(self, groups: np.ndarray) -> np.ndarray:
        """Eq. 2 for each group; groups has shape (..., pp, dp) of device indices."""
        sub = self.dp_link_s[groups[..., :, :, None], groups[..., :, None, :]]
        return sub.sum(axis=-1).max(axis=-1)

    # -- pipeline edges (eq. 3) ----------------------------------------------------------------

    def edge_bounds(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Lower bound of eq. 3 for each pair of groups (rows of a and b): every device must be
        matched, so no matching beats the slowest of the devices' fastest partners."""
        sub = self.pp_link_s[a[:, :, None], b[:, None, :]]
        return np.maximum(sub.min(axis=2).max(axis=1), sub.min(axis=1).max(axis=1))

    def edges(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Exact eq. 3 for each pair of groups; rows of a and b must be sorted (cache keys)."""
        return self.edges_refined(a, b)[0]

    def edges_refined(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Exact eq. 3 and its refined tie-breaking value (matching.refined_values) for each
        pair of groups; rows of a and b must be sorted, since they make the cache keys."""
        values, refined = np.empty(len(a)), np.empty(len(a))
        missing = []
        for i in range(len(a)):
            ka, kb = a[i].tobytes(), b[i].tobytes()
            key = (ka, kb) if ka < kb else (kb, ka)
            hit = self._edges.get(key)
            if hit is None:
                missing.append((i, key))
            else:
                values[i], refined[i] = hit
        if missing:
            idx = np.array([i for i, _ in missing])
            new_values, new_refined = refined_values(
                self.pp_link_s[a[idx][:, :, None], b[idx][:, None, :]]
            )
            self.num_edges_solved += len(missing)
            if len(self._edges) > 500_000:  # a long search: keep memory bounded (~100 MB)
                self._edges.clear()
            for (i, key), value, ref in zip(missing, new_values.tolist(), new_refined.tolist()):
                self._edges[key] = (value, ref)
                values[i], refined[i] = value, ref
        return values, refined

    def edge_matrix(self, groups: np.ndarray) -> np.ndarray:
        """The coarsened graph: exact eq. 3 between every two groups (rows of groups sorted)."""
        return self._pair_matrix(self.edges, groups)

    def bound_matrix(self, groups: np.ndarray) -> np.ndarray:
        """The same graph with each edge's lower bound."""
        return self._pair_matrix(self.edge_bounds, groups)

    def _pair_matrix(self, edge_fn, groups: np.ndarray) -> np.ndarray:
        e = np.zeros((self.pp, self.pp))
        if self.pp > 1:
            vals = edge_fn(groups[self.pair_j], groups[self.pair_k])
            e[self.pair_j, self.pair_k] = vals
            e[self.pair_k, self.pair_j] = vals
        return e

    # -- whole layouts ---------------------------------------------------------------------------

    def evaluate(self, groups: np.ndarray) -> Cost:
        """Full cost of a partition; groups (pp, dp) of device indices, any order inside rows."""
        groups = np.sort(np.asarray(groups, dtype=np.int64), axis=1)
        check_partition(groups, self.network.num_devices, self.pp, self.dp)
        group_dp = self.group_dp_costs(groups)
        e = self.edge_matrix(groups)
        pp_s, order, exact = open_loop_tsp(e)
        edge_s = tuple(float(e[a, b]) for a, b in itertools.pairwise(order))
        dp_s = float(group_dp.max())
        return Cost(
            dp_s=dp_s,
            pp_s=float(pp_s),
            total_s=dp_s + 2.0 * float(pp_s),
            group_dp_s=tuple(float(x) for x in group_dp),
            order=tuple(order),
            edge_s=edge_s,
            exact_order=exact,
        )

    def tsp_costs(self, edge_matrices: np.ndarray) -> np.ndarray:
        """PP cost of each coarsened graph, for the search: exact Held-Karp while it takes
        milliseconds (SEARCH_EXACT_MAX_STAGES), the TSP heuristic above; `evaluate` is exact
        up to 16 stages either way."""
        return open_loop_tsp_costs(edge_matrices, exact_max_nodes=SEARCH_EXACT_MAX_STAGES)


def check_degrees(network: Network, pp: int, dp: int) -> None:
    n = network.num_devices
    if pp < 1 or dp < 1:
        raise LayoutError(f"--pp {pp} --dp {dp}: both degrees must be at least 1")
    if pp * dp != n:
        raise LayoutError(
            f"--pp {pp} x --dp {dp} = {pp * dp} tasklets but network {network.name or ''} has {n} "
            f"devices; every device runs exactly one (stage, replica): choose pp*dp = {n} "
            f"(e.g. {_factor_hint(n)})"
        )


def _factor_hint(n: int) -> str:
    pairs = [f"--pp {p} --dp {n // p}" for p in range(1, n + 1) if n % p == 0]
    mid = len(pairs) // 2
    return ", ".join(pairs[max(0, mid - 1) : mid + 2])


def check_partition(groups: np.ndarray, num_devices: int, pp: int, dp: int) -> None:
    if groups.shape != (pp, dp):
        raise LayoutError(f"a layout needs {pp} groups of {dp} devices, got shape {groups.shape}")
    flat = np.sort(groups.ravel())
    if not np.array_equal(flat, np.arange(num_devices)):
        raise LayoutError("a layout must use every device exactly once")


# ---------------------------------------------------------------------------------------------
# message sizes from a plan


def stage_ranges(plan: Plan, pp: int) -> tuple[tuple[int, int], ...]:
    """Consecutive sub-model ranges [start, stop) for pp stages, minimising the slowest stage's
    compute (fwd + bwd of one micro-batch): pipeline throughput is set by its slowest stage."""
    n = len(plan.submodels)
    if n < pp:
        raise LayoutError(
            f"the plan has {n} sub-models but --pp {pp} asks for {pp} stages; every stage needs at "
            f"least one sub-model: lower --pp to at most {n}, or partition again into more "
            f"sub-models"
        )
    compute = [s.fwd_ms + s.bwd_ms for s in plan.submodels]
    prefix = np.concatenate([[0.0], np.cumsum(compute)])
    # best[k][i]: least possible slowest stage when the first i sub-models form k stages.
    best = np.full((pp + 1, n + 1), np.inf)
    cut = np.zeros((pp + 1, n + 1), dtype=np.int64)
    best[0][0] = 0.0
    for k in range(1, pp + 1):
        for i in range(k, n - (pp - k) + 1):
            starts = np.arange(k - 1, i)
            values = np.maximum(best[k - 1][starts], prefix[i] - prefix[starts])
            pick = int(values.argmin())  # the earliest cut among equals: deterministic
            best[k][i], cut[k][i] = values[pick], starts[pick]
    bounds = [n]
    for k in range(pp, 0, -1):
        bounds.append(int(cut[k][bounds[-1]]))
    bounds.reverse()
    return tuple((bounds[k], bounds[k + 1]) for k in range(pp))


def plan_message_sizes(plan: Plan, ranges: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """(c_PP, c_DP) in bytes for stages over `ranges` of the plan's sub-models.

    c_PP: the busiest stage boundary's activations for one micro-batch, times the plan's C
    micro-batches in a step (what one replica sends downstream per step; the gradients of
    those activations come back over the same pairs: the 2 in total = DP + 2*PP).
    c_DP: the largest stage's parameter bytes (its gradients, exchanged in data parallelism).
    One c for all stages as in DT-FM; the largest keeps the model an upper bound.
    """
    c_pp = max((boundary_bytes(plan, start)[0] for start, _ in ranges[1:]), default=0) * max(
        plan.accum, 1
    )
    c_dp = max(sum(s.param_bytes for s in plan.submodels[a:b]) for a, b in ranges)
    return int(c_pp), int(c_dp)
