"""A Plan from cut points chosen by hand: for tests, experiments and `atomc codegen --cuts`.

Input: a Profile (or a TracedModel, when no costs are known) and the node indices where new
sub-models start. Output: a Plan whose cost fields come from the profile's NodeCosts with a
simple serial model of the swap schedule; the partitioner's search and its simulator are what
a real plan should come from.
"""

from __future__ import annotations

import dataclasses
import itertools

from atomc import __version__
from atomc.errors import UsageError
from atomc.ir import CutTensor, NodeCost, OpGraph, Plan, Profile, Submodel
from atomc.trace import TracedModel

_SUBMODEL_FIELDS = {f.name for f in dataclasses.fields(Submodel)}


def plan_from_cuts(source: Profile | TracedModel, cuts: list[int], accum: int = 1, *,
                   activations: str = "recompute", capacity_bytes: int | None = None) -> Plan:
    """Sub-models [0, c1), [c1, c2), ..., [ck, N) of the graph's nodes for cuts c1 < ... < ck."""
    if isinstance(source, Profile):
        graph, costs, profile = source.graph, source.costs, source
    elif isinstance(source, TracedModel):
        graph, costs, profile = source.graph, None, None
    else:
        raise TypeError(f"expected a Profile or TracedModel, got {type(source).__name__}")
    if accum < 1:
        raise UsageError(f"accumulation {accum} must be 1 or more")
    if activations not in ("recompute", "keep"):
        raise UsageError(f"activations {activations!r}: expected 'recompute' or 'keep'")
    cuts = list(cuts)
    ranges = _ranges(graph, cuts)
    producer = {n.name: i for i, n in enumerate(graph.nodes)}
    tensor = {n.name: n.outputs[0] for n in graph.nodes if len(n.outputs) == 1}
    rows = _rows(graph, costs, profile, ranges, accum, activations, producer, tensor)

    pairs = [rows[i]["peak_bytes"] + (rows[i + 1]["param_bytes"] if i + 1 < len(rows) else 0)
             for i in range(len(rows))]
    capacity = capacity_bytes if capacity_bytes is not None else max(pairs)
    subs, binding = _submodels(graph, rows, pairs, capacity, accum, producer, tensor)

    step = 0.0
    for i, row in enumerate(rows):  # serial estimate: each phase waits for the slower lane
        step += max(accum * row["fwd_ms"], rows[i + 1]["load_ms"] if i + 1 < len(rows) else 0.0)
        step += max(accum * row["bwd_ms"], rows[i - 1]["load_ms"] if i > 0 else 0.0,
                    rows[i + 1]["offload_ms"] if i + 1 < len(rows) else 0.0)
    compute = accum * sum(r["fwd_ms"] + r["bwd_ms"] for r in rows)
    total_load = sum(r["load_ms"] for r in rows)
    total_fwd = sum(r["fwd_ms"] for r in rows)
    return Plan(
        profile_hash=profile.content_hash() if profile is not None else "",
        graph_hash=graph.structure_hash(),
        model_path=graph.model_path, config=graph.config, batch_size=graph.batch_size,
        options=dict(graph.options), device=profile.device if profile is not None else "unprofiled",
        capacity_bytes=capacity, reserve_bytes=0, accum=accum, accum_fixed=True,
        activations=activations, submodels=tuple(subs),
        cut_bytes=_cut_bytes(graph, ranges, producer, tensor),
        predicted_step_ms=step, predicted_utilisation=compute / step if step > 0 else 0.0,
        physical_bound_accum=total_load / total_fwd if total_fwd > 0 else 0.0,
        feasible=not binding, binding=binding, atomc_version=__version__,
        notes=((f"manual plan: cuts at nodes {cuts}; step time is a serial estimate, not a "
                f"simulation"),),
    )


def _ranges(graph: OpGraph, cuts: list[int]) -> list[tuple[int, int]]:
    """The sub-models' node ranges for `cuts`, checked: increasing, and after the inputs."""
    num_nodes = len(graph.nodes)
    last_input = max((i for i, n in enumerate(graph.nodes) if n.op == "placeholder"), default=-1)
    if sorted(set(cuts)) != cuts:
        raise UsageError(f"cuts {cuts} must be strictly increasing node indices")
    for c in cuts:
        if not (last_input < c < num_nodes):
            raise UsageError(f"cut {c} is outside {last_input + 1}..{num_nodes - 1}: sub-model 0 "
                             f"must hold the model's inputs (nodes 0..{last_input}) and every "
                             f"sub-model at least one node")
    return list(itertools.pairwise([0, *cuts, num_nodes]))


