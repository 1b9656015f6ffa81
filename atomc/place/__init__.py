"""Place stage: DT-FM layouts of pipeline stages x data-parallel replicas over a network.

    network (+ plan or message sizes) -place-> Layout

`build_network` makes a Network from DT-FM's scenarios or a region list, `load_network` reads
one from JSON, and `place` searches the assignment of tasklets (replica i, stage j) to
devices that minimises DT-FM's communication cost (eq. 1-4) and returns it as a Layout.
"""

from __future__ import annotations

import numpy as np

from atomc import __version__
from atomc.errors import UsageError
from atomc.ir import Plan
from atomc.place.cost import Cost, CostModel, plan_message_sizes, stage_ranges
from atomc.place.layout import (
    Layout,
    LayoutCost,
    SearchPoint,
    device_matrix,
    evaluate_layout,
    layout_cost,
    layout_stages,
    matrix_cost,
)
from atomc.place.network import (
    Device,
    Network,
    build_regions,
    build_scenario,
    load_network,
    network_from_data,
    scenario_names,
)
from atomc.place.search import STRATEGIES, Budget, PlacementResult, search_placement

__all__ = [
    "STRATEGIES",
    "Budget",
    "Cost",
    "CostModel",
    "Device",
    "Layout",
    "LayoutCost",
    "Network",
    "PlacementResult",
    "build_network",
    "evaluate_layout",
    "load_network",
    "matrix_cost",
    "message_sizes",
    "network_from_data",
    "place",
    "random_cost",
    "scenario_names",
    "search_placement",
]

RANDOM_SAMPLES = 16  # random layouts whose median cost a layout is compared with


def build_network(
    scenario: str | None = None,
    regions: list[str] | None = None,
    per_region: int = 8,
    intra_delay_ms: float = 5.0,
    intra_bandwidth_gbps: float = 2.0,
) -> Network:
    """One of DT-FM's five scenarios by name or number, or GPUs in a list of cloud regions."""
    if (scenario is None) == (regions is None):
        raise UsageError(
            "give either a scenario ("
            + ", ".join(scenario_names())
            + ") or --regions, not both or neither"
        )
    if scenario is not None:
        return build_scenario(scenario)
    assert regions is not None
    return build_regions(regions, per_region, intra_delay_ms, intra_bandwidth_gbps)


def message_sizes(plan: Plan, pp: int) -> tuple[int, int, tuple[tuple[int, int], ...]]:
    """(c_PP, c_DP, stage ranges) for the plan's sub-models cut into pp balanced stages."""
    ranges = stage_ranges(plan, pp)
    c_pp, c_dp = plan_message_sizes(plan, ranges)
    return c_pp, c_dp, ranges


def random_cost(model: CostModel, seed: int, samples: int = RANDOM_SAMPLES) -> LayoutCost:
    """The median (by total) of `samples` random layouts: what placing is measured against.
    They are ranked with the search's quick pipeline cost; only the median one is evaluated
    in full (Held-Karp over 16 stages takes a good fraction of a second)."""
    rng = np.random.default_rng([seed, 1])  # apart from the search's own stream
    candidates = [
        np.sort(rng.permutation(model.network.num_devices).reshape(model.pp, model.dp), axis=1)
        for _ in range(samples)
    ]
    quick = [
        float(model.group_dp_costs(g).max())
        + 2.0 * float(model.tsp_costs(model.edge_matrix(g)[None])[0])
        for g in candidates
    ]
    median = sorted(range(samples), key=lambda i: quick[i])[samples // 2]
    return layout_cost(model.evaluate(candidates[median]))


def place(
    network: Network,
    pp: int,
    dp: int,
    c_pp_bytes: int | None = None,
    c_dp_bytes: int | None = None,
    *,
    plan: Plan | None = None,
    strategy: str = "ours",
    seed: int = 0,
    budget_s: float | None = 5.0,
    max_evals: int | None = None,
    patience: int | None = 5000,
    link_seeds: bool = True,
    compare_random: bool = True,
) -> Layout:
    """The best layout `strategy` finds for pp stages x dp replicas on `network` within the budget.

    Message sizes come from the plan (sub-models cut into pp compute-balanced stages) unless
    given; sizes given explicitly win over the plan's.
    """
    network.check(network.name or "network")
    if strategy not in STRATEGIES:
        raise UsageError(f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
    ranges = None
    if plan is not None:
        plan_c_pp, plan_c_dp, ranges = message_sizes(plan, pp)
        c_pp_bytes = plan_c_pp if c_pp_bytes is None else c_pp_bytes
        c_dp_bytes = plan_c_dp if c_dp_bytes is None else c_dp_bytes
    if c_pp_bytes is None or c_dp_bytes is None:
        raise UsageError(
            "the cost model needs the message sizes: give a plan (--plan plan.json) or both "
            "--c-pp BYTES (activations per replica and stage boundary) and --c-dp BYTES "
            "(gradients per stage)"
        )
    model = CostModel(network, pp, dp, c_pp_bytes, c_dp_bytes)
    result = search_placement(
        model,
        strategy,
        seed,
        Budget(time_s=budget_s, max_evals=max_evals, patience=patience),
        link_seeds=link_seeds,
    )
    cost = model.evaluate(result.groups)
    matrix = device_matrix(model, result.groups, cost)
    names = [d.name for d in network.devices]
    devices = tuple(tuple(names[i] for i in row) for row in matrix)
    ranks = {devices[s][r]: r * pp + s for s in range(pp) for r in range(dp)}
    dp_by_stage = [cost.group_dp_s[g] for g in cost.order]
    return Layout(
        network_name=network.name,
        network_hash=network.content_hash(),
        num_stages=pp,
        num_replicas=dp,
        devices=devices,
        ranks=ranks,
        stages=layout_stages(model, matrix, cost, dp_by_stage, plan, ranges),
        c_pp_bytes=int(c_pp_bytes),
        c_dp_bytes=int(c_dp_bytes),
        cost=layout_cost(cost),
        random_cost=random_cost(model, seed) if compare_random else None,
        strategy=strategy,
        seed=seed,
        evaluations=result.evaluations,
        search_s=result.elapsed_s,
        stopped=result.stopped,
        history=tuple(SearchPoint(e, t, v) for e, t, v in result.history),
        exact_order=cost.exact_order,
        plan_hash=plan.content_hash() if plan is not None else None,
        atomc_version=__version__,
    ).check(network)
