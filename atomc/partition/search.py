"""Exact search over cut points (ATOM Algorithm 1, made exact): RangeTables + C -> cut positions.

The model the search optimises
------------------------------
A plan cuts the graph's N nodes into ranges P_0..P_{k-1}. With per-range costs from cost.py
(C micro-batches: F_i forward, B_i backward; L_i parameter load, K_i its checkpoints streamed
in during its own backward, O_i gradient offload, A_i CPU optimizer), the simulator
(atomc.simulate.events) runs the schedule of ATOM Fig. 12. Its step time is

    step = sum_{0<i<k-1} max(F_i, L_{i+1})         forward: P_{i+1} loads while P_i computes
         + H(P_0, P_1)                              P_0's forward and the step's tail (below)
         + F_{k-1}                                  P_{k-1} stays for its backward
         + max(B_{k-1}, K_{k-1})                    P_{k-2} is still in its slot
         + sum_{1<=i<k-1} max(B_i, K_i + L_{i-1})   backward: P_{i-1} loads while P_i computes
         + max(B_0, K_0)                            (a backward outlasts its checkpoint stream)

where H is the cheaper of two handovers at the step boundary (cost.first_pair): P_1 loads
during P_0's forward, or during P_0's update tail (gradients out, CPU update, refresh), which
hides a large P_1 behind a P_0 that holds little compute, such as the embedding (ATOM III-C).
The tail is exact (cost.handover_tail): when P_1's gradients and CPU update outlast P_0's
backward and offload, P_0's update queues behind P_1's, and the GPU, idle for P_0's update
and refresh at the step boundary anyway, waits that much longer; the tail says how much.

provided two lanes never fall behind elsewhere: P_i's gradient offload is hidden behind the
backward of P_{i-1} (O_i <= B_{i-1}), and P_i's CPU update ends before P_{i-1}'s gradients
arrive (O_i + A_i <= B_{i-1} + O_{i-1}), for i >= 2 (i = 1 is the handover's). Then every lane
starts each job when the compute lane asks for it, and the identity above holds exactly
(integers, ns); test_partition checks it against the simulator. Each term depends on one range
or two neighbouring ranges, and so does every constraint (docs/design.md, section "Partition:
Algorithm 1, exact"):

    memory   forward  mem_fwd(P_i) + params(P_{i+1})          <= M
             backward mem_bwd(P_{i+1}) + params(P_i)          <= M
                      mem_bwd(P_i) + grads(P_{i+1})           <= M   (gradients leaving)
             alone    mem_fwd(P_i) <= M and mem_bwd(P_i) <= M    (covers "fits alone")
             slots    with a cap c on every range's parameters (CostParams.slot_cap_bytes):
                      params(P_i) <= c and 4c + mem(P_i) - params(P_i) (- grads(P_i) in the
                      backward) <= M, the runtime's two weight and two gradient slots of the
                      largest sub-model beside its working memory (cost.derive; the caller
                      tries caps, atomc.partition.partition)
    overlap  forward  F_i >= L_{i+1};   backward  B_{i+1} >= K_{i+1} + L_i  (+ L_i: i+1 < k-1)
    gradient O_{i+1} <= B_i;             optimizer O_{i+1} + A_{i+1} <= B_i + O_i    (i >= 1)

So the objective (step, then bytes crossing cuts, then number of sub-models, compared in that
order) is a sum of terms over consecutive pairs of ranges, and a dynamic programme whose state
is the current range [a, b) is exact: V(a, b) = the best suffix value given that [a, b) is a
sub-model, V(a, b) = min over c of pair([a,b), [b,c)) + V(b, c), with V(a, N) = F(a, N). The
"memo on the start index" of Algorithm 1 becomes a memo on (start, end), which is exactly what
the suffix needs from its predecessor. Bounds prune it: a range is considered only when it
fits alone (its parameters and gradients bound its width), and pair constraints are masks.

Tiers. Tier 0 requires every constraint. When no plan meets them (C too small, or capped),
tier 1 drops the two load-overlap constraints (stalls are then paid in the max() terms above,
still exactly what the simulator does); tier 2 also drops the gradient and optimizer
constraints. A lane that falls behind then delays later jobs in ways no sum of pair terms
captures, so tier 2 minimises an estimate: the sum above plus, for each pair after the first,
the amounts by which the gradient offload and the CPU update overrun (max(0, O_{i+1} - B_i) and
max(0, O_{i+1} + A_{i+1} - B_i - O_i)), as if each overrun stalled the step. The caller keeps
whichever relaxed plan the simulator predicts faster. Memory is never relaxed.

Speed. For each middle cut b the search evaluates all (a, c) pairs at once with numpy, so a
run costs O(N * W^2) array work for ranges of at most W nodes (the widest range that may be a
sub-model: a cap on the largest one's parameters narrows it). In tier 0 most rows need no grid:
a column's figures (parameters, memory, load and offload times) grow with its width, so a
row's allowed columns are a prefix found by bisection, O(N * W log W) in all. Repeated blocks
fold the run: when the tables of every range starting near b equal those starting near b + s
(s a multiple of the block length) and the suffix values just computed satisfy
V(., c) = V(., c + s) + delta for a whole window of W cut positions, then every earlier value
follows by the same shift (min-plus recurrences commute with adding a constant), so the search
copies instead of computing until the blocks end. The check is on the numbers themselves, so
folding never changes the result; turning it off (fold=False) gives the same plan, only slower.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from atomc.partition.cost import CostParams, CostTables, PairSide, derive, first_pair
from atomc.partition.tables import RangeTables

INF = np.int64(2**62)
MAX_FOLD_MULTIPLE = 4  # try periods of 1..4 blocks (a pattern may repeat every few blocks)


@dataclass(frozen=True)
class SearchResult:
    cuts: tuple[int, ...]  # cut positions q: a cut between node q-1 and node q
    step_ns: int  # the additive step time (equal to the simulated one in tiers 0 and 1)
    cut_bytes: int
    num_submodels: int
    tier: int
    folded_positions: int = 0  # cut positions filled by shifting instead of computing
    early_prefetch: bool = False  # P_1 loads during P_0's update tail (cost.first_pair)

    @property
    def objective(self) -> tuple[int, int, int]:
        return (self.step_ns, self.cut_bytes, self.num_submodels)


def block_period(tables: RangeTables, blocks: tuple[str, ...], node_blocks: tuple[str, ...],
                 signatures: tuple[str, ...]) -> int:
    """Nodes per repeated block when the blocks are contiguous, equally long and alike; else 0."""
    if len(blocks) < 2:
        return 0
    spans: dict[str, list[int]] = {}
    for i, b in enumerate(node_blocks):
        if b:
            spans.setdefault(b, []).append(i)
    lengths = set()
    sigs = set()
    for b in blocks:
        idx = spans.get(b)
        if not idx or idx[-1] - idx[0] + 1 != len(idx):
            return 0
        lengths.add(len(idx))
        sigs.add(tuple(signatures[i] for i in idx))
    if len(lengths) != 1 or len(sigs) != 1:
        return 0
    return lengths.pop()


def _equal_rows(tables: RangeTables, shift: int) -> np.ndarray:
    """eq[a]: every range starting at a costs exactly what the same range starting at a+shift
    costs."""
    n = tables.num_nodes
    eq = np.zeros(n + 1, dtype=bool)
    if shift <= 0 or shift >= n:
        return eq
    same = np.ones(n - shift, dtype=bool)
    for arr in tables.row_arrays():
        same &= (arr[: n - shift] == arr[shift:]).all(axis=1)
    eq[: n - shift] = same
    return eq


class _Suffix:
    """V over states [b - w, b), stored by end b (rows) and width w (columns)."""

    def __init__(self, n: int, w_max: int):
        shape = (n + 1, w_max + 1)
        self.valid = np.zeros(shape, dtype=bool)
        self.step = np.full(shape, INF, dtype=np.int64)
        self.cut = np.full(shape, INF, dtype=np.int64)
        self.count = np.full(shape, INF, dtype=np.int64)
        self.next = np.full(shape, -1, dtype=np.int64)  # chosen end of the following range

    def shift_delta(self, lo: int, hi: int, s: int) -> tuple[int, int, int] | None:
        """delta when V(., c) = V(., c+s) + delta for every end c in [lo, hi); else None."""
        v0, v1 = self.valid[lo:hi], self.valid[lo + s:hi + s]
        if not np.array_equal(v0, v1):
            return None
        if not v0.any():
            return (0, 0, 0)
        delta = []
        for arr in (self.step, self.cut, self.count):
            d = arr[lo:hi][v0] - arr[lo + s:hi + s][v0]
            if (d != d[0]).any():
                return None
            delta.append(int(d[0]))
        return delta[0], delta[1], delta[2]


@dataclass(frozen=True)
class Folding:
    """Where the tables repeat: periodic[s][b] says every range the middle cut b touches costs
    what the same range shifted by s costs (s a multiple of the block length)."""

    period: int
    periodic: dict[int, np.ndarray]


def prepare_folding(tables: RangeTables, period: int) -> Folding | None:
    if period <= 0:
        return None
    n, w_max = tables.num_nodes, tables.max_width
    periodic = {}
    for mult in range(1, MAX_FOLD_MULTIPLE + 1):
        s = mult * period
        counts = np.concatenate([[0], np.cumsum(_equal_rows(tables, s))])
        b = np.arange(n + 1)
        lo = np.maximum(0, b - w_max)
        hi = np.minimum(b + 1, n + 1)
        periodic[s] = (counts[hi] - counts[lo] == hi - lo) & (b + s <= n)
    return Folding(period, periodic)


def search(tables: RangeTables, params: CostParams, tier: int = 0, folding: Folding | None = None,
           derived: CostTables | None = None) -> SearchResult | None:
    """The best plan of `tier` (0: all constraints; 1: loads may stall; 2: memory only), or None."""
    t = tables
    d = derived if derived is not None else derive(t, params)
    n = t.num_nodes
    m = np.int64(params.usable_bytes)
    ok = d.ok
    # one sub-model, the whole graph: its forward, backward and the step's tail in turn
    best = None
    if t.max_width >= n and ok[0, n] and not (tier == 0 and d.bwd_ns[0, n] < d.checkpoint_ns[0, n]):
        best = ((int(d.fwd_ns[0, n] + max(d.bwd_ns[0, n], d.checkpoint_ns[0, n])
                     + d.tail_ns[0, n]), 0, 1), n)
    # plans of two sub-models or more: the widest range that may be one bounds the states
    # (a cap on the largest narrows it)
    widths = np.flatnonzero(ok[:, :n].any(axis=0))
    w_max = min(t.max_width, int(widths[-1])) if len(widths) else 0
    v = _Suffix(n, w_max)
    lines = _Lines(t.max_width, w_max)

    # base: the last sub-model [N - w, N) adds its forward (it stays for its backward)
    for w in range(1, min(w_max, n) + 1):
        a = n - w
        if ok[a, w]:
            v.valid[n, w] = True
            v.step[n, w] = d.fwd_ns[a, w]
            v.cut[n, w] = 0
            v.count[n, w] = 1

    folded = 0
    b = n - 1 if w_max else 0
    while b >= 1:
        if b % 32 == 0 and not v.valid[b + 1:b + 1 + w_max].any():
            break  # nothing earlier can reach a valid state: no plan of two or more
        if t.allowed[b]:
            _solve_middle(b, t, d, v, tier, m, w_max, lines)
        stable = None
        if folding and b % folding.period == 0:
            stable = _find_shift(v, b, w_max, n, folding.period)
        if stable is None:
            b -= 1
            continue
        # every earlier middle whose ranges repeat with shift s: copy V by blocks of s rows
        s, delta = stable
        periodic = folding.periodic[s]
        lo = b - 1
        while lo >= 1 and periodic[lo]:
            lo -= 1
        hi = b - 1
        while hi > lo:
            first = max(lo + 1, hi - s + 1)
            _copy_rows(v, first, hi + 1, s, delta)
            folded += hi + 1 - first
            hi = first - 1
        b = lo

    _first_states(t, d, v, tier, m, w_max)
    # the first sub-model [0, b) adds its backward (the step's tail is in the first pair's term)
    for w in range(1, min(w_max, n - 1) + 1):
        if not (v.valid[w, w] and ok[0, w]):
            continue
        if tier == 0 and d.bwd_ns[0, w] < d.checkpoint_ns[0, w]:
            continue
        bwd = max(d.bwd_ns[0, w], d.checkpoint_ns[0, w])
        key = (int(v.step[w, w] + bwd), int(v.cut[w, w]), int(v.count[w, w]))
        if best is None or key < best[0]:
            best = (key, w)
    if best is None:
        return None
    (step, cut_bytes, count), b = best
    cuts = _cuts(v, b, n)
    early = False
    if cuts:  # the first cut is b
        end = cuts[1] if len(cuts) > 1 else n
        early = bool(_handover(PairSide.of_tables(d, 0, b), PairSide.of_tables(d, b, end - b),
                               end == n, tier, m)[2])
    return SearchResult(tuple(cuts), step, cut_bytes, count, tier, folded, early)


def _cuts(v: _Suffix, b: int, n: int) -> list[int]:
    """The cuts of the plan whose first sub-model is [0, b), following each state's choice."""
    cuts, a = [], 0
    while b != n:
        cuts.append(b)
        a, b = b, int(v.next[b, b - a])
    return cuts


