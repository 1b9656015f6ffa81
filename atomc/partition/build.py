"""A Plan from cut positions: its sub-models' costs, slacks and cut tensors, and its simulated
step; the same cuts costed on another profile (`recost`); the plan's and profile's hashes."""

from __future__ import annotations

import dataclasses
import itertools

from atomc import __version__
from atomc.errors import UsageError
from atomc.ir import CutTensor, OpGraph, Plan, Profile, Submodel
from atomc.ir.documents import SCHEMA_VERSION
from atomc.jsonio import canonical_hash
from atomc.partition.accum import (
    physical_bound_accum,
)
from atomc.partition.activations import apply_policy
from atomc.partition.constraints import (
    BACKWARD_OVERLAP,
    FORWARD_OVERLAP,
    GRADIENT_OFFLOAD,
    MEMORY,
    OPTIMIZER,
    Slack,
    plan_slacks,
)
from atomc.partition.cost import (
    CostParams,
    RangeCost,
    first_tail,
    plan_costs,
    range_stage_times,
    runtime_params,
)
from atomc.partition.memo import once_per_object
from atomc.partition.precision import Precision, device_view, model_dtype
from atomc.partition.tables import (
    NodeFacts,
    RangeTables,
    build_tables,
    live_sets,
    node_facts,
)
from atomc.simulate.events import Simulation, copies_on_host, simulate_swap
from atomc.simulate.plan import simulate_plan, stage_times
from atomc.units import NS_PER_MS, format_bytes, ms_to_ns


def recost(profile: Profile, plan: Plan, cpu_adam_gbps: float | None = None,
           cpu_adam_source: str | None = None) -> Plan:
    """`plan`'s decisions (cuts, C, activations, the step-boundary handover, dtypes, budget)
    costed and simulated on another profile of the same graph (a calibrated one): what the plan
    takes there. The CPU update rate is the plan's unless given."""
    if graph_hash(profile.graph) != plan.graph_hash:
        raise UsageError(
            f"the plan was made for graph {plan.graph_hash}, the profile is of graph "
            f"{graph_hash(profile.graph)}; give a profile of the model the plan cuts")
    n = len(profile.graph.nodes)
    bounds = [s.start for s in plan.submodels] + [plan.submodels[-1].stop]
    if bounds[0] != 0 or bounds[-1] != n or any(a >= b for a, b in itertools.pairwise(bounds)):
        raise UsageError(f"the plan's node ranges do not cover the profile's {n} nodes in order; "
                         f"give the profile the plan was made from")
    precision = Precision(plan.transfer_dtype or model_dtype(profile.graph), plan.autocast)
    view = device_view(profile, precision)
    facts = node_facts(view)
    tables = build_tables(facts, max(b - a for a, b in itertools.pairwise(bounds)))
    rate = plan.cpu_adam_gbps if cpu_adam_gbps is None else cpu_adam_gbps
    auto = plan.activations == "auto"
    p = CostParams(plan.accum, plan.capacity_bytes - plan.reserve_bytes, profile.h2d_gbps,
                   profile.d2h_gbps, rate, "recompute" if auto else plan.activations,
                   **runtime_params(profile))
    out = build_plan(profile, tables, p, bounds[1:-1], capacity_bytes=plan.capacity_bytes,
                     reserve_bytes=plan.reserve_bytes, accum_fixed=plan.accum_fixed,
                     tier=plan.search_tier, notes=[f"the cuts of plan {plan.content_hash()}"],
                     early_prefetch=plan.early_prefetch, precision=precision, view=view,
                     cpu_adam_source=cpu_adam_source or plan.cpu_adam_source or "given")
    return apply_policy(out, profile, plan) if auto else out


