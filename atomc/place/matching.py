"""Place stage: the pipeline edge between two data-parallel groups (DT-FM eq. 3).

input:  an n x n cost matrix, cost[r][c] = time for device r of one group to send one
        replica's activations to device c of the other
output: the bottleneck perfect matching: the pairing of the two groups (each replica's stage j
        device with its stage j+1 device) whose slowest pair is as fast as possible, and that value

Exact by threshold search: a perfect matching that uses only pairs with cost <= t exists for
every t at or above the optimum and for none below it, so a binary search over the distinct
costs, asking networkx's Hopcroft-Karp for a perfect matching each time, finds the optimum.

The search only needs values, thousands per second, for many pairs of groups at once.
`bottleneck_values` runs the same threshold search on a whole batch in lockstep and answers
"is there a perfect matching?" with the deficiency form of Hall's theorem (Konig-Ore): the
largest matching has n - max over row sets S of (|S| - |N(S)|) pairs, where N(S) are the
columns some row of S may use. For n <= HALL_MAX_N the 2**n neighbourhoods are a few array
operations; above that each pair goes through networkx. Tests check both against brute force
over all permutations.

The deficiency also says how far a pair of groups is from a cheaper edge: how many of its
pairs must stay at the bottleneck value. The search breaks ties with it (`refined_values`).
"""

from __future__ import annotations

import functools

import numpy as np

HALL_MAX_N = 12  # 2**12 row sets per matrix: still a small array


@functools.cache
def _popcount_table(n: int) -> np.ndarray:
    table = np.zeros(1 << n, dtype=np.int64)
    for bit in range(n):
        table[1 << bit : 1 << (bit + 1)] = table[: 1 << bit] + 1
    return table


def max_matching_sizes(allowed: np.ndarray) -> np.ndarray:
    """Size of a maximum matching of each (n, n) boolean matrix in a batch (n <= HALL_MAX_N)."""
    batch, n = allowed.shape[0], allowed.shape[-1]
    row_masks = (allowed.astype(np.int64) << np.arange(n)).sum(axis=-1)  # columns each row may use
    neighbours = np.zeros((batch, 1), dtype=np.int64)
    for r in range(n):  # neighbours[:, S] for row sets S over rows 0..r
        neighbours = np.concatenate([neighbours, neighbours | row_masks[:, r : r + 1]], axis=1)
    popcount = _popcount_table(n)
    deficiency = (popcount[None, :] - popcount[neighbours]).max(axis=1)
    return n - deficiency


def has_perfect_matching(allowed: np.ndarray) -> np.ndarray:
    return max_matching_sizes(allowed) == allowed.shape[-1]


def bottleneck_values(costs: np.ndarray) -> np.ndarray:
    """bottleneck_value of each matrix in a (batch, n, n) stack, exactly."""
    return refined_values(costs)[0]