def _handover(p0: PairSide, p1: PairSide, last1, tier: int, m: np.int64):
    """(term, allowed, early) of P_0's handover to P_1 (cost.first_pair): the early way where
    only it is allowed or it is cheaper. Elementwise on arrays."""
    late, late_ok, early, early_ok = first_pair(p0, p1, last1=last1, tier=tier, usable_bytes=m)
    pick_early = early_ok & ~(late_ok & (late <= early))
    return np.where(pick_early, early, late), late_ok | early_ok, pick_early


def _copy_rows(v: _Suffix, lo: int, hi: int, s: int, delta: tuple[int, int, int]) -> None:
    """V rows [lo, hi) = rows [lo+s, hi+s) + delta, where valid."""
    ds, dc, dn = delta
    row = v.valid[lo + s:hi + s]
    v.valid[lo:hi] = row
    v.step[lo:hi] = np.where(row, v.step[lo + s:hi + s] + ds, INF)
    v.cut[lo:hi] = np.where(row, v.cut[lo + s:hi + s] + dc, INF)
    v.count[lo:hi] = np.where(row, v.count[lo + s:hi + s] + dn, INF)
    v.next[lo:hi] = np.where(row, v.next[lo + s:hi + s] - s, -1)


def _find_shift(v: _Suffix, b: int, w_max: int, n: int, period: int):
    """A shift s with V(., c) = V(., c+s) + delta for the ends c in [b, b+W) that earlier
    states can reach; None when there is none (yet)."""
    hi = b + w_max
    for mult in range(1, MAX_FOLD_MULTIPLE + 1):
        s = mult * period
        if hi + s > n + 1:  # the shifted window must lie among computed ends
            return None
        delta = v.shift_delta(b, hi, s)
        if delta is not None:
            return (s, delta)
    return None