def plan_step(plan: Plan, slowdown: float = 1.0) -> Simulation:
    """The plan's step as its device runs it (simulate.plan.simulate_plan), simulated once
    per plan: `partition` keeps the step it simulated while weighing C with the plan it
    returns. With `slowdown`, every forward and backward that many times slower (an emulated
    device); copies and the CPU update keep their times, so that step is simulated again
    (stretching the timeline would stretch them too)."""
    if slowdown == 1.0:
        return once_per_object(plan, "plan_step", lambda: simulate_plan(plan))
    times = [dataclasses.replace(t, fwd_ns=round(t.fwd_ns * slowdown),
                                 bwd_ns=round(t.bwd_ns * slowdown)) for t in stage_times(plan)]
    return simulate_swap(times, plan.accum, early_prefetch=plan.early_prefetch,
                         host_copies=copies_on_host(plan.device),
                         host_gap_ns=ms_to_ns(plan.host_gap_ms or 0.0))


def same_step(plan: Plan, like: Plan) -> Plan:
    """`plan`, whose step is `like`'s (the same sub-models, C and device, other notes): the
    step simulated for `like` is `plan`'s too."""
    once_per_object(plan, "plan_step", lambda: plan_step(like))
    return plan


def host_gap_ms(profile: Profile) -> float:
    """On a CPU device, the runtime thread's own time before each action: calibrated when
    the profile is, else measured with the profile (0: neither)."""
    if not copies_on_host(profile.device):
        return 0.0
    if profile.calibration is not None:
        return profile.calibration.host_gap_ms
    return profile.runtime.action_ms if profile.runtime is not None else 0.0


def _cut_tensor(profile: Profile, j: int) -> CutTensor:
    """A value crossing a cut, named by its node. Non-tensor values (sizes) have dtype "" and no
    bytes; a node with several tensor outputs crosses as one value of dtype "tuple"."""
    node = profile.graph.nodes[j]
    outs = node.outputs
    if len(outs) == 1:
        return CutTensor(node.name, outs[0].shape, outs[0].dtype, outs[0].num_bytes)
    if not outs:
        return CutTensor(node.name, (), "", 0)
    return CutTensor(node.name, (), "tuple", sum(o.num_bytes for o in outs))


def build_plan(profile: Profile, tables: RangeTables, p: CostParams, cuts,
               capacity_bytes: int, reserve_bytes: int, accum_fixed: bool = False,
               tier: int = 0, notes: list[str] | None = None,
               early_prefetch: bool = False, precision: Precision | None = None,
               view: Profile | None = None, cpu_adam_source: str = "given") -> Plan:
    """A Plan for given cut positions: costs, slacks, cut tensors and the simulated step.

    Costs come from the range tables, built from `view` (the profile as the device holds it
    at `precision`; the profile itself when None). atomc.codegen.manual.plan_from_cuts builds
    a Plan for hand-chosen cuts without them."""
    facts = tables.facts
    view = view or profile
    graph = view.graph
    costs: list[RangeCost] = plan_costs(tables, p, list(cuts))
    early_prefetch = early_prefetch and len(costs) > 1
    # on a CPU the runtime's thread copies too, and spends time of its own between actions
    # (measured with the profile, or by a calibration): the plan predicts that (the search
    # times copies hidden, as on a GPU; on the CPU they are a few percent of a step)
    host = copies_on_host(profile.device)
    gap_ms = host_gap_ms(profile)
    sim = simulate_swap(range_stage_times(costs), p.accum, early_prefetch=early_prefetch,
                        host_copies=host, host_gap_ns=round(gap_ms * NS_PER_MS))
    slacks = plan_slacks(costs, p.usable_bytes, early_prefetch)
    submodels = _submodels(view, facts, costs, slacks)
    violated = [s for s in slacks if s.slack < 0]
    bound = physical_bound_accum(view)
    all_notes = [*(notes or []), *_notes(costs, bound, p, cpu_adam_source, tier)]
    precision = precision or Precision(model_dtype(profile.graph))
    return Plan(
        profile_hash=profile_hash(profile), graph_hash=graph_hash(profile.graph),
        model_path=graph.model_path, config=graph.config, batch_size=graph.batch_size,
        options=dict(graph.options), device=profile.device, capacity_bytes=capacity_bytes,
        reserve_bytes=reserve_bytes, accum=p.accum, accum_fixed=accum_fixed,
        activations=p.activations, submodels=tuple(submodels),
        cut_bytes=int(sum(int(tables.cut_bytes[q]) for q in cuts)),
        predicted_step_ms=sim.step_ns / NS_PER_MS, predicted_utilisation=sim.utilisation,
        physical_bound_accum=bound, feasible=not violated, binding=_binding(violated),
        atomc_version=__version__, notes=tuple(all_notes), cpu_adam_gbps=p.cpu_adam_gbps,
        search_tier=tier, early_prefetch=early_prefetch, cpu_adam_source=cpu_adam_source,
        transfer_dtype=precision.transfer_dtype, autocast=precision.autocast,
        host_gap_ms=gap_ms or None,
    )