def _rows(graph: OpGraph, costs: list[NodeCost] | None, profile: Profile | None,
          ranges: list[tuple[int, int]], accum: int, activations: str,
          producer: dict[str, int], tensor: dict) -> list[dict]:
    """Each sub-model's Submodel fields that depend on it alone: nodes, bytes and times."""
    nodes = graph.nodes
    num_nodes = len(nodes)
    specs = {**graph.params, **graph.buffers}
    zero = NodeCost("", 0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0, 0, "estimated")
    cost = list(costs) if costs is not None else [zero] * num_nodes
    h2d = profile.h2d_gbps if profile is not None else 0.0
    d2h = profile.d2h_gbps if profile is not None else 0.0

    def transfer_ms(num_bytes: int, gbps: float) -> float:
        return num_bytes / (gbps * 1e9) * 1e3 if gbps > 0 else 0.0

    rows = []
    for index, (start, stop) in enumerate(ranges):
        inside = nodes[start:stop]
        fqns = list(dict.fromkeys(f for n in inside for f in n.param_fqns + n.buffer_fqns))
        param_bytes = sum(specs[f].num_bytes for f in fqns)
        grad_bytes = sum(graph.params[f].num_bytes for f in fqns if f in graph.params)
        reads = _reads(graph, start, stop, producer, tensor, first=index == 0)
        writes = _writes(graph, start, stop, producer, tensor)
        in_bytes = sum(t.num_bytes for t in reads)
        saved = sum(c.saved_bytes for c in cost[start:stop])
        working = max((max(c.peak_fwd_bytes, c.peak_bwd_bytes) for c in cost[start:stop]),
                      default=0)
        # keeping, the runtime holds every sub-model's graphs up to this one until their backward
        kept = (accum * sum(c.saved_bytes for c in cost[:stop]) if activations == "keep"
                else saved)
        fwd = sum(c.fwd_ms for c in cost[start:stop])
        # the last sub-model keeps its autograd graph from forward to backward: no recomputation
        recompute = activations == "recompute" and stop < num_nodes
        bwd = sum(c.bwd_ms for c in cost[start:stop]) + (fwd if recompute else 0.0)
        rows.append({
            "index": index, "start": start, "stop": stop, "first_node": nodes[start].name,
            "last_node": nodes[stop - 1].name,
            "layers": tuple(dict.fromkeys(n.module_fqn for n in inside if n.module_fqn)),
            "param_bytes": param_bytes,
            "peak_bytes": param_bytes + accum * in_bytes + kept + working,
            "fwd_ms": fwd, "bwd_ms": bwd, "load_ms": transfer_ms(param_bytes, h2d),
            "offload_ms": transfer_ms(grad_bytes, d2h), "inputs": tuple(reads),
            "outputs": tuple(writes)})
    return rows


def _submodels(graph: OpGraph, rows: list[dict], pairs: list[int], capacity: int, accum: int,
               producer: dict[str, int], tensor: dict) -> tuple[list[Submodel], str]:
    """The Submodels, with the slack each has against its neighbours' transfers and the
    capacity, and the first slack that is short ("" when none is)."""
    subs = []
    binding = ""
    for i, row in enumerate(rows):
        next_load = rows[i + 1]["load_ms"] if i + 1 < len(rows) else 0.0
        prev_load = rows[i - 1]["load_ms"] if i > 0 else 0.0
        slack_memory = capacity - pairs[i]
        slack_fwd = accum * row["fwd_ms"] - next_load
        next_offload = rows[i + 1]["offload_ms"] if i + 1 < len(rows) else 0.0
        slack_bwd = accum * row["bwd_ms"] - max(prev_load, next_offload)  # next's gradients leave
        for ok, what in ((slack_memory >= 0, "memory"), (slack_fwd >= 0, "forward overlap"),
                         (slack_bwd >= 0, "backward overlap")):
            if not ok and not binding:
                binding = f"sub-model {i}: {what}"
        if "crossing" in _SUBMODEL_FIELDS:  # every value held across the cut after it
            row["crossing"] = tuple(_crossing(graph, row["stop"], producer, tensor)) \
                if i + 1 < len(rows) else ()
        subs.append(Submodel(slack_memory_bytes=slack_memory, slack_fwd_ms=slack_fwd,
                             slack_bwd_ms=slack_bwd, **row))
    return subs, binding


def _reads(graph: OpGraph, start: int, stop: int, producer: dict[str, int],
           tensor: dict, first: bool) -> list[CutTensor]:
    names: dict[str, None] = {}
    for node in graph.nodes[start:stop]:
        if first and node.op == "placeholder":
            names[node.name] = None
        for name in node.inputs:
            if producer[name] < start and graph.nodes[producer[name]].op != "get_attr":
                names[name] = None
    return [_cut(name, tensor) for name in names if name in tensor]


def _writes(graph: OpGraph, start: int, stop: int, producer: dict[str, int],
            tensor: dict) -> list[CutTensor]:
    names: dict[str, None] = {}
    for node in graph.nodes[stop:]:
        for name in node.inputs:
            if start <= producer[name] < stop and graph.nodes[producer[name]].op != "get_attr":
                names[name] = None
    return [_cut(name, tensor) for name in sorted(names, key=producer.__getitem__)
            if name in tensor]


def _cut(name: str, tensor: dict) -> CutTensor:
    spec = tensor[name]
    return CutTensor(name, spec.shape, spec.dtype, spec.num_bytes)


def _crossing(graph: OpGraph, stop: int, producer: dict[str, int], tensor: dict) -> list[CutTensor]:
    last_read: dict[str, int] = {}
    for i, node in enumerate(graph.nodes):
        for name in node.inputs:
            last_read[name] = i
    names = [name for name, last in last_read.items()
             if producer[name] < stop <= last and name in tensor
             and graph.nodes[producer[name]].op != "get_attr"]
    return [_cut(name, tensor) for name in sorted(names, key=producer.__getitem__)]


def _cut_bytes(graph: OpGraph, ranges: list[tuple[int, int]], producer: dict[str, int],
               tensor: dict) -> int:
    """Bytes held across each cut: a value read k sub-models later crosses k cuts."""
    last_read: dict[str, int] = {}
    for i, node in enumerate(graph.nodes):
        for name in node.inputs:
            last_read[name] = i
    total = 0
    for _, stop in ranges[:-1]:
        for name, last in last_read.items():
            if producer[name] < stop <= last and name in tensor \
                    and graph.nodes[producer[name]].op != "get_attr":
                total += tensor[name].num_bytes
    return total