def refined_values(costs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values, refined) for a (batch, n, n) stack. values: the exact bottleneck. refined: a
    value between the next lower cost in the matrix and the bottleneck, by the share of the n
    pairs that must stay at the bottleneck (Hall's deficiency below it); equal to the value
    when none could be lower. A search minimising it moves towards a cheaper edge before the
    edge itself moves."""
    costs = np.asarray(costs, dtype=np.float64)
    batch, n = costs.shape[0], costs.shape[-1]
    if batch == 0 or n == 0:
        return np.zeros(batch), np.zeros(batch)
    if n > HALL_MAX_N:
        values = np.array([bottleneck_value(c) for c in costs])
        return values, values.copy()
    lb = np.maximum(costs.min(axis=2).max(axis=1), costs.min(axis=1).max(axis=1))
    flat = np.sort(costs.reshape(batch, -1), axis=1)
    # Invariant: no perfect matching at flat[lo] (or lo is the bound, checked first), one at
    # flat[hi] (the largest cost allows every pair).
    lo = (flat < lb[:, None]).sum(axis=1)
    feasible = has_perfect_matching(costs <= lb[:, None, None])
    hi = np.where(feasible, lo, n * n - 1)
    rows = np.arange(batch)
    while True:
        open_ = hi - lo > 1
        if not open_.any():
            break
        mid = (lo + hi) // 2
        ok = has_perfect_matching(costs <= flat[rows, mid][:, None, None])
        hi = np.where(open_ & ok, mid, hi)
        lo = np.where(open_ & ~ok, mid, lo)
    values = flat[rows, hi]
    below = costs < values[:, None, None]
    stuck = n - max_matching_sizes(below)  # pairs that must stay at the bottleneck value
    next_lower = np.where(below, costs, -np.inf).max(axis=(1, 2))
    next_lower = np.where(np.isfinite(next_lower), next_lower, values)
    refined = next_lower + (values - next_lower) * stuck / n
    return values, refined


def lower_bound(cost: np.ndarray) -> float:
    """Every row and every column must be matched somewhere, so no matching beats its cheapest
    option; the largest of these cheapest options bounds the optimum from below."""
    return float(max(cost.min(axis=1).max(), cost.min(axis=0).max()))


def bottleneck_matching(cost: np.ndarray) -> tuple[float, tuple[int, ...]]:
    """(value, perm): rows r matched to columns perm[r]; max(cost[r, perm[r]]) == value, minimal."""
    cost = _square(cost)
    value, perm = _search(cost, want_matching=True)
    assert perm is not None
    return value, perm


def bottleneck_value(cost: np.ndarray) -> float:
    """The value of bottleneck_matching(cost), without building the final matching."""
    return _search(_square(cost), want_matching=False)[0]


def _square(cost: np.ndarray) -> np.ndarray:
    cost = np.asarray(cost, dtype=np.float64)
    if cost.ndim != 2 or cost.shape[0] != cost.shape[1]:
        raise ValueError(f"bottleneck matching needs a square matrix, got shape {cost.shape}")
    return cost


def _search(cost: np.ndarray, want_matching: bool) -> tuple[float, tuple[int, ...] | None]:
    n = cost.shape[0]
    if n == 0:
        return 0.0, ()
    identity = tuple(range(n))
    lb = lower_bound(cost)
    if cost.max() <= lb:  # every pair is as good as the bound: any matching is optimal
        return lb, identity
    thresholds = np.unique(cost)
    thresholds = thresholds[thresholds >= lb]
    # The bound is usually tight on structured networks, so try it before bisecting.
    perm = _perfect_matching(cost <= thresholds[0])
    if perm is not None:
        return _value(cost, perm), perm
    # Invariant: no perfect matching at thresholds[lo]; one at thresholds[hi] (`found`, or
    # any permutation while hi is the largest cost, where every pair is allowed).
    lo, hi, found = 0, len(thresholds) - 1, None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        perm = _perfect_matching(cost <= thresholds[mid])
        if perm is None:
            lo = mid
        else:
            hi, found = mid, perm
    if found is None:
        found = identity
    value = _value(cost, found)
    assert value == thresholds[hi]
    return value, found if want_matching else None


def _value(cost: np.ndarray, perm: tuple[int, ...]) -> float:
    return float(cost[np.arange(len(perm)), list(perm)].max())


def _perfect_matching(allowed: np.ndarray) -> tuple[int, ...] | None:
    """Column of each row in a perfect matching of the allowed pairs, or None if none exists.
    Every row and column has an allowed pair here (the threshold is at least the lower bound),
    so the edges alone name all 2n nodes."""
    import networkx as nx
    from networkx.algorithms import bipartite

    n = allowed.shape[0]
    rows, cols = np.nonzero(allowed)
    graph = nx.Graph()
    graph.add_edges_from(zip(rows.tolist(), (cols + n).tolist()))  # rows 0..n-1, columns n..2n-1
    matching = bipartite.hopcroft_karp_matching(graph, top_nodes=range(n))
    if len(matching) != 2 * n:
        return None
    return tuple(matching[r] - n for r in range(n))