def _submodels(view: Profile, facts: NodeFacts, costs: list[RangeCost],
               slacks: list[Slack]) -> list[Submodel]:
    """The plan's sub-models: each range's costs, its smallest slack of each constraint, and
    the values it reads, writes and holds across the cut after it."""
    graph = view.graph
    k = len(costs)
    index = graph.node_index()
    worst: dict[tuple[int, str], int] = {}  # smallest slack of each (sub-model, constraint)
    for s in slacks:
        key = (s.submodel, s.constraint)
        worst[key] = min(worst.get(key, s.slack), s.slack)
    crossing = live_sets(facts, [c.stop for c in costs[:-1]])
    submodels = []
    for i, c in enumerate(costs):
        mem = worst[(i, MEMORY)]
        nxt = costs[i + 1] if i + 1 < k else None
        inputs = sorted({index[src] for n in graph.nodes[c.start:c.stop] for src in n.inputs
                         if index[src] < c.start}
                        | {j for j in range(c.start, c.stop) if facts.ops[j] == "placeholder"})
        outputs = [j for j in range(c.start, c.stop) if facts.last_use[j] >= c.stop]
        if nxt is None and facts.output_index >= 0:
            out_node = graph.nodes[facts.output_index]
            outputs = [index[name] for name in out_node.inputs]
        layers = tuple(dict.fromkeys(n.module_fqn for n in graph.nodes[c.start:c.stop]
                                     if n.module_fqn))
        submodels.append(Submodel(
            index=i, start=c.start, stop=c.stop,
            first_node=graph.nodes[c.start].name, last_node=graph.nodes[c.stop - 1].name,
            layers=layers, param_bytes=c.param_bytes,
            peak_bytes=max(c.mem_fwd_bytes, c.mem_bwd_bytes),
            fwd_ms=c.fwd_ns / NS_PER_MS, bwd_ms=c.bwd_ns / NS_PER_MS,
            load_ms=c.load_fwd_ns / NS_PER_MS, offload_ms=c.offload_ns / NS_PER_MS,
            slack_memory_bytes=mem,
            slack_fwd_ms=worst.get((i, FORWARD_OVERLAP), c.accum_fwd_ns) / NS_PER_MS,
            slack_bwd_ms=min(worst.get((i, BACKWARD_OVERLAP), c.accum_bwd_ns - c.checkpoint_ns),
                             worst.get((i, GRADIENT_OFFLOAD), c.accum_bwd_ns)) / NS_PER_MS,
            inputs=tuple(_cut_tensor(view, j) for j in inputs),
            outputs=tuple(_cut_tensor(view, j) for j in outputs),
            checkpoint_ms=c.checkpoint_ns / NS_PER_MS, optimizer_ms=c.optimizer_ns / NS_PER_MS,
            # sub-model 0's is no constraint (the step boundary prices it), but the same sum
            slack_optimizer_ms=worst.get((i, OPTIMIZER), c.accum_bwd_ns + c.offload_ns - (
                nxt.offload_ns + nxt.optimizer_ns if nxt else 0)) / NS_PER_MS,
            crossing=tuple(_cut_tensor(view, j) for j in crossing[i]) if nxt else (),
        ))
    return submodels