class _Grid:
    """The pairs a middle cut b joins: rows are the states L = [a, b) with a > 0, a descending
    (the first sub-model's states [0, b) are _first_states'); columns the following ranges
    R = [b, c), c ascending (only the last column can be the last sub-model)."""

    def __init__(self, b: int, n: int, al: np.ndarray, wl: np.ndarray, wr: np.ndarray):
        self.b, self.n, self.al, self.wl, self.wr = b, n, al, wl, wr
        self.ends = b + wr
        self.last = self.ends[-1] == n  # the last column is P_{k-1}

    def left(self, x: np.ndarray) -> np.ndarray:
        return x[self.al, self.wl][:, None]

    def right(self, x: np.ndarray) -> np.ndarray:
        return x[self.b, self.wr][None, :]


class _Lines:
    """The states and ranges one middle cut b joins, read as strided views instead of gathers.

    A table x[a, w] (range [a, a + w), `x_width` + 1 columns) holds the states ending at b,
    [b - w, b) for w = 1, 2, ..., on one line of its flattened array (step -x_width), and the
    ranges starting at b on row b; V (by end c and width, `v_width` + 1 columns) holds the
    states [b, b + w) on another line (step v_width + 2). Slices of the flattened arrays are
    views, so a middle cut costs no copy of a table's figures unless a mask thins them."""

    def __init__(self, x_width: int, v_width: int):
        self.x_width, self.v_width = x_width, v_width

    def ending_at(self, x: np.ndarray, b: int, k: int) -> np.ndarray:
        """x[b - w, w] for w = 1..k (k <= b)."""
        step = self.x_width
        start = b * (step + 1) - step
        stop = start - k * step
        return x.reshape(-1)[start:stop if stop >= 0 else None:-step]

    def states_from(self, v: np.ndarray, b: int, k: int) -> np.ndarray:
        """V's v[b + w, w] for w = 1..k (b + k <= N)."""
        step = self.v_width + 2
        start = b * (self.v_width + 1) + step
        return v.reshape(-1)[start:start + k * step:step]


