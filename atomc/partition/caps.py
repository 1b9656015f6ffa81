"""The slot caps a search runs under: the runtime's weight and gradient slots are sized for the
largest sub-model, so each C is searched under caps on the largest sub-model's parameters
(atomc.partition.search within each cap), and plans are scored by their simulated step."""

from __future__ import annotations

import numpy as np

from atomc.ir import Profile
from atomc.partition.cost import (
    CostParams,
    CostTables,
    plan_costs,
    range_cost,
    range_stage_times,
    slot_fits,
    with_slot_cap,
)
from atomc.partition.search import (
    Folding,
    SearchResult,
    block_period,
    prepare_folding,
    search,
)
from atomc.partition.tables import (
    NodeFacts,
    RangeTables,
    build_tables,
    max_width_for,
)
from atomc.simulate.events import simulate_swap

# caps on the largest sub-model tried at one C: each at most this fraction of the one before
# (snapped down to a range's size), then the smallest that can hold the largest operator
_CAP_STEP = 0.85


def plan_tables(facts: NodeFacts, usable_bytes: int, activations: str = "recompute"
                ) -> RangeTables:
    """Range tables wide enough for every sub-model a plan within `usable_bytes` can hold.

    With two sub-models or more, the runtime's four slots of the largest sub-model fit in the
    budget, so no sub-model's parameters and gradients (at most twice its parameters) exceed
    half of it. Only a plan of one sub-model (one weight and one gradient slot) can be wider:
    the whole graph, whose memory no C changes but kept activations' (C = 1 is the least).
    The search's work grows with the square of the width."""
    n = facts.num_nodes
    narrow = max_width_for(facts, usable_bytes // 2)
    if max_width_for(facts, usable_bytes) >= n:
        tables = build_tables(facts, n)
        whole = range_cost(tables, CostParams(1, usable_bytes, 1.0, 1.0, 0.0, activations), 0, n)
        work = max(whole.mem_fwd_bytes - whole.param_bytes,
                   whole.mem_bwd_bytes - whole.param_bytes - whole.grad_bytes)
        if 2 * whole.param_bytes + work <= usable_bytes or narrow >= n:
            return tables
    return build_tables(facts, narrow)


def folding_of(view: Profile, tables: RangeTables, fold: bool) -> Folding | None:
    """Where the tables repeat, when the graph's blocks do. Kept activations make a range's
    memory depend on where it starts (no two starts repeat): the caller does not fold then."""
    if not fold:
        return None
    g = view.graph
    # a node without compute (a parameter read, an input) has its name in its signature, so
    # that it is never measured as another; blocks whose parameters are read inside them
    # (torch.export's graphs) are alike when those reads are alike in kind and shape. Alike
    # blocks only propose a period: the search folds where the costs themselves repeat
    alike = tuple(f"{n.op}:{n.outputs}" if n.op in ("placeholder", "get_attr", "output")
                  else n.signature for n in g.nodes)
    return prepare_folding(tables, block_period(
        tables, g.blocks, tuple(n.block for n in g.nodes), alike))


def over_caps(tables: RangeTables, p: CostParams, d: CostTables, folding: Folding | None,
               tier: int, score=None, first: bool = False,
               cache: dict | None = None) -> SearchResult | None:
    """The best plan of `tier` by `score` (None: the search's own objective) over caps on the
    largest sub-model's parameters (or, with `first`, the first plan found).

    Every cap worth trying is the size of a range that fits beside its own slots
    (cost.slot_fits), at least the largest single operator's. They are tried from the largest
    down, each at most _CAP_STEP of the one before (snapped down to a range's size); a plan
    found jumps the descent to below its own largest sub-model (every cap between gives it
    again). Smaller caps mean more sub-models, more cuts and more recomputation, so once a
    plan is found the descent stops at the first cap that does no better. Searches at one C
    share `d` (a cap only narrows its ranges) and `cache`, by tier and cap.

    A smaller cap admits no range of more parameters, and more working memory beside its
    smaller slots: where that admits no range the best plan's cap did not, the search would
    choose among fewer ranges under the same pair constraints, and its objective cannot do
    better, so it is not run (a score other than the objective, such as a simulated step,
    could)."""
    fits = slot_fits(d, p.usable_bytes)
    floor = int(tables.param_bytes[:, 1].max()) if tables.max_width >= 1 else 0
    sizes = np.unique(d.param_bytes[fits])
    sizes = sizes[sizes >= floor]
    if not len(sizes):
        return None

    cache = {} if cache is None else cache

    def attempt(cap: int):
        if (tier, cap) not in cache:
            cache[tier, cap] = search(tables, p, tier, folding,
                                      with_slot_cap(d, cap, p.usable_bytes))
        return cache[tier, cap]

    if first and tier == 2:
        # whether memory allows any plan: the smallest cap leaves the most working memory and
        # the narrowest ranges (the cheapest search) first
        return next((r for cap in _descending(sizes)[::-1] if (r := attempt(cap))), None)
    by_objective = score is None
    score = score or (lambda r: r.objective)
    best = None
    cap = int(sizes[-1])
    while True:
        r = attempt(cap)
        if r is not None and first:
            return r
        if r is not None and (best is None or score(r) < best[0]):
            best = (score(r), r, cap)
            cap = min(cap, largest_params(tables, p, r))
        elif best is not None:
            break
        below = sizes[sizes <= int(cap * _CAP_STEP)]
        nxt = int(below[-1]) if len(below) else int(sizes[0])
        if nxt >= cap or (by_objective and best is not None
                          and not _admits_more(d, nxt, best[2], p.usable_bytes)):
            break
        cap = nxt
    return None if best is None else best[1]


def _admits_more(d: CostTables, cap: int, than: int, usable_bytes: int) -> bool:
    """Whether slot cap `cap` (below `than`) admits a range that `than` does not: one whose
    working memory fits only beside the smaller slots."""
    room = d.work_bytes + d.slots_per_cap * np.int64(cap) <= usable_bytes
    before = d.work_bytes + d.slots_per_cap * np.int64(than) <= usable_bytes
    return bool((d.ok & (d.param_bytes <= cap) & room & ~before).any())


def _descending(sizes: np.ndarray) -> list[int]:
    """Caps from the largest size down, each at most _CAP_STEP of the one before, and the
    smallest size last."""
    out = [int(sizes[-1])]
    while out[-1] > sizes[0]:
        below = sizes[sizes <= int(out[-1] * _CAP_STEP)]
        out.append(int(below[-1]) if len(below) else int(sizes[0]))
    return out


def simulated_score(tables: RangeTables, p: CostParams,
                    result: SearchResult) -> tuple[int, int, int]:
    """A relaxed plan's score: its simulated step (the search's sum is an estimate there)."""
    costs = plan_costs(tables, p, result.cuts)
    sim = simulate_swap(range_stage_times(costs), p.accum, early_prefetch=result.early_prefetch,
                        record=False)
    return (sim.step_ns, result.cut_bytes, result.num_submodels)


def largest_params(tables: RangeTables, p: CostParams, result: SearchResult) -> int:
    return max(c.param_bytes for c in plan_costs(tables, p, list(result.cuts)))


def plan_utilisation(tables: RangeTables, p: CostParams, result: SearchResult) -> float:
    """The share of the simulated step that computes the model, the score plans are chosen by.
    The runtime's own time per call keeps the compute lane busy and trains nothing: counted
    as compute, it made a plan of more, smaller sub-models look busier, and on a CPU the
    slot-cap choice took 18 sub-models whose step was 4% longer than 14's and 9-25% longer than
    the 3-12 it takes now."""
    costs = plan_costs(tables, p, result.cuts)
    sim = simulate_swap(range_stage_times(costs), p.accum, early_prefetch=result.early_prefetch,
                        record=False)
    own = len(costs) * p.accum * (p.call_fwd_ns + p.call_bwd_ns)
    return (sim.compute_ns - own) / sim.step_ns if sim.step_ns else 0.0
