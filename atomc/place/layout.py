"""Place stage output: the Layout IR (kind "atomc.layout") and its text grid.

input:  the network, the best partition the search found (D_PP groups of D_DP devices), the
        cost model (for the pipeline order and the matchings), and optionally the plan
output: a D_PP x D_DP device matrix (devices[stage][replica]), the rank map
        (rank = replica * D_PP + stage), each stage's sub-model range, the cost breakdown,
        the search's history

The matrix is built the way the cost model reads it: stages follow the open-loop TSP order of
the groups, and each replica's device in stage s+1 is the one the bottleneck matching between
stages s and s+1 pairs with its device in stage s (networkx's Hopcroft-Karp, threshold search).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from atomc.errors import LayoutError
from atomc.ir import Plan
from atomc.ir.documents import Document
from atomc.place.cost import Cost, CostModel
from atomc.place.matching import bottleneck_matching
from atomc.place.network import Network
from atomc.units import format_bytes


@dataclass(frozen=True)
class LayoutCost:
    """DT-FM's model, in seconds per training step: total = DP + 2 * PP."""

    dp_s: float
    pp_s: float
    total_s: float


@dataclass(frozen=True)
class PlacedStage:
    """One pipeline stage of a layout: its sub-models and its share of the cost."""

    stage: int
    submodels: tuple[int, int] | None  # [start, stop) in the plan's sub-models; None without a plan
    compute_ms: float  # fwd + bwd of one micro-batch over those sub-models (0 without a plan)
    param_bytes: int  # parameters of those sub-models (0 without a plan)
    dp_cost_s: float  # eq. 2 for this stage's data-parallel group
    send_cost_s: float  # eq. 3 (without its 2) towards the next stage; 0 for the last stage


@dataclass(frozen=True)
class SearchPoint:
    evaluations: int
    elapsed_s: float
    best_total_s: float


@dataclass(frozen=True)
class Layout(Document):
    KIND: ClassVar[str] = "atomc.layout"

    network_name: str
    network_hash: str  # Network.content_hash(): the runner checks it was given the same network
    num_stages: int  # D_PP
    num_replicas: int  # D_DP
    devices: tuple[tuple[str, ...], ...]  # [stage][replica]: the D_PP x D_DP device matrix
    ranks: dict[str, int]  # device name -> rank = replica * D_PP + stage
    stages: tuple[PlacedStage, ...]
    c_pp_bytes: int
    c_dp_bytes: int
    cost: LayoutCost
    random_cost: LayoutCost | None  # the median of random layouts, for comparison
    strategy: str
    seed: int
    evaluations: int
    search_s: float
    stopped: str  # why the search ended: time, evaluations, converged or complete
    history: tuple[SearchPoint, ...]  # every improvement of the best total
    exact_order: bool = True  # False when the stage order came from the TSP heuristic (> 16 stages)
    plan_hash: str | None = None
    atomc_version: str = ""

    # -- rank map --------------------------------------------------------------------------------

    def rank(self, replica: int, stage: int) -> int:
        return replica * self.num_stages + stage

    def position(self, rank: int) -> tuple[int, int]:
        """(replica, stage) of a rank."""
        if not 0 <= rank < self.num_stages * self.num_replicas:
            world = self.num_stages * self.num_replicas
            raise LayoutError(f"rank {rank} is outside this layout's world of {world} ranks")
        return divmod(rank, self.num_stages)

    def device_at(self, rank: int) -> str:
        replica, stage = self.position(rank)
        return self.devices[stage][replica]

    # -- checks -----------------------------------------------------------------------------------

    def check(self, network: Network | None = None, source: str = "layout") -> Layout:
        pp, dp = self.num_stages, self.num_replicas
        if len(self.devices) != pp or any(len(row) != dp for row in self.devices):
            raise LayoutError(f"{source}: the device matrix is not {pp} stages x {dp} replicas")
        names = [d for row in self.devices for d in row]
        if len(set(names)) != len(names):
            raise LayoutError(f"{source}: a device appears twice in the device matrix")
        if len(self.ranks) != pp * dp:
            raise LayoutError(
                f"{source}: the rank map has {len(self.ranks)} devices for {pp * dp} ranks"
            )
        for stage, row in enumerate(self.devices):
            for replica, name in enumerate(row):
                if self.ranks.get(name) != self.rank(replica, stage):
                    raise LayoutError(
                        f"{source}: rank of {name} is {self.ranks.get(name)}, expected "
                        f"replica*D_PP+stage = {self.rank(replica, stage)}"
                    )
        if len(self.stages) != pp:
            raise LayoutError(f"{source}: {len(self.stages)} stage entries for {pp} stages")
        if network is not None and network.content_hash() != self.network_hash:
            raise LayoutError(
                f"{source} was placed on network {self.network_name} ({self.network_hash}), "
                f"not for {network.name or 'this network'} ({network.content_hash()}); "
                f"place again"
            )
        return self

    # -- text -------------------------------------------------------------------------------------

    def text(self, network: Network | None = None) -> str:
        pp, dp = self.num_stages, self.num_replicas
        c, lines = self.cost, []
        lines.append(
            f"layout {pp} stages x {dp} replicas on {self.network_name} ({pp * dp} devices); "
            f"strategy {self.strategy}, seed {self.seed}: {self.evaluations} evaluations in "
            f"{self.search_s:.2f} s ({self.stopped})"
        )
        lines.append(
            f"messages: c_PP {format_bytes(self.c_pp_bytes)} per replica and boundary, "
            f"c_DP {format_bytes(self.c_dp_bytes)} per stage"
        )
        lines.append(
            f"cost:   total {c.total_s:8.3f} s = DP {c.dp_s:.3f} s + 2 x PP {c.pp_s:.3f} s"
        )
        if self.random_cost is not None:
            r = self.random_cost
            lines.append(
                f"random: total {r.total_s:8.3f} s = DP {r.dp_s:.3f} s + 2 x PP {r.pp_s:.3f} s "
                f"({r.total_s / c.total_s:.2f}x this layout's)"
            )
        width = max(9, max(len(d) for row in self.devices for d in row) + 1)
        head = f"{'':<8}" + "".join(f"{'replica ' + str(r):<{width}}" for r in range(dp))
        lines.append(head + "  DP s     to next s  sub-models")
        for s, row in enumerate(self.devices):
            spec = self.stages[s]
            sub = "-" if spec.submodels is None else f"{spec.submodels[0]}..{spec.submodels[1] - 1}"
            nxt = f"{spec.send_cost_s:9.3f}" if s < pp - 1 else f"{'':9}"
            lines.append(
                f"{'stage ' + str(s):<8}"
                + "".join(f"{d:<{width}}" for d in row)
                + f"  {spec.dp_cost_s:7.3f}  {nxt}  {sub}"
            )
        if network is not None:
            lines.append(structure_summary(self, network))
        return "\n".join(lines)