def _first_states(t: RangeTables, d: CostTables, v: _Suffix, tier: int, m: np.int64,
                  w_max: int, cells: int = 1 << 18) -> None:
    """V for the first sub-model's states [0, b): the handover with the range after it
    (cost.first_pair) replaces the pair terms (P_1's offload and update lanes are priced, its
    load rules are the handover's). No middle reads these states, so they are solved after
    the middles, many b at once, as a grid of rows b and following widths."""
    n = t.num_nodes
    top = min(w_max, n - 1)
    if top < 1:
        return
    firsts = np.arange(1, top + 1)
    # a folded copy may have written these cells with a middle state's value
    v.valid[firsts, firsts] = False
    v.step[firsts, firsts] = v.cut[firsts, firsts] = v.count[firsts, firsts] = INF
    v.next[firsts, firsts] = -1
    firsts = firsts[t.allowed[firsts] & d.ok[0, firsts]]
    wr = np.arange(1, w_max + 1)[None, :]
    chunk = max(1, cells // w_max)  # rows at a time: a few MB per temporary
    for lo in range(0, len(firsts), chunk):
        b = firsts[lo:lo + chunk, None]
        ends = np.minimum(b + wr, n)  # past the graph's end: masked below
        p0, p1 = PairSide.of_tables(d, 0, b), PairSide.of_tables(d, b, wr)
        mask = (wr <= n - b) & d.ok[b, wr] & v.valid[ends, wr]
        mask &= p1.param_bytes <= m - d.mem_fwd_bytes[0, b]
        mask &= p0.param_bytes <= m - d.mem_bwd_bytes[b, wr]
        mask &= p1.grad_bytes <= m - d.mem_bwd_bytes[0, b]
        last = b + wr == n
        if tier == 0:
            # the H2D lane during P_1's backward, as for a middle pair (_pair_mask)
            mask &= np.where(last, p1.checkpoint_ns <= p1.bwd_ns,
                             p0.load_ns <= p1.bwd_ns - p1.checkpoint_ns)
            back = p1.bwd_ns
        else:
            back = np.maximum(p1.bwd_ns, p1.checkpoint_ns + np.where(last, 0, p0.load_ns))
        handover, allowed, _ = _handover(p0, p1, last, tier, m)
        mask &= allowed
        step = np.where(mask, handover + back + v.step[ends, wr], INF)
        # the least step, then bytes crossing cuts, then sub-models, then the narrower P_1
        best = step.min(axis=1)
        tie = step == best[:, None]
        cut = np.where(tie, v.cut[ends, wr], INF)
        tie &= cut == cut.min(axis=1)[:, None]
        count = np.where(tie, v.count[ends, wr], INF)
        tie &= count == count.min(axis=1)[:, None]
        rows = np.flatnonzero(best < INF)
        pick = tie[rows].argmax(axis=1)
        at = b[rows, 0]
        v.valid[at, at] = True
        v.step[at, at] = best[rows]
        v.cut[at, at] = cut[rows, pick] + t.cut_bytes[at]
        v.count[at, at] = count[rows, pick] + 1
        v.next[at, at] = at + pick + 1


def _solve_middle(b: int, t: RangeTables, d: CostTables, v: _Suffix, tier: int, m: np.int64,
                  w_max: int, lines: _Lines) -> None:
    """V for every state [a, b) with a > 0: try every following range [b, c) of at most w_max
    nodes."""
    n = t.num_nodes
    kl, kr = min(w_max, b - 1), min(w_max, n - b)
    left_ok = lines.ending_at(d.ok, b, kl)
    right_ok = d.ok[b, 1:kr + 1] & lines.states_from(v.valid, b, kr)
    if not left_ok.any() or not right_ok.any():
        return
    wl, wr = np.arange(1, kl + 1), np.arange(1, kr + 1)
    # all rows and columns allowed (the common case): views; else the allowed ones
    rows_at = slice(None) if left_ok.all() else left_ok
    cols_at = slice(None) if right_ok.all() else right_ok
    wl, wr = wl[rows_at], wr[cols_at]
    g = _Grid(b, n, b - wl, wl, wr)

    def row(x: np.ndarray) -> np.ndarray:
        return lines.ending_at(x, b, kl)[rows_at]

    def col(x: np.ndarray) -> np.ndarray:
        return x[b, 1:kr + 1][cols_at]

    # lexicographic minimum per row (step, then bytes crossing cuts, then sub-model count) as one
    # integer: the later keys belong to the column alone, so rank the columns by them once
    ends = g.ends
    col_cut = lines.states_from(v.cut, b, kr)[cols_at]
    col_count = lines.states_from(v.count, b, kr)[cols_at]
    col_v = lines.states_from(v.step, b, kr)[cols_at]
    order = np.lexsort((col_count, col_cut))  # stable: equal keys keep column order
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    if tier == 0:
        rows, pick, picked = _best_columns_sorted(g, d, col_v, m, rank, row, col)
    else:
        rows, pick, picked = _best_columns(g, d, col_v, tier, _pair_mask(g, d, tier, m), rank)
    if not len(rows):
        return
    v.valid[b, wl[rows]] = True
    v.step[b, wl[rows]] = picked
    v.cut[b, wl[rows]] = col_cut[pick] + t.cut_bytes[b]
    v.count[b, wl[rows]] = col_count[pick] + 1
    v.next[b, wl[rows]] = ends[pick]


def _best_columns_sorted(g: _Grid, d: CostTables, col_v: np.ndarray, m: np.int64,
                         rank: np.ndarray, row, col
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """_best_columns of tier 0 without forming the grid where the constraints allow it.

    Every tier-0 constraint of a middle pair compares a figure of the column with a bound of
    the row, and a column's figures mostly grow with its width (parameters, memory, load and
    offload times). Where a figure grows across the columns, the columns a row allows under it
    are a prefix, found by bisection; the best column of each row within its prefix comes from
    one running minimum of the columns' keys (unique: the rank breaks ties). That column is the
    row's answer when it also meets the constraints whose figure does not grow; the rows where
    it does not take the full grid. The result is the full grid's, cell for cell. `row(x)`
    and `col(x)` read a table's figures of the grid's rows and columns."""
    k = len(g.wl)
    bwd_r, off_r, fwd_l, bwd_l = col(d.bwd_ns), col(d.offload_ns), row(d.fwd_ns), row(d.bwd_ns)
    col_step = bwd_r + col_v
    key = col_step * len(rank) + rank
    hidden = col(d.checkpoint_ns) - bwd_r
    if g.last:  # the last sub-model holds its predecessor: only its own checkpoints count
        hidden[-1] = INF if hidden[-1] > 0 else -INF
    # (column figure, row bound): the pair is allowed when figure <= bound for every one
    pairs = [(col(d.param_bytes), m - row(d.mem_fwd_bytes)),
             (col(d.mem_bwd_bytes), m - row(d.param_bytes)),
             (col(d.grad_bytes), m - row(d.mem_bwd_bytes)),
             (off_r, bwd_l),
             (off_r + col(d.optimizer_ns), bwd_l + row(d.offload_ns)),
             (col(d.load_fwd_ns), fwd_l),
             (hidden, -row(d.load_fwd_ns))]
    allowed = np.full(k, len(key))
    unsorted = []
    for figure, bound in pairs:
        if (figure[1:] >= figure[:-1]).all():
            allowed = np.minimum(allowed, np.searchsorted(figure, bound, side="right"))
        else:
            unsorted.append((figure, bound))
    running = np.minimum.accumulate(key)
    best_so_far = np.maximum.accumulate(np.where(key == running, np.arange(len(key)), 0))
    pick = best_so_far[np.maximum(allowed, 1) - 1]
    found = allowed > 0
    done = found.copy()
    for figure, bound in unsorted:
        done &= figure[pick] <= bound
    rest = np.flatnonzero(found & ~done)
    rows = np.flatnonzero(done)
    pick = pick[rows]
    picked = fwd_l[rows] + col_step[pick]
    if len(rest):
        sub = _Grid(g.b, g.n, g.al[rest], g.wl[rest], g.wr)
        r2, p2, v2 = _best_columns(sub, d, col_v, 0, _pair_mask(sub, d, 0, m), rank)
        order = np.argsort(np.concatenate([rows, rest[r2]]), kind="stable")
        rows = np.concatenate([rows, rest[r2]])[order]
        pick = np.concatenate([pick, p2])[order]
        picked = np.concatenate([picked, v2])[order]
    return rows, pick, picked


def _pair_mask(g: _Grid, d: CostTables, tier: int, m: np.int64) -> np.ndarray:
    """Which pairs meet the constraints of `tier`. Each constraint compares a row's figure with
    a column's."""
    left, right = g.left, g.right
    mask = right(d.param_bytes) <= m - left(d.mem_fwd_bytes)
    mask &= left(d.param_bytes) <= m - right(d.mem_bwd_bytes)
    mask &= right(d.grad_bytes) <= m - left(d.mem_bwd_bytes)
    if tier <= 1:
        # R's offload and update against L's backward
        off_r, bwd_l = right(d.offload_ns), left(d.bwd_ns)
        mask &= off_r <= bwd_l
        mask &= off_r + right(d.optimizer_ns) <= bwd_l + left(d.offload_ns)
    if tier == 0:
        # the H2D lane during R's backward: R's checkpoints, then L's parameters, unless R is
        # the last sub-model (L is then still in its slot from its forward)
        bwd_r, ckpt_r = right(d.bwd_ns), right(d.checkpoint_ns)
        hidden = left(d.load_fwd_ns) <= bwd_r - ckpt_r
        if g.last:
            hidden[:, -1] = ckpt_r[0, -1] <= bwd_r[0, -1]
        mask &= hidden
        mask &= left(d.fwd_ns) >= right(d.load_fwd_ns)  # R loads while L computes its forward
    return mask


def _best_columns(g: _Grid, d: CostTables, col_v: np.ndarray, tier: int, mask: np.ndarray,
                  rank: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows with a pair, each one's best column, its step): the least step, ties broken by
    `rank`; `col_v` is each column's suffix step."""
    left, right = g.left, g.right
    f_l, bwd_r = left(d.fwd_ns), right(d.bwd_ns)
    scale = len(rank)
    if tier == 0:
        # every constraint met: the forward term is L's forward and the backward term R's
        # backward, so a row's best column is the best of the columns' own sums and no step
        # is formed cell by cell
        col_step = bwd_r[0] + col_v
        key = np.where(mask, (col_step * scale + rank)[None, :], INF)
        pick = key.argmin(axis=1)
        rows = np.flatnonzero(key[np.arange(len(pick)), pick] < INF)
        pick = pick[rows]
        return rows, pick, f_l[rows, 0] + col_step[pick]
    fwd_term = np.maximum(f_l, right(d.load_fwd_ns))
    lb_l = right(d.checkpoint_ns) + np.where(g.ends[None, :] == g.n, 0, left(d.load_fwd_ns))
    step = fwd_term + np.maximum(bwd_r, lb_l) + col_v[None, :]
    if tier == 2:
        off_r, off_l, bwd_l = right(d.offload_ns), left(d.offload_ns), left(d.bwd_ns)
        over = (np.maximum(off_r - bwd_l, 0)
                + np.maximum(off_r + right(d.optimizer_ns) - bwd_l - off_l, 0))
        step = step + over
    key = np.where(mask, step * scale + rank[None, :], INF)
    pick = key.argmin(axis=1)
    rows = np.flatnonzero(key[np.arange(len(pick)), pick] < INF)
    pick = pick[rows]
    return rows, pick, step[rows, pick]
