"""Schedule stage: the pipeline edge between two data-parallel groups (DT-FM eq. 3).

input:  an n x n cost matrix, cost[r][c] = time for device r of one group to send one
        replica's activations to device c of the other
output: the bottleneck perfect matching: the pairing of the two groups (each replica's stage j
        device with its stage j+1 device) whose slowest pair is as fast as possible, and that value

Exact by threshold search: a perfect matching that uses only pairs with cost <= t exists for
every t at or above the optimum and for none below it, so a binary search over the distinct
costs, asking networkx's Hopcroft-Karp for a perfect matching each time, finds the optimum.

The search only needs values, thousands per second, for many pairs of groups at once.
`bottleneck_values` runs the same threshold search on a whole batch in lockstep and answers
"is there a perfect matching?" with Ryser's formula for the permanent of the 0/1 matrix of
allowed pairs (the number of perfect matchings), one matrix product per step for the batch.
It is exact while the integer sums fit a float64 mantissa (n <= RYSER_MAX_N); above that each
pair goes through networkx. Tests check both against brute force over all permutations.
"""

from __future__ import annotations

import functools

import numpy as np

RYSER_MAX_N = 10  # n**n * 2**n < 2**53: every partial sum of the permanent is an exact integer


@functools.lru_cache(maxsize=None)
def _ryser_tables(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Column-subset indicators (n, 2**n) and Ryser's signs (-1)**(n - |S|)."""
    subsets = ((np.arange(1 << n)[None, :] >> np.arange(n)[:, None]) & 1).astype(np.float64)
    signs = np.where((n - subsets.sum(axis=0)) % 2 == 0, 1.0, -1.0)
    return subsets, signs


def has_perfect_matching(allowed: np.ndarray) -> np.ndarray:
    """For a (batch, n, n) boolean stack: whether each admits a perfect matching (n <= RYSER_MAX_N).

    perm(A) = sum over column sets S of (-1)**(n-|S|) * prod over rows of (row sum over S), and
    for a 0/1 matrix perm(A) counts the perfect matchings.
    """
    n = allowed.shape[-1]
    subsets, signs = _ryser_tables(n)
    row_sums = allowed.astype(np.float64) @ subsets  # (batch, n, 2**n)
    return (row_sums.prod(axis=1) @ signs) > 0.5


def bottleneck_values(costs: np.ndarray) -> np.ndarray:
    """bottleneck_value of each matrix in a (batch, n, n) stack, exactly."""
    costs = np.asarray(costs, dtype=np.float64)
    batch, n = costs.shape[0], costs.shape[-1]
    if batch == 0 or n == 0:
        return np.zeros(batch)
    if n > RYSER_MAX_N:
        return np.array([bottleneck_value(c) for c in costs])
    lb = np.maximum(costs.min(axis=2).max(axis=1), costs.min(axis=1).max(axis=1))
    flat = np.sort(costs.reshape(batch, -1), axis=1)
    # lo: an index whose threshold has no perfect matching (or the bound, checked first);
    # hi: one that has (the largest cost allows every pair).
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
    return flat[rows, hi]


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
