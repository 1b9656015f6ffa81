"""Place stage: the pipeline order of the data-parallel groups (DT-FM eq. 4).

input:  the coarsened graph, a symmetric n x n matrix of pipeline edge costs between groups
output: the open-loop travelling salesman path (visit every group once, any start, any end)
        of least total cost: the order of the stages, and that cost

Exact Held-Karp dynamic programming up to EXACT_MAX_NODES groups: best[S, j] is the cheapest
path that visits the set S and ends at j, built layer by layer (|S| = 2, 3, ...) with numpy, so
2**n * n**2 work runs in a handful of array operations. Beyond that the state space is too big;
the stated heuristic is nearest-neighbour paths from HEURISTIC_STARTS spread start nodes, each
improved by 2-opt until no reversal helps: a good path, not a proven optimum.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np

EXACT_MAX_NODES = 16


@functools.cache
def _layers(n: int) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]:
    """For each subset size k >= 2: the subsets S, S minus each j, and whether j is in S."""
    masks = np.arange(1 << n)
    bits = (masks[:, None] >> np.arange(n)[None, :]) & 1
    size = bits.sum(axis=1)
    out = []
    for k in range(2, n + 1):
        subset = masks[size == k]
        prev = subset[:, None] ^ (1 << np.arange(n))[None, :]
        member = bits[subset].astype(bool)
        out.append((subset, prev, member))
    return tuple(out)


def _held_karp(weights: np.ndarray, keep_parents: bool):
    """best[b, S, j] over a batch of matrices; parents[k][S-index, j] when asked."""
    batch, n, _ = weights.shape
    best = np.full((batch, 1 << n, n), np.inf)
    best[:, 1 << np.arange(n), np.arange(n)] = 0.0
    into = weights.transpose(0, 2, 1)[:, None, :, :]  # into[b, 0, j, i] = w[b, i, j]
    parents = []
    for subset, prev, member in _layers(n):
        # Ending at j: come from the best path over S - {j} ending at some i, plus edge i -> j.
        # An i outside S - {j} has best = inf, so it never wins.
        candidates = best[:, prev, :] + into
        layer = candidates.min(axis=-1)
        layer[:, ~member] = np.inf
        best[:, subset, :] = layer
        if keep_parents:
            parents.append(candidates[0].argmin(axis=-1))
    return best, parents


def open_loop_tsp_costs(weights: np.ndarray, exact_max_nodes: int = EXACT_MAX_NODES) -> np.ndarray:
    """Least open-path cost of each matrix in a (batch, n, n) stack (the heuristic's cost
    above exact_max_nodes)."""
    weights = np.asarray(weights, dtype=np.float64)
    batch, n, _ = weights.shape
    if n <= 1:
        return np.zeros(batch)
    if n == 2:
        return weights[:, 0, 1].copy()
    if n <= min(exact_max_nodes, EXACT_MAX_NODES):
        best, _ = _held_karp(weights, keep_parents=False)
        return best[:, (1 << n) - 1, :].min(axis=-1)
    return np.array([_heuristic(w)[0] for w in weights])


def open_loop_tsp(weights: np.ndarray) -> tuple[float, tuple[int, ...], bool]:
    """(cost, order, exact): the cheapest open path through all nodes of a symmetric matrix."""
    weights = np.asarray(weights, dtype=np.float64)
    n = weights.shape[0]
    if weights.shape != (n, n):
        raise ValueError(f"open_loop_tsp needs a square matrix, got shape {weights.shape}")
    if n <= 1:
        return 0.0, tuple(range(n)), True
    if n > EXACT_MAX_NODES:
        cost, order = _heuristic(weights)
        return cost, order, False
    best, parents = _held_karp(weights[None], keep_parents=True)
    full = (1 << n) - 1
    end = int(best[0, full].argmin())
    cost = float(best[0, full, end])
    order = [end]
    subset, node = full, end
    for k in range(n, 1, -1):
        layer_subsets = _layers(n)[k - 2][0]
        row = int(np.searchsorted(layer_subsets, subset))
        prev_node = int(parents[k - 2][row, node])
        subset ^= 1 << node
        node = prev_node
        order.append(node)
    order.reverse()
    return cost, tuple(order), True


def path_cost(weights: np.ndarray, order: tuple[int, ...] | list[int]) -> float:
    return float(sum(weights[a, b] for a, b in itertools.pairwise(order)))


HEURISTIC_STARTS = 8  # nearest-neighbour paths tried, from evenly spread start nodes


def _heuristic(weights: np.ndarray) -> tuple[float, tuple[int, ...]]:
    n = weights.shape[0]
    best_cost, best_order = np.inf, None
    for start in np.unique(
        np.linspace(0, n - 1, min(n, HEURISTIC_STARTS)).round().astype(int)
    ).tolist():
        order = [start]
        left = np.ones(n, bool)
        left[start] = False
        for _ in range(n - 1):
            nxt = int(np.where(left, weights[order[-1]], np.inf).argmin())
            order.append(nxt)
            left[nxt] = False
        order = _two_opt(weights, order)
        cost = path_cost(weights, order)
        if cost < best_cost:
            best_cost, best_order = cost, tuple(order)
    assert best_order is not None
    return float(best_cost), best_order


def _two_opt(weights: np.ndarray, order: list[int]) -> list[int]:
    """Reverse order[i..j] while that shortens the path (an open path has no edge at its ends);
    for each i every j is priced at once."""
    n = len(order)
    path = np.array(order)
    improved = True
    while improved:
        improved = False
        for i in range(n - 1):
            j = np.arange(i + 1, n)
            before, after = np.zeros(len(j)), np.zeros(len(j))
            if i > 0:
                before += weights[path[i - 1], path[i]]
                after += weights[path[i - 1], path[j]]
            inner = j < n - 1
            jn = j[inner]
            before[inner] += weights[path[jn], path[jn + 1]]
            after[inner] += weights[path[i], path[jn + 1]]
            delta = after - before
            best = int(delta.argmin())
            if delta[best] < -1e-12:
                path[i : j[best] + 1] = path[i : j[best] + 1][::-1].copy()
                improved = True
    return path.tolist()
