"""Schedule stage: the pipeline edge between two data-parallel groups (DT-FM eq. 3).

input:  an n x n cost matrix, cost[r][c] = time for device r of one group to send one
        replica's activations to device c of the other
output: the bottleneck perfect matching: the pairing of the two groups (each replica's stage j
        device with its stage j+1 device) whose slowest pair is as fast as possible, and that value

Exact by threshold search: a perfect matching that uses only pairs with cost <= t exists for
every t at or above the optimum and for none below it, so a binary search over the distinct
costs, asking networkx's Hopcroft-Karp for a perfect matching each time, finds the optimum.
"""

from __future__ import annotations

import numpy as np


def lower_bound(cost: np.ndarray) -> float:
    """Every row and every column must be matched somewhere, so no matching beats its cheapest
    option; the largest of these cheapest options bounds the optimum from below."""
    return float(max(cost.min(axis=1).max(), cost.min(axis=0).max()))


def bottleneck_matching(cost: np.ndarray) -> tuple[float, tuple[int, ...]]:
    """(value, perm): rows r matched to columns perm[r]; max(cost[r, perm[r]]) == value, minimal."""
    cost = np.asarray(cost, dtype=np.float64)
    n = cost.shape[0]
    if cost.ndim != 2 or cost.shape[1] != n:
        raise ValueError(f"bottleneck_matching needs a square matrix, got shape {cost.shape}")
    if n == 0:
        return 0.0, ()
    lb = lower_bound(cost)
    if cost.max() <= lb:  # every pair is as good as the bound: any matching is optimal
        return lb, tuple(range(n))
    thresholds = np.unique(cost)
    thresholds = thresholds[thresholds >= lb]
    # The bound is usually tight on structured networks, so try it before bisecting.
    perm = _perfect_matching(cost <= thresholds[0])
    if perm is not None:
        return _value(cost, perm), perm
    lo, hi = 0, len(thresholds) - 1  # thresholds[lo] infeasible, thresholds[hi] feasible (all pairs)
    best = None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        found = _perfect_matching(cost <= thresholds[mid])
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
    if best is None:
        best = _perfect_matching(cost <= thresholds[hi])
    assert best is not None
    return _value(cost, best), best


def _value(cost: np.ndarray, perm: tuple[int, ...]) -> float:
    return float(cost[np.arange(len(perm)), list(perm)].max())


def _perfect_matching(allowed: np.ndarray) -> tuple[int, ...] | None:
    """Column of each row in a perfect matching of the allowed pairs, or None if none exists."""
    import networkx as nx
    from networkx.algorithms import bipartite

    n = allowed.shape[0]
    rows, cols = np.nonzero(allowed)
    graph = nx.Graph()
    graph.add_nodes_from(range(2 * n))  # rows are 0..n-1, columns n..2n-1
    graph.add_edges_from(zip(rows.tolist(), (cols + n).tolist()))
    matching = bipartite.hopcroft_karp_matching(graph, top_nodes=range(n))
    if len(matching) != 2 * n:
        return None
    return tuple(matching[r] - n for r in range(n))