def structure_summary(layout: Layout, network: Network) -> str:
    """Where the layout keeps its traffic: regions per pipeline and per data-parallel group."""
    region = {d.name: d.region for d in network.devices}
    pipelines = [
        {region[layout.devices[s][r]] for s in range(layout.num_stages)}
        for r in range(layout.num_replicas)
    ]
    groups = [{region[d] for d in row} for row in layout.devices]
    return (
        f"structure: pipelines span {_spread(pipelines)} region(s) each; data-parallel groups "
        f"span {_spread(groups)} region(s) each ({len(network.regions())} regions in the network)"
    )


def _spread(sets: list[set[str]]) -> str:
    sizes = sorted(len(x) for x in sets)
    return str(sizes[0]) if sizes[0] == sizes[-1] else f"{sizes[0]}-{sizes[-1]}"


# ---------------------------------------------------------------------------------------------


def device_matrix(model: CostModel, groups: np.ndarray, cost: Cost) -> np.ndarray:
    """[stage][replica] device indices: stages in TSP order, replicas chained by the matchings."""
    order = cost.order
    matrix = np.empty((model.pp, model.dp), dtype=np.int64)
    matrix[0] = np.sort(groups[order[0]])
    for s in range(1, model.pp):
        prev, nxt = matrix[s - 1], np.sort(groups[order[s]])
        value, perm = bottleneck_matching(model.pp_link_s[np.ix_(prev, nxt)])
        if not np.isclose(value, cost.edge_s[s - 1], rtol=1e-12, atol=0.0):
            raise AssertionError(
                f"matching {value} differs from the cost model's edge {cost.edge_s[s - 1]}"
            )
        matrix[s] = nxt[list(perm)]
    return matrix


def matrix_cost(model: CostModel, matrix: np.ndarray) -> LayoutCost:
    """Cost of a device matrix exactly as laid out: its rows as groups, its stage order, and
    each replica's own pairs between consecutive stages (no re-optimisation)."""
    dp_s = float(model.group_dp_costs(matrix).max())
    pp_s = float(sum(model.pp_link_s[matrix[s], matrix[s + 1]].max() for s in range(model.pp - 1)))
    return LayoutCost(dp_s=dp_s, pp_s=pp_s, total_s=dp_s + 2.0 * pp_s)


def layout_stages(
    model: CostModel,
    matrix: np.ndarray,
    cost: Cost,
    groups_order_dp: list[float],
    plan: Plan | None,
    ranges: tuple[tuple[int, int], ...] | None,
) -> tuple[PlacedStage, ...]:
    specs = []
    for s in range(model.pp):
        if plan is not None and ranges is not None:
            a, b = ranges[s]
            subs = plan.submodels[a:b]
            compute_ms = float(sum(x.fwd_ms + x.bwd_ms for x in subs))
            param_bytes = int(sum(x.param_bytes for x in subs))
            submodels: tuple[int, int] | None = (a, b)
        else:
            compute_ms, param_bytes, submodels = 0.0, 0, None
        send = cost.edge_s[s] if s < model.pp - 1 else 0.0
        specs.append(
            PlacedStage(
                stage=s,
                submodels=submodels,
                compute_ms=compute_ms,
                param_bytes=param_bytes,
                dp_cost_s=float(groups_order_dp[s]),
                send_cost_s=float(send),
            )
        )
    return tuple(specs)


def layout_cost(cost: Cost) -> LayoutCost:
    return LayoutCost(dp_s=cost.dp_s, pp_s=cost.pp_s, total_s=cost.total_s)


def evaluate_layout(layout: Layout, network: Network) -> Cost:
    """Cost of a saved layout on a network, recomputed from its device matrix."""
    layout.check(network)
    index = {d.name: i for i, d in enumerate(network.devices)}
    groups = np.array([[index[name] for name in row] for row in layout.devices])
    model = CostModel(
        network, layout.num_stages, layout.num_replicas, layout.c_pp_bytes, layout.c_dp_bytes
    )
    return model.evaluate(groups)