def _binding(violated: list[Slack]) -> str:
    """What binds a plan whose constraints are violated: the worst time deficit (memory always
    holds in a returned plan); "" when none is."""
    if not violated:
        return ""
    worst = min(violated, key=lambda s: (s.constraint == MEMORY, s.slack))
    if worst.constraint != MEMORY:
        return (f"sub-model {worst.submodel}: {worst.constraint} short by "
                f"{-worst.slack / NS_PER_MS:.1f} ms ({worst.detail})")
    return (f"sub-model {worst.submodel}: memory short by {format_bytes(-worst.slack)} "
            f"({worst.detail})")


def _notes(costs: list[RangeCost], bound: float, p: CostParams, cpu_adam_source: str,
           tier: int) -> list[str]:
    """The plan's own notes: the step-boundary wait, the physical bound on C, the CPU update's
    rate and, for a relaxed search, what may stall."""
    all_notes = []
    if len(costs) > 1:
        tail, _ = first_tail(costs)
        first, second = costs[0], costs[1]
        own = first.offload_ns + first.optimizer_ns
        if tail > own:
            all_notes.append(
                f"step boundary: sub-model 0's update waits {(tail - own) / NS_PER_MS:.1f} ms "
                f"for sub-model 1's (its offload + CPU update "
                f"{(second.offload_ns + second.optimizer_ns) / NS_PER_MS:.1f} ms vs sub-model "
                f"0's C*t_bwd + offload {(first.accum_bwd_ns + first.offload_ns) / NS_PER_MS:.1f}"
                f" ms); the GPU waits for sub-model 0's update there anyway, and the predicted "
                f"step includes the wait")
    all_notes.append(f"physical bound C >= {bound:.1f} (bytes/param * achieved FLOP/s / "
                     f"(2 * H2D B/s * tokens per micro-batch))")
    all_notes.append(f"CPU AdamW at {p.cpu_adam_gbps:g} GB/s of fp32 masters ({cpu_adam_source})")
    if tier:
        all_notes.append("no plan meets every constraint at this C: "
                         + ("loads may stall" if tier == 1
                            else "loads and gradient offloads may stall"))
    return all_notes


def _fields(obj):
    """json.dumps hook: a dataclass as the dict ir.to_data makes of it (one level; the C
    encoder recurses, and turns tuples into lists as to_data does)."""
    tp = type(obj)
    names = _FIELDS.get(tp)
    if names is None:
        import dataclasses

        if not dataclasses.is_dataclass(obj):
            raise TypeError(f"cannot hash a {tp.__name__}")
        names = _FIELDS[tp] = tuple(f.name for f in dataclasses.fields(obj))
    optional = getattr(tp, "OPTIONAL", ())  # written only when set, as ir.to_data does
    return {name: getattr(obj, name) for name in names
            if not (name in optional and getattr(obj, name) is None)}


_FIELDS: dict[type, tuple[str, ...]] = {}


def profile_hash(profile: Profile) -> str:
    """Profile.content_hash(), computed faster (tests compare the two), once per profile."""
    def compute() -> str:
        fields = _fields(profile)
        data = {"kind": profile.KIND, "schema_version": SCHEMA_VERSION, **fields}
        return canonical_hash(data, default=_fields)

    return once_per_object(profile, "profile_hash", compute)


def graph_hash(graph: OpGraph) -> str:
    """OpGraph.structure_hash(), computed faster (tests compare the two), once per graph."""
    def compute() -> str:
        data = {"nodes": graph.nodes, "params": graph.params, "frontend": graph.frontend}
        return canonical_hash(data, default=_fields)

    return once_per_object(graph, "graph_hash", compute)
